"""EAM prediction: MoE-Infinity's request-level activation matching (Sec. 4.3-4.5, App. B.1).

The current request's EAM is matched against the EAMC of past requests (``policy.eam_model.EamModel``,
shared with the ``eam`` eviction policy); the best matches, summed and normalised per row, rank each
future layer's experts. A recorded trace, when given, fills the EAMC before the first request.
"""

from __future__ import annotations

import numpy as np

from expertcache.errors import ExpertcacheError
from expertcache.policy.eam_model import DEFAULT_CAPACITY, DEFAULT_MATCHES, EamModel, request_eams
from expertcache.predict.base import PredictContext, Predictor, PredictorError
from expertcache.trace.trace import Trace


def check_trace(name: str, trace: object, ctx: PredictContext) -> None:
    """A trace given to a predictor must be a Trace of the model's shape (L and E)."""
    if not isinstance(trace, Trace):
        raise PredictorError(
            f"predictor {name!r}: the recorded trace must be a Trace, got {type(trace).__name__}"
        )
    if (trace.num_layers, trace.num_experts) != (ctx.num_layers, ctx.num_experts):
        raise PredictorError(
            f"predictor {name!r}: trace {trace.source} has {trace.num_layers} layers x "
            f"{trace.num_experts} experts, the model {ctx.num_layers} x {ctx.num_experts}"
        )


class Eam(Predictor):
    """MoE-Infinity's prediction: the current request's EAM matched against past requests' EAMs."""

    name = "eam"
    reads = "trace"

    def __init__(
        self, ctx: PredictContext, *, capacity: int = DEFAULT_CAPACITY, matches: int = DEFAULT_MATCHES
    ) -> None:
        super().__init__(ctx)
        try:
            self.model = EamModel(ctx.num_layers, ctx.num_experts, capacity, matches)
        except ExpertcacheError as e:
            raise PredictorError(str(e)) from None
        if ctx.trace is not None:  # warm start: the recorded requests fill the EAMC
            check_trace(self.name, ctx.trace, ctx)
            for eam in request_eams(ctx.trace):
                self.model.store(eam)

    def _begin(self, token_ids, prefill, new_request, future) -> None:
        if new_request:
            self.model.end_request()

    def _observe(self, layer: int, experts: np.ndarray) -> None:
        self.model.observe(layer, experts)

    def _predict(self, source: int, target: int, gate_input) -> list[int]:
        # The proximity weight scales a whole row, so a target's ranking is its aggregate row's.
        row = self.model.aggregate()[target]
        return ranked(row)


def ranked(scores: np.ndarray) -> list[int]:
    """Experts with a positive score, best first (ties: lower id)."""
    order = np.lexsort((np.arange(len(scores)), -scores))
    return order[scores[order] > 0].tolist()
