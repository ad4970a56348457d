"""The predictor interface shared by the engine and the timing simulator.

A predictor guesses which experts upcoming layers will route to, so the prefetcher can move them
before they are needed. The driver (engine or simulator) calls it at two points of every forward
step, and it answers with predictions: ``{target layer: experts ranked most likely first}``.

- ``begin_step(token_ids, prefill, new_request, future)``: a step starts (``future`` is the step's
  true groups per layer, given by the simulator only: what ``oracle`` reads).
- ``after_router(layer, experts, gate_input)``: layer ``layer`` has routed its tokens
  (``experts`` [T, K]); ``gate_input`` is the router's input [T, H] (None in the simulator).

Sliding window (ProMoE Sec. 4): with window ``k`` the prediction for layer ``i`` is made at layer
``i - k``. Predictors that need a layer's gate input (``needs_model``) make the predictions of
layers 1..k at layer 0 (ProMoE's fallback, ``i - k`` clamped to 0); the others make layers
0..k-1's at the start of the step. Each target layer is predicted exactly once per step.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from expertcache.errors import ExpertcacheError

Predictions = dict[int, list[int]]  # target layer -> experts, most likely first


class PredictorError(ExpertcacheError):
    """A predictor cannot be built or run as asked (unknown name, missing model or trace, ...)."""


@dataclass(frozen=True)
class PredictContext:
    """What a predictor may use: the model's shape, its routers (engine), a recorded trace."""

    num_layers: int
    num_experts: int
    top_k: int
    window: int | None = None  # None: the predictor's default_window
    routers: Sequence[Callable] | None = None  # layer -> (gate input [T, H]) -> top-k index [T, K]
    trace: object | None = None  # a recorded Trace (token's table, eam's warm start)
    path: str | None = None  # trained predictor directory (learned)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k", "window", "seed"):  # not "6", 1.5 or True
            value = getattr(self, name)
            if value is None and name == "window":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise PredictorError(f"PredictContext {name} must be a whole number, got {value!r}")
            object.__setattr__(self, name, int(value))
        if min(self.num_layers, self.num_experts, self.top_k) < 1:
            raise PredictorError("num_layers, num_experts and top_k must be at least 1")
        if self.window is not None and self.window < 1:
            raise PredictorError(f"prefetch window must be at least 1 layer, got {self.window}")


class Predictor(ABC):
    """One prediction method; subclasses implement ``_predict`` for one (source, target) pair."""

    name: ClassVar[str]
    needs_model: ClassVar[bool] = False  # uses the gate input of the source layer (engine only)
    sim_only: ClassVar[bool] = False  # needs the true future (simulator only)
    default_window: ClassVar[int] = 1  # layers ahead when the user gives no window
    adaptive: ClassVar[bool] = False  # prefetch its targets only up to the first with a missing expert
    trained: ClassVar[bool] = False  # reads a predictor trained for the model (the embedded one's bundled)
    reads: ClassVar[str | None] = None  # the data it takes (--predictor): "trace" (recorded), "directory"

    def __repr__(self) -> str:
        name, window = getattr(self, "name", "?"), getattr(self, "window", "?")
        return f"<{type(self).__name__} predictor {name!r}, window {window}>"

    def __init__(self, ctx: PredictContext) -> None:
        self.ctx = ctx
        self.window = ctx.window if ctx.window is not None else self.default_window
        self.num_layers = ctx.num_layers
        self.top_k = ctx.top_k
        self.note: str | None = None  # for the user: the window was clipped to the model
        most = max(
            1, self.num_layers - 1 if self.needs_model else self.num_layers
        )  # from layer 0 / the start
        if ctx.window is None:  # the default, cut to the model (adaptive's 3 on 3 MoE layers reaches 2): the
            self.window = min(self.window, most)  # window reported and recorded is the one it runs
        elif ctx.window > most:
            self.window = most
            self.note = (
                f"prefetch window {ctx.window} reaches past a model of {self.num_layers} MoE layers: "
                f"{self.name} predicts at most {most} layer(s) ahead, so its window is {most}"
            )

    # -- the driver's calls -------------------------------------------------------------------
    def begin_step(
        self,
        token_ids: np.ndarray,
        prefill: bool,
        new_request: bool,
        future: Sequence[Sequence[int]] | None = None,
    ) -> Predictions:
        self._begin(token_ids, prefill, new_request, future)
        if self.needs_model:
            return {}
        return self._targets(-1, range(0, min(self.window, self.num_layers)), None)

    def after_router(self, layer: int, experts: np.ndarray, gate_input=None) -> Predictions:
        self._observe(layer, experts)
        if self.needs_model and layer == 0:
            targets = range(1, min(self.window, self.num_layers - 1) + 1)
        else:
            targets = range(layer + self.window, layer + self.window + 1)
        return self._targets(layer, [t for t in targets if t < self.num_layers], gate_input)

    # -- what subclasses provide --------------------------------------------------------------
    def _begin(self, token_ids, prefill, new_request, future) -> None:  # noqa: B027 (optional hook)
        """A step starts (default: nothing to remember)."""

    def _observe(self, layer: int, experts: np.ndarray) -> None:  # noqa: B027 (optional hook)
        """Layer ``layer`` routed its tokens (default: nothing to remember)."""

    @abstractmethod
    def _predict(self, source: int, target: int, gate_input) -> list[int]:
        """Ranked experts of ``target`` predicted at ``source`` (-1 = the step's start)."""

    def _targets(self, source: int, targets, gate_input) -> Predictions:
        out = {}
        for target in targets:
            ranked = self._predict(source, target, gate_input)
            if isinstance(ranked, np.ndarray):  # a user's predictor may rank with numpy
                ranked = ranked.tolist()
            if ranked is not None and len(ranked):
                out[target] = ranked
        return out


def rank_union(index: np.ndarray) -> list[int]:
    """Distinct experts of per-token top-k rows [T, K], most tokens first (ties: best rank, then id)."""
    index = np.asarray(index)
    index = index.reshape(-1, index.shape[-1])
    if index.shape[0] == 1:  # one token (every decode step): its own ranking, ids distinct already
        return [e for e in index[0].tolist() if e >= 0]
    valid = index >= 0
    if not valid.any():
        return []
    flat = index[valid]
    ranks = np.broadcast_to(np.arange(index.shape[1]), index.shape)[valid]
    num = int(flat.max()) + 1
    counts = np.bincount(flat, minlength=num)
    best = np.full(num, index.shape[1], dtype=np.int64)
    np.minimum.at(best, flat, ranks)
    experts = np.flatnonzero(counts)
    order = np.lexsort((experts, best[experts], -counts[experts]))
    return experts[order].tolist()
