"""LRU: evict the resident expert whose last request is oldest (the classic; the LLRU paper Sec. 3).

An insertion-ordered dict is the recency list: a hit moves the key to the end, the victim is the
first key not pinned.
"""

from __future__ import annotations

from collections.abc import Container

from expertcache.policy.base import Key, Policy, PolicyContext, no_victim


class LRU(Policy):
    name = "lru"
    move_on_hit = True  # FIFO is LRU without this

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._order: dict[Key, None] = {}

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def on_hit(self, key: Key) -> None:
        if self.move_on_hit:
            order = self._order
            del order[key]
            order[key] = None

    def on_hits(self, keys) -> None:
        if self.move_on_hit:
            order = self._order
            for key in keys:
                del order[key]
                order[key] = None

    def on_insert(self, key: Key) -> None:
        self._order[key] = None

    def on_evict(self, key: Key) -> None:
        del self._order[key]

    def victim(self, incoming: Key, pinned: Container[Key]) -> Key | None:
        if len(self._order) < self.capacity:
            return None
        for key in self._order:
            if key not in pinned:
                return key
        raise no_victim(self, incoming)
