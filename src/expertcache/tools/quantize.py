"""``expertcache quantize``: write a checkpoint's low-precision expert copies once, or a packed checkpoint.

For each precision asked (int8, int4, int2), every expert's weight matrices are quantised and written,
with the biases, into one safetensors file (format in ``engine/quantized.py``). int8 and int4 are the
packed checkpoints' formats (``engine.packed``), which the packed kernels compute without expanding them;
int2 is HQQ's (``hqq.core.quantize.Quantizer``: asymmetric min-max refined by half-quadratic
optimisation, a scale and a zero per ``group`` weights, packed into bytes), expanded for each use. Why
HQQ for int2: it runs on the CPU and on CUDA in plain
PyTorch (no kernels to build), packs 8, 4, 3, 2 and 1 bits, needs no calibration data, and its
optimisation keeps 4- and 2-bit errors well below plain min-max rounding; torchao's primitives would
also do, but importing it took 4 s and printed warnings on every start here, and optimum-quanto is in
maintenance mode. The destination is checked before any work; a progress bar shows the experts done.
"""

from __future__ import annotations

import json
import numbers
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from expertcache.engine.loader import build_skeleton
from expertcache.engine.memory import SlotLayout, SlotPool
from expertcache.engine.packed import DEFAULT_GROUP, SOURCE_KEY, Packed, describe_format, require_gate
from expertcache.engine.quantized import (
    BITS,
    FORMAT,
    MATRICES,
    PACKED,
    cache_root,
    file_name,
    fingerprint,
    read_meta,
)
from expertcache.errors import ExpertcacheError, option
from expertcache.lazy import hqq_quantizer
from expertcache.paths import output_dir, save_tensors, writable_dir
from expertcache.units import true_or_false, values_of, whole_number

PACKED_BITS = (8, 4)  # the copies in the packed checkpoints' formats (the others: HQQ's)


def destination(model: Path, out: str | Path | None, fp: str | None = None) -> Path:
    """``out``, else beside the checkpoint when that can be written, else the user's cache (always for
    the embedded model: nothing is written into the installed package)."""
    from expertcache.engine.hub import DEFAULT_MODEL

    if out is not None:
        if not str(out).strip():
            raise ExpertcacheError("an empty path for the quantised copies: give a folder (or no --out)")
        folder = Path(out)
    else:
        beside = model / "expertcache-quant"
        mine = os.access(model, os.W_OK) and model.resolve() != DEFAULT_MODEL
        folder = beside if mine else cache_root() / (fp or fingerprint(model))
        return writable_dir(folder, "the quantised copies", parents=not mine)  # the cache: its own
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


def _write(
    target: Path, tensors, info, bits: int, group: int, model: Path, dtype: torch.dtype, extra: dict, fp: str
) -> None:
    meta = {
        "format": FORMAT, "bits": str(bits), "group": str(group), "fingerprint": fp,
        "model": str(model), "dtype": str(dtype).removeprefix("torch."), "tensors": json.dumps(info), **extra,
    }  # fmt: skip
    save_tensors(tensors, target, meta)


