"""Memory: budgets, the layout of one expert in a slot, and the fixed pool of slots.

Every expert occupies one contiguous buffer (a slot) holding its tensors back to back, each one
starting on a 64-byte boundary so that kernels see the same alignment as in a freshly allocated
parameter. The pool is allocated once; loading an expert is a copy into a free slot.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from expertcache.errors import ExpertcacheError, first_line

_ALIGN_BYTES = 64
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


@dataclass(frozen=True)
class SlotLayout:
    """Where each tensor of one expert lives inside its slot (element offsets, aligned)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    slot_numel: int  # padded size of one slot, in elements
    dtype: torch.dtype

    @classmethod
    def of(cls, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> SlotLayout:
        align = max(1, _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
        offsets, pos = [], 0
        for shape in shapes.values():
            offsets.append(pos)
            pos += -(-math.prod(shape) // align) * align
        return cls(tuple(shapes), tuple(tuple(s) for s in shapes.values()), tuple(offsets), pos, dtype)

    @property
    def numel(self) -> int:
        """Elements of real data in one expert (without padding)."""
        return sum(math.prod(s) for s in self.shapes)

    @property
    def nbytes(self) -> int:
        """Bytes one expert moves over the link."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot occupies in the pool (what the budget is charged per expert)."""
        return self.slot_numel * torch.empty((), dtype=self.dtype).element_size()

    def chunks(self, chunk_bytes: int | None) -> tuple[tuple[tuple[str, int, int, int], ...], ...]:
        """How a transfer moves one expert: chunks, each a tuple of ``(tensor, first row, end row,
        bytes)`` pieces. With ``chunk_bytes`` every chunk is one piece of at most that many bytes (at
        least one row), tensor by tensor; with None the whole expert is one chunk (one piece per tensor)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        pieces = []
        for name, shape in zip(self.names, self.shapes, strict=True):
            rows = shape[0]
            row_bytes = math.prod(shape[1:]) * size
            step = rows if not chunk_bytes else max(1, min(rows, chunk_bytes // row_bytes))
            for start in range(0, rows, step):
                stop = min(rows, start + step)
                pieces.append((name, start, stop, (stop - start) * row_bytes))
        if not chunk_bytes:
            return (tuple(pieces),)
        return tuple((p,) for p in pieces)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The expert's tensors as views into one slot's flat buffer."""
        return {
            name: flat[off : off + math.prod(shape)].view(shape)
            for name, shape, off in zip(self.names, self.shapes, self.offsets, strict=True)
        }


class SlotPool:
    """``num_slots`` slots allocated once on ``device`` as one [num_slots, slot_numel] tensor."""

    def __init__(self, layout: SlotLayout, num_slots: int, device: torch.device, pin: bool = False) -> None:
        self.layout = layout
        self.device = torch.device(device)
        try:
            self.buffer = torch.empty(
                (num_slots, layout.slot_numel), dtype=layout.dtype, device=self.device, pin_memory=pin
            )
        except RuntimeError as exc:
            raise ExpertcacheError(
                f"cannot allocate {num_slots} expert slots ({format_bytes(num_slots * layout.slot_bytes)}) "
                f"on {self.device}: {first_line(exc)}"
            ) from None
        self.views = [layout.views(self.buffer[s]) for s in range(num_slots)]

    def __len__(self) -> int:
        return len(self.views)
