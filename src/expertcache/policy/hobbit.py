"""HOBBIT's multi-dimensional cache score: recency, frequency, full-precision uses, layer distance.

Each resident expert e scores (Tang et al., HOBBIT, "sequence-level multidimensional caching")
``w_lru * R/T + w_lfu * F/T + w_lhu * H/T + w_fld * (1 - ((l_e - l_now + L) mod L) / L)`` with R the
index of its last use in the current sequence, F its uses in the sequence, H its uses at full precision,
T the tokens of the sequence so far, l_e its layer and l_now the layer being served; the lowest score is
evicted (ties: the least recently used). Records restart with every sequence (the clock's ``seq``). The
weights sum to 1 (HOBBIT tunes them per model; equal by default). With HOBBIT's separate full- and
low-precision caches each cache has its own policy object: H then counts the uses served by that cache
(full precision in the full one). The score changes with time and layer, so every eviction scores all
keys at once (numpy arrays over the L x E keys): each key's weighted sum of R, F and H is kept up to date
as it is used (``inf`` for a key not resident), and the layer-distance term is computed once per layer
being served, so that an eviction is one division and one addition over the keys, with the same floats,
operation by operation, as the formula above.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Container, Sequence

import numpy as np

from expertcache.errors import PolicyError
from expertcache.policy.base import Key, Policy, PolicyContext, no_victim


class Hobbit(Policy):
    name = "hobbit"
    observes = True

    def __init__(
        self,
        ctx: PolicyContext,
        *,
        w_lru: float = 0.25,
        w_lfu: float = 0.25,
        w_lhu: float = 0.25,
        w_fld: float = 0.25,
    ) -> None:
        super().__init__(ctx)
        weights = (w_lru, w_lfu, w_lhu, w_fld)
        if min(weights) < 0 or not math.isclose(sum(weights), 1.0, abs_tol=1e-6):
            raise PolicyError(f"hobbit: the weights must be non-negative and sum to 1, got {list(weights)}")
        self.w = tuple(float(w) for w in weights)
        L, E = ctx.num_layers, ctx.num_experts
        self._E = E
        self._layer = np.repeat(np.arange(L), E)  # [L*E] each key's layer
        self._resident = np.zeros(L * E, dtype=bool)
        self._last = np.zeros(L * E)  # 1 + last use, tokens since the sequence started (0: unused)
        self._uses = np.zeros(L * E)  # uses in the sequence
        self._served = np.zeros(L * E)  # uses through this cache (full precision in the full one)
        # w_lru * R + w_lfu * F + w_lhu * H of each resident key (inf: not resident), kept as keys are used
        self._live = np.full(L * E, np.inf)
        self._near: dict[int, np.ndarray] = {}  # layer served -> each key's w_fld * (1 - distance)
        self._count = 0
        self._seq: int | None = None
        self._start = 0  # the clock's token at the sequence's start

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: object) -> bool:
        try:
            return bool(self._resident[key[0] * self._E + key[1]])  # type: ignore[index]
        except (TypeError, IndexError):
            return False

    def _now(self) -> int:
        if self.clock.seq != self._seq:  # a new sequence: the records restart
            self._seq, self._start = self.clock.seq, self.clock.token
            self._last[:] = self._uses[:] = self._served[:] = 0.0
            self._live[:] = np.where(self._resident, self._weighted(), np.inf)
        return self.clock.token - self._start

    def _weighted(self) -> np.ndarray:
        """w_lru * R + w_lfu * F + w_lhu * H of every key. -> [L*E]"""
        w_lru, w_lfu, w_lhu, _ = self.w
        return w_lru * self._last + w_lfu * self._uses + w_lhu * self._served

    def _nearness(self) -> np.ndarray:
        """w_fld * (1 - distance) of every key from the layer being served. -> [L*E]"""
        layer = self.clock.layer
        near = self._near.get(layer)
        if near is None:
            L = self.ctx.num_layers
            near = self._near[layer] = self.w[3] * (1.0 - ((self._layer - layer) % L) / L)
        return near

    def _weighted_one(self, i: int) -> float:
        """``_weighted()[i]``: the same floats, in the same order."""
        w_lru, w_lfu, w_lhu, _ = self.w
        return w_lru * self._last[i] + w_lfu * self._uses[i] + w_lhu * self._served[i]

    def on_request(self, keys: Sequence[Key], scores: Sequence[float] | None = None) -> None:
        now = self._now()
        last, uses, served, resident = self._last, self._uses, self._served, self._resident
        for layer, expert in keys:
            i = layer * self._E + expert
            last[i] = now + 1
            uses[i] += 1
            served[i] += 1
            if resident[i]:
                self._live[i] = self._weighted_one(i)

    def on_hit(self, key: Key) -> None:
        pass  # counted in on_request

    def on_insert(self, key: Key) -> None:
        i = key[0] * self._E + key[1]
        self._resident[i] = True
        self._live[i] = self._weighted_one(i)
        self._count += 1

    def on_evict(self, key: Key) -> None:
        i = key[0] * self._E + key[1]
        self._resident[i] = False
        self._live[i] = np.inf
        self._count -= 1

    def scores(self) -> np.ndarray:
        """Every key's score now (lower is evicted first). -> [L*E]"""
        t = self._now() + 1
        return self._weighted() / t + self._nearness()

    def score(self, key: Key) -> float:
        return float(self.scores()[key[0] * self._E + key[1]])

    def victim(self, incoming: Key, pinned: Container[Key]) -> Key | None:
        if self._count < self.capacity:
            return None
        t = self._now() + 1
        live = self._live / t + self._nearness()  # scores(), inf where not resident
        if isinstance(pinned, Collection):  # a group: mask its keys at once
            for layer, expert in pinned:
                live[layer * self._E + expert] = np.inf
            pinned = ()
        while True:  # the lowest score, ties to the least recently used, then the lowest index
            low = live.min()
            if low == np.inf:
                raise no_victim(self, incoming)
            tied = (live == low).nonzero()[0]
            i = int(tied[self._last[tied].argmin()]) if len(tied) > 1 else int(tied[0])
            key = divmod(i, self._E)
            if key not in pinned:
                return key
            live[i] = np.inf
