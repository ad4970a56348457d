"""The "-Dist" wrapper: a fixed per-layer split of the capacity, one inner policy per layer.

The LLRU paper Sec. 5.1 (LRU-Dist, OPT-Dist, ...), as Mixtral-offloading's per-layer LRU does: layer l may
hold at most budget[l] experts and a miss in layer l evicts from layer l only. Budgets are uniform
(capacity // L each, the first capacity % L layers one more) or given. The LLRU paper Thm 3.1: any fixed
split has unbounded competitive ratio.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import replace

from expertcache.errors import PolicyError
from expertcache.policy.base import Key, Policy, PolicyContext, no_victim


def uniform_budgets(capacity: int, num_layers: int) -> list[int]:
    """capacity // L per layer, the first capacity % L layers one more."""
    base, extra = divmod(capacity, num_layers)
    return [base + (layer < extra) for layer in range(num_layers)]


def _layer_profile(ctx: PolicyContext, layer: int) -> dict[Key, int] | None:
    """The usage profile restricted to one layer's keys (what a per-layer Static ranks)."""
    if ctx.profile is None:
        return None
    return {k: c for k, c in ctx.profile.items() if k[0] == layer}


class Dist(Policy):
    def __init__(
        self,
        ctx: PolicyContext,
        *,
        inner: type[Policy],
        budgets: Sequence[int] | None = None,
        **inner_params: object,
    ) -> None:
        super().__init__(ctx)
        self.name = f"{inner.name}-dist"
        self.offline = inner.offline
        self.observes = inner.observes
        self.weighs = inner.weighs
        self.selective = inner.selective
        L = ctx.num_layers
        budgets = list(budgets) if budgets is not None else uniform_budgets(ctx.capacity, L)
        if len(budgets) != L:
            raise PolicyError(f"{self.name}: {len(budgets)} budgets given for {L} layers")
        if sum(budgets) > ctx.capacity:
            raise PolicyError(f"{self.name}: budgets sum to {sum(budgets)} > capacity {ctx.capacity}")
        if min(budgets) < 1:
            raise PolicyError(
                f"{self.name}: every layer needs at least one slot: capacity {ctx.capacity} "
                f"over {L} layers gives budgets {min(budgets)}..{max(budgets)} (need capacity >= {L})"
            )
        self.budgets = budgets
        self.layers = [
            inner(
                replace(ctx, capacity=b, seed=ctx.seed + layer, profile=_layer_profile(ctx, layer)),
                **inner_params,
            )
            for layer, b in enumerate(budgets)
        ]

    def room(self, layer: int) -> int:
        return self.budgets[layer]

    def __len__(self) -> int:
        return sum(len(p) for p in self.layers)

    def __contains__(self, key: object) -> bool:
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], int)):
            return False
        return 0 <= key[0] < len(self.layers) and key in self.layers[key[0]]

    def on_request(self, keys: Sequence[Key], scores: Sequence[float] | None = None) -> None:
        for layer, idx in _by_layer(keys).items():
            own = [keys[i] for i in idx]
            self.layers[layer].on_request(own, None if scores is None else [scores[i] for i in idx])

    def on_use(self, keys: Sequence[Key], tokens: Sequence[int]) -> None:
        for layer, idx in _by_layer(keys).items():
            self.layers[layer].on_use([keys[i] for i in idx], [tokens[i] for i in idx])

    def admits(self, incoming: Sequence[Key], pinned: Container[Key]) -> list[bool]:
        out = [True] * len(incoming)
        for layer, idx in _by_layer(incoming).items():
            for i, ok in zip(idx, self.layers[layer].admits([incoming[i] for i in idx], pinned), strict=True):
                out[i] = ok
        return out

    def on_hit(self, key: Key) -> None:
        self.layers[key[0]].on_hit(key)

    def on_hits(self, keys) -> None:
        if keys:  # one layer's keys: its own policy's
            self.layers[keys[0][0]].on_hits(keys)

    def on_insert(self, key: Key) -> None:
        self.layers[key[0]].on_insert(key)

    def on_evict(self, key: Key) -> None:
        self.layers[key[0]].on_evict(key)

    def victim(self, incoming: Key, pinned: Container[Key]) -> Key | None:
        layer = self.layers[incoming[0]]
        victim = layer.victim(incoming, pinned)
        if victim is None and len(layer) >= self.budgets[incoming[0]]:  # full: None is not room
            raise no_victim(self, incoming)
        return victim


def _by_layer(keys: Sequence[Key]) -> dict[int, list[int]]:
    """The positions of ``keys`` by layer."""
    out: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        out.setdefault(key[0], []).append(i)
    return out
