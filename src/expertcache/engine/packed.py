"""Packed experts: a checkpoint's experts stored, moved and computed as int8 or int4 weights.

A packed checkpoint (written by ``expertcache quantize --checkpoint DIR``, ``tools.quantize``) is a
checkpoint folder like any other (config, tokenizer, dense weights under their own names) whose experts
are stored per layer as packed bytes, ``{layer prefix}.packed_experts.{tensor}`` ``[experts, bytes]``
(uint8), and whose ``config.json`` says how (``expertcache_experts``: the format and group).
The engine reads it as it reads any checkpoint (``ExpertStore``, every slow tier): a slot holds one
expert's packed bytes, the expert memory counts them, a miss moves them, and the kernels read them as
they are (``_packed_jit``, numba, on a CPU); nothing is expanded to bfloat16 for a decode step.

Formats (weight-only: activations stay in float32 inside the kernels):

- ``int8``: symmetric, one float32 scale per output row (``absmax / 127``); a weight is ``q * scale``.
  8.03 bits a weight at Granite's shapes. torch's ``_weight_int8pack_mm`` takes the same layout.
- ``int4``: asymmetric min-max, per group of ``group`` input columns of a row (default 64; a row's last
  group is shorter where ``group`` does not divide it) a bfloat16 scale and minimum; two weights a byte
  (the even column in the low nibble); a weight is ``q * scale + minimum``. 4.5 bits a weight at group 64.

On a GPU the kernels are Triton's (``_packed_triton``): the same per-row products, each weight block
unpacked in registers. An expert with more tokens than ``DECODE_ROWS`` in a step (a prefill's share) takes,
on a CPU and up to ``PREFILL_ROWS`` tokens, loops that unpack each weight row once for all its tokens
(a 64-token Granite prefill: 732 ms against 1221 ms expanding, int8); beyond that, and on a GPU, the
expert's matrices are expanded to the compute dtype once per step and multiplied as the full-precision
experts are (compute-bound: the expansion is small beside it); so does a GPU without Triton.

The dense weights stay as they are. GPT-OSS's matrices (stored ``[in, out]``) are packed as their
transposes; its biases are stored in float32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from expertcache.engine.memory import SlotLayout
from expertcache.errors import ExpertcacheError

CONFIG_KEY = "expertcache_experts"  # config.json's entry of a packed checkpoint
STORED = "packed_experts"  # the checkpoint's tensors: {layer prefix}.packed_experts.{tensor}
FORMATS = {"int8": 8, "int4": 4}  # format -> bits
DEFAULT_GROUP = 64  # int4's columns per scale and minimum
MATRICES = ("gate_up_proj", "down_proj")
DECODE_ROWS = 8  # at most this many tokens an expert: each token a row of the one-token kernels
PREFILL_ROWS = 64  # more, up to this (CPU): each weight row unpacked once for all; beyond: expanded


def check_format(fmt: str, group: int | None = None) -> int:
    """The group ``fmt`` uses (int8: 0, one scale per row); one line for a format or group it cannot take."""
    if fmt not in FORMATS:
        raise ExpertcacheError(f"packed format {fmt!r} is not one of: {', '.join(FORMATS)}")
    if fmt == "int8":
        if group not in (None, 0):
            raise ExpertcacheError("int8 experts have one scale per row: --group applies to int4 only")
        return 0
    group = DEFAULT_GROUP if group is None else group
    if not isinstance(group, int) or group < 8 or group & (group - 1):
        raise ExpertcacheError(f"int4 group must be a power of two of at least 8, got {group!r}")
    return group


@dataclass(frozen=True)
class Packed:
    """How one model's experts are packed: the format, and the full-precision tensors it stands for."""

    format: str  # int8 | int4
    group: int  # int4: input columns per scale and minimum; int8: 0 (one scale per row)
    shapes: dict[str, tuple[int, ...]]  # one expert's full-precision tensors (family order)
    dtype: torch.dtype  # the compute dtype (biases are stored in float32)
    transposed: bool  # GPT-OSS: matrices stored [in, out] (packed as their transposes)

    @property
    def bits(self) -> int:
        return FORMATS[self.format]

    def matrix(self, name: str) -> tuple[int, int]:
        """``(rows, cols)`` of ``name`` as packed: transformers' ``[out, in]``."""
        shape = self.shapes[name]
        return (shape[1], shape[0]) if self.transposed else (shape[0], shape[1])

    def tensors(self) -> dict[str, tuple[int]]:
        """Each stored tensor of one expert and its bytes, in slot order."""
        out: dict[str, tuple[int]] = {}
        for name, shape in self.shapes.items():
            if name not in MATRICES:  # a bias, in float32
                out[name] = (math.prod(shape) * 4,)
                continue
            rows, cols = self.matrix(name)
            if self.format == "int8":
                out.update({f"{name}.q": (rows * cols,), f"{name}.scale": (4 * rows,)})
            else:
                groups = rows * -(-cols // self.group)
                out.update({f"{name}.q": (rows * cols // 2,), f"{name}.scale": (2 * groups,),
                            f"{name}.min": (2 * groups,)})  # fmt: skip
        return out

    def layout(self) -> SlotLayout:
        return SlotLayout.of(self.tensors(), torch.uint8)

    def check_shapes(self) -> None:
        """One line where an expert's matrices cannot be packed in this format (int4: two columns a byte)."""
        if self.format != "int4":
            return
        for name in MATRICES:
            rows, cols = self.matrix(name)
            if cols % 2:
                raise ExpertcacheError(f"int4 packs two columns a byte; {name} has {cols} input columns")

    # -- packing -----------------------------------------------------------------------------------
    def pack(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One expert's full-precision tensors -> its stored tensors (uint8, ``tensors()``' sizes)."""
        out = {}
        for name, t in views.items():
            if name not in MATRICES:
                out[name] = _bytes(t.to(torch.float32))
                continue
            w = (t.T if self.transposed else t).to(torch.float32)  # [out, in]
            out.update(
                {
                    f"{name}.{k}": v
                    for k, v in (pack_int8(w) if self.format == "int8" else pack_int4(w, self.group)).items()
                }
            )
        return out

    def expand(self, views: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """The matrix ``name`` of a slot's views, unpacked: float32 ``[out, in]``."""
        rows, cols = self.matrix(name)
        q = views[f"{name}.q"]
        if self.format == "int8":
            scale = views[f"{name}.scale"].view(torch.float32)
            return q.view(torch.int8).view(rows, cols).to(torch.float32) * scale[:, None]
        groups = -(-cols // self.group)
        scale = views[f"{name}.scale"].view(torch.bfloat16).to(torch.float32).view(rows, groups, 1)
        low = views[f"{name}.min"].view(torch.bfloat16).to(torch.float32).view(rows, groups, 1)
        nib = torch.stack((q & 15, q >> 4), dim=-1).view(rows, cols).to(torch.float32)
        nib = F.pad(nib, (0, groups * self.group - cols)).view(rows, groups, self.group)
        return (nib * scale + low).view(rows, -1)[:, :cols]

    def bias(self, views: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        return views[name].view(torch.float32).to(self.dtype)

    def entry(self) -> dict[str, object]:
        """``config.json``'s ``expertcache_experts``."""
        return {"format": self.format, "group": self.group}


def refuse_other_quantisation(config, label: str) -> None:
    """One line for a checkpoint quantised by another tool (its config's ``quantization_config``: GPT-OSS's
    MXFP4, FP8 block-quantised, GPTQ, AWQ, ...): its weights are not the tensors the engine reads, so it
    is refused rather than run through a kernel for other weights."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = getattr(method, "value", method) or "an unnamed method"
    raise ExpertcacheError(
        f"{label}: its weights are quantised ({method}, the config's quantization_config), which this "
        f"expertcache does not read; it runs full-precision checkpoints and its own packed ones (int8, int4: "
        f"'expertcache quantize MODEL --bits 8 --checkpoint DIR' from the full-precision model)"
    )


def from_config(
    config, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, transposed: bool
) -> Packed | None:
    """The packing a checkpoint's config declares (None: full-precision experts); one line if unusable."""
    entry = getattr(config, CONFIG_KEY, None)
    if entry is None:
        return None
    if not isinstance(entry, dict) or "format" not in entry:
        raise ExpertcacheError(f"config's {CONFIG_KEY} is not a packing record: {entry!r}")
    fmt = str(entry["format"])
    if fmt not in FORMATS:
        raise ExpertcacheError(
            f"packed experts in format {fmt!r}: this expertcache runs {', '.join(FORMATS)} (upgrade it?)"
        )
    group = check_format(fmt, int(entry.get("group") or 0) or None)
    packed = Packed(fmt, group, dict(shapes), dtype, transposed)
    packed.check_shapes()
    return packed


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8).clone()


def pack_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``w`` float32 ``[rows, cols]`` -> ``q`` (int8 as bytes) and one float32 scale per row."""
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / torch.where(scale > 0, scale, 1)[:, None]).clamp_(-127, 127).to(torch.int8)
    return {"q": _bytes(q), "scale": _bytes(scale.to(torch.float32))}


def pack_int4(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """``w`` float32 ``[rows, cols]`` -> ``q`` (two a byte, even column low) and per group of ``group``
    columns a bfloat16 scale and minimum (a row's last group may be shorter: its own columns only); the
    rounding uses the stored (bfloat16) scale and minimum."""
    rows, cols = w.shape
    groups = -(-cols // group)
    g = F.pad(w, (0, groups * group - cols), mode="replicate").view(rows, groups, group)  # the last group's
    low = g.amin(dim=-1, keepdim=True).to(torch.bfloat16).to(torch.float32)
    scale = ((g.amax(dim=-1, keepdim=True) - low) / 15).to(torch.bfloat16).to(torch.float32)
    q = torch.round((g - low) / torch.where(scale > 0, scale, 1)).clamp_(0, 15).to(torch.uint8)
    q = q.view(rows, -1)[:, :cols]
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return {
        "q": _bytes(packed),
        "scale": _bytes(scale.to(torch.bfloat16)),
        "min": _bytes(low.to(torch.bfloat16)),
    }


# -- computing ---------------------------------------------------------------------------------------
def slot_bytes(views: dict[str, torch.Tensor], layout: SlotLayout) -> torch.Tensor:
    """The slot behind ``views`` as one ``[1, slot bytes]`` uint8 tensor (the same memory)."""
    first = views[layout.names[0]]
    row = torch.empty(0, dtype=torch.uint8, device=first.device)
    return row.set_(
        first.untyped_storage(), first.storage_offset() - layout.offsets[0], (1, layout.slot_bytes)
    )


class PackedKernels:
    """The packed experts' computations over a pool of packed slots (``[S, slot bytes]`` uint8)."""

    def __init__(self, packed: Packed) -> None:
        self.packed = packed
        self.layout = packed.layout()
        self.offsets = dict(zip(self.layout.names, self.layout.offsets, strict=True))

    def offsets_of(self, name: str) -> tuple[int, ...]:
        """Where in a slot the matrix ``name``'s packed tensors start: q, scale (and int4's minimum)."""
        off = self.offsets
        return (off[f"{name}.q"], off[f"{name}.scale"]) + (
            (off[f"{name}.min"],) if self.packed.format == "int4" else ()
        )

    def warm(self, pool: torch.Tensor) -> None:
        """Compile the GPU kernels for this model's matrices (on ``pool``, a GPU's pool) once, at load."""
        from expertcache.engine import _packed_triton

        p = self.packed
        _packed_triton.warm(
            p.format,
            p.group,
            pool,
            {n: self.offsets_of(n) for n in MATRICES},
            {n: p.matrix(n) for n in MATRICES},
            p.dtype,
        )

    def project(self, name: str, pool, slots, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[1 or K, in]`` times the matrix ``name`` of each slot in ``slots`` ``[K]`` -> float32
        ``[K, out]``: numba's loops over a CPU pool (``np.ndarray``), Triton's over a GPU's (a tensor; a
        slot past the pool gives zeros)."""
        p, off = self.packed, self.offsets
        rows, cols = p.matrix(name)
        if isinstance(pool, torch.Tensor):
            from expertcache.engine import _packed_triton

            return _packed_triton.project(
                p.format, p.group, pool, self.offsets_of(name), rows, cols, slots, x
            )
        from expertcache.engine import _packed_jit

        xf = np.ascontiguousarray(x.detach().to(torch.float32).numpy())
        out = np.empty((len(slots), rows), dtype=np.float32)
        if p.format == "int8":
            _packed_jit.rows_int8(pool, off[f"{name}.q"], off[f"{name}.scale"], rows, cols, slots, xf, out)
        else:
            even, odd = np.ascontiguousarray(xf[:, 0::2]), np.ascontiguousarray(xf[:, 1::2])
            groups = -(-cols // p.group)
            padded = np.zeros((xf.shape[0], groups * p.group), dtype=np.float32)
            padded[:, :cols] = xf
            xsum = padded.reshape(xf.shape[0], groups, p.group).sum(axis=-1)
            _packed_jit.rows_int4(
                pool, off[f"{name}.q"], off[f"{name}.scale"], off[f"{name}.min"], rows, cols, p.group,
                slots, even, odd, xsum, out,
            )  # fmt: skip
        return torch.from_numpy(out)

    def project_tokens(self, name: str, pool: np.ndarray, slot: int, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]`` times the matrix ``name`` of one slot -> float32 ``[T, out]``: each row unpacked
        once for all the tokens (CPU)."""
        from expertcache.engine import _packed_jit

        p, off = self.packed, self.offsets
        rows, cols = p.matrix(name)
        xf = np.ascontiguousarray(x.detach().to(torch.float32).numpy())
        out = np.empty((xf.shape[0], rows), dtype=np.float32)
        if p.format == "int8":
            _packed_jit.tokens_int8(pool, off[f"{name}.q"], off[f"{name}.scale"], rows, cols, slot, xf, out)
        else:
            _packed_jit.tokens_int4(
                pool, off[f"{name}.q"], off[f"{name}.scale"], off[f"{name}.min"], rows, cols, p.group, slot,
                xf, out,
            )  # fmt: skip
        return torch.from_numpy(out)

    def tokens(self, module, pool: np.ndarray, x: torch.Tensor) -> torch.Tensor:
        """Several tokens ``x`` ``[T, H]`` through the expert of a one-slot CPU pool -> ``[T, H]`` in the
        compute dtype (``project_tokens``)."""
        p = self.packed
        h = self.project_tokens("gate_up_proj", pool, 0, x).to(p.dtype)
        if module.is_transposed:
            h = module._apply_gate(
                h + _bias_rows(p, pool, self.offsets, np.zeros(1, np.int64), "gate_up_proj_bias")
            )
        else:
            gate, up = h.chunk(2, dim=-1)
            h = module.act_fn(gate) * up
        out = self.project_tokens("down_proj", pool, 0, h).to(p.dtype)
        if module.is_transposed:
            out = out + _bias_rows(p, pool, self.offsets, np.zeros(1, np.int64), "down_proj_bias")
        return out

    def rows(self, module, pool, slots, x: torch.Tensor) -> torch.Tensor:
        """Each expert's output on its own row of ``x`` (``[K, H]``, or ``[1, H]`` shared by all), for the
        slots ``slots`` ``[K]`` of ``pool`` (a CPU's ``np.ndarray`` ``[S, slot bytes]`` with slot ids, or a
        GPU's uint8 tensor with a tensor of them on it): ``[K, H]`` in the compute dtype."""
        p = self.packed
        ids = slots if isinstance(pool, torch.Tensor) else np.asarray(slots, dtype=np.int64)
        h = self.project("gate_up_proj", pool, ids, x).to(p.dtype)
        if module.is_transposed:
            h = module._apply_gate(h + _bias_rows(p, pool, self.offsets, ids, "gate_up_proj_bias"))
        else:
            gate, up = h.chunk(2, dim=-1)
            h = module.act_fn(gate) * up
        out = self.project("down_proj", pool, ids, h).to(p.dtype)
        if module.is_transposed:
            out = out + _bias_rows(p, pool, self.offsets, ids, "down_proj_bias")
        return out

    def expert(self, module, views: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """One expert on its tokens ``x`` ``[T, H]`` -> ``[T, H]``, from one slot's views: up to
        ``DECODE_ROWS`` tokens in the one-token kernels (each token a row of the slot's own one-slot pool;
        on a GPU, Triton's), on a CPU up to ``PREFILL_ROWS`` in the several-token loops, else from the
        matrices expanded. Which one depends on ``T`` alone, so an expert's output is the same whichever
        path (resident, missed, batched) computes it."""
        if x.device.type == "cpu" and x.shape[0] <= PREFILL_ROWS:
            one = slot_bytes(views, self.layout).numpy()
            if x.shape[0] <= DECODE_ROWS:
                return self.rows(module, one, np.zeros(x.shape[0], dtype=np.int64), x)
            return self.tokens(module, one, x)
        if x.shape[0] <= DECODE_ROWS:
            one = slot_bytes(views, self.layout)
            if gpu_kernels(x.device):
                return self.rows(module, one, torch.zeros(x.shape[0], dtype=torch.int64, device=x.device), x)
        p = self.packed
        w1, w2 = (self.packed.expand(views, n).to(p.dtype) for n in MATRICES)
        if module.is_transposed:
            h = module._apply_gate(F.linear(x, w1) + p.bias(views, "gate_up_proj_bias"))
            return F.linear(h, w2) + p.bias(views, "down_proj_bias")
        gate, up = F.linear(x, w1).chunk(2, dim=-1)
        return F.linear(module.act_fn(gate) * up, w2)


def gpu_kernels(device: torch.device) -> bool:
    """Whether the packed kernels run on ``device`` (a CUDA or ROCm GPU with Triton installed)."""
    return device.type == "cuda" and _has_triton()


@functools.cache
def _has_triton() -> bool:  # asked for every expert a GPU computes: looked up once
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _bias_rows(p: Packed, pool, offsets: dict[str, int], ids, name: str) -> torch.Tensor:
    n = p.shapes[name][0] * 4
    start = offsets[name]
    if isinstance(pool, torch.Tensor):  # a GPU's pool: ids past it (computed elsewhere) read slot 0
        raw = pool[torch.where(ids < pool.shape[0], ids, 0), start : start + n].contiguous()
    else:
        raw = torch.from_numpy(np.ascontiguousarray(pool[ids, start : start + n]))
    return raw.view(torch.float32).to(p.dtype)


class PackedPool:
    """The slot pool of packed whole experts, as the runtime's stacked kernels take it (``engine.kernels``'
    ``StackedPool`` for full-precision experts): the pool's bytes and the packed kernels."""

    packed = True

    def __init__(self, pool, kernels: PackedKernels) -> None:
        self.pool, self.kernels = pool, kernels
        self.num_slots = len(pool)
        self.device = pool.buffer.device
        self.array = pool.buffer.numpy() if self.device.type == "cpu" else None  # [S, slot bytes]
        self.gpu = gpu_kernels(self.device)  # the whole step's pairs in one call of the Triton kernels
        if self.gpu:
            kernels.warm(pool.buffer)


def packed_decode_rows(module, pool: PackedPool, hidden: torch.Tensor, slots, top_k_weights) -> torch.Tensor:
    """One token's weighted output from each of the packed experts in ``slots`` ``[K]`` (CPU), ``[K, H]``:
    ``kernels.decode_rows`` for packed experts."""
    out = pool.kernels.rows(module, pool.array, slots, hidden.reshape(1, -1))
    return out * top_k_weights.reshape(-1).unsqueeze(-1)


def packed_grouped_rows(
    module, pool: PackedPool, hidden: torch.Tensor, slot_ids, top_k_weights
) -> torch.Tensor:
    """Each (token, expert) pair's weighted output ``[T*K, H]`` in routing order, from the packed experts in
    slots ``slot_ids`` ``[T, K]`` (``pool.num_slots``: computed elsewhere, its row left zero):
    ``kernels.grouped_rows`` for packed experts, one expert after another."""
    T, K = slot_ids.shape
    ids = slot_ids.reshape(-1)
    weights = top_k_weights.reshape(-1)
    if pool.gpu and T <= DECODE_ROWS:  # every pair a row: each expert has at most T tokens (``expert``)
        out = pool.kernels.rows(module, pool.pool.buffer, ids, hidden.repeat_interleave(K, dim=0))
        return (out * weights[:, None]).to(hidden.dtype)
    host = ids.to("cpu").numpy()
    out = torch.zeros(ids.numel(), hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
    for slot in np.unique(host):
        if slot >= pool.num_slots:
            continue
        flat = torch.from_numpy(np.flatnonzero(host == slot)).to(hidden.device)
        y = pool.kernels.expert(module, pool.pool.views[int(slot)], hidden[flat // K])
        out[flat] = (y * weights[flat, None]).to(out.dtype)
    return out


def describe_format(packed: Packed | None, dtype: torch.dtype | None = None) -> str:
    """The experts' storage format in a word: ``int8``, ``int4-g64``, or the full-precision dtype."""
    if packed is None:
        return str(dtype).removeprefix("torch.")
    return packed.format if packed.format == "int8" else f"{packed.format}-g{packed.group}"
