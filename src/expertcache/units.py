"""Units on the command line and in files: sizes, rates, durations, budgets. Torch-free."""

from __future__ import annotations

import math
import re

from expertcache.errors import ExpertcacheError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float, what: str = "size") -> float:
    """Bytes from ``1234``, ``500MB``, ``6GiB`` (decimal kB/MB/GB, binary KiB/MiB/GiB)."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _SIZE.match(str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ExpertcacheError(f"{what} {text!r} is not a size (examples: 6GiB, 500MB, 123456)")
        value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 0:
        raise ExpertcacheError(f"{what} {text!r} must be a non-negative size")
    return value


def parse_rate(text: str | int | float, what: str = "bandwidth") -> float:
    """Bytes per second from ``16GB/s``, ``500MiB/s`` or a plain number of bytes per second."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = parse_size(text, what)
        if value <= 0:
            raise ExpertcacheError(f"{what} {text!r} must be positive")
        return value
    s = str(text).strip()
    if s.lower().endswith("/s"):
        s = s[:-2]
    value = parse_size(s, what)
    if value <= 0:
        raise ExpertcacheError(f"{what} {text!r} must be positive")
    return value


def parse_duration(text: str | int | float, what: str = "latency") -> float:
    """Seconds from ``20us``, ``1.5ms``, ``0.01s`` or a plain number of seconds."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        if not math.isfinite(text) or text < 0:
            raise ExpertcacheError(f"{what} {text!r} must be a non-negative duration")
        return float(text)
    m = re.match(r"^\s*([0-9]*\.?[0-9]+)\s*(s|ms|us|µs|ns)?\s*$", str(text))
    if m is None:
        raise ExpertcacheError(f"{what} {text!r} is not a duration (examples: 20us, 1.5ms, 0.01s)")
    scale = {"s": 1.0, None: 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}[m.group(2)]
    return float(m.group(1)) * scale


def capacity_for(budget: str | int | float, expert_bytes: int, total_experts: int) -> int:
    """How many experts a budget holds: bytes (``6GiB``) or a share of all experts (``30%``)."""
    text = str(budget).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            raise ExpertcacheError(f"expert memory {budget!r} is not a percentage") from None
        if not 0 < share <= 100:
            raise ExpertcacheError(f"expert memory {budget!r} must be a share in (0%, 100%]")
        return min(total_experts, math.floor(total_experts * share / 100 + 1e-9))
    return min(total_experts, int(parse_size(budget, "expert memory") // expert_bytes))


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
