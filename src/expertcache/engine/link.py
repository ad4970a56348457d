"""An emulated slow-tier link: every transfer takes at least latency + bytes / bandwidth.

The link is serial (one transfer at a time, as the worker issues them), and throttles in real
time, so the effect of transfers on latency can be measured on a machine without a GPU: the
worker performs the real copy, then sleeps until the emulated transfer would have finished.
"""

from __future__ import annotations

import ctypes
import math
import sys
import time
from dataclasses import dataclass

from expertcache.units import parse_duration, parse_rate


@dataclass(frozen=True)
class EmulatedLink:
    bandwidth: float  # bytes per second
    latency: float = 0.0  # seconds per transfer

    @classmethod
    def parse(cls, bandwidth: str | float | None, latency: str | float | None = 0.0) -> EmulatedLink | None:
        """From CLI-style strings: ``EmulatedLink.parse("16GB/s", "20us")``; None when neither is set
        (a latency alone gives a link of unbounded bandwidth)."""
        lat = parse_duration(latency if latency is not None else 0, "link latency")
        if bandwidth is None:
            return cls(math.inf, lat) if lat > 0 else None
        return cls(parse_rate(bandwidth, "link bandwidth"), lat)

    def duration(self, nbytes: int) -> float:
        """Seconds one transfer of ``nbytes`` occupies the link."""
        return self.latency + nbytes / self.bandwidth

    def finish(self, started: float, nbytes: int, begin: float | None = None) -> float:
        """Block until a transfer would be done; return when it is done on the emulated timeline.

        It starts at ``begin`` when given (the emulated time the link became free for it, which
        may be before the worker woke up: a sleep's overshoot is the emulation's, not the link's,
        and must not accumulate over back-to-back chunks), else at ``started`` (perf_counter)."""
        end = (started if begin is None else min(begin, started)) + self.duration(nbytes)
        remaining = end - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return end

    def describe(self) -> str:
        return f"{self.bandwidth / 1e9:g} GB/s, {self.latency * 1e6:g} us"  # inf GB/s: latency only


def tighten_timer_slack() -> bool:
    """Make this thread's sleeps end within ~1 us of their deadline where the OS allows it (Linux
    ``PR_SET_TIMERSLACK``; the default slack of 50 us made a 50 us sleep last ~115 us, longer than a
    small expert's emulated transfer). Returns whether it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0) == 0  # 29 = PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        return False
