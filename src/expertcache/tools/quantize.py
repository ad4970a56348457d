"""``expertcache quantize``: write a checkpoint's low-precision expert copies once (HQQ, group-wise).

For each precision asked (int8, int4, int2), every expert's weight matrices are quantised by HQQ
(``hqq.core.quantize.Quantizer``: asymmetric min-max refined by half-quadratic optimisation, a scale and
a zero per ``group`` weights, packed into bytes) and written, with the biases as they are, into one
safetensors file (format in ``engine/quantized.py``). Why HQQ: it runs on the CPU and on CUDA in plain
PyTorch (no kernels to build), packs 8, 4, 3, 2 and 1 bits, needs no calibration data, and its
optimisation keeps 4- and 2-bit errors well below plain min-max rounding; torchao's primitives would
also do, but importing it took 4 s and printed warnings on every start here, and optimum-quanto is in
maintenance mode. The destination is checked before any work; a progress bar shows the experts done.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from expertcache.engine.loader import build_skeleton
from expertcache.engine.memory import SlotLayout, SlotPool
from expertcache.engine.quantized import BITS, FORMAT, MATRICES, cache_root, file_name, fingerprint
from expertcache.errors import ExpertcacheError
from expertcache.lazy import hqq_quantizer
from expertcache.paths import writable_dir


def destination(model: Path, out: str | Path | None) -> Path:
    """``out``, else beside the checkpoint when that can be written, else the user's cache (always for
    the embedded model: nothing is written into the installed package)."""
    from expertcache.engine.hub import DEFAULT_MODEL

    if out is not None:
        folder = Path(out)
    else:
        beside = model / "expertcache-quant"
        mine = os.access(model, os.W_OK) and model.resolve() != DEFAULT_MODEL
        folder = beside if mine else cache_root() / fingerprint(model)
    return writable_dir(folder, "the quantised copies")


def quantize_expert(
    views: dict[str, torch.Tensor],
    bits: int,
    group: int,
    transposed: bool,
    optimize: bool = True,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """One expert's stored tensors: per matrix its packed weights, 16-bit scales and zeros (HQQ, groups of
    ``group`` along the input dimension, computed on ``device``); biases as they are."""
    quantizer = hqq_quantizer()
    out = {}
    for name, view in views.items():
        if name not in MATRICES:
            out[name] = view.clone()
            continue
        w = view.T.contiguous() if transposed else view  # [O, I]
        q, meta = quantizer.quantize(
            w.to(device, torch.float32), nbits=bits, group_size=group, axis=1, optimize=optimize,
            device=device, compute_dtype=torch.float32,
        )  # fmt: skip
        out[name + ".q"] = q.contiguous().cpu()
        out[name + ".scale"] = meta["scale"].to("cpu", torch.float16).contiguous()
        out[name + ".zero"] = meta["zero"].to("cpu", torch.float16).contiguous()
    return out


def describe(name: str, t: torch.Tensor, views: dict[str, torch.Tensor], transposed: bool) -> dict:
    """What the loader needs to know of one stored tensor (the same for every expert)."""
    info = {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "bytes": t.numel() * t.element_size(),
    }
    if name.endswith(".q"):
        matrix = views[name.removesuffix(".q")].shape
        info.update(matrix=list(matrix[::-1] if transposed else matrix), transposed=transposed)
    return info


def _write(target: Path, tensors, info, bits: int, group: int, model: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    meta = {
        "format": FORMAT, "bits": str(bits), "group": str(group), "fingerprint": fingerprint(model),
        "model": str(model), "dtype": str(dtype).removeprefix("torch."), "tensors": json.dumps(info),
    }  # fmt: skip
    save_file(tensors, str(target), metadata=meta)


def quantize_model(
    model: str | Path | None,
    bits: Sequence[int] = (8, 4),
    group: int = 64,
    out: str | Path | None = None,
    optimize: bool = True,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
    device: str | None = None,
) -> list[dict[str, object]]:
    """Write ``model``'s int``bits`` expert copies; return one record per file (path, bytes, seconds).
    The quantisation runs on ``device`` (default: a GPU if torch sees one, much faster for large experts)."""
    from expertcache.engine.hub import resolve_model

    bad = [b for b in bits if b not in BITS]
    if bad or not bits:
        raise ExpertcacheError(f"--bits must be among {', '.join(map(str, BITS))}, got {list(bits)}")
    if group < 8 or group & (group - 1):
        raise ExpertcacheError(f"--group must be a power of two of at least 8, got {group}")
    hqq_quantizer()  # optional: refused before any work when it is not installed
    path = resolve_model(model)
    sk = build_skeleton(path)
    layout = SlotLayout.of(sk.shapes, sk.dtype)
    transposed = bool(sk.experts[0].is_transposed)
    for name in MATRICES:
        shape = layout.shapes[layout.names.index(name)]
        if (shape[0] * shape[1]) % group:
            raise ExpertcacheError(f"{name} of shape {list(shape)} does not split into groups of {group}")
    folder = destination(path, out)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    show = sys.stderr.isatty() if progress is None else progress
    keys = [(layer, e) for layer in range(len(sk.experts)) for e in range(sk.num_experts)]
    scratch = SlotPool(layout, 1, torch.device("cpu")).views[0]
    records = []
    for b in bits:
        start = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        info: dict[str, dict] = {}
        items = keys
        if show:
            from tqdm.auto import tqdm

            items = tqdm(keys, desc=f"int{b} copies", unit="expert", leave=False)
        for key in items:
            sk.store.read(key, scratch)
            for name, t in quantize_expert(scratch, b, group, transposed, optimize, device).items():
                tensors[f"{key[0]}.{key[1]}.{name}"] = t
                info[name] = describe(name, t, scratch, transposed)
        target = folder / file_name(b, group)
        _write(target, tensors, info, b, group, path, sk.dtype)
        per_expert = sum(t["bytes"] for t in info.values())
        record = {
            "bits": b, "group": group, "path": str(target), "file_bytes": target.stat().st_size,
            "bytes_per_expert": per_expert, "full_bytes_per_expert": layout.nbytes, "experts": len(keys),
            "seconds": round(time.perf_counter() - start, 2),
        }  # fmt: skip
        if log is not None:
            share = per_expert / layout.nbytes
            log(f"int{b}: {len(keys)} experts, {per_expert} bytes each ({share:.1%} of {layout.nbytes}) "
                f"-> {target} ({record['seconds']} s)")  # fmt: skip
        records.append(record)
    return records