def _method_of(path: Path) -> str | None:
    """How the copies in ``path`` were made (None: no such file, an unreadable one, or one of a version
    that did not say: int2's HQQ, with or without its optimisation)."""
    if not path.is_file():
        return None
    try:
        return read_meta(path).get("method")
    except ExpertcacheError:
        return None


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

    bits = values_of(bits, option("--bits", "bits"), numbers.Integral)  # bits=8: one precision
    bad = [b for b in bits if b not in BITS]
    if bad:
        raise ExpertcacheError(
            f"{option('--bits', 'bits')} must be among {', '.join(map(str, BITS))}, got {list(bits)}"
        )
    group = whole_number(group, option("--group", "group"))
    if group < 8 or group & (group - 1):
        raise ExpertcacheError(
            f"{option('--group', 'group')} must be a power of two of at least 8, got {group}"
        )
    true_or_false(optimize, "optimize")
    if not optimize and 2 not in bits:  # int8 and int4 are rounded plainly anyway (the packed formats)
        raise ExpertcacheError(
            f"{option('--fast', 'optimize=False')} is int2's (HQQ without its optimisation): give "
            f"{option('--bits 2', 'bits=[2]')} with it"
        )
    if any(b not in PACKED_BITS for b in bits):
        hqq_quantizer()  # optional: refused before any work when it is not installed
    path = resolve_model(model)
    sk = build_skeleton(path)
    if sk.packed is not None:
        raise ExpertcacheError(
            f"{path}: its experts are packed ({describe_format(sk.packed)}); hobbit's copies are made from a "
            "full-precision checkpoint"
        )
    require_gate(sk.shapes)
    layout = SlotLayout.of(sk.shapes, sk.dtype)
    transposed = bool(sk.experts[0].is_transposed)
    for name in MATRICES:  # HQQ's groups run over a matrix's elements; the packed formats' scales do not
        shape = layout.shapes[layout.names.index(name)]
        if any(b not in PACKED_BITS for b in bits) and (shape[0] * shape[1]) % group:
            hqq = ", ".join(f"int{b}" for b in bits if b not in PACKED_BITS)
            raise ExpertcacheError(
                f"{name} of shape {list(shape)} does not split into groups of {group} ({hqq}: HQQ's groups "
                "of a matrix's elements)"
            )
    fp = fingerprint(path)  # read once: it samples every weight file
    folder = destination(path, out, fp)
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
        packed = None
        if b in PACKED_BITS:
            packed = Packed(f"int{b}", 0 if b == 8 else group, sk.shapes, sk.dtype, transposed)
            packed.check_shapes()
            _group_within_a_row(packed)
        for key in items:
            sk.store.read(key, scratch)
            if packed is not None:
                stored = packed.pack({n: v.to(device) for n, v in scratch.items()})
                stored = {n: t.cpu() for n, t in stored.items()}
            else:
                stored = quantize_expert(scratch, b, group, transposed, optimize, device)
            for name, t in stored.items():
                tensors[f"{key[0]}.{key[1]}.{name}"] = t
                info[name] = describe(name, t, scratch, transposed)
        target = folder / file_name(b, group)
        method = "round" if packed is not None else ("hqq" if optimize else "hqq-fast")
        extra = {"method": method}  # int2's two makings share a file: which one is there is said
        if packed is not None:
            extra |= {"layout": PACKED, "transposed": str(int(transposed)),
                      "shapes": json.dumps({n: list(v) for n, v in sk.shapes.items()})}  # fmt: skip
        before = _method_of(target)
        if before is not None and before != method and log is not None:
            log(f"note: {target.name} held copies made by {before}; they are replaced by {method}'s")
        _write(target, tensors, info, b, group, path, sk.dtype, extra, fp)
        per_expert = sum(t["bytes"] for t in info.values())
        record = {
            "bits": b, "group": None if b == 8 else group, "method": method, "path": str(target),
            "file_bytes": target.stat().st_size, "bytes_per_expert": per_expert,
            "full_bytes_per_expert": layout.nbytes, "experts": len(keys),
            "seconds": round(time.perf_counter() - start, 2),
        }  # fmt: skip
        if log is not None:  # progress, as each file is written; its sizes are the result's (stdout)
            log(f"int{b}: {len(keys)} experts written in {record['seconds']} s")
        records.append(record)
    return records


# -- packed checkpoints (``engine.packed``) ------------------------------------------------------------
SHARD_BYTES = 2 << 30  # a packed checkpoint's files hold up to about this many bytes each
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


