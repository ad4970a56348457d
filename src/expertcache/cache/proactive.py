"""Proactive caching: prefetch, early preemption and reordered execution, for engine and simulator.

``Proactive`` wraps the shared ``Residency`` with the decisions ProMoE (seed 001 Sec. 5) adds to a
reactive cache. It moves nothing itself: a ``Transport`` does (the engine's transfer worker, or the
timing simulator's virtual link), so both run the very same decisions.

- ``prefetch(predictions, current)``: every predicted expert not resident enters the cache through
  the policy (it may evict), as a speculative (low priority) transfer. It never evicts an expert of
  the layer being computed (``current``), one in flight, or one prefetched for a layer still to come
  in this step; when nothing else can go, the prediction is skipped.
- ``serve(layer, experts)``: the layer's router has chosen. With preemption, that layer's queued
  speculative transfers the router did not choose are dropped (their keys leave the cache) and the
  chosen ones become demand (high priority) transfers; the misses are demand transfers. Experts
  are yielded once ready, in the order resident, in flight, not started (reordering), or in the
  router's first-use order without it.
- A key is resident from the moment its transfer is queued; keys in flight are pinned. When a
  demand miss finds every other key pinned (the minimum budget, say), the queued speculative
  transfers are dropped and the started ones awaited, so serving never deadlocks.

Accounting per layer (decode and prefill together): requests, demand misses, prefetches issued,
used, late (still moving when needed), cancelled and skipped, and ProMoE's prediction quality:
``actual`` experts, ``correct`` (predicted), ``in_time`` (predicted and resident when needed), so
ACCURACY = correct / actual, FETCHRATE = in_time / correct, GOODPRED = in_time / actual.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from expertcache.cache.residency import Residency
from expertcache.errors import PolicyError
from expertcache.policy.base import Key

DEMAND, SPECULATIVE = 0, 1
PENDING, READY, FAILED = 0, 1, 2


class Transport(Protocol):
    """What moves an expert into the fast tier: the engine's worker or the simulator's link."""

    def submit(self, key: Key, victim: Key | None, priority: int) -> object:
        """Queue the transfer of ``key`` into ``victim``'s place (or a free one); return a handle."""

    def cancel(self, handle: object) -> bool:
        """Drop a queued transfer (not being copied right now); True when it will not complete."""

    def promote(self, handle: object) -> None:
        """Make a queued speculative transfer a demand one."""

    def poll(self, handle: object) -> int:
        """PENDING, READY (usable by compute now) or FAILED."""

    def started(self, handle: object) -> bool:
        """Whether any of the transfer has moved (for the reordering: in flight before not started)."""

    def wait(self, handle: object) -> None:
        """Until the transfer is usable by compute (raises if it failed)."""

    def release(self, key: Key) -> None:
        """A key left the cache without arriving (a dropped or failed prefetch): free its place."""


@dataclass
class ProactiveStats:
    """Per-layer counters since the start (arrays [L])."""

    num_layers: int
    requests: np.ndarray = field(init=False)
    misses: np.ndarray = field(init=False)
    issued: np.ndarray = field(init=False)  # speculative transfers queued
    used: np.ndarray = field(init=False)  # prefetched for a layer that then requested it
    late: np.ndarray = field(init=False)  # ... and still in flight when requested
    cancelled: np.ndarray = field(init=False)  # dropped by early preemption before arriving
    skipped: np.ndarray = field(init=False)  # predictions not prefetched: no evictable slot
    actual: np.ndarray = field(init=False)  # requested experts of predicted layer visits
    correct: np.ndarray = field(init=False)  # ... that were predicted
    in_time: np.ndarray = field(init=False)  # ... predicted and resident (not moving) when requested

    def __post_init__(self) -> None:
        for name in (
            "requests",
            "misses",
            "issued",
            "used",
            "late",
            "cancelled",
            "skipped",
            "actual",
            "correct",
            "in_time",
        ):
            setattr(self, name, np.zeros(self.num_layers, dtype=np.int64))

    def to_dict(self) -> dict[str, object]:
        def ratio(a: np.ndarray, b: np.ndarray) -> float:
            return float(a.sum() / b.sum()) if b.sum() else 0.0

        return {
            "prefetch_issued": int(self.issued.sum()),
            "prefetch_used": int(self.used.sum()),
            "prefetch_late": int(self.late.sum()),
            "prefetch_cancelled": int(self.cancelled.sum()),
            "prefetch_skipped": int(self.skipped.sum()),
            "accuracy": ratio(self.correct, self.actual),
            "fetchrate": ratio(self.in_time, self.correct),
            "goodpred": ratio(self.in_time, self.actual),
            "accuracy_by_layer": _per_layer(self.correct, self.actual),
            "fetchrate_by_layer": _per_layer(self.in_time, self.correct),
            "goodpred_by_layer": _per_layer(self.in_time, self.actual),
        }


