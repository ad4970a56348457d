"""Random: evict a uniformly random resident expert (seeded; the memoryless baseline, MoEpic's RND)."""

from __future__ import annotations

import random
from collections.abc import Container

from expertcache.policy.base import Key, Policy, PolicyContext, no_victim


class Random(Policy):
    name = "random"
    seeded = True

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._rng = random.Random(ctx.seed)
        self._keys: list[Key] = []  # swap-remove array for O(1) uniform choice
        self._pos: dict[Key, int] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._pos

    def on_hit(self, key: Key) -> None:
        pass

    def on_insert(self, key: Key) -> None:
        self._pos[key] = len(self._keys)
        self._keys.append(key)

    def on_evict(self, key: Key) -> None:
        i = self._pos.pop(key)
        last = self._keys.pop()
        if last is not key and last != key:
            self._keys[i] = last
            self._pos[last] = i

    def victim(self, incoming: Key, pinned: Container[Key]) -> Key | None:
        keys = self._keys
        if len(keys) < self.capacity:
            return None
        for _ in range(64):  # pinned keys are few: rejection sampling ends fast
            key = keys[self._rng.randrange(len(keys))]
            if key not in pinned:
                return key
        free = [k for k in keys if k not in pinned]
        if not free:
            raise no_victim(self, incoming)
        return free[self._rng.randrange(len(free))]
