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
_SIZE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_DURATION = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+)\s*(s|ms|us|µs|ns)?\s*$")


def parse_size(text: str | int | float, what: str = "size") -> float:
    """Bytes from ``500MB``, ``6GiB``, ``1234B`` (decimal kB/MB/GB, binary KiB/MiB/GiB) or a number of
    bytes given as a number; text needs a unit (but ``0``)."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _SIZE.match(str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ExpertcacheError(f"{what} {text!r} is not a size (examples: 6GiB, 500MB, 123456B)")
        value = float(m.group(1)) * _UNITS[unit]
        if value >= 0:
            _need_unit(text, m.group(1), unit, what, ("B", "MB", "GiB"))
    if not math.isfinite(value) or value < 0:
        raise ExpertcacheError(f"{what} {text!r} must be a non-negative size")
    return value


def parse_rate(text: str | int | float, what: str = "bandwidth") -> float:
    """Bytes per second from ``16GB/s``, ``500MiB/s``, or a number of bytes per second given as a number."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip()
        m = _SIZE.match(s[:-2] if s.lower().endswith("/s") else s)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ExpertcacheError(f"{what} {text!r} is not a rate (examples: 16GB/s, 500MiB/s)")
        value = float(m.group(1)) * _UNITS[unit]
        if value > 0:
            _need_unit(text, m.group(1), unit, what, ("GB/s", "MB/s"))
        if unit and not s.lower().endswith("/s"):
            raise ExpertcacheError(f"{what} {text!r} is a size, not a rate: write {s}/s")
    if not (math.isfinite(value) and value > 0):
        raise ExpertcacheError(f"{what} {text!r} must be positive and finite")
    return value


def parse_duration(text: str | int | float, what: str = "latency") -> float:
    """Seconds from ``20us``, ``1.5ms``, ``0.01s`` or a number of seconds given as a number; text needs a
    unit (but ``0``)."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _DURATION.match(str(text))
        if m is None:
            raise ExpertcacheError(f"{what} {text!r} is not a duration (examples: 20us, 1.5ms, 0.01s)")
        scale = {"s": 1.0, None: 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}[m.group(2)]
        value = float(m.group(1)) * scale
        if value >= 0:
            _need_unit(text, m.group(1), m.group(2), what, ("us", "ms", "s"))
    if not math.isfinite(value) or value < 0:
        raise ExpertcacheError(f"{what} {text!r} must be a non-negative duration")
    return value


def _need_unit(text: object, number: str, unit: str | None, what: str, units: tuple[str, ...]) -> None:
    """Text that is a bare number other than 0 is refused: ``20`` seconds of latency, ``2048`` bytes per
    second or ``6`` bytes of memory are too easy to give by mistake."""
    if not unit and float(number) != 0:
        choices = [f"{number}{u}" for u in units]
        raise ExpertcacheError(f"{what} {text!r} needs a unit: {', '.join(choices[:-1])} or {choices[-1]}")


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
