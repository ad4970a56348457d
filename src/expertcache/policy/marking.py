"""Randomized marking (Fiat, Karp, Luby, McGeoch, Sleator, Young 1991; the LLRU paper Sec. 5.1, "Marking").

Every request marks its page. On a miss with a full cache, evict a uniformly random unmarked page;
when every resident page is marked a new phase begins and all marks are cleared (the pages of the
group being served stay marked: they were requested in the new phase). H_k-competitive in classic
paging. Seeded.
"""

from __future__ import annotations

import random
from collections.abc import Container

from expertcache.policy.base import Key, Policy, PolicyContext, no_victim


class Marking(Policy):
    name = "marking"
    seeded = True

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._rng = random.Random(ctx.seed)
        self._marked: set[Key] = set()
        self._unmarked: list[Key] = []  # swap-remove array for O(1) uniform choice
        self._pos: dict[Key, int] = {}

    def __len__(self) -> int:
        return len(self._marked) + len(self._unmarked)

    def __contains__(self, key: object) -> bool:
        return key in self._marked or key in self._pos

    def _unmark_remove(self, key: Key) -> None:
        i = self._pos.pop(key)
        last = self._unmarked.pop()
        if last != key:
            self._unmarked[i] = last
            self._pos[last] = i

    def on_hit(self, key: Key) -> None:
        if key in self._pos:
            self._unmark_remove(key)
            self._marked.add(key)

    def on_insert(self, key: Key) -> None:
        self._marked.add(key)

    def on_evict(self, key: Key) -> None:
        if key in self._pos:
            self._unmark_remove(key)
        else:
            self._marked.remove(key)

    def _new_phase(self, pinned: Container[Key]) -> None:
        keep = [k for k in self._marked if k in pinned]
        for key in self._marked.difference(keep):
            self._pos[key] = len(self._unmarked)
            self._unmarked.append(key)
        self._marked = set(keep)

    def victim(self, incoming: Key, pinned: Container[Key]) -> Key | None:
        if len(self) < self.capacity:
            return None
        key = self._pick_unmarked(pinned)
        if key is None:  # every unpinned resident key is marked: a new phase begins
            self._new_phase(pinned)
            key = self._pick_unmarked(pinned)
        if key is None:
            raise no_victim(self, incoming)
        return key

    def _pick_unmarked(self, pinned: Container[Key]) -> Key | None:
        free = self._unmarked
        for _ in range(min(len(free), 64)):  # pinned keys are rarely unmarked: rejection ends fast
            key = free[self._rng.randrange(len(free))]
            if key not in pinned:
                return key
        free = [k for k in free if k not in pinned]
        return free[self._rng.randrange(len(free))] if free else None
