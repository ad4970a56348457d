"""Belady's OPT (MIN): evict the resident expert whose next request is furthest in the future.

Offline: it needs ``ctx.future``, for every key the ascending indices of the request groups that use
it (the simulator derives them from the trace). The next use of a key changes only when it is
requested, so it is a score fixed at each touch (``ScoredPolicy``). Keys never used again tie at
infinity. In layer order the future is kept at group granularity: a key of the group being served
that has not been served yet has next use "now" and is never a victim.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from expertcache.errors import PolicyError
from expertcache.policy.base import Key, PolicyContext
from expertcache.policy.scored import ScoredPolicy

_NEVER = float("inf")


class OPT(ScoredPolicy):
    name = "opt"
    offline = True

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        if ctx.future is None:
            raise PolicyError("opt is offline: it needs the future requests (use it in the simulator)")
        self._future = ctx.future
        self._ptr: dict[Key, int] = {}  # key -> index of its next use in its future list

    def next_use(self, key: Key) -> float:
        """Index of the first group after the current one that requests ``key`` (inf if none)."""
        uses: Sequence[int] = self._future.get(key, ())
        i = self._ptr.get(key, 0)
        g = self.clock.group
        if i < len(uses) and uses[i] <= g:
            i += 1
            if i < len(uses) and uses[i] <= g:  # the caller skipped groups: search
                i = bisect_right(uses, g, lo=i)
        self._ptr[key] = i
        return uses[i] if i < len(uses) else _NEVER

    def score(self, key: Key) -> float:
        return -self.next_use(key)
