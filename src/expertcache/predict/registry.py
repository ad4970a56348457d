"""Every predictor by the name the CLI and the API use (``none`` means no prefetching)."""

from __future__ import annotations

from expertcache.predict.base import PredictContext, Predictor, PredictorError
from expertcache.predict.eam import Eam
from expertcache.predict.gate import NextGate, Window
from expertcache.predict.learned import Learned
from expertcache.predict.oracle import Oracle
from expertcache.predict.token import TokenPredictor

PREDICTORS: dict[str, type[Predictor]] = {
    "next-gate": NextGate,
    "window": Window,
    "learned": Learned,
    "token": TokenPredictor,
    "eam": Eam,
    "oracle": Oracle,
}


def predictor_class(name: str) -> type[Predictor]:
    try:
        return PREDICTORS[name]
    except KeyError:
        raise PredictorError(
            f"unknown predictor {name!r}; choose from none, {', '.join(PREDICTORS)}"
        ) from None


def make_predictor(name: str, ctx: PredictContext) -> Predictor:
    """Build a registered predictor; unknown names, or inputs it lacks, raise PredictorError."""
    return predictor_class(name)(ctx)
