"""Token-based prediction: the experts a recorded trace used with the same input token (ProMoE,).

From a recorded trace (``ctx.trace``, with ``token_id``), count for each token id and layer how
many times each expert was chosen. A step's prediction for a layer ranks the experts by their
expected use over the step's tokens: the sum, over its tokens, of each token id's counts per
occurrence (so a prompt's frequent tokens do not drown its rare ones; for one token it is the
plain count ranking). A token id absent from the trace contributes its layer's overall per-token
counts. Depends only on the token ids, so every layer's prediction is known at the step's start.
"""

from __future__ import annotations

import numpy as np

from expertcache.errors import option
from expertcache.predict.base import PredictContext, Predictor, PredictorError
from expertcache.predict.eam_matching import check_trace, ranked


class TokenPredictor(Predictor):
    """Experts most used with this step's token id(s) in a recorded trace; unknown ids: overall use."""

    name = "token"
    reads = "trace"

    def __init__(self, ctx: PredictContext) -> None:
        super().__init__(ctx)
        trace = ctx.trace
        if trace is None:
            raise PredictorError(
                f"predictor {self.name!r} needs a recorded trace of this model (with token ids): "
                + option(
                    "--predictor TRACE.npz, from generate --record-trace",
                    "predictor='TRACE.npz', from model.save_trace",
                )
            )
        check_trace(self.name, trace, ctx)
        if trace.token_id is None or (trace.token_id < 0).all():
            raise PredictorError(f"predictor {self.name!r}: trace {trace.source} has no token ids")
        L, E = ctx.num_layers, ctx.num_experts
        known = np.flatnonzero(trace.token_id >= 0)
        order = known[np.argsort(trace.token_id[known], kind="stable")]
        ids, starts = np.unique(trace.token_id[order], return_index=True)
        self._rows = dict(zip(ids.tolist(), np.split(order, starts[1:]), strict=True))  # id -> rows
        self._memo: dict[int, np.ndarray] = {}  # id -> [L, E] counts per occurrence
        self._keys = np.arange(L)[:, None] * E + trace.experts.astype(np.int64)  # [T, L, K] key ids
        self._keys[trace.experts < 0] = -1
        self._overall = self._rate(np.arange(trace.num_tokens))
        self._step = np.zeros((L, E))  # [L, E] expected use over the step's tokens

    def _rate(self, rows: np.ndarray) -> np.ndarray:
        """Counts per token over trace rows. -> [L, E]"""
        ids = self._keys[rows].reshape(-1)
        L, E = self.ctx.num_layers, self.ctx.num_experts
        return np.bincount(ids[ids >= 0], minlength=L * E).reshape(L, E) / max(len(rows), 1)

    def _token(self, token: int) -> np.ndarray:
        rate = self._memo.get(token)
        if rate is None:
            rows = self._rows.get(token)
            rate = self._overall if rows is None else self._rate(rows)
            self._memo[token] = rate
        return rate

    def _begin(self, token_ids, prefill, new_request, future) -> None:
        tokens = [] if token_ids is None else np.asarray(token_ids).reshape(-1).tolist()
        if not tokens:
            self._step = self._overall
            return
        step = self._token(tokens[0])
        for token in tokens[1:]:
            step = step + self._token(token)
        self._step = step

    def _predict(self, source: int, target: int, gate_input) -> list[int]:
        return ranked(self._step[target])