def _per_layer(num: np.ndarray, den: np.ndarray) -> list[float | None]:
    """num / den per layer; None where a layer was never predicted (layer 0 of gate predictors)."""
    return [float(n / d) if d else None for n, d in zip(num.tolist(), den.tolist(), strict=True)]


class Proactive:
    """Residency + in-flight transfers + speculative bookkeeping, driven layer by layer."""

    def __init__(
        self,
        residency: Residency,
        transport: Transport,
        num_layers: int,
        limit: int,
        preemption: bool = True,
        reorder: bool = True,
    ) -> None:
        self.residency, self.policy, self.transport = residency, residency.policy, transport
        self.limit = max(1, limit)  # experts prefetched per predicted layer at most
        self.preemption, self.reorder = preemption, reorder
        self.inflight: dict[Key, object] = {}
        self.demand: set[Key] = set()  # in-flight keys some layer now waits for (never dropped)
        self.spec: dict[int, dict[Key, None]] = {}  # target layer -> prefetched keys awaiting it
        self.predicted: dict[int, set[int]] = {}  # target layer -> predicted experts, this step
        self.stats = ProactiveStats(num_layers)

    def begin_step(self) -> None:
        self.spec.clear()
        self.predicted.clear()

    # -- prefetch -------------------------------------------------------------------------------
    def prefetch(self, predictions: dict[int, list[int]], current: Collection[Key] = ()) -> int:
        """Queue speculative transfers for predicted experts; return how many were queued."""
        queued = 0
        res, stats = self.residency, self.stats
        self._reap()  # finished transfers are no longer pinned (what this call queues is still moving)
        for target, ranked in predictions.items():
            chosen = ranked[: self.limit]
            self.predicted.setdefault(target, set()).update(chosen)
            waiting = self.spec.setdefault(target, {})
            for expert in chosen:
                key = (target, expert)
                if key in res:
                    continue
                pinned = _Pins(current, self.inflight, self.spec)
                try:
                    victim = res.insert(key, pinned)
                except PolicyError:
                    stats.skipped[target] += 1
                    continue
                self.inflight[key] = self.transport.submit(key, victim, SPECULATIVE)
                waiting[key] = None
                stats.issued[target] += 1
                queued += 1
        return queued

    # -- serving a layer ------------------------------------------------------------------------
    def serve(self, layer: int, experts: Sequence[int]) -> Iterator[Key]:
        """Yield the layer's keys, each resident and ready when yielded (chunk by chunk when the
        group exceeds the layer's room); the caller computes each before asking for the next."""
        keys = [(layer, e) for e in experts]
        stats, inflight, transport = self.stats, self.inflight, self.transport
        spec = self.spec.pop(layer, {})
        predicted = self.predicted.pop(layer, None)
        chosen = set(experts)
        if self.preemption:
            for key in spec:
                handle = inflight.get(key)
                if handle is not None and key[1] not in chosen and transport.cancel(handle):
                    self._forget(key)
                    stats.cancelled[layer] += 1
            for key in keys:  # chosen and still moving, whenever it was prefetched: now a demand
                handle = inflight.get(key)
                if handle is not None and key not in self.demand:
                    transport.promote(handle)
                    self.demand.add(key)
        self._reap()
        here = {key: self._arrived(key) for key in keys}  # resident and not moving any more
        if predicted is not None:
            stats.actual[layer] += len(keys)
            for key in keys:
                if key[1] in predicted:
                    stats.correct[layer] += 1
                    stats.in_time[layer] += here[key]
        for key in keys:
            if key in spec:
                stats.used[layer] += 1
                stats.late[layer] += not here[key]
        stats.requests[layer] += len(keys)
        chunks = [keys] if len(keys) <= self.policy.room(layer) else self.residency.chunks(layer, keys)
        for chunk in chunks:
            self._admit(layer, chunk)
            for key in self._order(chunk):
                handle = inflight.get(key)
                if handle is not None:
                    transport.wait(handle)
                    del inflight[key]
                    self.demand.discard(key)
                yield key

    def _arrived(self, key: Key) -> bool:
        if key not in self.residency:
            return False
        handle = self.inflight.get(key)
        return handle is None or self.transport.poll(handle) == READY

    def _admit(self, layer: int, chunk: list[Key]) -> None:
        res, policy, inflight = self.residency, self.policy, self.inflight
        if policy.observes:
            policy.on_request(chunk)
        for key in chunk:
            if key in res:
                policy.on_hit(key)
                continue
            try:
                victim = res.insert(key, _Pins(chunk, inflight, {}))
            except PolicyError:  # every other key is in flight: make room, then it must fit
                self._drain(chunk)
                victim = res.insert(key, chunk)
            inflight[key] = self.transport.submit(key, victim, DEMAND)
            self.demand.add(key)
            self.stats.misses[layer] += 1

    def _drain(self, keep: Collection[Key]) -> None:
        """Drop every queued speculative transfer outside ``keep`` and wait for the rest to land."""
        for key, handle in list(self.inflight.items()):
            if key not in keep and self.transport.cancel(handle):
                self._forget(key)
                self.stats.cancelled[key[0]] += 1
        for key, handle in list(self.inflight.items()):
            if key not in keep:
                try:
                    self.transport.wait(handle)
                except Exception:  # a failed prefetch: it never arrived
                    pass
        self._reap()

    def _order(self, chunk: list[Key]) -> list[Key]:
        if not self.reorder:
            return chunk
        ready, moving, queued = [], [], []
        for key in chunk:
            handle = self.inflight.get(key)
            if handle is None or self.transport.poll(handle) == READY:
                ready.append(key)
            elif self.transport.started(handle):
                moving.append(key)
            else:
                queued.append(key)
        if len(queued) > 1:  # in the order the link will take them: demand first, then by submission
            rank = {key: i for i, key in enumerate(self.inflight)}
            queued.sort(key=lambda k: (k not in self.demand, rank[k]))
        return ready + moving + queued

    def _reap(self) -> None:
        """Forget finished speculative transfers (no longer pinned); a failed one leaves the cache.
        Transfers a layer waits for stay until ``serve`` waits on them (which raises if they failed)."""
        for key, handle in list(self.inflight.items()):
            state = self.transport.poll(handle)
            if state == READY and key not in self.demand:
                del self.inflight[key]
            elif state == FAILED and key not in self.demand:
                self._forget(key)

    def _forget(self, key: Key) -> None:
        """A speculative transfer that will not land: its key leaves the cache and its place is freed."""
        del self.inflight[key]
        self.residency.remove(key)
        self.transport.release(key)
        waiting = self.spec.get(key[0])
        if waiting is not None:
            waiting.pop(key, None)


class _Pins:
    """Container of keys that may not be evicted: the current group, in flight, awaited prefetches."""

    __slots__ = ("current", "inflight", "spec")

    def __init__(self, current: Collection[Key], inflight: dict, spec: dict[int, dict[Key, None]]) -> None:
        self.current, self.inflight, self.spec = current, inflight, spec

    def __contains__(self, key: object) -> bool:
        if key in self.current or key in self.inflight:
            return True
        waiting = self.spec.get(key[0])  # type: ignore[index]
        return waiting is not None and key in waiting
