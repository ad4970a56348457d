"""What moves experts into the fast tier: the engine's transfer worker, or the simulator's virtual link.

Both implement ``Transport``; the expert cache (``cache.expert_cache``) decides what moves and when, so
the engine and the timing simulator take the same decisions. A transfer moves one key of one cache
part (``full``, a low-precision copy, a segment of a split expert).
"""

from __future__ import annotations

from typing import Protocol

from expertcache.miss.base import FULL
from expertcache.policy.base import Key

DEMAND, SPECULATIVE = 0, 1  # priorities: a layer waits for it / a prefetch
PENDING, READY, FAILED = 0, 1, 2  # transfer states


class Transport(Protocol):
    """Moves one key of one part into the fast tier: the engine's worker or the simulator's link."""

    stall_s: float  # compute time spent waiting for transfers so far (what prefetching could save)
    busy_s: float  # time transfers were moving so far, summed over the threads that move them
    active_s: float  # wall time some transfer was moving so far (busy_s less the threads' overlap)
    transfers: int  # transfers submitted so far

    def submit(self, key: Key, victim: Key | None, priority: int, part: str = FULL) -> object:
        """Queue the transfer of ``key`` into ``victim``'s place in the part (or a free one); a handle."""

    def cancel(self, handle: object) -> bool:
        """Drop a queued transfer (not being copied right now); True when it will not complete."""

    def promote(self, handle: object) -> None:
        """Make a queued speculative transfer a demand one."""

    def poll(self, handle: object) -> int:
        """PENDING, READY (usable by compute now) or FAILED."""

    def started(self, handle: object) -> bool:
        """Whether any of the transfer has moved (for the reordering: in flight before not started)."""

    def wait(self, handle: object) -> None:
        """Until the transfer is usable by compute (raises if it failed)."""

    def release(self, key: Key, part: str = FULL) -> None:
        """A key left the part without arriving (a dropped or failed prefetch): free its place."""
