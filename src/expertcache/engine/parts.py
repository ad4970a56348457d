"""The engine's side of the cache parts: what one slot of a part holds, where it comes from, how it runs.

A miss path names its parts (``miss.base.PartSpec``); here each becomes an ``EnginePart``: the layout of
one slot, the source that fills a slot from the slow tier (``copy_chunk``), and the computation of one
unit from a slot's tensors. ``full`` is the whole expert, computed with the operations of transformers'
eager loop for its family, so that the output is the reference's bit for bit.

Shape letters: T tokens routed to the expert, H hidden size, F the expert's intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from expertcache.engine.kernels import first_matrix, gate
from expertcache.engine.memory import SlotLayout
from expertcache.miss.base import PartSpec


def expert_output(module, views: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """One expert on its tokens x [T, H] -> [T, H], with the operations of transformers' eager loop (packed
    experts: from their packed bytes, ``engine.packed``)."""
    packed = getattr(module, "_expertcache_packed", None)
    if packed is not None:
        return packed.expert(module, views, x)
    if module.is_transposed:  # GPT-OSS: x @ W + b; Aria: x @ W
        h = x @ views["gate_up_proj"]
        if module.has_bias:
            h = h + views["gate_up_proj_bias"]
        h = module._apply_gate(h) @ views["down_proj"]
        return h + views["down_proj_bias"] if module.has_bias else h
    h = gate(module, F.linear(x, views[first_matrix(module)]))  # act(gate) * up, the family's own, act(up)
    return F.linear(h, views["down_proj"])


@dataclass
class EnginePart:
    """One cache part in the engine: the layout of its slots (one for every layer, key None, or one
    per layer when its slots differ by layer), its source in the slow tier, its computation."""

    spec: PartSpec
    layouts: dict[int | None, SlotLayout]
    make_source: Callable[[object], object]  # tier -> a source: copy_chunk(key, views, chunk) fills a slot
    compute: Callable[[object, dict[str, torch.Tensor], torch.Tensor], torch.Tensor]
    source: object = None  # set by bind(), once the slow tier exists
    kernels: object = None  # ``packed.PackedKernels`` where it computes from packed bytes (warmed at load)
    copies: str | None = None  # the file of low-precision copies it reads, and how they were made

    def bind(self, tier) -> None:
        self.source = self.make_source(tier)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def per_layer(self) -> bool:
        return None not in self.layouts

    def slot_bytes(self) -> int | list[int]:
        """Bytes of one slot: one figure (a shared pool's: the largest layer's), or one per layer."""
        if not self.per_layer:
            return self.layouts[None].slot_bytes
        sizes = [self.layouts[layer].slot_bytes for layer in sorted(self.layouts)]
        return max(sizes) if self.spec.shared else sizes

    def transfer_bytes(self) -> int | list[int]:
        """Bytes one transfer of the part moves (a slot's, less its alignment): one figure, or one per
        layer where they differ by layer."""
        sizes = {layer: layout.nbytes for layer, layout in self.layouts.items()}
        if None in sizes or len(set(sizes.values())) == 1:
            return next(iter(sizes.values()))
        return [sizes[layer] for layer in sorted(sizes)]

    def largest(self) -> SlotLayout:
        """The layout with the largest slot (a shared pool's)."""
        return max(self.layouts.values(), key=lambda layout: layout.slot_bytes)


def full_part(spec: PartSpec, layout: SlotLayout) -> EnginePart:
    """The whole expert, read by the slow tier as it is."""
    return EnginePart(spec, {None: layout}, lambda tier: tier, expert_output)


def segment_part(
    spec: PartSpec, full: SlotLayout, transposed: bool, num_layers: int, interleaved: bool = True
) -> EnginePart:
    """A segment of every expert's neurons (``spec.bounds(layer)``), copied from the whole expert;
    ``interleaved``: transposed experts' gate and up columns alternate (GPT-OSS's), else they are
    concatenated (Aria's)."""
    bounds = {layer: neuron_bounds(full, transposed, *spec.bounds(layer)) for layer in range(num_layers)}
    layouts = {layer: segment_layout(full, transposed, a, b) for layer, (a, b) in bounds.items()}
    if len(set(bounds.values())) == 1:  # one layout for every layer: one pool
        layouts = {None: layouts[0]}
    source = lambda tier: SegmentSource(tier, full, transposed, bounds, interleaved)  # noqa: E731
    return EnginePart(spec, layouts, source, segment_output)


# -- split experts (MoEpic): a segment of the intermediate neurons ---------------------------------
def intermediate_size(full: SlotLayout, transposed: bool) -> int:
    """F, the expert's intermediate size, from the whole expert's layout."""
    if "up_proj" in full.names:  # no gate (Nemotron-H): up [F, H]
        return full.shapes[full.names.index("up_proj")][0]
    shape = full.shapes[full.names.index("gate_up_proj")]  # [2F, H], or [H, 2F] transposed
    return (shape[1] if transposed else shape[0]) // 2


def neuron_bounds(full: SlotLayout, transposed: bool, lo: float, hi: float) -> tuple[int, int]:
    """The neurons ``[a, b)`` of the fractions ``[lo, hi)``, at least one on each side of a cut."""
    f = intermediate_size(full, transposed)
    cut = lambda x: 0 if x <= 0 else f if x >= 1 else min(f - 1, max(1, round(x * f)))  # noqa: E731
    return cut(lo), cut(hi)


def segment_layout(full: SlotLayout, transposed: bool, a: int, b: int) -> SlotLayout:
    """One slot of the neurons ``[a, b)``: gate_up [2s, H] and down [H, s] (transposed: gate_up
    [H, 2s] with its bias [2s], down [s, H]; the down bias, added once, goes with the top segment)."""
    s = b - a
    shapes = dict(zip(full.names, full.shapes, strict=True))
    if "up_proj" in shapes:  # no gate: up [s, H], down [H, s]
        h = shapes["up_proj"][1]
        return SlotLayout.of({"up_proj": (s, h), "down_proj": (h, s)}, full.dtype)
    if not transposed:
        h = shapes["gate_up_proj"][1]
        return SlotLayout.of({"gate_up_proj": (2 * s, h), "down_proj": (h, s)}, full.dtype)
    h = shapes["gate_up_proj"][0]
    out = {"gate_up_proj": (h, 2 * s), "gate_up_proj_bias": (2 * s,), "down_proj": (s, h)}
    if a == 0:
        out["down_proj_bias"] = (h,)
    out = {name: shape for name, shape in out.items() if name in shapes}  # Aria's have no biases
    return SlotLayout.of(out, full.dtype)


class SegmentSource:
    """Fills a segment's slot from the slow tier's whole expert: ``copy_chunk`` as the worker asks.

    A segment's columns of a matrix are strided in the whole expert (the down projection's, or GPT-OSS's
    interleaved gate_up): for a GPU they are gathered into a pinned staging buffer first, so that the
    copy over the link is one contiguous, asynchronous transfer (the worker waits for each chunk's copies
    before the next chunk reuses the buffer). Measured on an H100 before this: a strided copy from pinned
    memory made a split expert's decode step 6x slower than moving the whole expert."""

    def __init__(
        self,
        tier,
        full: SlotLayout,
        transposed: bool,
        bounds: dict[int, tuple[int, int]],
        interleaved: bool = True,
    ) -> None:
        self.tier, self.transposed, self.bounds = tier, transposed, bounds  # layer -> (a, b)
        self.interleaved = interleaved  # transposed gate and up columns alternate (else: concatenated)
        self.f = intermediate_size(full, transposed)
        self._reader = tier.reader()  # host views of whole experts, for the transfer worker's thread
        self._staging: torch.Tensor | None = None  # pinned bytes, grown on demand

    def copy_chunk(self, key, views: dict[str, torch.Tensor], chunk, flat=None) -> None:
        src = self._reader(key)
        a, b = self.bounds[key[0]]
        offset = 0  # into the staging buffer, for this chunk's strided pieces
        for name, start, stop, _ in chunk:
            for dst_rows, piece in self._pieces(src, name, a, b, start, stop):
                dst = views[name][dst_rows]
                if dst.device.type == "cpu":
                    dst.copy_(piece)
                elif piece.is_contiguous():
                    dst.copy_(piece, non_blocking=True)
                else:
                    staged = self._stage(piece, offset)
                    offset += piece.numel() * piece.element_size()
                    dst.copy_(staged, non_blocking=True)

    def _stage(self, piece: torch.Tensor, offset: int) -> torch.Tensor:
        """``piece`` gathered, contiguous, into pinned memory at byte ``offset`` of the staging buffer."""
        need = offset + piece.numel() * piece.element_size()
        if self._staging is None or self._staging.numel() < need:
            size = max(need, 2 * (0 if self._staging is None else self._staging.numel()))
            self._staging = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        out = self._staging[offset:need].view(piece.dtype).view(piece.shape)
        out.copy_(piece)
        return out

    def _pieces(self, src, name: str, a: int, b: int, start: int, stop: int):
        """(slot rows, source tensor) pairs that fill rows ``[start, stop)`` of the slot's ``name``."""
        s, f = b - a, self.f
        t = src[name]
        if not self.transposed:
            if name == "down_proj":  # [H, F]: the columns of the neurons
                return [(slice(start, stop), t[start:stop, a:b])]
            if name == "up_proj":  # [F, H] without a gate: the rows of the neurons
                return [(slice(start, stop), t[a + start : a + stop])]
            out = []  # gate_up [2F, H]: gate rows [a, b), then up rows F + [a, b)
            if start < s:
                out.append((slice(start, min(stop, s)), t[a + start : a + min(stop, s)]))
            if stop > s:
                lo = max(start, s)
                out.append((slice(lo, stop), t[f + a + lo - s : f + a + stop - s]))
            return out
        if name == "gate_up_proj" and self.interleaved:  # [H, 2F] interleaved gate/up: columns [2a, 2b)
            return [(slice(start, stop), t[start:stop, 2 * a : 2 * b])]
        if name == "gate_up_proj":  # [H, 2F] gate columns, then up columns: [a, b) and F + [a, b)
            rows = slice(start, stop)
            return [((rows, slice(0, s)), t[rows, a:b]), ((rows, slice(s, 2 * s)), t[rows, f + a : f + b])]
        if name == "gate_up_proj_bias":
            return [(slice(start, stop), t[2 * a + start : 2 * a + stop])]
        if name == "down_proj":  # [F, H]: rows of the neurons
            return [(slice(start, stop), t[a + start : a + stop])]
        return [(slice(start, stop), t[start:stop])]  # down_proj_bias (top segment only)


def segment_output(module, views: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """One segment's share of the expert's output on x [T, H] -> [T, H] (the segments sum to it)."""
    if module.is_transposed:
        h = x @ views["gate_up_proj"]
        h = module._apply_gate(h + views["gate_up_proj_bias"] if "gate_up_proj_bias" in views else h)
        out = h @ views["down_proj"]
        return out + views["down_proj_bias"] if "down_proj_bias" in views else out
    # [T, 2s]: the segment's gate rows, then its up rows (or [T, s] of up rows without a gate); every
    # family's gate is elementwise
    return F.linear(gate(module, F.linear(x, views[first_matrix(module)])), views["down_proj"])


# -- low-precision copies (HOBBIT) ------------------------------------------------------------------
def quantized_part(spec: PartSpec, model: Path, dtype: torch.dtype, pin: bool = False) -> EnginePart:
    """The ``spec.bits``-bit copies that ``expertcache quantize`` wrote for ``model``, read from their file
    (into host memory first, with the host tier): int8 and int4 computed by the packed kernels from the
    slot's bytes (``engine.packed``), int2 (HQQ's) expanded to ``dtype`` for each use."""
    from expertcache.engine.quantized import (
        Dequantizer,
        QuantSource,
        find_copy,
        packed_of,
        quant_layout,
        read_meta,
    )

    if int(spec.bits) not in (8, 4):
        from expertcache.lazy import hqq_quantizer

        hqq_quantizer()  # optional: said first, before the copies it would build are looked for
    path = find_copy(model, int(spec.bits), int(spec.group or 64))
    meta = read_meta(path)
    layout = quant_layout(meta)
    packed = packed_of(meta, dtype)
    kernels = None
    if packed is not None:
        from expertcache.engine.packed import PackedKernels

        kernels = PackedKernels(packed)
        compute = kernels.expert
    else:
        from expertcache.lazy import hqq_quantizer

        hqq_quantizer()  # int2, or int8/int4 copies of earlier versions: HQQ's
        expand = Dequantizer(meta, dtype)

        def compute(module, views, x):
            return expert_output(module, expand(views), x)

    def source(tier) -> QuantSource:
        return QuantSource(path, layout, pin=pin, in_memory=getattr(tier, "name", "") == "host")

    made = meta.get("method") or ("round" if packed is not None else "hqq, or hqq-fast: not recorded")
    return EnginePart(spec, {None: layout}, source, compute, kernels=kernels, copies=f"{path.name} ({made})")
