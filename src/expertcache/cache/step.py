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

from collections.abc import Callable
from typing import Protocol

import numpy as np

from expertcache.cache.expert_cache import ExpertCache, LayerWork
from expertcache.cache.governor import LinkCounts, PrefetchGovernor
from expertcache.cache.needs import LayerNeeds, needs_of  # noqa: F401 (needs_of re-exported)
from expertcache.cache.recorder import Recorder
from expertcache.errors import ExpertcacheError
from expertcache.policy.base import Clock

Predictions = dict[int, list[int]]
# Who the tokens of the step about to run are, where the engine cannot tell from the model's inputs
# (continuous batching: several requests, some in their prompt, share a step): each token's request id
# and whether it is a prompt token, int32 [T] and bool [T]; None: not known for this step.
StepSource = Callable[[], "tuple[np.ndarray, np.ndarray] | None"]


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
        self.num_experts = cache.policy.ctx.num_experts
        self.predictor, self.recorder, self.governor = predictor, recorder, governor
        self.predicting = predictor is not None  # in this step
        self.shadow = False  # in this step, predictions are only scored (the governor's warm-up)
        self.predictor_s = 0.0  # time spent in predictor calls (measured with a governor, for it)
        self.clock: Clock = cache.policy.clock
        self.steps = 0  # forward steps begun
        self.tokens = 0  # tokens of those steps
        self.steps_by_phase = [0, 0]  # [decode, prefill]: a step holding any prompt token is prefill
        self.tokens_by_phase = [0, 0]  # [generated, prompt] tokens of those steps
        self._seq: int | None = None

    def begin_step(
        self,
        token_ids: np.ndarray,
        prefill: bool,
        seq: int,
        future=None,
        seq_ids: np.ndarray | None = None,
        prompt: np.ndarray | None = None,
        padding: np.ndarray | None = None,
    ) -> None:
        """A forward step of ``token_ids`` (all rows, flattened) starts; ``seq`` is its first row's
        request (``seq_ids`` each token's, and ``prompt`` which of them are prompt tokens, for the
        recorder: a step of continuous batching mixes requests and phases; ``prefill`` is then whether
        any token is a prompt token; ``padding`` which rows are a padded batch's left padding); ``future``
        (simulator only) the step's true experts per layer, for the oracle."""
        clock = self.clock
        clock.round, clock.token, clock.seq, clock.layer = self.steps, self.tokens, seq, 0
        clock.prefill = bool(prefill)
        new_request = prefill or self._seq is None or seq != self._seq
        self._seq = seq
        self.steps += 1
        self.tokens += len(token_ids)
        self.steps_by_phase[int(prefill)] += 1
        prompt_tokens = int(np.count_nonzero(prompt)) if prompt is not None else len(token_ids) * prefill
        self.tokens_by_phase[1] += prompt_tokens
        self.tokens_by_phase[0] += len(token_ids) - prompt_tokens
        self.cache.begin_step(prefill)
        if self.recorder is not None:
            if seq_ids is None:
                seq_ids = np.full(len(token_ids), seq, dtype=np.int32)
            self.recorder.begin(np.asarray(token_ids, dtype=np.int32), prefill, seq_ids, prompt, padding)
        if self.predictor is not None and self.governor is not None:
            t, stats = self.cache.transport, self.cache.stats
            link = LinkCounts(t.busy_s, t.active_s, t.transfers, stats.shadow_guesses, stats.shadow_hits)
            on = self.governor.begin_step(prefill, len(token_ids), t.stall_s, self.predictor_s, link)
            self.shadow = not on and getattr(self.governor, "shadow", False)
            self.predicting = on or self.shadow
        if self.predicting:
            self._prefetch(self._call(self.predictor.begin_step, token_ids, prefill, new_request, future), ())

    def step_wall(self, start: float, end: float) -> None:
        """The engine's wall clock of the step begun last (its forward's start and end): recorded with its
        routing (``--record-trace``), never decided on."""
        if self.recorder is not None:
            self.recorder.wall(start, end)

    def layer(self, layer: int, index: np.ndarray, weights: np.ndarray | None, gate_input=None) -> LayerWork:
        """Layer ``layer`` routed the step's tokens to ``index`` [T, K] with gate ``weights`` [T, K]."""
        clock = self.clock
        clock.layer, clock.group = layer, clock.round * self.num_layers + layer
        if self.recorder is not None:
            self.recorder.add(layer, index, weights)
        needs = LayerNeeds(layer, index, weights)
        work = self.cache.begin_layer(layer, needs)
        if self.predicting:
            current = needs.keys_in_order
            self._prefetch(self._call(self.predictor.collect, layer), current, after=layer)
            self._prefetch(
                self._call(self.predictor.after_router, layer, index, gate_input), current, source=layer
            )
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

    def _prefetch(
        self, batches: list[Predictions], current, after: int = -1, source: int | None = None
    ) -> None:
        """Each batch of predictions to the cache. ``source``: the layer they were made at, where known (a
        predictor inline); an adaptive predictor's are recorded as made, before the walk, so that a
        replay walks them at the same layers over its own cache."""
        for predictions in batches:
            self._check(predictions)
            if after >= 0:  # layers already computed need nothing any more
                predictions = {t: r for t, r in predictions.items() if t > after}
            if getattr(self.predictor, "adaptive", False):
                if source is not None and self.recorder is not None and not self.shadow:
                    self.recorder.predict_from(source, predictions)
                predictions = self._up_to_first_miss(predictions)
            if not predictions:
                continue
            if self.shadow:
                self.cache.shadow(predictions)
                continue
            if self.recorder is not None:
                self.recorder.predict(predictions)
            self.cache.prefetch(predictions, current)

    def _check(self, predictions: Predictions) -> None:
        """One clear error for a prediction that names no expert of the model (a user's predictor's ids
        out of range went to the simulator as experts that do not exist, and to the engine's slot tables
        as an IndexError)."""
        L, E = self.num_layers, self.num_experts
        for target, ranked in predictions.items():
            if _index(target, L) and all(_index(e, E) for e in ranked):
                continue
            inner = getattr(self.predictor, "predictor", self.predictor)
            name = getattr(inner, "name", type(inner).__name__)
            raise ExpertcacheError(
                f"predictor {name} predicted experts {list(ranked)!r} for layer {target!r}: layers are whole "
                f"numbers 0..{L - 1}, experts 0..{E - 1}"
            )

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


def _index(value: object, size: int) -> bool:
    """Whether ``value`` is a whole number in 0..size-1 (numpy's integers too, not True or False)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and 0 <= value < size
