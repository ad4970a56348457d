"""The key-value cache grown in place: each step's keys and values written into room kept for them.

transformers' ``DynamicCache`` keeps each layer's keys and values as tensors it concatenates with the
step's at every step (``DynamicLayer.update``: ``torch.cat``), so a decode token copies the whole cache of
every layer: 2 MB a layer of a Granite-shaped model after 1000 tokens, 48 MB a token, time that grows
with the context. ``GrowingLayer`` keeps the same tensors as views of a buffer with room beyond them
(``ROOM_TOKENS`` at a time, a quarter more than is held): a step writes its rows once, and the buffer is
copied only when it fills. The views hold the same values in the same layout within each head as the
concatenated tensors (only the stride between heads differs), and every attention implementation reads
them as it reads those: tokens and logits are bit-identical, which every family's exactness test checks
(their references run transformers' own cache).

The engine converts the plain layers (``type(layer) is DynamicLayer``: not the sliding-window or
linear-attention ones) of the cache each step is given, on a CPU (``grow``); the class changes, the
state stays, so a cache made by transformers or by the caller works as it did. A layer reordered or
reset is read again from what it holds (a reset frees the buffer). One difference is seen from outside:
after a crop (assisted generation) the next steps write their rows in place over the cropped ones, so
keys or values a caller kept from before the crop change with them (``DynamicLayer``'s do not);
transformers' own generation keeps none.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

ROOM_TOKENS = 256  # the buffer grows by multiples of this many tokens


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` whose ``keys`` and ``values`` are prefix views of buffers with room for more."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = _append(self, "_key_room", self.keys, key_states)
        self.values = _append(self, "_value_room", self.values, value_states)
        return self.keys, self.values

    def reset(self) -> None:
        self._key_room = self._value_room = None  # the memory goes with what the layer held
        super().reset()


def _append(layer: GrowingLayer, attr: str, held: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """``held`` ``[..., n, D]``, then ``new`` ``[..., m, D]``: a view of the layer's buffer ``attr``."""
    n = 0 if held is None or held.numel() == 0 else held.shape[-2]
    end = n + new.shape[-2]
    room = getattr(layer, attr, None)
    fits = (
        room is not None
        and room.shape[:-2] == new.shape[:-2]
        and room.shape[-1] == new.shape[-1]
        and room.dtype == new.dtype
        and room.device == new.device
        and end <= room.shape[-2]
        and (n == 0 or (held.data_ptr() == room.data_ptr() and held.stride() == room.stride()))
    )
    if not fits:
        tokens = -(-(end + end // 4) // ROOM_TOKENS) * ROOM_TOKENS
        room = new.new_empty((*new.shape[:-2], tokens, new.shape[-1]))
        if n:
            room[..., :n, :].copy_(held)
        setattr(layer, attr, room)
    room[..., n:end, :].copy_(new)
    return room[..., :end, :]


def grow(cache) -> None:
    """Convert ``cache``'s plain layers (a transformers ``Cache`` with ``layers``) to ``GrowingLayer``: at
    every step, as a cache made without a config adds its layers as they are first written."""
    for layer in getattr(cache, "layers", ()):
        if type(layer) is DynamicLayer:
            layer.__class__ = GrowingLayer
