"""The step driver: one forward step after another, layer by layer, for the engine and the simulator.

Both drive the expert cache the same way, so they take the same decisions; only the work differs (the
engine computes, the timing simulator advances virtual time):

    driver.begin_step(token_ids, prefill, seq)     # the clock, the governor, the step-start predictions
    for each MoE layer:
        work = driver.layer(layer, index, weights, gate_input)
            # the router has chosen: needs, preemption, routes (miss paths), demand transfers queued,
            # then the predictor sees the router's choice and its predictions are prefetched
        ... compute work.host on the host, and each unit of work.units() on the device ...
        driver.end_layer(layer)                    # predictions finished meanwhile (predictor thread)

With a governor (``cache.governor``: prefetch only where it pays) the predictor runs in the steps the
governor says, in its warm-up in shadow (its predictions scored, nothing moved or recorded), and not at
all in the others.

Shape letters: T tokens of the step, K experts per token.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from expertcache.cache.expert_cache import ExpertCache, LayerWork
from expertcache.cache.governor import LinkCounts, PrefetchGovernor
from expertcache.cache.recorder import Recorder
from expertcache.miss.base import Need
from expertcache.policy.base import Clock

Predictions = dict[int, list[int]]


class PredictorRunner(Protocol):
    """How the driver calls a predictor: each call returns the predictions ready to prefetch now."""

    window: int

    def begin_step(self, token_ids, prefill: bool, new_request: bool, future) -> list[Predictions]: ...

    def after_router(self, layer: int, index: np.ndarray, gate_input) -> list[Predictions]: ...

    def collect(self, layer: int) -> list[Predictions]: ...

    def close(self) -> None: ...


class InlinePredictor:
    """A predictor called on the compute thread: its predictions are ready as soon as it returns."""

    def __init__(self, predictor) -> None:
        self.predictor = predictor
        self.window = predictor.window
        self.adaptive = getattr(predictor, "adaptive", False)

    def begin_step(self, token_ids, prefill, new_request, future=None) -> list[Predictions]:
        return [self.predictor.begin_step(token_ids, prefill, new_request, future)]

    def after_router(self, layer, index, gate_input) -> list[Predictions]:
        return [self.predictor.after_router(layer, index, gate_input)]

    def collect(self, layer: int) -> list[Predictions]:
        return []

    def close(self) -> None:
        pass


class StepDriver:
    """Drives an ``ExpertCache`` through forward steps: the clock, the predictor, the recorder."""

    def __init__(
        self,
        cache: ExpertCache,
        num_layers: int,
        predictor: PredictorRunner | None = None,
        recorder: Recorder | None = None,
        governor: PrefetchGovernor | None = None,
    ) -> None:
        self.cache, self.num_layers = cache, num_layers
        self.predictor, self.recorder, self.governor = predictor, recorder, governor
        self.predicting = predictor is not None  # in this step
        self.shadow = False  # in this step, predictions are only scored (the governor's warm-up)
        self.predictor_s = 0.0  # time spent in predictor calls (measured with a governor, for it)
        self.clock: Clock = cache.policy.clock
        self.steps = 0  # forward steps begun
        self.tokens = 0  # tokens of those steps
        self._seq: int | None = None

    def begin_step(
        self, token_ids: np.ndarray, prefill: bool, seq: int, future=None, seq_ids: np.ndarray | None = None
    ) -> None:
        """A forward step of ``token_ids`` (all rows, flattened) starts; ``seq`` is its first row's
        request (``seq_ids`` each token's, for the recorder); ``future`` (simulator only) the step's true
        experts per layer, for the oracle."""
        clock = self.clock
        clock.round, clock.token, clock.seq, clock.layer = self.steps, self.tokens, seq, 0
        new_request = prefill or self._seq is None or seq != self._seq
        self._seq = seq
        self.steps += 1
        self.tokens += len(token_ids)
        self.cache.begin_step(prefill)
        if self.recorder is not None:
            if seq_ids is None:
                seq_ids = np.full(len(token_ids), seq, dtype=np.int32)
            self.recorder.begin(np.asarray(token_ids, dtype=np.int32), prefill, seq_ids)
        if self.predictor is not None and self.governor is not None:
            t, stats = self.cache.transport, self.cache.stats
            link = LinkCounts(t.busy_s, t.active_s, t.transfers, stats.shadow_guesses, stats.shadow_hits)
            on = self.governor.begin_step(prefill, len(token_ids), t.stall_s, self.predictor_s, link)
            self.shadow = not on and getattr(self.governor, "shadow", False)
            self.predicting = on or self.shadow
        if self.predicting:
            self._prefetch(self._call(self.predictor.begin_step, token_ids, prefill, new_request, future), ())

    def layer(self, layer: int, index: np.ndarray, weights: np.ndarray | None, gate_input=None) -> LayerWork:
        """Layer ``layer`` routed the step's tokens to ``index`` [T, K] with gate ``weights`` [T, K]."""
        clock = self.clock
        clock.layer, clock.group = layer, clock.round * self.num_layers + layer
        if self.recorder is not None:
            self.recorder.add(layer, index, weights)
        needs = needs_of(layer, index, weights)
        work = self.cache.begin_layer(layer, needs)
        if self.predicting:
            current = [n.key for n in needs]
            self._prefetch(self._call(self.predictor.collect, layer), current, after=layer)
            self._prefetch(self._call(self.predictor.after_router, layer, index, gate_input), current)
        return work

    def end_layer(self, layer: int) -> None:
        """The layer's experts are computed: prefetch what a predictor thread finished meanwhile."""
        if self.predicting:
            self._prefetch(self._call(self.predictor.collect, layer), (), after=layer)

    def _call(self, fn, *args):
        """A predictor call, its time counted for the governor."""
        if self.governor is None:
            return fn(*args)
        start = self.governor.clock()
        try:
            return fn(*args)
        finally:
            self.predictor_s += self.governor.clock() - start

    def _prefetch(self, batches: list[Predictions], current, after: int = -1) -> None:
        for predictions in batches:
            if after >= 0:  # layers already computed need nothing any more
                predictions = {t: r for t, r in predictions.items() if t > after}
            if getattr(self.predictor, "adaptive", False):
                predictions = self._up_to_first_miss(predictions)
            if not predictions:
                continue
            if self.shadow:
                self.cache.shadow(predictions)
                continue
            if self.recorder is not None:
                self.recorder.predict(predictions)
            self.cache.prefetch(predictions, current)

    def _up_to_first_miss(self, predictions: Predictions) -> Predictions:
        """HOBBIT's layer-adaptive walk: the target layers in order, up to the first one whose predicted
        experts are not all present already (those are cached: nothing to move for them)."""
        out, cache, limit = {}, self.cache, self.cache.limit
        for target in sorted(predictions):
            out[target] = predictions[target]
            if not all(cache.present(cache.primary, (target, e)) for e in predictions[target][:limit]):
                break
        return out

    def close(self) -> None:
        if self.predictor is not None:
            self.predictor.close()


def needs_of(layer: int, index: np.ndarray, weights: np.ndarray | None = None) -> list[Need]:
    """The distinct experts of one layer's routing ``index`` [T, K] (-1 unknown) in first-use order,
    each with its tokens, largest renormalised gate weight, best rank, HOBBIT's importance (the least,
    over its tokens, of the summed weight of the experts ranked above it) and its summed weight. Without
    ``weights`` every expert of a token weighs 1/K and ranks in column order."""
    index = np.asarray(index)
    index = index.reshape(-1, index.shape[-1])  # [T, K]
    if index.shape[0] == 1:
        row = index[0].tolist()
        if len(set(row)) == len(row):  # distinct experts (as a router chooses them)
            return _needs_of_token(layer, row, None if weights is None else np.asarray(weights).reshape(-1))
    w = _renormalised(index, weights)  # [T, K]
    order = np.argsort(-w, axis=1, kind="stable")  # [T, K] columns by descending weight
    ranked_w = np.take_along_axis(w, order, axis=1)
    above = np.zeros_like(ranked_w)  # [T, K] weight of the experts ranked above: summed in rank order,
    np.cumsum(ranked_w[:, :-1], axis=1, out=above[:, 1:])  # as a token alone sums it
    ranked_e = np.take_along_axis(index, order, axis=1)  # [T, K] experts by descending weight
    ranks = np.broadcast_to(np.arange(index.shape[1]), index.shape)
    valid = ranked_e >= 0  # token by token, best rank first: the order the sums below add in
    experts, slot = np.unique(ranked_e[valid], return_inverse=True)
    if not len(experts):
        return []
    n = len(experts)
    w_v, imp_v, rank_v = ranked_w[valid], above[valid], ranks[valid]
    tokens = np.bincount(slot, minlength=n)
    weight = np.full(n, -np.inf)
    np.maximum.at(weight, slot, w_v)
    importance = np.full(n, np.inf)
    np.minimum.at(importance, slot, imp_v)
    rank = np.full(n, index.shape[1], dtype=np.int64)
    np.minimum.at(rank, slot, rank_v)
    mass = np.zeros(n)
    np.add.at(mass, slot, w_v)  # one after another, in the loop's order: the same float sum
    seen, first = np.unique(index.reshape(-1), return_index=True)  # first use, row by row
    first = first[seen >= 0]  # the same experts as ``experts``, both ascending
    cols = [
        a[np.argsort(first, kind="stable")].tolist()
        for a in (experts, tokens, weight, importance, rank, mass)
    ]
    return [Need((layer, e), *rest) for e, *rest in zip(*cols, strict=True)]


def _needs_of_token(layer: int, experts: list[int], weights: np.ndarray | None) -> list[Need]:
    """``needs_of`` for one token (every decode step) routed to distinct ``experts``, in routing order."""
    k = len(experts)
    if weights is None:
        w = [1.0 / k if e >= 0 else 0.0 for e in experts]
    else:
        w = [x if e >= 0 else 0.0 for x, e in zip(weights.tolist(), experts, strict=True)]
    total = sum(w) or 1.0
    w = [x / total for x in w]
    order = sorted(range(k), key=w.__getitem__, reverse=True)  # stable: ties keep column order
    out: list[Need | None] = [None] * k
    above = 0.0
    for rank, i in enumerate(order):
        e = experts[i]
        if e >= 0:
            out[i] = Need((layer, e), 1, w[i], above, rank, w[i])
            above += w[i]
    return [n for n in out if n is not None]


def _renormalised(index: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    """Gate weights [T, K] scaled to sum to 1 per token over known entries (uniform without weights)."""
    valid = index >= 0
    if weights is None:
        w = valid.astype(np.float64)
    else:
        w = np.where(valid, np.asarray(weights, dtype=np.float64).reshape(index.shape), 0.0)
    total = w.sum(axis=1, keepdims=True)
    return np.divide(w, total, out=np.zeros_like(w), where=total > 0)
