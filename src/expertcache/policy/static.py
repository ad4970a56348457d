"""Static: keep the most frequently used experts resident; stream the rest through LRU slots.

The baseline "static cache" of ProMoE and Fiddler-style offline placement: from a usage
profile (the trace itself in the simulator, a profiling run in the engine), the
capacity - top_k most used experts are favoured and never evicted while an unfavoured expert is
evictable; the other top_k slots (at least) hold on-demand experts, evicted in LRU order. When a
group needs more slots than that (a prefill layer), favoured experts are evicted in LRU order too.
"""

from __future__ import annotations

from collections.abc import Container

from expertcache.errors import PolicyError
from expertcache.policy.base import Key, Policy, PolicyContext, no_victim


class Static(Policy):
    name = "static"
    needs_profile = True

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        if ctx.profile is None:
            raise PolicyError("static needs a usage profile (the simulator takes it from the trace)")
        n = max(0, ctx.capacity - ctx.top_k)
        ranked = sorted(ctx.profile.items(), key=lambda kv: (-kv[1], kv[0]))
        self.favoured = frozenset(k for k, c in ranked[:n] if c > 0)
        self._fav: dict[Key, None] = {}  # resident favoured keys, LRU order
        self._other: dict[Key, None] = {}  # resident on-demand keys, LRU order

    def __len__(self) -> int:
        return len(self._fav) + len(self._other)

    def __contains__(self, key: object) -> bool:
        return key in self._fav or key in self._other

    def _list(self, key: Key) -> dict[Key, None]:
        return self._fav if key in self.favoured else self._other

    def on_hit(self, key: Key) -> None:
        order = self._list(key)
        del order[key]
        order[key] = None

    def on_insert(self, key: Key) -> None:
        self._list(key)[key] = None

    def on_evict(self, key: Key) -> None:
        del self._list(key)[key]

    def victim(self, incoming: Key, pinned: Container[Key]) -> Key | None:
        if len(self) < self.capacity:
            return None
        for order in (self._other, self._fav):
            for key in order:
                if key not in pinned:
                    return key
        raise no_victim(self, incoming)
