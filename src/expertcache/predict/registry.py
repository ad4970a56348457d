"""Every predictor by the name the CLI and the API use (``none`` means no prefetching).

Values name the class (``module:Class``) and are imported on first use, so that listing names or
using a torch-free predictor never imports torch (the gate-input predictors need the model).
"""

from __future__ import annotations

from expertcache.lazy import LazyRegistry
from expertcache.predict.base import PredictContext, Predictor, PredictorError

PREDICTORS: LazyRegistry[type[Predictor]] = LazyRegistry(
    {
        "next-gate": "expertcache.predict.gate:NextGate",
        "window": "expertcache.predict.gate:Window",
        "adaptive": "expertcache.predict.gate:Adaptive",
        "learned": "expertcache.predict.learned:Learned",
        "token": "expertcache.predict.token:TokenPredictor",
        "eam": "expertcache.predict.eam_matching:Eam",
        "oracle": "expertcache.predict.oracle:Oracle",
    }
)


def predictor_class(name: str) -> type[Predictor]:
    try:
        return PREDICTORS[name]
    except KeyError:
        raise PredictorError(f"unknown predictor {name!r}; choose from {', '.join(PREDICTORS)}") from None


def trace_readers(names) -> list[str]:
    """Those of the predictor ``names`` that learn from a recorded trace (``--predictor TRACE.npz``: token,
    eam); ``none`` and ``recorded`` read none."""
    return [n for n in names if n not in ("none", "recorded", "auto") and predictor_class(n).reads == "trace"]


def make_predictor(name: str, ctx: PredictContext) -> Predictor:
    """Build a registered predictor; unknown names, or inputs it lacks, raise PredictorError."""
    cls = predictor_class(name)
    if not isinstance(ctx, PredictContext):  # as make_policy checks its context
        raise PredictorError(
            f"make_predictor needs a PredictContext (num_layers, num_experts, top_k, ...), got "
            f"{type(ctx).__name__}"
        )
    return cls(ctx)
