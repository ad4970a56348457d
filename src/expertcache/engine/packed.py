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
unpacked in registers. An expert with several tokens in a step (a prefill's share, a batch) takes, on a CPU
and up to ``PREFILL_ROWS`` tokens, loops that unpack each weight row once for all its tokens (from
``CPU_ROWS`` + 1 tokens; a 64-token Granite prefill: 732 ms against 1221 ms expanding, int8); beyond that,
and on a GPU beyond ``DECODE_ROWS``, the expert's matrices are expanded to the compute dtype once per step
and multiplied as the full-precision experts are (compute-bound: the expansion is small beside it); so
does a GPU without Triton.

The dense weights stay as they are. GPT-OSS's matrices (stored ``[in, out]``) are packed as their
transposes; its biases are stored in float32.

Checkpoints quantised by other tools are read in their own format, under their own tensor names, with the
same machinery (a slot holds the expert's bytes as the checkpoint stores them; ``Packed.sources``):

- ``mxfp4``: GPT-OSS's published checkpoints (transformers' ``Mxfp4Config``): per matrix ``{name}_blocks``
  ``[E, out, in / 32, 16]`` (two e2m1 values a byte, the even column in the low nibble) and
  ``{name}_scales`` ``[E, out, in / 32]`` (an e8m0 exponent per 32 columns of a row, biased by 127);
  a weight is ``fp4 * 2 ** (scale - 127)``, exactly the value transformers' dequantisation gives. The
  biases stay in the checkpoint's dtype.
- ``fp8``: block-quantised FP8 (DeepSeek-V3, Qwen3-FP8; transformers' ``FineGrainedFP8Config``): per
  expert projection ``weight`` ``[out, in]`` in float8 e4m3 and ``weight_scale_inv`` float32
  ``[ceil(out / 128), ceil(in / 128)]``, one scale per 128 x 128 block (the config's
  ``weight_block_size``); a weight is ``fp8 * scale``, rounded to bfloat16 in a bfloat16 model (as
  transformers' dequantised weight is) before its product. The checkpoint's other FP8 linear layers
  (attention, shared experts, dense MLPs) are dequantised at load, as transformers does on a CPU.
- ``pack-int4``, ``pack-int8``: compressed-tensors' symmetric ``pack-quantized`` weights (llm-compressor's
  W4A16, W8A16): per expert projection ``weight_packed`` int32 ``[out, in * bits / 32]`` (unsigned values
  ``q + 2 ** (bits - 1)``, little-endian within a word: int4's bytes are expertcache's int4 order) and
  ``weight_scale`` ``[out, in / group]`` (one per row for the ``channel`` strategy) in the model's dtype;
  a weight is ``q * scale``, rounded to bfloat16 in a bfloat16 model. Its other quantised linear layers
  are decompressed at load. On a GPU these are expanded per use (no Triton kernel for them yet).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from expertcache.engine.kernels import cast, host_f32
from expertcache.engine.memory import SlotLayout
from expertcache.errors import ExpertcacheError

CONFIG_KEY = "expertcache_experts"  # config.json's entry of a packed checkpoint
SOURCE_KEY = "expertcache_source"  # a checkpoint expertcache quantised: the one it was made from (quality's)
STORED = "packed_experts"  # the checkpoint's tensors: {layer prefix}.packed_experts.{tensor}
FORMATS = {"int8": 8, "int4": 4, "mxfp4": 4, "fp8": 8, "pack-int4": 4, "pack-int8": 8}  # -> bits a weight
OWN = ("int8", "int4")  # expertcache's own formats (``expertcache quantize --checkpoint``); others: read only
PACK_QUANTIZED = ("pack-int4", "pack-int8")  # compressed-tensors' symmetric pack-quantized int formats
TRITON = ("int8", "int4", "mxfp4", "fp8")  # the formats with GPU kernels; others expanded per use there
MX_BLOCK = 32  # MXFP4: columns per e8m0 scale
DEFAULT_GROUP = 64  # int4's columns per scale and minimum
MATRICES = ("gate_up_proj", "down_proj")

DECODE_ROWS = 8  # GPU: at most this many tokens an expert: each token a row of the one-token kernels
# CPU: at most this many tokens an expert in the one-token loops, which read and decode the matrix again for
# each token; more, up to PREFILL_ROWS, in the several-token loops, which decode each row once for all of
# them: those win from 2 tokens where decoding is the cost (int4, mxfp4, fp8: 1.6-3.7x at 4 tokens), while
# int8's one-token loops, memory-bound, stay ahead up to 8 at Granite's and OLMoE's shapes
# (``bench/packed_rows_cpu.py``; compressed-tensors' pack-*, which decode and round each weight as fp8's
# do, follow them unmeasured); beyond PREFILL_ROWS: expanded
CPU_ROWS = {"int8": 8, "int4": 1, "mxfp4": 1, "fp8": 1, "pack-int4": 1, "pack-int8": 1}
PREFILL_ROWS = 64


def require_gate(shapes) -> None:
    """One line where an expert has no gate projection (Nemotron-H's ``up_proj``): low-precision copies
    and packed checkpoints hold ``gate_up_proj`` and ``down_proj``."""
    if "gate_up_proj" not in shapes:
        raise ExpertcacheError(
            f"low-precision and packed experts need a gate projection (gate_up_proj); these experts have "
            f"{' and '.join(shapes)}: run them at full precision"
        )


def check_format(fmt: str, group: int | None = None) -> int:
    """The group ``fmt`` uses (int8: 0, one scale per row); one line for a format or group it cannot take."""
    if fmt not in OWN:
        raise ExpertcacheError(f"packed format {fmt!r} is not one of: {', '.join(OWN)}")
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

    format: str  # int8 | int4 (expertcache's) | mxfp4 | fp8 | pack-int4 | pack-int8 (other tools')
    group: int  # int4, pack-*: input columns per scale (pack-*: 0, one scale a row); mxfp4: 32; int8, fp8: 0
    shapes: dict[str, tuple[int, ...]]  # one expert's full-precision tensors (family order)
    dtype: torch.dtype  # the compute dtype
    transposed: bool  # GPT-OSS: matrices stored [in, out] (expertcache's formats pack their transposes)
    bias_dtype: torch.dtype = torch.float32  # biases as stored (another tool's checkpoint: its own dtype)
    block: tuple[int, int] = (0, 0)  # fp8: rows and columns per scale
    # fp8: rows of each checkpoint tensor a matrix gathers (gate, up), each with its own blocks of scales
    parts: tuple[tuple[str, tuple[int, ...]], ...] = ()
    method: str | None = None  # the quantisation tool's method (mxfp4, fp8, compressed-tensors); None: own

    @property
    def bits(self) -> int:
        return FORMATS[self.format]

    @property
    def exact(self) -> bool:
        """Whether the kernels compute with the weights transformers' dequantised model has: another tool's
        MXFP4 (each value is a bfloat16 too), or FP8 in a float32 or bfloat16 model (the kernels round each
        ``fp8 * scale`` to bfloat16 as transformers does; not to float16). expertcache's own formats do not
        stand for their full-precision source. compressed-tensors' int formats: as FP8 (its weights are
        ``q * scale`` in the scale's dtype, the model's)."""
        return self.method == "mxfp4" or (
            self.method in ("fp8", "compressed-tensors") and self.dtype in (torch.float32, torch.bfloat16)
        )

    def group_of(self, name: str) -> int:
        """pack-*: the columns a scale of the matrix ``name`` covers (a row's, where one scale a row)."""
        return self.group or self.matrix(name)[1]

    def matrix(self, name: str) -> tuple[int, int]:
        """``(rows, cols)`` of ``name`` as packed: transformers' ``[out, in]``."""
        shape = self.shapes[name]
        return (shape[1], shape[0]) if self.transposed else (shape[0], shape[1])

    def scale_rows(self, name: str) -> np.ndarray:
        """fp8: the row of ``name``'s scales each of its rows takes (int32 ``[rows]``): each checkpoint
        tensor it gathers has its own blocks of ``block[0]`` rows, the last one maybe shorter."""
        out, first = [], 0
        for rows in dict(self.parts)[name]:
            out.append(first + np.arange(rows) // self.block[0])
            first += -(-rows // self.block[0])
        return np.concatenate(out).astype(np.int32)

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Each stored tensor of one expert and its shape in bytes, in slot order (another tool's: its
        checkpoint tensor's shape, an element of several bytes a last dimension of them)."""
        out: dict[str, tuple[int, ...]] = {}
        for name, shape in self.shapes.items():
            if name not in MATRICES:  # a bias
                size = self.bias_dtype.itemsize
                out[name] = (math.prod(shape) * size,) if self.method is None else (*shape, size)
                continue
            rows, cols = self.matrix(name)
            if self.format == "int8":
                out.update({f"{name}.q": (rows * cols,), f"{name}.scale": (4 * rows,)})
            elif self.format == "int4":
                groups = rows * -(-cols // self.group)
                out.update({f"{name}.q": (rows * cols // 2,), f"{name}.scale": (2 * groups,),
                            f"{name}.min": (2 * groups,)})  # fmt: skip
            elif self.format == "mxfp4":
                blocks = cols // MX_BLOCK
                out.update({f"{name}.q": (rows, blocks, MX_BLOCK // 2), f"{name}.scale": (rows, blocks)})
            elif self.format in PACK_QUANTIZED:  # int32 words of packed values; a scale per group
                words = cols * self.bits // 32
                groups = cols // self.group_of(name)
                out.update(
                    {f"{name}.q": (rows, words, 4), f"{name}.scale": (rows, groups, self.dtype.itemsize)}
                )
            else:  # fp8
                scale_rows = sum(-(-r // self.block[0]) for r in dict(self.parts)[name])
                out.update(
                    {f"{name}.q": (rows, cols), f"{name}.scale": (scale_rows, -(-cols // self.block[1]), 4)}
                )
        return out

    def layout(self) -> SlotLayout:
        return SlotLayout.of(self.tensors(), torch.uint8)

    def sources(self, prefix: str, family_keys: dict[str, list[tuple[str, bool]]]) -> dict:
        """Where each stored tensor of one expert lies in the checkpoint: ``{slot tensor: [(key, fused)]}``
        (``ExpertStore``), from its layer's ``prefix`` (``model.layers.{l}``) and the family's keys of the
        expert at full precision (``Family.expert_keys``)."""
        if self.method is None:
            return {name: [(f"{prefix}.{STORED}.{name}", True)] for name in self.tensors()}
        out = {}
        for name, srcs in family_keys.items():
            if name not in MATRICES:
                out[name] = srcs
            elif self.format == "mxfp4":  # {name}_blocks, {name}_scales
                out[f"{name}.q"] = [(k + "_blocks", fused) for k, fused in srcs]
                out[f"{name}.scale"] = [(k + "_scales", fused) for k, fused in srcs]
            elif self.format in PACK_QUANTIZED:  # {proj}.weight_packed, {proj}.weight_scale
                out[f"{name}.q"] = [(k + "_packed", fused) for k, fused in srcs]
                out[f"{name}.scale"] = [(k + "_scale", fused) for k, fused in srcs]
            else:  # fp8: {proj}.weight with {proj}.weight_scale_inv (a fused {name} with {name}_scale_inv)
                out[f"{name}.q"] = srcs
                out[f"{name}.scale"] = [(k + "_scale_inv", fused) for k, fused in srcs]
        return out

    def check_shapes(self) -> None:
        """One line where an expert's matrices cannot be packed in this format (int4: two columns a byte)."""
        require_gate(self.shapes)
        for name in MATRICES:
            rows, cols = self.matrix(name)
            if self.format == "int4" and cols % 2:
                raise ExpertcacheError(f"int4 packs two columns a byte; {name} has {cols} input columns")
            if self.format == "mxfp4" and cols % MX_BLOCK:
                raise ExpertcacheError(
                    f"mxfp4 scales {MX_BLOCK} columns each; {name} has {cols} input columns"
                )
            if self.format in PACK_QUANTIZED and (cols * self.bits % 32 or cols % self.group_of(name)):
                raise ExpertcacheError(
                    f"{self.format}: {name}'s {cols} input columns are not whole int32 words and groups of "
                    f"{self.group_of(name)} (this expertcache reads those)"
                )

    # -- packing -----------------------------------------------------------------------------------
    def pack(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One expert's full-precision tensors -> its stored tensors (uint8, ``tensors()``' sizes)."""
        if self.format not in OWN:
            raise ExpertcacheError(f"expertcache writes {', '.join(OWN)} experts, not {self.format}")
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
        if self.format == "mxfp4":
            lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=q.device)
            q = q.reshape(rows, cols // 2).to(torch.int64)
            w = torch.stack((lut[q & 15], lut[q >> 4]), dim=-1).view(rows, cols // MX_BLOCK, MX_BLOCK)
            exp = views[f"{name}.scale"].reshape(rows, -1, 1).to(torch.int32) - 127
            return torch.ldexp(w, exp).view(rows, cols)
        if self.format in PACK_QUANTIZED:
            return dequantize_pack(q.reshape(rows, -1), views[f"{name}.scale"], self.bits, self.dtype)
        if self.format == "fp8":
            w = q.reshape(rows, cols).view(torch.float8_e4m3fn).to(torch.float32)
            scale = views[f"{name}.scale"].reshape(-1).view(torch.float32).view(-1, -(-cols // self.block[1]))
            per_row = scale[torch.from_numpy(self.scale_rows(name)).to(q.device, torch.int64)]
            return w * per_row.repeat_interleave(self.block[1], dim=1)[:, :cols]
        groups = -(-cols // self.group)
        scale = views[f"{name}.scale"].view(torch.bfloat16).to(torch.float32).view(rows, groups, 1)
        low = views[f"{name}.min"].view(torch.bfloat16).to(torch.float32).view(rows, groups, 1)
        nib = torch.stack((q & 15, q >> 4), dim=-1).view(rows, cols).to(torch.float32)
        nib = F.pad(nib, (0, groups * self.group - cols)).view(rows, groups, self.group)
        return (nib * scale + low).view(rows, -1)[:, :cols]

    def bias(self, views: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        return views[name].reshape(-1).view(self.bias_dtype).to(self.dtype)

    def entry(self) -> dict[str, object]:
        """``config.json``'s ``expertcache_experts``."""
        return {"format": self.format, "group": self.group}


# e2m1's sixteen values by code (sign in the high bit), as transformers' ``FP4_VALUES``
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


READ = (
    "int8, int4 (expertcache's), mxfp4 (GPT-OSS's), fp8 with block scales (DeepSeek-V3's, Qwen3-FP8's), "
    "compressed-tensors' symmetric pack-quantized int4 and int8 (W4A16, W8A16)"
)
FP8_DTYPES = (torch.float8_e4m3fn,)  # the e4m3 of fp8 checkpoints (e5m2 and others: refused)


def from_config(
    config, family, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, transposed: bool, stored_dtype
) -> Packed | None:
    """The packing a checkpoint's config declares (None: full-precision experts); one line if unusable.
    ``stored_dtype(name, suffix="")``: the checkpoint's dtype of the first expert's tensor ``name``
    (``Family``'s slot names, at full precision: a bias, or a matrix of an fp8 checkpoint; with ``suffix``
    a tensor beside it, e.g. compressed-tensors' ``weight_packed``)."""
    qc = getattr(config, "quantization_config", None)
    entry = getattr(config, CONFIG_KEY, None)
    if qc is None and entry is None:
        return None
    require_gate(shapes)  # before any format's own checks, which read the gate's projection
    if qc is not None:
        return _other_tool(qc, family, shapes, dtype, transposed, stored_dtype)
    if not isinstance(entry, dict) or "format" not in entry:
        raise ExpertcacheError(f"config's {CONFIG_KEY} is not a packing record: {entry!r}")
    fmt = str(entry["format"])
    if fmt not in OWN:
        raise ExpertcacheError(
            f"packed experts in format {fmt!r}: this expertcache runs {', '.join(OWN)} (upgrade it?)"
        )
    group = entry.get("group") or None
    if group is not None and (isinstance(group, bool) or not isinstance(group, int)):
        raise ExpertcacheError(
            f"config's {CONFIG_KEY}.group is not a whole number of columns a scale: {entry['group']!r}"
        )
    try:
        group = check_format(fmt, group)
    except ExpertcacheError as exc:  # the config's own record, not an option the user gave
        raise ExpertcacheError(f"config's {CONFIG_KEY}: {str(exc).replace('--group', 'group')}") from None
    packed = Packed(fmt, group, dict(shapes), dtype, transposed)
    packed.check_shapes()
    return packed


def _other_tool(qc, family, shapes, dtype, transposed, stored_dtype) -> Packed:
    """A checkpoint quantised by another tool (its config's ``quantization_config``): the experts as that
    tool stores them, for the formats this engine reads; any other (GPTQ, AWQ, bitsandbytes, ...) is refused
    in one line rather than run through a kernel for other weights."""
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = qc.get("quant_method")
    method = str(getattr(method, "value", method) or "an unnamed method")
    what = f"its weights are quantised ({method}, the config's quantization_config)"
    if method == "mxfp4" and family.name == "gpt_oss":
        bias = {stored_dtype(n) for n in shapes if n not in MATRICES}
        packed = Packed(
            "mxfp4", MX_BLOCK, dict(shapes), dtype, transposed, bias_dtype=bias.pop(), method=method
        )
    elif method == "compressed-tensors" and not transposed:
        _one_by_one(family, what, method)
        packed = _compressed_tensors(qc, what, dict(shapes), dtype, transposed, stored_dtype)
    elif method == "fp8" and not transposed:
        _one_by_one(family, what, "fp8")
        block = qc.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise ExpertcacheError(
                f"{what} without block scales (weight_block_size {block!r}): this expertcache reads fp8 "
                "with a scale per block of rows and columns"
            )
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ExpertcacheError(
                f"{what} with static activation scales: this expertcache reads dynamic ones"
            )
        for name in MATRICES:
            got = stored_dtype(name)
            if got not in FP8_DTYPES:
                raise ExpertcacheError(
                    f"{what}, but its experts' {name} is stored in {got}, not float8_e4m3fn"
                )
        parts = tuple(
            (name, (shapes[name][0] // len(family.sources[name]),) * len(family.sources[name]))
            for name in MATRICES
        )
        packed = Packed("fp8", 0, dict(shapes), dtype, transposed, block=(int(block[0]), int(block[1])),
                        parts=parts, method=method)  # fmt: skip
    else:
        raise ExpertcacheError(
            f"{what}, which this expertcache does not read for {family.name}; it reads {READ} "
            f"(or write expertcache's own from the full-precision model: 'expertcache quantize MODEL "
            f"--bits 8 --checkpoint DIR')"
        )
    packed.check_shapes()
    return packed


def _one_by_one(family, what: str, method: str) -> None:
    if family.fused:
        raise ExpertcacheError(
            f"{what}: {family.name} stores its experts fused, and {method} checkpoints store them one by one "
            "(transformers 5.24 drops the scales of fused ones too); this expertcache reads them for the "
            "families that store experts one by one (Qwen, DeepSeek, Mixtral, OLMoE)"
        )


def _compressed_tensors(qc: dict, what: str, shapes, dtype, transposed, stored_dtype) -> Packed:
    """compressed-tensors' weight-only symmetric pack-quantized int4 or int8 (llm-compressor's W4A16,
    W8A16): every config group's weights alike, no activation or KV-cache quantisation."""
    status = qc.get("quantization_status")
    if status != "compressed":
        raise ExpertcacheError(f"{what} with status {status!r}: this expertcache reads compressed ones")
    if qc.get("kv_cache_scheme"):
        raise ExpertcacheError(f"{what} with a quantised KV cache: this expertcache reads weight-only ones")
    kept = [n for n in qc.get("ignore") or [] if "experts" in n]  # left at full precision by its writer
    if kept:  # (llm-compressor leaves a layer whose inputs its group does not divide): one format a part
        more = f" and {len(kept) - 1} more" if len(kept) > 1 else ""
        raise ExpertcacheError(
            f"{what}, but it keeps some of its experts' projections at full precision (its 'ignore' lists "
            f"{kept[0]}{more}): this expertcache reads checkpoints whose every expert projection is quantised"
        )
    groups = list((qc.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if not groups or any(w != weights[0] for w in weights):
        raise ExpertcacheError(f"{what} with {len(groups)} config groups of different weights: this "
                               "expertcache reads one kind of weights")  # fmt: skip
    w, g = weights[0], groups[0]
    fmt = g.get("format") or qc.get("format")
    kind = f"{w.get('type')}{w.get('num_bits')} {w.get('strategy')} {fmt}"
    wanted = (
        fmt == "pack-quantized" and w.get("type") == "int" and w.get("num_bits") in (4, 8)
        and w.get("symmetric") and w.get("strategy") in ("group", "channel") and not w.get("dynamic")
        and w.get("actorder") in (None, "static", "weight")  # "group": a column order stored per weight
        and not any(x.get("input_activations") or x.get("output_activations") for x in groups)
    )  # fmt: skip
    if not wanted:
        raise ExpertcacheError(
            f"{what}: {kind}{'' if w.get('symmetric') else ' asymmetric'} weights"
            f"{' with quantised activations' if g.get('input_activations') else ''}; this expertcache reads "
            "weight-only symmetric pack-quantized int4 and int8, a scale per group or channel"
        )
    for name in MATRICES:
        if stored_dtype(name, "_packed") != torch.int32:
            raise ExpertcacheError(f"{what}, but its experts' {name} is not stored as int32 words")
        scale = stored_dtype(name, "_scale")
        if scale != dtype or dtype not in (torch.bfloat16, torch.float32):
            raise ExpertcacheError(
                f"{what} with scales in {scale} for a {dtype} model: this expertcache reads bfloat16 and "
                "float32 models with scales in their dtype"
            )
    bits = int(w["num_bits"])
    group = int(w.get("group_size") or 0) if w["strategy"] == "group" else 0
    if w["strategy"] == "group" and group <= 0:
        raise ExpertcacheError(f"{what}: group strategy without a group_size")
    return Packed(f"pack-int{bits}", group, shapes, dtype, transposed, method="compressed-tensors")


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """A dense fp8 weight ``[out, in]`` with its ``weight_scale_inv`` (one float32 per ``block`` of rows and
    columns, the last ones maybe shorter) -> ``dtype``, as transformers dequantises one on a CPU (float32
    products, rounded once)."""
    rows, cols = q.shape
    s = scale.to(torch.float32).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return (q.to(torch.float32) * s).to(dtype)


def dequantize_pack(q: torch.Tensor, scale: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """A compressed-tensors pack-quantized weight (``q``: its int32 words, or their bytes, ``[out, words]``;
    ``scale`` ``[out, groups]``, or its bytes with one more dimension) -> float32 ``[out, in]``: ``(u - 2 **
    (bits - 1)) * scale``, each value exact in float32 (the model's dtype rounds it as compressed-tensors'
    product in the scale's dtype does)."""
    rows = q.shape[0]
    u = q.contiguous().view(torch.uint8).reshape(rows, -1)
    if bits == 4:
        u = torch.stack((u & 15, u >> 4), dim=-1).reshape(rows, -1)
    v = u.to(torch.float32) - 2 ** (bits - 1)
    if scale.dtype == torch.uint8:  # a slot's bytes
        scale = scale.contiguous().view(dtype)
    s = scale.reshape(rows, -1).to(torch.float32)
    return (v.view(rows, s.shape[1], -1) * s[:, :, None]).view(rows, -1)


def dense_name(packed: Packed | None, key: str) -> str:
    """The checkpoint key of the weight that the dense tensor ``key`` stands for: compressed-tensors'
    ``X.weight_packed`` is ``X.weight``; any other key itself."""
    if packed is not None and packed.method == "compressed-tensors" and key.endswith(".weight_packed"):
        return key.removesuffix("_packed")
    return key


def dense_weight(packed: Packed | None, ckpt, key: str, t: torch.Tensor, want: torch.dtype) -> torch.Tensor:
    """The dense tensor ``key`` (``t``, read from the checkpoint ``ckpt``) as transformers loads it on a CPU:
    another tool's quantised weight dequantised (an fp8 one with its ``weight_scale_inv``, one scale per
    block; compressed-tensors' ``weight_packed`` with its ``weight_scale``), any other as stored."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale = f"{key}_scale_inv"
        if packed is None or packed.format != "fp8" or scale not in ckpt:
            raise ExpertcacheError(f"{ckpt.path}: {key} is stored in {t.dtype} without {scale}")
        return dequantize_fp8(t, ckpt.tensor(scale), packed.block, want)
    if dense_name(packed, key) != key:
        scale = ckpt.tensor(dense_name(packed, key) + "_scale")
        return dequantize_pack(t, scale, packed.bits, scale.dtype).to(scale.dtype)
    return t


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8).clone()


def exact_div(a: torch.Tensor, b: float) -> torch.Tensor:
    """``a / b`` rounded once, the same bits on every device: on a GPU torch multiplies by the reciprocal of
    a Python number (``1 / 127`` is not exact: a quotient one bit off now and then), so a checkpoint or a
    reference quantised there would differ from the CPU's; a tensor divisor is divided by."""
    return a / torch.tensor(b, dtype=a.dtype, device=a.device)


def pack_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``w`` float32 ``[rows, cols]`` -> ``q`` (int8 as bytes) and one float32 scale per row."""
    scale = exact_div(w.abs().amax(dim=1), 127)
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
    scale = exact_div(g.amax(dim=-1, keepdim=True) - low, 15).to(torch.bfloat16).to(torch.float32)
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
        # fp8: the scale row of each matrix row (``Packed.scale_rows``)
        self.srows = {n: packed.scale_rows(n) for n in MATRICES} if packed.format == "fp8" else {}
        # fp8 and compressed-tensors' ints in a bfloat16 model: each weight rounded to bfloat16 before its
        # product, as transformers' dequantised weights are
        self.round_bf16 = packed.format in ("fp8", *PACK_QUANTIZED) and packed.dtype == torch.bfloat16
        self.srows_on: dict[torch.device, dict[str, torch.Tensor]] = {}  # fp8: ``srows`` on a GPU, by device

    def offsets_of(self, name: str) -> tuple[int, ...]:
        """Where in a slot the matrix ``name``'s packed tensors start: q, scale (and int4's minimum)."""
        off = self.offsets
        return (off[f"{name}.q"], off[f"{name}.scale"]) + (
            (off[f"{name}.min"],) if self.packed.format == "int4" else ()
        )

    def warm_host(self) -> None:
        """Load this format's CPU loops now, at load: numba's import and its cached machine code take
        0.3-0.6 s in a fresh process, which the first request's first packed or low-precision expert
        paid otherwise (``--miss hobbit`` at 30 %: a TTFT of 290-370 ms against fetch's 31). Each loop
        runs once on a zero slot, one token and two (the one-token and the several-token loops)."""
        pool = np.zeros((1, self.layout.slot_bytes), dtype=np.uint8)
        for name in MATRICES:
            cols = self.packed.matrix(name)[1]
            self.project(name, pool, np.zeros(1, dtype=np.int64), torch.zeros(1, cols))
            self.project(name, pool, np.zeros(2, dtype=np.int64), torch.zeros(2, cols))  # by block
            self.project_tokens(name, pool, 0, torch.zeros(2, cols))

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
            {n: self._gpu_extras(n, pool.device) for n in MATRICES},
        )

    def _gpu_extras(self, name: str, device: torch.device) -> dict:
        """Triton's ``project``'s keyword arguments for the matrix ``name`` beyond the layout: fp8's block
        columns, scale rows (an int32 copy of ``srows[name]`` on ``device``, made once) and rounding."""
        if self.packed.format != "fp8":
            return {}
        on = self.srows_on.get(device)
        if on is None:
            on = self.srows_on[device] = {n: torch.from_numpy(r).to(device) for n, r in self.srows.items()}
        return {"bcols": self.packed.block[1], "srow": on[name], "round_bf16": self.round_bf16}

    def project(self, name: str, pool, slots, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[1 or K, in]`` times the matrix ``name`` of each slot in ``slots`` ``[K]`` -> float32
        ``[K, out]``: numba's loops over a CPU pool (``np.ndarray``), Triton's over a GPU's (a tensor; a
        slot past the pool gives zeros)."""
        p, off = self.packed, self.offsets
        rows, cols = p.matrix(name)
        if isinstance(pool, torch.Tensor):
            from expertcache.engine import _packed_triton

            return _packed_triton.project(
                p.format, p.group, pool, self.offsets_of(name), rows, cols, slots, x,
                **self._gpu_extras(name, pool.device),
            )  # fmt: skip
        from expertcache.engine import _packed_jit

        xf = host_f32(x)
        out = np.empty((len(slots), rows), dtype=np.float32)
        qoff, soff = off[f"{name}.q"], off[f"{name}.scale"]
        if p.format == "int8":  # a one-slot pool's rows (an expert's tokens) by block: each read once
            one = len(pool) == 1 and len(slots) > 1
            _packed_jit.rows_int8(pool, qoff, soff, rows, cols, slots, xf, out, one)
        elif p.format == "mxfp4":
            even, odd = np.ascontiguousarray(xf[:, 0::2]), np.ascontiguousarray(xf[:, 1::2])
            _packed_jit.rows_mxfp4(pool, qoff, soff, rows, cols, slots, even, odd, out)
        elif p.format in PACK_QUANTIZED:
            _packed_jit.rows_ct(
                pool, qoff, soff, rows, cols, p.group_of(name), p.bits, p.dtype == torch.float32,
                self.round_bf16, slots, xf, out,
            )  # fmt: skip
        elif p.format == "fp8":
            _packed_jit.rows_fp8(
                pool, qoff, soff, rows, cols, p.block[1], self.srows[name], self.round_bf16, slots, xf, out
            )  # fmt: skip
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
        xf = host_f32(x)
        out = np.empty((xf.shape[0], rows), dtype=np.float32)
        qoff, soff = off[f"{name}.q"], off[f"{name}.scale"]
        if p.format == "int8":
            _packed_jit.tokens_int8(pool, qoff, soff, rows, cols, slot, xf, out)
        elif p.format == "mxfp4":
            _packed_jit.tokens_mxfp4(pool, qoff, soff, rows, cols, slot, xf, out)
        elif p.format in PACK_QUANTIZED:
            _packed_jit.tokens_ct(
                pool, qoff, soff, rows, cols, p.group_of(name), p.bits, p.dtype == torch.float32,
                self.round_bf16, slot, xf, out,
            )  # fmt: skip
        elif p.format == "fp8":
            _packed_jit.tokens_fp8(
                pool, qoff, soff, rows, cols, p.block[1], self.srows[name], self.round_bf16, slot, xf, out
            )  # fmt: skip
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
        if module.is_transposed and module.has_bias:
            h = module._apply_gate(
                h + _bias_rows(p, pool, self.offsets, np.zeros(1, np.int64), "gate_up_proj_bias")
            )
        else:
            h = module._apply_gate(h)
        out = self.project_tokens("down_proj", pool, 0, h).to(p.dtype)
        if module.is_transposed and module.has_bias:
            out = out + _bias_rows(p, pool, self.offsets, np.zeros(1, np.int64), "down_proj_bias")
        return out

    def rows(self, module, pool, slots, x: torch.Tensor) -> torch.Tensor:
        """Each expert's output on its own row of ``x`` (``[K, H]``, or ``[1, H]`` shared by all), for the
        slots ``slots`` ``[K]`` of ``pool`` (a CPU's ``np.ndarray`` ``[S, slot bytes]`` with slot ids, or a
        GPU's uint8 tensor with a tensor of them on it): ``[K, H]`` in the compute dtype."""
        p = self.packed
        ids = slots if isinstance(pool, torch.Tensor) else np.asarray(slots, dtype=np.int64)
        h = cast(self.project("gate_up_proj", pool, ids, x), p.dtype)
        if module.is_transposed and module.has_bias:
            h = module._apply_gate(h + _bias_rows(p, pool, self.offsets, ids, "gate_up_proj_bias"))
        else:
            h = module._apply_gate(h)
        out = cast(self.project("down_proj", pool, ids, h), p.dtype)
        if module.is_transposed and module.has_bias:
            out = out + _bias_rows(p, pool, self.offsets, ids, "down_proj_bias")
        return out

    def expert(self, module, views: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """One expert on its tokens ``x`` ``[T, H]`` -> ``[T, H]``, from one slot's views: up to
        ``CPU_ROWS`` (CPU) or ``DECODE_ROWS`` (GPU, Triton's) tokens in the one-token kernels (each token a
        row of the slot's own one-slot pool), on a CPU up to ``PREFILL_ROWS`` in the several-token loops,
        else from the matrices expanded. Which one depends on ``T`` alone (and the format), so an expert's
        output is the same whichever path (resident, missed, batched) computes it."""
        if x.device.type == "cpu" and x.shape[0] <= PREFILL_ROWS:
            one = slot_bytes(views, self.layout).numpy()
            if x.shape[0] <= CPU_ROWS[self.packed.format]:
                return self.rows(module, one, np.zeros(x.shape[0], dtype=np.int64), x)
            return self.tokens(module, one, x)
        if x.shape[0] <= DECODE_ROWS:
            one = slot_bytes(views, self.layout)
            if gpu_kernels(x.device, self.packed):
                return self.rows(module, one, torch.zeros(x.shape[0], dtype=torch.int64, device=x.device), x)
        p = self.packed
        w1, w2 = (self.packed.expand(views, n).to(p.dtype) for n in MATRICES)
        if module.is_transposed and module.has_bias:
            h = module._apply_gate(F.linear(x, w1) + p.bias(views, "gate_up_proj_bias"))
            return F.linear(h, w2) + p.bias(views, "down_proj_bias")
        return F.linear(module._apply_gate(F.linear(x, w1)), w2)


class SiluExperts:
    """What ``PackedKernels`` reads of a transformers experts module, for a family that is not transposed,
    has no biases and gates with SiLU (Mixtral's and most others'): for running the kernels outside a
    model (benches, tests). ``_apply_gate`` is transformers' default gate."""

    is_transposed = False
    has_bias = False
    has_gate = True
    act_fn = staticmethod(F.silu)

    @staticmethod
    def _apply_gate(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up


def gpu_kernels(device: torch.device, packed: Packed) -> bool:
    """Whether the packed kernels run on ``device`` (a CUDA or ROCm GPU with Triton installed) for
    ``packed``'s format: int8, int4, mxfp4 and fp8 have Triton's kernels; compressed-tensors' pack-*
    formats are expanded there for each use."""
    return device.type == "cuda" and packed.format in TRITON and _has_triton()


@functools.cache
def _has_triton() -> bool:  # asked for every expert a GPU computes: looked up once
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _bias_rows(p: Packed, pool, offsets: dict[str, int], ids, name: str) -> torch.Tensor:
    n = p.shapes[name][0] * p.bias_dtype.itemsize
    start = offsets[name]
    if isinstance(pool, torch.Tensor):  # a GPU's pool: ids past it (computed elsewhere) read slot 0
        raw = pool[torch.where(ids < pool.shape[0], ids, 0), start : start + n].contiguous()
    else:
        raw = torch.from_numpy(np.ascontiguousarray(pool[ids, start : start + n]))
    return raw.view(p.bias_dtype).to(p.dtype)


class PackedPool:
    """The slot pool of packed whole experts, as the runtime's stacked kernels take it (``engine.kernels``'
    ``StackedPool`` for full-precision experts): the pool's bytes and the packed kernels."""

    packed = True

    def __init__(self, pool, kernels: PackedKernels) -> None:
        self.pool, self.kernels = pool, kernels
        self.num_slots = len(pool)
        self.device = pool.buffer.device
        self.array = pool.buffer.numpy() if self.device.type == "cpu" else None  # [S, slot bytes]
        self.gpu = gpu_kernels(self.device, kernels.packed)  # the step's pairs in one call of Triton's
        if self.gpu:
            kernels.warm(pool.buffer)


def packed_decode_rows(module, pool: PackedPool, hidden: torch.Tensor, slots, top_k_weights) -> torch.Tensor:
    """One token's weighted output from each of the packed experts in ``slots`` ``[K]`` (CPU), ``[K, H]``:
    ``kernels.decode_rows`` for packed experts."""
    out = pool.kernels.rows(module, pool.array, slots, hidden.reshape(1, -1))
    return out * top_k_weights.reshape(-1, 1)


def packed_grouped_rows(
    module, pool: PackedPool, hidden: torch.Tensor, slot_ids, top_k_weights, order=None
) -> torch.Tensor:
    """Each (token, expert) pair's weighted output ``[T*K, H]`` in routing order, from the packed experts in
    slots ``slot_ids`` ``[T, K]`` (``pool.num_slots``: computed elsewhere, its row left zero):
    ``kernels.grouped_rows`` for packed experts, one expert after another (``order`` unused: the packed
    kernels sum in their own order, within 1e-5 of the dequantised reference whatever the rows' order)."""
    T, K = slot_ids.shape
    ids = slot_ids.reshape(-1)
    weights = top_k_weights.reshape(-1)
    # weighted rows in the weights' precision where it is higher (DeepSeek-V3's float32 router), as every
    # other path gives them (an expert computed alone, on the host): the runtime's rows take that dtype
    kind = torch.promote_types(hidden.dtype, weights.dtype)
    if pool.gpu and T <= DECODE_ROWS:  # every pair a row: each expert has at most T tokens (``expert``)
        out = pool.kernels.rows(module, pool.pool.buffer, ids, hidden.repeat_interleave(K, dim=0))
        return (out * weights[:, None]).to(kind)
    host = ids.to("cpu").numpy()
    out = torch.zeros(ids.numel(), hidden.shape[-1], dtype=kind, device=hidden.device)
    for slot in np.unique(host):
        if slot >= pool.num_slots:
            continue
        flat = torch.from_numpy(np.flatnonzero(host == slot)).to(hidden.device)
        y = pool.kernels.expert(module, pool.pool.views[int(slot)], hidden[flat // K])
        out[flat] = (y * weights[flat, None]).to(out.dtype)
    return out


def describe_format(packed: Packed | None, dtype: torch.dtype | None = None) -> str:
    """The experts' storage format in a word: ``int8``, ``int4-g64``, ``mxfp4``, ``fp8-b128x128``,
    ``pack-int4-g128``, ``pack-int8-channel``, or the full-precision dtype."""
    if packed is None:
        return str(dtype).removeprefix("torch.")
    if packed.format == "int4":
        return f"int4-g{packed.group}"
    if packed.format == "fp8":
        return f"fp8-b{packed.block[0]}x{packed.block[1]}"
    if packed.format in PACK_QUANTIZED:
        return f"{packed.format}-" + (f"g{packed.group}" if packed.group else "channel")
    return packed.format
