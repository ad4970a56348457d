"""LFU: evict the resident expert requested least often since the start (ties: least recently).

Counts persist across evictions ("perfect" LFU): expert popularity is a property of the model and the
workload, not of one residency (BrainStorm's frequency counts; MoEpic's LFU baseline).
"""

from __future__ import annotations

from expertcache.policy.base import Key, PolicyContext
from expertcache.policy.scored import ScoredPolicy


class LFU(ScoredPolicy):
    name = "lfu"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._count: dict[Key, int] = {}

    def score(self, key: Key) -> float:
        count = self._count.get(key, 0) + 1
        self._count[key] = count
        return count
