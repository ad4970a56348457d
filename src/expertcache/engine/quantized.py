"""Low-precision copies of the experts (HOBBIT's, Fate's): where they are, what a slot of one holds.

``expertcache quantize MODEL --bits 8 4`` writes, once, one safetensors file per precision
(``int{bits}-g{group}.safetensors``) with every expert's weight matrices quantised. int8 and int4 are the
packed checkpoints' formats (``engine.packed``: int8 a float32 scale per row, int4 a bfloat16 scale and
minimum per group of ``group`` columns), computed by the packed kernels straight from the slot's bytes;
int2 is HQQ's (``hqq``: half-quadratic quantisation, asymmetric, a 16-bit scale and zero per group of
``group`` weights, bits packed into bytes), expanded to the compute dtype for each use, as are int8 and
int4 copies written by earlier versions (HQQ's too: their meta has no ``layout``). The biases (GPT-OSS)
are kept as they are (packed copies: float32). The files go beside the
checkpoint (``MODEL/expertcache-quant/``) or, where that folder cannot be written, into the user's cache
(``$XDG_CACHE_HOME/expertcache/quant/<fingerprint>/``); ``find_copy`` looks in both, and refuses a file
made for another checkpoint (its fingerprint: config and weight files' names and sizes).

A slot of a quantised part holds, per matrix, the packed weights and the scales (and zeros or minima) as
bytes; the bytes moved on a miss are these.

Shape letters: O a matrix's output rows, I its input columns (transformers' [O, I] orientation; the
GPT-OSS matrices are stored transposed and quantised as their transposes).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from expertcache.engine.memory import SlotLayout
from expertcache.errors import ExpertcacheError, first_line
from expertcache.miss.base import MissPathError

FORMAT = "expertcache-quantized-experts"
PACKED = "packed"  # meta "layout" of copies in the packed checkpoints' formats (else HQQ's)
FOLDER = "expertcache-quant"
BITS = (8, 4, 2)
MATRICES = ("gate_up_proj", "down_proj")  # quantised; anything else (biases) is kept as it is


def file_name(bits: int, group: int) -> str:
    """The copies' file. int8 copies have one scale a row, whatever the group asked for: one name (the
    default group's, as earlier versions wrote it), so that ``--bits 8 4 --group 32`` writes the int8
    file every spec finds (it wrote int8-g32, which hobbit:bits=8 never read)."""
    if bits == 8:
        group = 64
    return f"int{bits}-g{group}.safetensors"


SAMPLES, SAMPLE_BYTES = 16, 64 << 10  # a weight file's bytes the fingerprint reads: 1 MiB, spread over it


def fingerprint(model: str | Path) -> str:
    """The checkpoint's identity: its config, the names and sizes of its weight files, and bytes read at
    ``SAMPLES`` places spread over each file (its header, its end and between), so that new weights of
    the same shapes (a fine-tune saved over its base) are another checkpoint, while a copy of the
    checkpoint elsewhere is the same one. About 1 MiB read a file, whatever its size."""
    model = Path(model)
    h = hashlib.sha256((model / "config.json").read_bytes())
    for f in sorted(model.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            for i in range(SAMPLES):
                fh.seek(max(0, (size - SAMPLE_BYTES) * i // (SAMPLES - 1)))
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "expertcache" / "quant"


def candidates(model: str | Path, fp: str | None = None) -> list[Path]:
    """Where copies of ``model`` (of fingerprint ``fp``, read if not given) may be: beside it, then in
    the user's cache."""
    return [Path(model) / FOLDER, cache_root() / (fp or fingerprint(model))]


def find_copy(model: str | Path, bits: int, group: int) -> Path:
    """The file of ``model``'s ``bits``-bit copies; a one-line error saying how to make it if none."""
    want = fingerprint(model)
    for folder in candidates(model, want):
        path = folder / file_name(bits, group)
        if path.is_file():
            meta = read_meta(path)
            if meta.get("fingerprint") != want:
                raise MissPathError(f"{path}: made for another checkpoint (run expertcache quantize again)")
            return path
    from expertcache.engine.hub import EMBEDDED, model_label

    name = model_label(Path(model))
    arg = "" if name == EMBEDDED else f" {model}"
    if bits == 8:  # one scale a row: quantize takes no --group for them
        raise MissPathError(
            f"no int8 copies of {name}: build them once with 'expertcache quantize{arg} --bits 8'"
        )
    raise MissPathError(
        f"no int{bits} copies (group {group}) of {name}: build them once with "
        f"'expertcache quantize{arg} --bits {bits} --group {group}'"
    )


def read_meta(path: Path) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:
        raise ExpertcacheError(f"{path}: cannot read quantised experts ({exc})") from None
    if meta.get("format") != FORMAT:
        raise ExpertcacheError(f"{path}: not a file of quantised experts (format {meta.get('format')!r})")
    try:
        tensors = json.loads(meta["tensors"])
        for t in tensors.values():  # each stored tensor's bytes: what its slot is laid out from
            if isinstance(t["bytes"], bool) or not isinstance(t["bytes"], int) or t["bytes"] < 0:
                raise ValueError(f"bytes {t['bytes']!r}")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ExpertcacheError(
            f"{path}: its metadata does not describe its tensors ({first_line(exc)}): run expertcache "
            "quantize again"
        ) from None
    return {**meta, "tensors": tensors, "path": str(path)}  # the path: named in later messages


