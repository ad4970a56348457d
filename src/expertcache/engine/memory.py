"""Memory: the layout of one expert in a slot, and the fixed pool of slots.

Every expert occupies one contiguous buffer (a slot) holding its tensors back to back, each one
starting on a 64-byte boundary so that kernels see the same alignment as in a freshly allocated
parameter. The pool is allocated once; loading an expert is a copy into a free slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from expertcache.errors import ExpertcacheError, first_line
from expertcache.units import format_bytes

_ALIGN_BYTES = 64


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
