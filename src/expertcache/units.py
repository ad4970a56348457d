"""Units on the command line and in files: sizes, rates, durations, budgets. Torch-free.

Unit spellings are case-sensitive, as in SI and IEC: ``B`` is a byte and ``b`` a bit, ``k`` ``M`` ``G``
``T`` are powers of 1000 and ``Ki`` ``Mi`` ``Gi`` ``Ti`` powers of 1024. A spelling that could mean two of
them (``mb``, ``KB``, a bare ``G``) is refused with the ones it could mean. Rates take bits (a link is often
given in ``Gb/s``); sizes of memory take only bytes, where a bit unit is far likelier a mistake.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable

from expertcache.errors import ExpertcacheError

_PREFIXES = {p: (b**e, f"{b}^{e} " if e else "") for p, b, e in (
    ("", 10, 0), ("k", 10, 3), ("M", 10, 6), ("G", 10, 9), ("T", 10, 12),
    ("Ki", 2, 10), ("Mi", 2, 20), ("Gi", 2, 30), ("Ti", 2, 40),
)}  # fmt: skip  # prefix -> (factor, how a message writes it)
BYTE_UNITS: dict[str, int] = {p + "B": f for p, (f, _) in _PREFIXES.items()}
"""Every size spelling and the bytes it stands for."""
BIT_UNITS: dict[str, float] = {p + s: f / 8 for p, (f, _) in _PREFIXES.items() for s in ("b", "bit")}
"""Every bit spelling (rates only) and the bytes it stands for: ``Gb/s`` is 0.125 ``GB/s``."""
_SIZE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_SHARE = re.compile(r"^\s*-?[0-9]*\.?[0-9]+\s*$")  # a percentage's number, as a size's
_DURATION = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+)\s*(s|ms|us|µs|ns)?\s*$")


def _meaning(unit: str) -> str:
    prefix = unit[: -3 if unit.endswith("bit") else -1]
    return f"{_PREFIXES[prefix][1]}{'bytes' if unit.endswith('B') else 'bits'}"


def _unit_factor(text: object, number: str, unit: str, what: str, *, bits: bool, rate: str = "") -> float:
    """Bytes per unit of a spelling in the table; a spelling that is not is refused, naming the
    spellings it could have meant."""
    if unit == "":
        return 1.0
    if unit in BYTE_UNITS:
        return float(BYTE_UNITS[unit])
    if unit in BIT_UNITS:
        if bits:
            return BIT_UNITS[unit]
        byte = unit.removesuffix("bit").removesuffix("b") + "B"
        raise ExpertcacheError(
            f"{what} {text!r} is in bits ({_meaning(unit)}); give memory in bytes: "
            f"{number}{byte} ({_meaning(byte)})"
        )
    low = unit.lower()
    stems = {low, low + "b", low[:1] + "i" + low[1:], low[:1] + "ib"} if low else set()
    known = [u for u in (*BYTE_UNITS, *(BIT_UNITS if bits else ())) if u.lower() in stems and u != "B"]
    if known:
        choices = [f"{number}{u}{rate} ({_meaning(u)}{rate})" for u in known]
        if len(choices) == 1:  # one spelling it could mean ("ambiguous; write  or 5MiB" was printed)
            time = " (a duration's, not a size's)" if unit in ("s", "ms", "us", "ns") else ""
            raise ExpertcacheError(
                f"{what} {text!r}: unit {unit!r} is not one this reads{time}; write {choices[0]}"
            )
        raise ExpertcacheError(
            f"{what} {text!r}: unit {unit!r} is ambiguous; write {', '.join(choices[:-1])} or {choices[-1]}"
        )
    kind, example = ("a rate", "16GB/s, 500MiB/s, 8Gb/s") if rate else ("a size", "6GiB, 500MB, 123456B")
    raise ExpertcacheError(f"{what} {text!r} is not {kind}: unknown unit {unit!r} (examples: {example})")


def parse_size(text: str | int | float, what: str = "size") -> float:
    """Bytes from ``500MB``, ``6GiB``, ``1234B`` (decimal kB/MB/GB/TB, binary KiB/MiB/GiB/TiB) or a number
    of bytes given as a number; text needs a unit (but ``0``)."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _SIZE.match(str(text))
        if m is None:
            raise ExpertcacheError(f"{what} {text!r} is not a size (examples: 6GiB, 500MB, 123456B)")
        value = float(m.group(1)) * _unit_factor(text, m.group(1), m.group(2), what, bits=False)
        if value >= 0:
            _need_unit(text, m.group(1), m.group(2), what, ("B", "MB", "GiB"))
    if not math.isfinite(value) or value < 0:
        raise ExpertcacheError(f"{what} {text!r} must be a non-negative size")
    return value