class Shards:
    """A checkpoint's tensors gathered into safetensors files of up to ``SHARD_BYTES`` each (``put``), then
    written (``save``): one ``model.safetensors``, or numbered files with an index."""

    def __init__(self) -> None:
        self.shards: list[dict[str, torch.Tensor]] = [{}]
        self.sizes = [0]

    def put(self, name: str, t: torch.Tensor) -> None:
        if self.sizes[-1] and self.sizes[-1] + t.nbytes > SHARD_BYTES:
            self.shards.append({})
            self.sizes.append(0)
        self.shards[-1][name] = t
        self.sizes[-1] += t.nbytes

    def save(self, target: Path, meta: dict[str, str]) -> None:
        from expertcache.engine.store import INDEX

        if len(self.shards) == 1:
            save_tensors(self.shards[0], target / "model.safetensors", meta)
            return
        weight_map = {}
        for i, shard in enumerate(self.shards, 1):
            name = f"model-{i:05d}-of-{len(self.shards):05d}.safetensors"
            save_tensors(shard, target / name, meta)
            weight_map.update(dict.fromkeys(shard, name))
        index = {"metadata": {"total_size": sum(self.sizes)}, "weight_map": weight_map}
        (target / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def source_record(path: Path) -> dict[str, str]:
    """What a quantised checkpoint records of the one it was made from (``quality``'s reference): where
    it is and its fingerprint, so that a checkpoint changed since is not taken for it."""
    return {"path": str(path.resolve()), "fingerprint": fingerprint(path)}


def copy_small_files(source: Path, target: Path) -> None:
    """The tokenizer, generation config, licence ...: every file of ``source`` but its config and weights
    (and ``model synth``'s mark: the new checkpoint is not one it may replace)."""
    from expertcache.engine.random_checkpoint import MARK

    for f in sorted(source.iterdir()):
        if f.is_file() and f.name not in ("config.json", MARK) and not f.name.endswith(_WEIGHTS):
            (target / f.name).write_bytes(f.read_bytes())


def full_precision_source(model: str | Path | None, out: str | Path, already: str):
    """What writing a checkpoint of ``model`` into ``out`` starts from: the model's folder, ``out`` (checked
    new or empty before any work) and the model's skeleton, whose experts must be full precision (else one
    line: they are ``already`` so)."""
    from expertcache.engine.hub import resolve_model
    from expertcache.engine.packed import describe_format

    path = resolve_model(model)
    if not str(out).strip():
        raise ExpertcacheError("an empty path for the checkpoint: give a new folder")
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise ExpertcacheError(f"{target}: a file, not a folder (give a new folder for the checkpoint)")
    if target.exists() and any(target.iterdir()):
        raise ExpertcacheError(f"{target}: exists and is not an empty directory (give a new one)")
    sk = build_skeleton(path)
    if sk.packed is not None:
        raise ExpertcacheError(f"{path}: its experts are {already} already ({describe_format(sk.packed)})")
    require_gate(sk.shapes)  # every packed format holds a gate projection: before anything is written
    return path, target, sk


def write_checkpoint(
    model: str | Path | None,
    bits: int,
    out: str | Path,
    group: int | None = None,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
    device: str | None = None,
) -> dict[str, object]:
    """Write ``model`` as a packed checkpoint in ``out``: its config (with ``expertcache_experts``), its
    tokenizer and other small files, its dense weights as they are, and its experts packed in ``int{bits}``
    (``engine.packed``), in safetensors files of up to ``SHARD_BYTES`` with an index. ``out`` must be new
    or empty; it is checked before any work. The packing runs on ``device`` (default: a GPU if torch sees
    one). Returns what was written (bytes, seconds)."""

    from expertcache.engine.packed import CONFIG_KEY, OWN, STORED, Packed, check_format, describe_format

    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral):  # "8" was written as int"8"
        raise ExpertcacheError(f"{option('--bits', 'bits')} must be a whole number, got {bits!r}")
    fmt = f"int{bits}"
    if fmt not in OWN:
        raise ExpertcacheError(
            f"{option('--bits', 'bits')} {bits}: a packed checkpoint is one of "
            f"{', '.join(f[3:] for f in OWN)}"
        )
    group = check_format(fmt, group)
    start = time.perf_counter()
    path, target, sk = full_precision_source(model, out, "packed")
    packed = Packed(fmt, group, sk.shapes, sk.dtype, bool(sk.experts[0].is_transposed))
    packed.check_shapes()
    _group_within_a_row(packed)
    with output_dir(target, "the packed checkpoint") as target:  # removed if the writing fails
        copy_small_files(path, target)
        config = json.loads((path / "config.json").read_text())
        config[CONFIG_KEY] = packed.entry()
        config[SOURCE_KEY] = source_record(path)  # quality's reference
        (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")

        shards = Shards()
        put = shards.put
        ckpt, skip = sk.store.ckpt, sk.store.expert_keys()
        for key in ckpt:  # the dense weights, as stored
            if key not in skip:
                put(key, ckpt.tensor(key).contiguous())
        full = SlotLayout.of(sk.shapes, sk.dtype)
        scratch = SlotPool(full, 1, torch.device("cpu")).views[0]
        stored = packed.tensors()
        keys = [(layer, e) for layer in range(len(sk.experts)) for e in range(sk.num_experts)]
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        show = sys.stderr.isatty() if progress is None else progress
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(keys), desc=f"{fmt} experts", unit="expert", leave=False)
        for layer, prefix in enumerate(sk.store.prefixes):
            tensors = {
                name: torch.empty(sk.num_experts, n, dtype=torch.uint8) for name, (n,) in stored.items()
            }
            for e in range(sk.num_experts):
                sk.store.read((layer, e), scratch)
                for name, t in packed.pack({n: v.to(device) for n, v in scratch.items()}).items():
                    tensors[name][e] = t.cpu()
                if bar is not None:
                    bar.update()
            for name, t in tensors.items():
                put(f"{prefix}.{STORED}.{name}", t)
        if bar is not None:
            bar.close()
        shards.save(target, {"format": "pt", CONFIG_KEY: json.dumps(packed.entry())})
    layout = packed.layout()
    record = {
        "path": str(target), "format": describe_format(packed), "bits": bits, "group": group,
        "experts": len(keys), "bytes_per_expert": layout.nbytes, "full_bytes_per_expert": full.nbytes,
        "file_bytes": sum(f.stat().st_size for f in target.glob("*.safetensors")),
        "seconds": round(time.perf_counter() - start, 2),
    }  # fmt: skip
    if log is not None:  # progress; its sizes are the result's (stdout)
        log(f"{record['format']}: {len(keys)} experts written in {record['seconds']} s")
    return record


def _group_within_a_row(packed: Packed) -> None:
    """An int4 group above the default and longer than every matrix's rows would be written as one scale
    a row under a name (``int4-g4096``) that says otherwise: one line instead, before any work. (The
    default group on a model of narrower rows, a tiny one's, is one scale a row as well: not asked for.)"""
    if packed.format != "int4":
        return
    widest = max(packed.matrix(name)[1] for name in MATRICES)
    if packed.group > max(widest, DEFAULT_GROUP):
        flag = option("--group", "group")
        raise ExpertcacheError(
            f"{flag} {packed.group} is more than the {widest} input columns of this model's widest expert "
            f"matrix (one scale a row whatever the group): give {flag} "
            f"{max(_pow2_at_most(widest), DEFAULT_GROUP)} or less"
        )


def _pow2_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)
