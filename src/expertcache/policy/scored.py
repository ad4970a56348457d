"""Shared mechanism for policies that rank resident keys by a score fixed at their last touch.

The victim is the resident, unpinned key with the smallest (score, stamp); the stamp (a touch
counter) breaks ties in favour of the key touched least recently. A min-heap with lazy deletion
keeps this O(log n) per request: each touch pushes a fresh entry, stale ones are dropped on sight,
and the heap is rebuilt when stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
from abc import abstractmethod
from collections.abc import Container

from expertcache.policy.base import Key, Policy, PolicyContext, no_victim


class ScoredPolicy(Policy):
    """Evict the lowest score; subclasses say what the score of a key is at the moment it is touched."""

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._entry: dict[Key, tuple[float, int, Key]] = {}  # resident key -> its live heap entry
        self._heap: list[tuple[float, int, Key]] = []
        self._stamp = 0

    @abstractmethod
    def score(self, key: Key) -> float:
        """The key's eviction score as of now (lower is evicted first); may update counters."""

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, key: object) -> bool:
        return key in self._entry

    def _touch(self, key: Key) -> None:
        self._stamp += 1
        entry = (self.score(key), self._stamp, key)
        self._entry[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._entry) + 64:
            self._heap = list(self._entry.values())
            heapq.heapify(self._heap)

    def on_hit(self, key: Key) -> None:
        self._touch(key)

    def on_insert(self, key: Key) -> None:
        self._touch(key)

    def on_evict(self, key: Key) -> None:
        del self._entry[key]

    def victim(self, incoming: Key, pinned: Container[Key]) -> Key | None:
        if len(self._entry) < self.capacity:
            return None
        heap, entry, skipped = self._heap, self._entry, []
        try:
            while heap:
                top = heap[0]
                if entry.get(top[2]) is not top:
                    heapq.heappop(heap)  # stale: the key was touched again or evicted
                elif top[2] in pinned:
                    skipped.append(heapq.heappop(heap))
                else:
                    return top[2]
            raise no_victim(self, incoming)
        finally:
            for e in skipped:
                heapq.heappush(heap, e)
