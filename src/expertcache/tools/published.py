"""``expertcache quantize --format mxfp4|fp8 --checkpoint DIR``: another tool's published layout.

The engine reads the quantised checkpoints users download (``engine.packed``): GPT-OSS's MXFP4 experts and
the block-scaled FP8 of DeepSeek-V3 and Qwen3-FP8. This writes a full-precision checkpoint in those layouts,
so that they can be tried, tested and measured at any shape without the hub: transformers' own writers
cannot run here (its MXFP4 quantiser needs the hub's ``triton_kernels``, its FP8 one a GPU), while its
loaders read what this writes (on a CPU, dequantising it: the reference the engine's outputs are checked
against).

- ``mxfp4`` (GPT-OSS only, as transformers' ``Mxfp4Config``): each expert matrix as ``{name}_blocks``
  ``[E, out, in / 32, 16]`` and ``{name}_scales`` ``[E, out, in / 32]``, the rounding of the OCP MX
  specification (a block's exponent ``floor(log2(absmax)) - 2``, each value to the nearest e2m1, ties to
  the even code, clipped at 6). The attention, router, embeddings and head stay as they are.
- ``fp8`` (``FineGrainedFP8Config``, e4m3, dynamic activations): every expert matrix and every linear
  projection of the decoder layers (keys ending ``_proj.weight``: attention, shared experts, dense MLPs)
  in float8 e4m3 with ``weight_scale_inv`` float32, ``absmax / 448`` per block of 128 x 128 (the last
  blocks shorter). Routers, norms, embeddings and head stay in the checkpoint's dtype.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from expertcache.errors import ExpertcacheError
from expertcache.paths import output_dir

FORMATS = ("mxfp4", "fp8")
FP8_BLOCK = (128, 128)
FP8_MAX = 448.0  # e4m3's largest value
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the codes' magnitudes (code 8+: negative)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[..., cols]`` (cols a multiple of 32) -> blocks ``[..., cols / 32, 16]`` (two e2m1 codes a
    byte, the even column low) and e8m0 scales ``[..., cols / 32]`` (exponent + 127)."""
    *lead, cols = w.shape
    g = w.to(torch.float32).reshape(*lead, cols // 32, 32)
    amax = g.abs().amax(dim=-1)
    exp = torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - 2  # 6 = 1.5 * 2 ** 2: e2m1's emax is 2
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127)).clamp(-127, 127)
    x = g / torch.exp2(exp)[..., None]
    # nearest magnitude; a tie between two goes to the even code (the one whose mantissa bit is 0)
    dist = (x.abs()[..., None] - _E2M1).abs()
    best = dist.min(dim=-1, keepdim=True).values
    ties = (dist == best) & (torch.arange(8) % 2 == 0)
    mag = torch.where(ties.any(dim=-1), ties.float().argmax(dim=-1), dist.argmin(dim=-1))
    code = (mag + 8 * (x < 0)).to(torch.uint8)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous(), (exp + 127).to(torch.uint8).contiguous()


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[..., rows, cols]`` -> float8 e4m3 ``[..., rows, cols]`` and float32 ``weight_scale_inv``
    ``[..., ceil(rows / block[0]), ceil(cols / block[1])]`` (``absmax / 448`` of each block)."""
    *lead, rows, cols = w.shape
    br, bc = block
    sr, sc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(*lead, sr * br, sc * bc, dtype=torch.float32)
    padded[..., :rows, :cols] = w.to(torch.float32)
    blocks = padded.view(*lead, sr, br, sc, bc)
    scale = blocks.abs().amax(dim=(-3, -1)) / FP8_MAX  # [..., sr, sc]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / safe[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(*lead, sr * br, sc * bc)[..., :rows, :cols].contiguous()
    return q, scale.contiguous()


def partial_blocks(shape, block=FP8_BLOCK) -> bool:
    """A matrix of several FP8 blocks along a side, the last partial (a size above the block, not a
    multiple of it), which transformers dequantises with a block derived from its scale grid; one block
    alone along a side is read right."""
    return any(n > b and n % b for n, b in zip(tuple(shape)[-2:], block, strict=True))


def write_published(
    model: str | Path | None,
    fmt: str,
    out: str | Path,
    log: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Write ``model`` (a full-precision checkpoint; default the embedded one) to ``out`` (new or empty,
    checked first) in ``fmt``'s published layout (module docstring). Returns what was written."""
    from expertcache.engine.loader import build_skeleton
    from expertcache.engine.packed import describe_format
    from expertcache.tools.quantize import (
        SOURCE_KEY,
        Shards,
        copy_small_files,
        full_precision_source,
        source_record,
    )

    if fmt not in FORMATS:
        raise ExpertcacheError(f"--format {fmt}: one of {', '.join(FORMATS)}")
    start = time.perf_counter()
    path, target, sk = full_precision_source(model, out, "quantised")
    fused = sk.family.fused
    if fmt == "mxfp4" and sk.family.name != "gpt_oss":
        other = ("" if fused else "--format fp8, or ") + "--bits 4 for expertcache's int4"  # not fp8: fused
        raise ExpertcacheError(
            f"mxfp4 is GPT-OSS's layout (transformers reads it for gpt_oss only), not {sk.family.name}'s: "
            f"write {other}"
        )
    if fmt == "fp8" and fused:
        raise ExpertcacheError(
            f"fp8 checkpoints store experts one by one; {sk.family.name} stores them fused (transformers "
            "5.24 would drop their scales): write --bits 8 for expertcache's int8"
        )
    if fmt == "mxfp4":  # blocks of 32 along each matrix's input: every input size a multiple of 32
        ckpt, experts = sk.store.ckpt, sk.store.expert_keys()
        for key in ckpt:
            shape = ckpt.shape(key)
            if key in experts and len(shape) == 3 and shape[1] % 32:
                raise ExpertcacheError(
                    f"mxfp4 scales blocks of 32 of a matrix's inputs; {key} of shape {list(shape)} has "
                    f"{shape[1]} a row: write --bits 4 or --bits 8 for expertcache's int4 or int8"
                )
    with output_dir(target, f"the {fmt} checkpoint") as target:  # removed if the writing fails
        copy_small_files(path, target)
        ckpt, experts = sk.store.ckpt, sk.store.expert_keys()
        shards = Shards()
        partial = []  # fp8 matrices of several blocks, the last partial (a size above 128, not a multiple)
        for key in ckpt:
            t = ckpt.tensor(key)
            if fmt == "mxfp4" and key in experts and t.dim() == 3:  # [E, in, out] -> [E, out, in] blocks
                # one expert at a time: the rounding's float32 temporaries stay a few times an expert's size
                blocks, scales = zip(*(quantize_mxfp4(t[e].T) for e in range(t.shape[0])), strict=True)
                shards.put(f"{key}_blocks", torch.stack(blocks))
                shards.put(f"{key}_scales", torch.stack(scales))
            elif fmt == "fp8" and _fp8_target(key, t, experts):
                if t.dim() == 3:
                    q, scale = (torch.stack(x) for x in zip(*(quantize_fp8(w) for w in t), strict=True))
                else:
                    q, scale = quantize_fp8(t)
                shards.put(key, q)
                shards.put(f"{key}_scale_inv", scale)
                if partial_blocks(t.shape):
                    partial.append(key)
            else:
                shards.put(key, t.contiguous())
        shards.save(target, {"format": "pt"})
        config = json.loads((path / "config.json").read_text())
        if fmt == "mxfp4":
            config["quantization_config"] = {
                "quant_method": "mxfp4",
                "modules_to_not_convert": [
                    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"
                ],
            }  # fmt: skip
        else:
            config["quantization_config"] = {
                "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(FP8_BLOCK),
            }  # fmt: skip
        config[SOURCE_KEY] = source_record(path)  # quality's reference
        (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        written = build_skeleton(target)  # read back as the engine reads it
    full = sk.layout.nbytes
    record = {
        "path": str(target), "format": describe_format(written.packed), "experts": len(sk.store.prefixes)
        * sk.num_experts, "bytes_per_expert": written.layout.nbytes, "full_bytes_per_expert": full,
        "file_bytes": sum(f.stat().st_size for f in target.glob("*.safetensors")),
        "seconds": round(time.perf_counter() - start, 2),
    }  # fmt: skip
    if partial:
        record["partial_blocks"] = len(partial)
    if partial and log is not None:  # measured: the embedded model's q_proj read 0.068 off, against 0.008
        log(
            f"note: {len(partial)} matrices (e.g. {partial[0]}) are larger than {FP8_BLOCK[0]} and not a "
            "multiple of it: their last blocks are partial, as the format allows. expertcache reads them as "
            "defined; transformers 5 reads such blocks differently on a CPU, so its forward of this "
            "checkpoint (a reference for quality) is not the checkpoint's"
        )
    if log is not None:
        share = record["bytes_per_expert"] / full
        log(f"{record['format']}: {record['experts']} experts, {record['bytes_per_expert']} bytes each "
            f"({share:.1%} of {full}) -> {target} ({record['seconds']} s)")  # fmt: skip
    return record


def _fp8_target(key: str, t: torch.Tensor, experts: set[str]) -> bool:
    """Whether ``key`` is quantised in an fp8 checkpoint: the expert matrices and the decoder layers' linear
    projections (not routers, norms, embeddings or the head)."""
    if not t.is_floating_point() or t.dim() < 2:
        return False
    if key in experts:
        return True
    return ".layers." in key and key.endswith("_proj.weight") and t.dim() == 2 and math.prod(t.shape) > 0
