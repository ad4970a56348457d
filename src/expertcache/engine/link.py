"""An emulated slow-tier link: every transfer takes at least latency + bytes / bandwidth.

The link is serial (one transfer at a time, as the worker issues them), and throttles in real
time, so the effect of transfers on latency can be measured on a machine without a GPU: the
worker performs the real copy, then sleeps until the emulated transfer would have finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from expertcache.engine.memory import parse_duration, parse_rate


@dataclass(frozen=True)
class EmulatedLink:
    bandwidth: float  # bytes per second
    latency: float = 0.0  # seconds per transfer

    @classmethod
    def parse(cls, bandwidth: str | float, latency: str | float = 0.0) -> EmulatedLink:
        """From CLI-style strings: ``EmulatedLink.parse("16GB/s", "20us")``."""
        return cls(parse_rate(bandwidth, "link bandwidth"), parse_duration(latency, "link latency"))

    def duration(self, nbytes: int) -> float:
        """Seconds one transfer of ``nbytes`` occupies the link."""
        return self.latency + nbytes / self.bandwidth

    def finish(self, started: float, nbytes: int) -> None:
        """Block until a transfer that started at ``started`` (perf_counter) would be done."""
        remaining = started + self.duration(nbytes) - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def describe(self) -> str:
        return f"{self.bandwidth / 1e9:g} GB/s, {self.latency * 1e6:g} us"
