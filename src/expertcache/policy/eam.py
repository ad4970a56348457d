"""EAM: MoE-Infinity's sparsity-aware expert cache (Sec. 4.6-4.7, Algorithm 1).

The policy tracks expert activations per request in an ``EamModel`` (shared with the ``eam``
predictor): the current request's EAM, and an EAMC of past requests' EAMs. At an eviction the
current EAM is matched against the EAMC and the best matches summed into ``peam`` [L, E]; each
resident expert e of layer i scores ``p = (peam[i, e] + eps) * (1 - i/L) / ntoken`` with ntoken the
row sum of peam[i] (a row with nothing known counts as uniform), so experts likely to be reused are
kept and early layers, which prefetching helps least, are favoured. The lowest p is evicted; ties
go to the least recently used.

It observes every requested group (``on_request``), counting each requested (layer, expert) once
per group: in the simulator and the engine a group is one layer's distinct experts of one forward
step, so a prompt step counts an expert once however many of its tokens chose it (the predictor,
which sees the router's [T, K] choices, counts tokens). A request ends when ``clock.seq`` changes;
its EAM then enters the EAMC. Parameters: ``eamc`` (EAMC capacity, 64), ``matches`` (EAMs summed,
3), ``eps`` (Algorithm 1's epsilon, in counts).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Container, Sequence

import numpy as np

from expertcache.errors import ExpertcacheError, PolicyError
from expertcache.policy.base import Key, Policy, PolicyContext, no_victim
from expertcache.policy.eam_model import EamModel


class EAM(Policy):
    name = "eam"
    observes = True

    def __init__(self, ctx: PolicyContext, *, eamc: int = 64, matches: int = 3, eps: float = 1e-3) -> None:
        super().__init__(ctx)
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < math.inf:
            raise PolicyError(f"eam: eps must be a positive finite number, got {eps}")
        for name, value in (("eamc", eamc), ("matches", matches)):  # not truncated: 1.5 is not 1
            if isinstance(value, bool) or not isinstance(value, int | float) or not float(value).is_integer():
                raise PolicyError(f"eam: {name} must be a whole number, got {value}")
        try:
            self.model = EamModel(ctx.num_layers, ctx.num_experts, int(eamc), int(matches))
        except ExpertcacheError as e:
            raise PolicyError(str(e)) from None
        self.eps = float(eps)
        L, E = ctx.num_layers, ctx.num_experts
        self._num_experts = E
        self._keys: set[Key] = set()
        self._decay = 1.0 - np.arange(L) / L  # [L] 1 - i/L: early layers favoured
        self._score = np.zeros(L * E)  # [L*E] p of every key, as of the model's version below
        self._version = -1
        self._live = np.full(L * E, np.inf)  # [L*E] p of resident keys, inf elsewhere: argmin = victim
        self._stamp = np.zeros(L * E, dtype=np.int64)  # [L*E] last touch, to break ties
        self._tick = 0
        self._seq: int | None = None

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def on_request(self, keys: Sequence[Key], scores: Sequence[float] | None = None) -> None:
        seq = self.clock.seq
        if seq != self._seq:
            if self._seq is not None:
                self.model.end_request()
            self._seq = seq
        self.model.observe_keys(keys)

    def _touch(self, key: Key) -> None:
        self._tick += 1
        self._stamp[key[0] * self._num_experts + key[1]] = self._tick

    def on_hit(self, key: Key) -> None:
        self._touch(key)

    def on_insert(self, key: Key) -> None:
        self._keys.add(key)
        i = key[0] * self._num_experts + key[1]
        self._live[i] = self._score[i]
        self._touch(key)

    def on_evict(self, key: Key) -> None:
        self._keys.remove(key)
        self._live[key[0] * self._num_experts + key[1]] = np.inf

    def scores(self) -> np.ndarray:
        """Algorithm 1's priority p of every (layer, expert), resident or not. -> [L, E]"""
        self._refresh()
        return self._score.reshape(self.model.num_layers, -1)

    def _refresh(self) -> None:
        """Recompute p when the model's prediction changed."""
        peam = self.model.aggregate()  # [L, E]; cheap when nothing changed
        if self.model.version == self._version:
            return
        rows = peam.sum(axis=1, keepdims=True)  # [L, 1] ntoken
        known = rows > 0
        p = np.where(known, peam + self.eps, 1.0 + self.eps) / np.where(known, rows, peam.shape[1])
        self._score = (p * self._decay[:, None]).reshape(-1)
        self._version = self.model.version
        self._live = np.where(self._live < np.inf, self._score, np.inf)

    def victim(self, incoming: Key, pinned: Container[Key]) -> Key | None:
        if len(self._keys) < self.capacity:
            return None
        self._refresh()
        live, E = self._live, self._num_experts
        if not isinstance(pinned, Collection):
            return self._lowest(incoming, pinned)
        kept = []
        for layer, expert in pinned:  # a group (the usual case): mask its keys at once
            i = layer * E + expert
            kept.append((i, live[i]))
            live[i] = np.inf
        try:
            return self._lowest(incoming, ())
        finally:
            for i, value in reversed(kept):  # reversed: a key pinned twice gets its own value back
                live[i] = value

    def _lowest(self, incoming: Key, pinned: Container[Key]) -> Key:
        """The resident key of lowest p (ties: least recently used) not in ``pinned``."""
        live, skipped = self._live, []
        try:
            while True:
                low = live.min()
                if low == np.inf:
                    raise no_victim(self, incoming)
                tied = np.flatnonzero(live == low)
                i = int(tied[self._stamp[tied].argmin()]) if len(tied) > 1 else int(tied[0])
                key = divmod(i, self._num_experts)
                if key not in pinned:
                    return key
                skipped.append((i, low))
                live[i] = np.inf
        finally:
            for i, value in skipped:
                live[i] = value
