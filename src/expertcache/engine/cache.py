"""The engine's expert cache: the shared residency logic, bound to slots and transfers.

``serve(layer, experts)`` is the engine-side twin of the simulator's replay step: the same
``Residency.chunks`` / ``admit`` decide hits, misses and victims (so a recorded trace replayed in the
simulator gives the same counts), and each miss becomes a demand transfer into the victim's slot
(or a free one). Every chunk is resident when it is yielded; the layer computes it before asking
for the next, so a chunk's experts are never evicted before use.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from expertcache.cache.residency import Residency
from expertcache.engine.memory import SlotPool
from expertcache.engine.transfer import DEMAND, TransferWorker
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
            "steps": self.steps,
            "misses_by_layer": self.misses.sum(axis=0).tolist(),
            "prefill_misses": int(self.misses[1].sum()),
            "decode_misses": int(self.misses[0].sum()),
        }


class ExpertCache:
    """Which experts sit in which slot, decided by a policy through the shared ``Residency``."""

    def __init__(self, policy: Policy, pool: SlotPool, worker: TransferWorker, num_layers: int) -> None:
        self.policy, self.pool, self.worker = policy, pool, worker
        self.residency = Residency(policy)
        self.clock = policy.clock
        self.num_layers = num_layers
        self.slot_of: dict[Key, int] = {}
        self.free = list(range(len(pool)))[::-1]
        self.stats = CacheStats(num_layers)
        self._round = -1
        self._prefill = 0

    def begin_step(self, first_token: int, prefill: bool) -> None:
        """A forward step starts (one round of the simulator's layer order)."""
        self._round += 1
        self._prefill = int(prefill)
        self.clock.round = self._round
        self.clock.token = first_token
        self.stats.steps += 1

    def serve(self, layer: int, experts: list[int]) -> Iterator[list[tuple[int, dict[str, torch.Tensor]]]]:
        """Yield the layer's experts chunk by chunk as (expert, slot views), each chunk resident."""
        clock, res, stats = self.clock, self.residency, self.stats
        clock.layer = layer
        clock.group = self._round * self.num_layers + layer
        keys = [(layer, e) for e in experts]
        chunks = [keys] if len(keys) <= self.policy.room(layer) else res.chunks(layer, keys)
        for chunk in chunks:
            misses = res.admit(chunk)
            if misses:
                pending = []
                for key, victim in misses:
                    slot = self.slot_of.pop(victim) if victim is not None else self.free.pop()
                    self.slot_of[key] = slot
                    pending.append(self.worker.submit(key, slot, DEMAND))
                start = time.perf_counter()
                for t in pending:
                    self.worker.wait(t)
                stats.stall_s += time.perf_counter() - start
                stats.bytes_transferred += len(misses) * self.pool.layout.nbytes
            stats.requests[self._prefill, layer] += len(chunk)
            stats.misses[self._prefill, layer] += len(misses)
            views = self.pool.views
            yield [(e, views[self.slot_of[(lay, e)]]) for lay, e in chunk]