def parse_rate(text: str | int | float, what: str = "bandwidth") -> float:
    """Bytes per second from ``16GB/s``, ``500MiB/s``, ``8Gb/s`` (bits: 1GB/s), or a number of bytes per
    second given as a number."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip()
        per_second = s.endswith("/s")
        m = _SIZE.match(s[:-2] if per_second else s)
        if m is None:
            raise ExpertcacheError(f"{what} {text!r} is not a rate (examples: 16GB/s, 500MiB/s, 8Gb/s)")
        value = float(m.group(1)) * _unit_factor(text, m.group(1), m.group(2), what, bits=True, rate="/s")
        if value > 0:
            _need_unit(text, m.group(1), m.group(2), what, ("GB/s", "MB/s"))
        if m.group(2) and not per_second:
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


def _share(text: str) -> float | None:
    """A percentage's number as a size's is written (``25``, ``12.5``), or None: not ``1e-9``, ``5_0`` or
    ``inf``, which Python's float reads and a size's grammar does not."""
    return float(text) if _SHARE.match(text) else None


def parse_share(text: str, what: str) -> float:
    """A share of all experts, ``25%`` -> 25.0: in (0%, 100%], written as a size's number is. The one
    reading of a percentage budget (an expert memory, a host level's memory)."""
    share = _share(str(text).strip().removesuffix("%"))
    if share is None:
        raise ExpertcacheError(f"{what} {text!r} is not a percentage")
    if not 0 < share <= 100:
        raise ExpertcacheError(f"{what} {text!r} must be a share in (0%, 100%]")
    return share


def capacity_for(budget: str | int | float, expert_bytes: int, total_experts: int) -> int:
    """How many experts a budget holds: bytes (``6GiB``) or a share of all experts (``30%``)."""
    text = str(budget).strip()
    if text.endswith("%"):
        share = parse_share(budget, "expert memory")
        return min(total_experts, math.floor(total_experts * share / 100 + 1e-9))
    return min(total_experts, int(parse_size(budget, "expert memory") // expert_bytes))


def capacity_items(item: str | int, total: int, low: int) -> list[int | str]:
    """The capacities one item names on a trace of ``total`` experts: whole experts (24), a range
    (START:STOP[:STEP], cut at ``total``), a share of all experts (25%, rounded down) or ``all`` (from
    ``low``, the least a layer order allows). A share below one expert is returned as its text, for the
    caller to leave out or refuse. The one grammar of ``sim --capacity``, ``sweep`` and ``simulate``."""
    text = str(item).strip()
    if text == "all":
        return list(range(low, total + 1))
    if text.endswith("%"):
        share = _share(text[:-1])
        if share is None:
            raise ExpertcacheError(f"capacity {item!r} is not a share of all experts (25%)") from None
        if not 0 < share <= 100:
            raise ExpertcacheError(f"capacity {item!r}: a share is in (0%, 100%]")
        n = capacity_for(text, 1, total)
        return [n] if n >= 1 else [text]
    try:
        nums = [int(p) for p in text.split(":")] if not isinstance(item, bool | float) else []
    except ValueError:
        nums = []
    if not 1 <= len(nums) <= 3:
        raise ExpertcacheError(
            f"capacity {item!r} is not experts (24), a range (8:96:8), a share (25%) or all"
        )
    if min(nums) < 1:
        raise ExpertcacheError(f"capacity {item!r}: a capacity is at least 1 expert, a step at least 1")
    if len(nums) == 1:
        return nums
    if nums[1] < nums[0]:
        raise ExpertcacheError(f"capacity {text} selects no capacity (a range is START:STOP, STOP >= START)")
    return list(range(nums[0], min(nums[1], total) + 1, nums[2] if len(nums) == 3 else 1))


def capacity_beyond(item: str | int, total: int) -> str | None:
    """What of a range item (``START:STOP[:STEP]``) lies beyond all ``total`` experts, where
    ``capacity_items`` cut it (``"1450:1500:50"``, ``"1441-1500"``, ``"1500"``), for a note; None where
    nothing does (or ``item`` is no range)."""
    parts = str(item).strip().split(":")
    try:
        start, stop, *rest = (int(p) for p in parts)
    except ValueError:
        return None
    step = rest[0] if rest else 1
    if len(parts) not in (2, 3) or min(start, step) < 1:
        return None
    last = start + (stop - start) // step * step
    first = start if start > total else start + -(-(total + 1 - start) // step) * step
    if first > last:
        return None
    if first == last:
        return str(first)
    return f"{first}-{last}" if step == 1 else f"{first}:{last}:{step}"


def one_capacity(item: str | int, total: int, what: str = "capacity") -> int:
    """One cache size in experts, as the API's functions of one capacity take it: whole experts (24, "24")
    or a share of all ``total`` experts ("25%", rounded down), ``capacity_items``'s grammar less ranges."""
    if isinstance(item, numbers.Integral) and not isinstance(item, bool):
        item = int(item)  # numpy's integers too
    if isinstance(item, bool) or not isinstance(item, int | str):
        raise ExpertcacheError(
            f"{what}: a whole number of experts (24) or a share of all experts ('25%'), got {item!r}"
        )
    if isinstance(item, int) and item < 1:
        raise ExpertcacheError(f"{what} must be at least 1 expert, got {item}")
    text = str(item).strip()
    if not (text.isdigit() or text.endswith("%") or ":" in text or text == "all"):  # named as one capacity
        try:  # (capacity_items' message offered a range and all, refused here: a new user's trial)
            parse_size(text, what)
            size = "; a size in bytes is the timing model's (simulate_timing), which prices an expert's bytes"
        except ExpertcacheError:
            size = ""
        raise ExpertcacheError(f"{what} {item!r} is not experts (24) or a share of all experts ('25%'){size}")
    got = capacity_items(item, total, 1)
    if len(got) != 1:
        raise ExpertcacheError(f"{what} {item!r}: one capacity, not a range or all")
    if isinstance(got[0], str):
        raise ExpertcacheError(f"{what} {item!r} is less than one expert of {total}")
    return got[0]


def capped_capacity(capacity: int, total: int) -> tuple[int, list[str]]:
    """A cache of more experts than all ``total``, as the engine caps an expert memory beyond every expert:
    all of them, and the note that says so (the simulator, the timing model, the planner and the doctor
    alike)."""
    if capacity <= total:
        return capacity, []
    return total, [f"a cache of {capacity} experts is more than all {total}; capped at {total}"]


def true_or_false(value: object, what: str) -> bool:
    """``value`` as a switch: True or False only ("no" and 1 are truthy, and not taken for True)."""
    if not isinstance(value, bool):
        raise ExpertcacheError(f"{what} must be True or False, got {value!r}")
    return value


def values_of(value: object, what: str, kind: type | tuple[type, ...]) -> list:
    """An argument that takes a list of ``kind``: one value alone is a list of one (a string is one
    text or name, not its characters); anything else in it, or an empty list, is one clear error."""
    one = isinstance(value, str) or (isinstance(value, kind) and not isinstance(value, bool))
    if one:
        items = [value]
    elif isinstance(value, Iterable) and not isinstance(value, bytes | dict):
        items = list(value)
    else:
        raise ExpertcacheError(
            f"{what} is a list of {_kind_name(kind)}, got {type(value).__name__} {value!r:.40}"
        )
    if not items:
        raise ExpertcacheError(f"{what} is empty")
    for v in items:
        if isinstance(v, bool) or not isinstance(v, kind):
            raise ExpertcacheError(f"{what} holds {type(v).__name__} {v!r:.40}; it takes {_kind_name(kind)}")
    return items


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {str: "text", numbers.Integral: "whole numbers", numbers.Real: "numbers"}
    return " or ".join(names.get(k, k.__name__) for k in (kind if isinstance(kind, tuple) else (kind,)))


def whole_number(value: object, what: str, low: int = 1) -> int:
    """``value`` as an argument that counts something: an int (not a bool, not 2.5, not "8") of at least
    ``low``, else one clear error naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy's integers too
        raise ExpertcacheError(f"{what} must be a whole number, got {value!r}")
    if value < low:
        raise ExpertcacheError(f"{what} must be at least {low}, got {value}")
    return int(value)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
