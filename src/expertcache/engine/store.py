"""The expert store: one expert at a time, straight from the safetensors files (memory-mapped).

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``) checkpoints are
read as views of one memory map per file (``safe_open`` where a view cannot be made); an expert's
tensors are read row by row (only that expert's rows of a fused tensor are touched), so no step of
loading or serving materialises every expert.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from expertcache.engine.families import Family
from expertcache.errors import ExpertcacheError
from expertcache.policy.base import Key

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, through numpy for CPU tensors of one dtype.

    The transfer worker is a second thread: a torch CPU copy there starts an OpenMP pool whose
    threads keep spinning against the compute thread's, which slowed every later forward by 10-25%
    on a 2-core machine. numpy copies raw bytes without any pool, as fast."""
    if (
        dst.dtype == src.dtype
        and dst.device.type == src.device.type == "cpu"
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.shape == src.shape
    ):
        np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
    else:
        dst.copy_(src)


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def _map_file(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as read-only views of one memory map (8-byte header length,
    a JSON header of dtype, shape and data offsets, then the data)."""
    try:
        mm = np.memmap(file, dtype=np.uint8, mode="r")
        size = int.from_bytes(mm[:8].tobytes(), "little")
        header = json.loads(mm[8 : 8 + size].tobytes())
    except (OSError, ValueError):
        return {}  # safe_open reports the problem
    with warnings.catch_warnings():  # read-only: these views are only ever copied from
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(mm[8 + size :])
    out = {}
    for key, info in header.items():
        dtype = _DTYPES.get(info.get("dtype")) if isinstance(info, dict) else None
        if key == "__metadata__" or dtype is None:
            continue
        start, end = info["data_offsets"]
        try:
            out[key] = data[start:end].view(dtype).view(info["shape"])
        except RuntimeError:  # misaligned for its dtype: safe_open reads it
            continue
    return out


class Checkpoint:
    """Every tensor of a safetensors checkpoint by name, each file opened once and memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._handles: dict[Path, object] = {}
        self._maps: dict[Path, dict[str, torch.Tensor]] = {}
        index, single = self.path / INDEX, self.path / SINGLE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ExpertcacheError(f"{index}: not a safetensors index ({exc})") from None
            self.files = {k: self.path / f for k, f in weight_map.items()}
        elif single.is_file():
            handle = self._open(single)
            self.files = dict.fromkeys(handle.keys(), single)
        else:
            raise ExpertcacheError(f"{self.path}: no {SINGLE} or {INDEX} (not a safetensors checkpoint)")

    def _open(self, file: Path):
        handle = self._handles.get(file)
        if handle is None:
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise ExpertcacheError(f"{file}: cannot read safetensors file ({exc})") from None
            self._handles[file] = handle
        return handle

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._open(self.files[key]).get_slice(key).get_shape())

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor, a zero-copy view of the memory-mapped file where it can be (see ``_mapped``)."""
        mapped = self._mapped(self.files[key]).get(key)
        if mapped is not None:
            return mapped
        try:
            return self._open(self.files[key]).get_tensor(key)
        except ExpertcacheError:
            raise
        except Exception as exc:
            raise ExpertcacheError(f"{self.files[key]}: cannot read tensor {key} ({exc})") from None

    def row(self, key: str, index: int) -> torch.Tensor:
        """Row ``index`` of a tensor's first dimension, reading only that row."""
        mapped = self._mapped(self.files[key]).get(key)
        try:
            if mapped is not None:
                return mapped[index]
            return self._open(self.files[key]).get_slice(key)[index]
        except Exception as exc:
            raise ExpertcacheError(f"{self.files[key]}: cannot read {key}[{index}] ({exc})") from None

    def _mapped(self, file: Path) -> dict[str, torch.Tensor]:
        """Every tensor of ``file`` as a view of one memory map, made once. safetensors' ``get_tensor``
        and ``get_slice`` keep a little memory per call on an open file (0.8.0: a server on the disk
        tier grew by 15 KB per request); views of one map cost nothing per read. A tensor whose dtype
        or alignment a view cannot take is left out (it is read through ``safe_open``)."""
        views = self._maps.get(file)
        if views is None:
            views = self._maps[file] = _map_file(file)
        return views


class ExpertStore:
    """Reads expert (moe layer, expert) of a checkpoint into slot views, tensor by tensor."""

    def __init__(
        self,
        ckpt: Checkpoint,
        family: Family,
        prefixes: list[str],
        shapes: dict[str, tuple],
        num_experts: int,
    ) -> None:
        self.ckpt, self.family, self.prefixes = ckpt, family, prefixes
        self.shapes, self.num_experts = shapes, num_experts
        self._check()

    def sources(self, key: Key) -> dict[str, list[tuple[str, bool]]]:
        layer, expert = key
        return self.family.expert_keys(self.prefixes[layer], expert)

    def expert_keys(self) -> set[str]:
        """Every checkpoint key that holds expert weights (the loader skips them)."""
        out: set[str] = set()
        for layer in range(len(self.prefixes)):
            for expert in range(self.num_experts):
                for srcs in self.sources((layer, expert)).values():
                    out.update(k for k, _ in srcs)
        return out

    def read(self, key: Key, views: dict[str, torch.Tensor]) -> None:
        """Copy expert ``key`` into ``views`` (name -> tensor of the slot shape), converting dtype."""
        for name in self.sources(key):
            self.read_rows(key, name, 0, views[name].shape[0], views[name])

    def read_rows(self, key: Key, name: str, start: int, stop: int, dst: torch.Tensor) -> None:
        """Copy rows ``start:stop`` of the expert's tensor ``name`` into the same rows of ``dst``
        (one chunk of a chunked transfer; a slot tensor may gather several checkpoint tensors)."""
        _, expert = key
        row = 0
        for ckey, fused in self.sources(key)[name]:
            src = self.ckpt.row(ckey, expert) if fused else self.ckpt.tensor(ckey)
            n = src.shape[0]
            lo, hi = max(start, row), min(stop, row + n)
            if lo < hi:
                copy_tensor(dst[lo:hi], src[lo - row : hi - row])
            row += n

    def _check(self) -> None:
        """Every tensor of every expert exists and has the shape the model expects (headers only)."""
        for layer in range(len(self.prefixes)):
            for expert in range(self.num_experts):
                for name, srcs in self.sources((layer, expert)).items():
                    self._check_tensor(name, srcs)

    def _check_tensor(self, name: str, srcs: list[tuple[str, bool]]) -> None:
        rows, want = 0, self.shapes[name]
        for ckey, fused in srcs:
            if ckey not in self.ckpt:
                raise ExpertcacheError(f"{self.ckpt.path}: checkpoint lacks expert tensor {ckey}")
            shape = self.ckpt.shape(ckey)
            if fused:
                if shape[0] != self.num_experts:
                    raise ExpertcacheError(
                        f"{self.ckpt.path}: {ckey} holds {shape[0]} experts, not {self.num_experts}"
                    )
                shape = shape[1:]
            if tuple(shape[1:]) != tuple(want[1:]):
                raise ExpertcacheError(
                    f"{self.ckpt.path}: {ckey} has shape {shape}, model expects rows of {want[1:]}"
                )
            rows += shape[0]
        if rows != want[0]:
            keys = " + ".join(k for k, _ in srcs)
            raise ExpertcacheError(
                f"{self.ckpt.path}: {keys} give {rows} rows for {name}, expected {want[0]}"
            )
