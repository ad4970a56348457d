"""The engine's expert cache: the shared proactive-caching logic, bound to slots and transfers.

``serve(layer, experts)`` is the engine-side twin of the simulator's replay step: the same
``Residency`` (through ``cache.proactive.Proactive``) decides hits, misses and victims, so a recorded
trace replayed in the simulator gives the same counts when nothing is prefetched; each miss or
prefetch becomes a transfer into the victim's slot (or a free one). Every expert is resident and
ready when it is yielded, and the layer computes it before asking for the next.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from expertcache.cache.proactive import FAILED, PENDING, READY, Proactive
from expertcache.cache.residency import Residency
from expertcache.engine.memory import SlotPool
from expertcache.engine.transfer import Transfer, TransferWorker
from expertcache.policy.base import Key, Policy


@dataclass
class CacheStats:
    """Counts since load (or the last reset); arrays are [phase, layer] with phase 1 = prefill."""

    num_layers: int
    requests: np.ndarray = field(init=False)
    misses: np.ndarray = field(init=False)
    bytes_transferred: int = 0
    stall_s: float = 0.0
    steps: int = 0
    stall_by_phase: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [decode, prefill]

    def __post_init__(self) -> None:
        self.requests = np.zeros((2, self.num_layers), dtype=np.int64)
        self.misses = np.zeros((2, self.num_layers), dtype=np.int64)

    @property
    def hits(self) -> int:
        return int(self.requests.sum() - self.misses.sum())

    def to_dict(self) -> dict[str, object]:
        req, miss = int(self.requests.sum()), int(self.misses.sum())
        return {
            "requests": req,
            "hits": req - miss,
            "misses": miss,
            "miss_ratio": miss / req if req else 0.0,
            "bytes_transferred": self.bytes_transferred,
            "stall_s": self.stall_s,
            "decode_stall_s": self.stall_by_phase[0],
            "prefill_stall_s": self.stall_by_phase[1],
            "steps": self.steps,
            "misses_by_layer": self.misses.sum(axis=0).tolist(),
            "prefill_misses": int(self.misses[1].sum()),
            "decode_misses": int(self.misses[0].sum()),
        }


class ExpertCache:
    """Which experts sit in which slot: the shared ``Proactive`` decides, this class is its transport.

    ``Proactive`` (over the shared ``Residency``) decides hits, misses, victims, prefetches,
    preemption and the order experts are computed in; this class gives each admitted key a slot
    (its victim's, or a free one) and hands the copy to the transfer worker.
    """

    def __init__(
        self,
        policy: Policy,
        pool: SlotPool,
        worker: TransferWorker,
        num_layers: int,
        limit: int = 1,
        preemption: bool = True,
        reorder: bool = True,
    ) -> None:
        self.policy, self.pool, self.worker = policy, pool, worker
        self.residency = Residency(policy)
        self.proactive = Proactive(self.residency, self, num_layers, limit, preemption, reorder)
        self.clock = policy.clock
        self.num_layers = num_layers
        self.slot_of: dict[Key, int] = {}
        self.free = list(range(len(pool)))[::-1]
        self.stats = CacheStats(num_layers)
        self._round = -1
        self._prefill = 0

    def begin_step(self, first_token: int, prefill: bool, seq: int = 0) -> None:
        """A forward step starts (one round of the simulator's layer order)."""
        self._round += 1
        self._prefill = int(prefill)
        self.clock.round = self._round
        self.clock.token = first_token
        self.clock.seq = seq
        self.clock.layer = 0
        self.stats.steps += 1
        self.proactive.begin_step()

    def prefetch(self, predictions: dict[int, list[int]], current=()) -> int:
        """Queue speculative transfers for predicted experts (see ``Proactive.prefetch``)."""
        return self.proactive.prefetch(predictions, current)

    def serve(self, layer: int, experts: list[int]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Yield the layer's experts one by one as (expert, slot views), each resident and ready."""
        clock, stats, pro = self.clock, self.stats, self.proactive
        clock.layer = layer
        clock.group = self._round * self.num_layers + layer
        misses = int(pro.stats.misses[layer])
        views = self.pool.views
        for key in pro.serve(layer, experts):
            yield key[1], views[self.slot_of[key]]
        stats.requests[self._prefill, layer] += len(experts)
        stats.misses[self._prefill, layer] += int(pro.stats.misses[layer]) - misses
        stats.bytes_transferred = self.worker.bytes_moved

    # -- Transport (for Proactive) -------------------------------------------------------------
    def submit(self, key: Key, victim: Key | None, priority: int) -> Transfer:
        slot = self.slot_of.pop(victim) if victim is not None else self.free.pop()
        self.slot_of[key] = slot
        return self.worker.submit(key, slot, priority)

    def cancel(self, handle: Transfer) -> bool:
        return self.worker.cancel(handle)

    def promote(self, handle: Transfer) -> None:
        self.worker.promote(handle)

    def poll(self, handle: Transfer) -> int:
        if not handle.done.is_set():
            return PENDING
        return FAILED if handle.error is not None or handle.cancelled else READY

    def started(self, handle: Transfer) -> bool:
        return handle.started

    def wait(self, handle: Transfer) -> None:
        start = time.perf_counter()
        try:
            self.worker.wait(handle)
        finally:
            waited = time.perf_counter() - start
            self.stats.stall_s += waited
            self.stats.stall_by_phase[self._prefill] += waited

    def release(self, key: Key) -> None:
        self.free.append(self.slot_of.pop(key))