def quant_layout(meta: dict) -> SlotLayout:
    """One slot of a quantised expert: each stored tensor's bytes, back to back (64-byte aligned)."""
    return SlotLayout.of({name: (int(t["bytes"]),) for name, t in meta["tensors"].items()}, torch.uint8)


class QuantSource:
    """Fills a quantised slot from the copies' file (memory-mapped), chunk by chunk (``copy_chunk``);
    with ``in_memory`` every expert's copy is read into host memory once (pinned for a GPU), as the
    host tier holds the whole experts."""

    def __init__(self, path: Path, layout: SlotLayout, pin: bool = False, in_memory: bool = False) -> None:
        from safetensors import safe_open

        self.path, self.layout = path, layout
        self._file = safe_open(str(path), framework="pt")
        self._host: dict = {}
        if in_memory:
            from expertcache.engine.memory import SlotPool

            keys = sorted({tuple(map(int, k.split(".")[:2])) for k in self._file.keys()})  # noqa: SIM118
            self._pool = SlotPool(layout, len(keys), torch.device("cpu"), pin=pin)
            for i, key in enumerate(keys):
                for name, view in self._pool.views[i].items():
                    view.copy_(self._bytes(key, name))
                self._host[key] = self._pool.views[i]

    def _bytes(self, key, name: str) -> torch.Tensor:
        t = self._file.get_tensor(f"{key[0]}.{key[1]}.{name}")
        return t.contiguous().view(torch.uint8).reshape(-1)

    def copy_chunk(self, key, views: dict[str, torch.Tensor], chunk, flat=None) -> None:
        src = self._host.get(key)
        for name, start, stop, _ in chunk:
            piece = src[name][start:stop] if src is not None else self._bytes(key, name)[start:stop]
            dst = views[name][start:stop]
            dst.copy_(piece, non_blocking=dst.device.type != "cpu")


class Dequantizer:
    """Expands a quantised slot's matrices to the compute dtype (HQQ), for the expert's operations."""

    def __init__(self, meta: dict, dtype: torch.dtype) -> None:
        from expertcache.lazy import hqq_quantizer

        self.quantizer, self.dtype = hqq_quantizer(), dtype
        self.bits, self.group = int(meta["bits"]), int(meta["group"])
        self.tensors = meta["tensors"]
        self.matrices = [n.removesuffix(".q") for n in self.tensors if n.endswith(".q")]
        self.plain = {n: t for n, t in self.tensors.items() if "." not in n}

    def __call__(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name in self.matrices:
            info = self.tensors[name + ".q"]
            q = views[name + ".q"].view(torch.uint8).reshape(info["shape"])
            meta = {
                "nbits": self.bits, "group_size": self.group, "shape": torch.Size(info["matrix"]), "axis": 1,
                "packing": f"{self.bits}bit_u8", "unpack_view_dtype": torch.uint8, "view_as_float": False,
                "compute_dtype": self.dtype,
                "scale": views[name + ".scale"].view(torch.float16).reshape(-1, 1).to(self.dtype),
                "zero": views[name + ".zero"].view(torch.float16).reshape(-1, 1).to(self.dtype),
            }  # fmt: skip
            w = self.quantizer.dequantize(q, meta)  # [O, I]
            out[name] = w.T if info["transposed"] else w
        for name, info in self.plain.items():
            out[name] = views[name].view(getattr(torch, info["dtype"])).reshape(info["shape"]).to(self.dtype)
        return out


def packed_of(meta: dict, dtype: torch.dtype):
    """The packing of copies in the packed checkpoints' formats (``engine.packed.Packed``), else None
    (HQQ's copies, expanded for each use). Its stored tensors are the file's, in the file's order, so its
    slot layout is ``quant_layout(meta)``."""
    if meta.get("layout") != PACKED:
        return None
    from expertcache.engine.packed import Packed

    where = meta.get("path", "quantised copies")
    try:
        shapes = {name: tuple(shape) for name, shape in json.loads(meta["shapes"]).items()}
        bits = int(meta["bits"])
        group = 0 if bits == 8 else int(meta["group"])
        packed = Packed(f"int{bits}", group, shapes, dtype, meta["transposed"] == "1")
        expected = [(name, n) for name, (n,) in packed.tensors().items()]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ExpertcacheError(
            f"{where}: its metadata does not describe its packing ({first_line(exc)}): run expertcache "
            "quantize again"
        ) from None
    got = [(name, int(t["bytes"])) for name, t in meta["tensors"].items()]  # in order: ``quant_layout``'s
    if got != expected:
        raise ExpertcacheError(f"{where}: tensors do not match their layout (run expertcache quantize again)")
    return packed
