"""The expert store: one expert at a time, straight from the safetensors files (memory-mapped).

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``) checkpoints are
read as views of one memory map per file (``safe_open`` where a view cannot be made); an expert's
tensors are read row by row (only that expert's rows of a fused tensor are touched), so no step of
loading or serving materialises every expert.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import mmap
import os
import threading
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors import safe_open

from expertcache.engine.families import Family
from expertcache.engine.memory import SlotLayout, _libc
from expertcache.errors import ExpertcacheError
from expertcache.policy.base import Key

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# bytes between two pieces of one chunk that one read takes along rather than split in two reads: about
# what a disk moves in the time a second request costs it (a 184 KiB read took 0.4-1 ms on the
# development VM's virtio disk against about 0.1 ms per 128 KiB of bandwidth)
READ_GAP = 128 << 10
# a load that fills every slot (``ExpertStore.fill``) reads the checkpoint in runs of up to this many bytes,
# on this many threads: requests in flight together (a disk serves several faster than one) and copies
# out of the reads while the next ones wait on the disk. Measured on the development VM's virtio disk,
# O_DIRECT reads of 8 MiB: 1.0 GiB/s one at a time, 1.5 GiB/s four at a time
RUN_BYTES = 16 << 20
FILL_THREADS = 4

# a run of bytes this long or longer, copied by the thread that runs the model, goes through torch's
# intra-op threads (``copy_bytes``)
PARALLEL_BYTES = 1 << 20
_alone = threading.local()  # ``on``: this thread copies with numpy only (``copy_alone``)
_scratch = threading.local()  # ``buf``: this thread's page-aligned buffer for reads (``_Mapping._scratch``)


def copy_alone() -> None:
    """The calling thread (the transfer worker's) copies with numpy only: a torch copy on a thread of its
    own starts a second OpenMP pool, whose threads then spin against the computation's."""
    _alone.on = True


def copies_in_parallel(nbytes: int) -> bool:
    """Whether ``copy_bytes`` copies a run of ``nbytes`` on this thread through torch's threads."""
    return nbytes >= PARALLEL_BYTES and not getattr(_alone, "on", False) and torch.get_num_threads() > 1


def copy_bytes(
    dst: np.ndarray, src: np.ndarray, src_tensor: torch.Tensor | None = None, at: int | None = None
) -> None:
    """``dst[:] = src`` (uint8, one length). A run of ``PARALLEL_BYTES`` or more, on a thread that may
    use torch's intra-op threads (not ``copy_alone``) while there are several, is copied by all of
    them: it is the computation's thread waiting for a miss, its other threads idle. Measured on the
    2-core development VM, 3 MiB experts copied inside a generation on 2 torch threads: 136 against
    275 us. Smaller runs go through numpy, which wakes no threads (a 180 KiB copy: 11 against 20 us).
    ``src_tensor``: ``src`` as a tensor (for a read-only ``src``, which ``torch.from_numpy`` warns
    about); with ``at``, a larger one whose bytes ``at : at + len(dst)`` are ``src`` (sliced only when
    torch's threads copy)."""
    if copies_in_parallel(len(dst)):
        if src_tensor is None:
            src_tensor = torch.from_numpy(src)
        elif at is not None:
            src_tensor = src_tensor[at : at + len(dst)]
        torch.from_numpy(dst).copy_(src_tensor)
    else:
        dst[:] = src


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
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


_ITEMSIZE = {str(t): t.itemsize for t in _DTYPES.values()}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a uint8 view: the same shape for one-byte elements, else one more dimension of each
    element's bytes (a packed slot holds another tool's tensors as they are stored)."""
    if t.dtype == torch.uint8:
        return t
    if t.element_size() == 1:
        return t.view(torch.uint8)
    return t.unsqueeze(-1).view(torch.uint8)


class Read(NamedTuple):
    """One read of a copy plan: bytes ``start:stop`` of a file, and the pieces of it a slot takes, each
    ``(offset in the read, bytes, offset in the slot)``."""

    mapping: _Mapping
    start: int
    stop: int
    pieces: tuple[tuple[int, int, int], ...]


class _Mapping:
    """One file's read-only memory map, and exact reads of its bytes that leave no pages behind (the
    disk tier's path, ``read``): ``O_DIRECT`` where the file system takes it (the page cache is not
    touched at all; the aligned span is read into a scratch buffer of the reading thread and the bytes
    copied out), else buffered reads with ``posix_fadvise`` RANDOM (no readahead into the next
    expert's bytes) and DONTNEED after each (measured: about 1 ms a call, so O_DIRECT comes first).

    ``found``: which of the file's pages the page cache held when the checkpoint was opened (one bool a
    page; None: not known). Dropping pages (``forget``) leaves those: the page cache is left as it was
    found, never emptied of what other processes (or an earlier start) put there."""

    ALIGN = 4096  # O_DIRECT's alignment of offset, length and buffer (the largest logical block size)

    def __init__(self, file: Path) -> None:
        fd = os.open(file, os.O_RDONLY)
        try:
            self.map = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)  # the map holds its own
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.base = self.array.ctypes.data
        self._tensor: torch.Tensor | None = None
        self.file = file
        self._fd: int | None = None  # buffered, RANDOM
        self._direct: int | None = None  # O_DIRECT; -1 where the file system refuses it
        self.found: np.ndarray | None = None
        self._opening = threading.Lock()  # the descriptors are opened once, by whichever thread is first

    @property
    def tensor(self) -> torch.Tensor:
        """The whole map as a uint8 tensor, to be copied from only (it is read-only)."""
        if self._tensor is None:
            with warnings.catch_warnings():  # torch warns of a read-only array, once per process
                warnings.simplefilter("ignore", UserWarning)
                self._tensor = torch.from_numpy(self.array)
        return self._tensor

    def _reader(self) -> int:
        with self._opening:
            if self._fd is None:
                fd = os.open(self.file, os.O_RDONLY)
                if hasattr(os, "posix_fadvise"):  # Linux: read exactly what is asked
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                self._fd = fd
            return self._fd

    def _direct_fd(self) -> int:
        with self._opening:
            if self._direct is None:
                try:
                    self._direct = (
                        os.open(self.file, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                        if hasattr(os, "O_DIRECT")
                        else -1
                    )
                except OSError:  # e.g. tmpfs
                    self._direct = -1
            return self._direct

    def read(self, start: int, out: np.ndarray) -> None:
        """Bytes ``start : start + out.nbytes`` of the file into ``out`` (contiguous uint8), leaving none
        of them in the page cache."""
        np.copyto(out, self.span(start, start + out.nbytes))

    def span(self, start: int, stop: int) -> np.ndarray:
        """Bytes ``start:stop`` of the file, read at once into a scratch buffer of the calling thread
        (valid until its next call), leaving none of them in the page cache."""
        fd = self._direct_fd()
        if fd >= 0:
            try:
                return self._read_direct(fd, start, stop)
            except OSError:  # EINVAL: the file system takes O_DIRECT at open but not these reads
                with self._opening:
                    if self._direct == fd:  # not already given up by another thread
                        self._direct = -1
                        os.close(fd)
        out = self._scratch(stop - start)[: stop - start]
        self._read_all(self._reader(), start, memoryview(out).cast("B"))
        self.forget(start, stop)
        return out

    def _scratch(self, nbytes: int) -> np.ndarray:
        """This thread's scratch buffer of at least ``nbytes`` (one for every file): page-aligned
        (anonymous memory), as ``O_DIRECT`` wants, grown when a larger read comes."""
        buf = getattr(_scratch, "buf", None)
        if buf is None or len(buf) < nbytes:
            size = max(nbytes, 1 << 20, 0 if buf is None else 2 * len(buf))
            _scratch.buf = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
        return _scratch.buf

    def cached(self, start: int, stop: int) -> bool:
        """Whether the page cache holds every page of bytes ``start:stop`` now (``mincore`` over the map;
        False where it cannot be told)."""
        vec = _resident(self.base, len(self.map), start, stop)
        return vec is not None and bool(vec.all())

    def pread(self, start: int, outs: list[tuple[int, np.ndarray]]) -> None:
        """A buffered read of bytes ``start`` onward straight into ``outs`` (``(offset from start, uint8
        array)``, in order, not overlapping; the bytes between them are read into a scratch buffer): the
        kernel copies from the page cache into the arrays, no copy of ours and no page mapped here.
        Pages the page cache lacks are read into it (the caller drops them)."""
        views, at = [], 0
        for offset, out in outs:
            if offset > at:
                views.append(memoryview(self._scratch(offset - at)[: offset - at]))
            views.append(memoryview(out))
            at = offset + out.nbytes
        fd = self._reader()
        for i in range(0, len(views), 512):  # IOV_MAX is 1024 on Linux
            part = views[i : i + 512]
            done, want = 0, sum(v.nbytes for v in part)
            while done < want:
                n = os.preadv(fd, _skip(part, done), start + done)
                if n <= 0:
                    raise ExpertcacheError(
                        f"{self.file}: short read at byte {start + done} (file truncated?)"
                    )
                done += n
            start += want

    def _read_direct(self, fd: int, start: int, stop: int) -> np.ndarray:
        a = self.ALIGN
        lo = start - start % a
        hi = -(-stop // a) * a
        scratch = self._scratch(hi - lo)
        got = self._read_all(fd, lo, memoryview(scratch[: hi - lo]), eof_ok=True)
        if got < stop - lo:
            raise ExpertcacheError(f"{self.file}: short read at byte {lo + got} (file truncated?)")
        return scratch[start - lo : stop - lo]

    def _read_all(self, fd: int, start: int, view: memoryview, eof_ok: bool = False) -> int:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], start + done)
            if n <= 0:
                if eof_ok:
                    break
                raise ExpertcacheError(f"{self.file}: short read at byte {start + done} (file truncated?)")
            done += n
        return done

    def forget(self, start: int = 0, end: int | None = None, unmap: bool = False, cache: bool = True) -> None:
        """Let the page cache drop bytes ``start:end`` (all by default; not with ``cache=False``), first
        out of this process's page tables too with ``unmap``."""
        page = mmap.PAGESIZE
        end = len(self.map) if end is None else min(end, len(self.map))
        start -= start % page
        end = min(-(-end // page) * page, len(self.map))
        if end <= start:
            return
        if unmap and hasattr(mmap, "MADV_DONTNEED"):  # POSIX systems
            self.map.madvise(mmap.MADV_DONTNEED, start, end - start)
        if cache and hasattr(os, "posix_fadvise"):  # Linux (macOS has no page-cache advice)
            for lo, hi in self._not_found(start, end):
                os.posix_fadvise(self._reader(), lo, hi - lo, os.POSIX_FADV_DONTNEED)

    def _not_found(self, start: int, end: int) -> list[tuple[int, int]]:
        """The runs of page-aligned bytes ``start:end`` that were not in the page cache when the checkpoint
        was opened (``found``): what ``forget`` may drop."""
        if self.found is None:
            return [(start, end)]
        page = mmap.PAGESIZE
        first, last = start // page, -(-end // page)
        keep = self.found[first:last]
        if len(keep) < last - first:  # pages past what was seen at open (a file that grew)
            keep = np.concatenate([keep, np.zeros(last - first - len(keep), dtype=bool)])
        if not keep.any():
            return [(start, end)]
        edges = np.diff(np.concatenate(([True], keep, [True])).astype(np.int8))
        starts, stops = np.flatnonzero(edges == -1), np.flatnonzero(edges == 1)
        return [
            (max(start, (first + a) * page), min(end, (first + b) * page))
            for a, b in zip(starts.tolist(), stops.tolist(), strict=True)
        ]


class _Sized:
    """An iterable and its length (a progress bar's total)."""

    def __init__(self, items: Iterable, n: int) -> None:
        self.items, self.n = items, n

    def __iter__(self) -> Iterator:
        return iter(self.items)

    def __len__(self) -> int:
        return self.n


def _skip(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """``views`` less their first ``nbytes`` bytes (what a short ``preadv`` left to read)."""
    for i, v in enumerate(views):
        if nbytes < v.nbytes:
            return [v[nbytes:], *views[i + 1 :]]
        nbytes -= v.nbytes
    return []


def _resident(base: int, size: int, start: int = 0, stop: int | None = None) -> np.ndarray | None:
    """Which pages of bytes ``start:stop`` of a map at address ``base`` (``size`` bytes) the page cache
    holds (``mincore``): one bool a page, from the page holding ``start``; None where it cannot be told."""
    libc = _libc()
    stop = size if stop is None else min(stop, size)
    if libc is None or stop <= start:
        return None if libc is None else np.zeros(0, dtype=bool)
    page = mmap.PAGESIZE
    lo = start - start % page
    vec = np.zeros(-(-(stop - lo) // page), dtype=np.uint8)
    rc = libc.mincore(ctypes.c_void_p(base + lo), ctypes.c_size_t(stop - lo),
                      vec.ctypes.data_as(ctypes.c_void_p))  # fmt: skip
    return None if rc != 0 else (vec & 1).astype(bool)


def _found(file: Path) -> np.ndarray | None:
    """Which pages of ``file`` the page cache holds now (``_resident`` over a fresh map), None if unknown."""
    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return np.zeros(0, dtype=bool)
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
            view = np.frombuffer(m, dtype=np.uint8)
            try:
                return _resident(view.ctypes.data, size)
            finally:
                del view  # before the map closes: it exports the buffer
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _map_file(file: Path) -> tuple[dict[str, torch.Tensor], _Mapping | None]:
    """The tensors of a safetensors file as read-only views of one memory map (8-byte header length,
    a JSON header of dtype, shape and data offsets, then the data), and the map."""
    try:
        mapping = _Mapping(file)
        mm = mapping.array
        size = int.from_bytes(mm[:8].tobytes(), "little")
        header = json.loads(mm[8 : 8 + size].tobytes())
    except (OSError, ValueError):
        return {}, None  # safe_open reports the problem
    data = mapping.tensor[8 + size :]  # read-only: these views are only ever copied from
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
    return out, mapping


def _leaves_folder(name: str) -> bool:
    """Whether a file name of an index points out of its folder (an absolute path, or up past it)."""
    path = Path(os.path.normpath(name))
    return path.is_absolute() or path.parts[:1] == ("..",)


class Checkpoint:
    """Every tensor of a safetensors checkpoint by name, each file opened once and memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._handles: dict[Path, object] = {}
        self._maps: dict[Path, dict[str, torch.Tensor]] = {}
        self._mappings: dict[Path, _Mapping | None] = {}
        self._found: dict[Path, np.ndarray | None] = {}  # pages in the page cache at open (``_Mapping``)
        index, single = self.path / INDEX, self.path / SINGLE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8-sig"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ExpertcacheError(f"{index}: not a safetensors index ({exc})") from None
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(f, str) for k, f in weight_map.items()
            ):
                raise ExpertcacheError(
                    f"{index}: not a safetensors index (its weight_map maps names to files)"
                )
            # "../../etc/passwd": a checkpoint's shards are files of its folder, by name (not resolved: the
            # Hugging Face cache links each to a blob elsewhere)
            outside = next((f for f in weight_map.values() if _leaves_folder(f)), None)
            if outside is not None:
                raise ExpertcacheError(f"{index}: names a file outside the checkpoint's folder ({outside})")
            self.files = {k: self.path / f for k, f in weight_map.items()}
            self._found = {f: _found(f) for f in dict.fromkeys(self.files.values())}
        elif single.is_file():
            self._found = {single: _found(single)}
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

    def dtype(self, key: str) -> torch.dtype | str:
        """The tensor's dtype (safetensors' name of it where torch has none here)."""
        name = self._open(self.files[key]).get_slice(key).get_dtype()
        return _DTYPES.get(name, name)

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

    def copy(self, key: str) -> torch.Tensor:
        """The tensor in fresh memory of its own: where it is a view of a file's map, one buffered read of
        its bytes straight into it (the kernel copies from the page cache; measured on the development
        VM, a Granite-shaped model's 337 MiB of dense weights took 0.16-0.29 s so, against 1.7-1.8 s
        for torch's copy out of the map); else a copy of ``tensor``."""
        t = self.tensor(key)
        mapping = self._mappings.get(self.files[key])
        start = t.data_ptr() - mapping.base if mapping is not None else -1
        if not (t.is_contiguous() and t.nbytes and 0 <= start <= start + t.nbytes <= len(mapping.map)):
            return t.clone(memory_format=torch.contiguous_format)
        out = torch.empty(t.shape, dtype=t.dtype)
        mapping.pread(start, [(0, out.view(torch.uint8).reshape(-1).numpy())])
        return out

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
            views, mapping = _map_file(file)
            if mapping is not None:
                mapping.found = self._found.get(file)
            self._maps[file], self._mappings[file] = views, mapping
        return views

    def read_into(self, key: str, piece: torch.Tensor, dst: torch.Tensor) -> bool:
        """Copy ``piece`` (a view of tensor ``key``) into ``dst`` by an exact read of its bytes from the
        file, its pages dropped after (``_Mapping.read``); False, nothing done, for a tensor read through
        ``safe_open`` (no map to place it)."""
        mapping = self._mappings.get(self.files[key])
        if mapping is None or not piece.is_contiguous():
            return False
        start = piece.data_ptr() - mapping.base
        if not (0 <= start <= start + piece.nbytes <= len(mapping.map)):
            return False
        direct = dst.dtype == piece.dtype and dst.device.type == "cpu" and dst.is_contiguous()
        out = dst if direct else torch.empty(piece.shape, dtype=piece.dtype)
        mapping.read(start, out.view(torch.uint8).reshape(-1).numpy())
        if not direct:
            copy_tensor(dst, out)
        return True

    def locate(self, key: str, piece: torch.Tensor) -> tuple[_Mapping, int] | None:
        """Where ``piece`` (a contiguous view of tensor ``key``) lies: its file's mapping and its first
        byte in the file; None for a tensor read through ``safe_open`` (not a view of a map)."""
        mapping = self._mappings.get(self.files[key])
        if mapping is None or not piece.is_contiguous():
            return None
        start = piece.data_ptr() - mapping.base
        if not (0 <= start <= start + piece.nbytes <= len(mapping.map)):
            return None
        return mapping, start

    def forget_all(self, cache: bool = True) -> None:
        """Drop every mapped file's pages from this process and those it brought into the page cache
        (after loading the dense weights, which are copied: the disk tier then reads experts exactly, on
        demand); pages the page cache held when the checkpoint was opened stay there (``_Mapping.found``).
        With ``cache=False`` only from this process (the host tier, which holds its own copies: the page
        cache may keep the file for the next start)."""
        for mapping in self._mappings.values():
            if mapping is not None:
                mapping.forget(unmap=True, cache=cache)


class ExpertStore:
    """Reads expert (moe layer, expert) of a checkpoint into slot views, tensor by tensor."""

    def __init__(
        self,
        ckpt: Checkpoint,
        family: Family,
        prefixes: list[str],
        shapes: dict[str, tuple],
        num_experts: int,
        packed=None,
    ) -> None:
        self.ckpt, self.family, self.prefixes = ckpt, family, prefixes
        # packed experts (``engine.packed.Packed``): the slot tensors are bytes, each read as stored from the
        # checkpoint tensors ``packed.sources`` names (``as_bytes``)
        self.packed = packed
        self.shapes, self.num_experts = shapes, num_experts
        # read an expert's bytes exactly and let their pages go (the disk tier: memory bounded by the
        # budget), rather than copy from the map and leave them to the page cache (the mapped tier)
        self.drop_pages = False
        self._plans: dict[tuple, tuple[Read, ...] | None] = {}  # (key, chunk) -> its copy plan
        self._collected: list | None = None  # ``collecting``: the plans noted instead of run
        self._transposed: set[str] = set()  # fused tensors stored transposed (``Family.transposed_ok``)
        self._last_block: tuple[tuple[str, int], torch.Tensor] | None = None  # ``_stored_block``'s
        self._check()

    def sources(self, key: Key) -> dict[str, list[tuple[str, bool]]]:
        layer, expert = key
        keys = self.family.expert_keys(self.prefixes[layer], expert)
        return keys if self.packed is None else self.packed.sources(self.prefixes[layer], keys)

    def _source(self, ckey: str, fused: bool, expert: int) -> torch.Tensor:
        """Checkpoint tensor ``ckey``'s part of ``expert`` (its row of a fused tensor); packed: its bytes."""
        src = self.ckpt.row(ckey, expert) if fused else self.ckpt.tensor(ckey)
        if ckey in self._transposed:  # a view: ``copy_plan`` leaves it to ``read_rows``
            return src.T
        return src if self.packed is None else as_bytes(src)

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

    def copy_plan(self, key: Key, chunk, layout: SlotLayout) -> tuple[Read, ...] | None:
        """How to fill one chunk (``(tensor, first row, end row, bytes)`` pieces) of expert ``key`` in a
        slot of ``layout``, as byte ranges: reads of the checkpoint's files, each a run of the chunk's
        source bytes that lie close together in one file (an expert's tensors usually lie side by side:
        one read for all of them), and where each piece of it lands in the slot. Made once per expert
        and chunk. None where some piece is not a view of a file's map in the slot's dtype (a tensor read
        through ``safe_open``, a dtype conversion): ``read_rows`` copies those."""
        cache_key = (key, chunk)
        if cache_key in self._plans:
            return self._plans[cache_key]
        _, expert = key
        size = layout.dtype.itemsize
        segments = []  # (mapping, first byte in the file, bytes, first byte in the slot)
        sources = self.sources(key)
        plan: tuple[Read, ...] | None = None
        for name, start, stop, _ in chunk:
            i = layout.names.index(name)
            shape = layout.shapes[i]
            row_bytes, base = math.prod(shape[1:]) * size, layout.offsets[i] * size
            row = 0
            for ckey, fused in sources[name]:
                src = self._source(ckey, fused, expert)
                n = src.shape[0]
                lo, hi = max(start, row), min(stop, row + n)
                if lo < hi:
                    piece = src[lo - row : hi - row]
                    where = self.ckpt.locate(ckey, piece) if piece.dtype == layout.dtype else None
                    if where is None:
                        self._plans[cache_key] = None
                        return None
                    segments.append((where[0], where[1], piece.nbytes, base + lo * row_bytes))
                row += n
        reads: list[Read] = []
        for mapping, first, nbytes, dst in sorted(segments, key=lambda s: (s[0].file, s[1])):
            last = reads[-1] if reads else None
            if last is not None and last.mapping is mapping and 0 <= first - last.stop <= READ_GAP:
                reads[-1] = Read(
                    mapping, last.start, first + nbytes, (*last.pieces, (first - last.start, nbytes, dst))
                )
            else:
                reads.append(Read(mapping, first, first + nbytes, ((0, nbytes, dst),)))
        plan = tuple(reads)
        self._plans[cache_key] = plan
        return plan

    def run_plan(self, plan: tuple[Read, ...], slot: np.ndarray) -> None:
        """Fill ``slot`` (the slot's bytes) by ``plan``: copies from the files' maps (the ``mapped``
        tier), or with ``drop_pages`` one exact read per run of bytes, none of them left in the page
        cache (the ``disk`` tier). While ``collecting``, only noted, for ``fill``."""
        collected = self._collected
        if collected is not None:
            collected.append((plan, slot))
            return
        for read in plan:
            if self.drop_pages:
                span, at = read.mapping.span(read.start, read.stop), 0
            else:
                span, at = read.mapping.array, read.start
            tensor = None if self.drop_pages else read.mapping.tensor
            for offset, nbytes, dst in read.pieces:
                lo = at + offset
                copy_bytes(slot[dst : dst + nbytes], span[lo : lo + nbytes], tensor, lo)

    @contextlib.contextmanager
    def collecting(self) -> Iterator[list[tuple[tuple[Read, ...], np.ndarray]]]:
        """Within, ``run_plan`` notes ``(plan, slot)`` in the list yielded instead of copying: a load about
        to fill many slots runs them all at once after (``fill``). Only the caller may then use those
        slots, once filled."""
        jobs: list[tuple[tuple[Read, ...], np.ndarray]] = []
        self._collected = jobs
        try:
            yield jobs
        finally:
            self._collected = None

    def fill(self, jobs: list[tuple[tuple[Read, ...], np.ndarray]], progress=None) -> None:
        """Run many copy plans (``(plan, slot bytes)``) at once, as a load that fills every slot does: their
        pieces sorted by file and offset and read in runs of up to ``RUN_BYTES`` (a layer's experts lie
        side by side in a fused tensor: one read for many of them), on ``FILL_THREADS`` threads. A run
        the page cache holds is read from it by a buffered read straight into the slots (no disk, no
        copy of ours); the ``disk`` tier reads any other run exactly (``_Mapping.span``: ``O_DIRECT``)
        and copies it out, so that the page cache is left as it was; the ``mapped`` tier reads it
        through the page cache. ``progress`` wraps an iterable of the plans as each is done (a bar)."""
        pieces = []  # (mapping, first byte in the file, bytes, job, destination)
        for j, (plan, slot) in enumerate(jobs):
            for read in plan:
                for offset, nbytes, dst in read.pieces:
                    pieces.append((read.mapping, read.start + offset, nbytes, j, slot[dst : dst + nbytes]))
        pieces.sort(key=lambda p: (str(p[0].file), p[1]))
        runs: list[list[tuple]] = []
        end = 0
        for p in pieces:
            run = runs[-1] if runs else None
            joins = run and run[0][0] is p[0] and 0 <= p[1] - end <= READ_GAP
            if joins and p[1] + p[2] - run[0][1] <= RUN_BYTES:
                run.append(p)
            else:
                runs.append([p])
            end = p[1] + p[2]
        left = Counter(p[3] for p in pieces)
        done = _Sized(self._fill_runs(runs, left), len(left))
        for _ in progress(done) if progress else done:
            pass

    def _fill_runs(self, runs: list[list[tuple]], left: Counter) -> Iterable[int]:
        """Read ``runs`` on ``FILL_THREADS`` threads; yields each job as its last piece lands."""
        if not runs:
            return
        with ThreadPoolExecutor(min(FILL_THREADS, len(runs)), thread_name_prefix="expertcache-fill") as pool:
            pending = {pool.submit(self._fill_run, run): run for run in runs}
            try:
                while pending:
                    finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in finished:
                        run = pending.pop(future)
                        future.result()
                        for piece in run:
                            left[piece[3]] -= 1
                            if not left[piece[3]]:
                                yield piece[3]
            finally:
                for future in pending:
                    future.cancel()

    def _fill_run(self, run: list[tuple]) -> None:
        mapping, start = run[0][0], run[0][1]
        stop = max(first + nbytes for _, first, nbytes, _, _ in run)
        if self.drop_pages and not mapping.cached(start, stop):
            span = mapping.span(start, stop)  # exact: no page left in the page cache
            for _, first, nbytes, _, dst in run:
                np.copyto(dst, span[first - start : first - start + nbytes])
            return
        mapping.pread(start, [(first - start, dst) for _, first, _, _, dst in run])
        if self.drop_pages:  # a page evicted since it was found cached came back: let it go again
            mapping.forget(start, stop)

    def read_rows(self, key: Key, name: str, start: int, stop: int, dst: torch.Tensor) -> None:
        """Copy rows ``start:stop`` of the expert's tensor ``name`` into the same rows of ``dst``
        (one chunk of a chunked transfer; a slot tensor may gather several checkpoint tensors)."""
        _, expert = key
        row = 0
        for ckey, fused in self.sources(key)[name]:
            src = self._source(ckey, fused, expert)
            n = src.shape[0]
            lo, hi = max(start, row), min(stop, row + n)
            if lo < hi:
                if ckey in self._transposed:
                    piece = self._stored_block(ckey, expert, src.T).T[lo - row : hi - row]
                    copy_tensor(dst[lo:hi], piece)
                    row += n
                    continue
                piece = src[lo - row : hi - row]
                if not (self.drop_pages and self.ckpt.read_into(ckey, piece, dst[lo:hi])):
                    copy_tensor(dst[lo:hi], piece)
            row += n

    def _stored_block(self, ckey: str, expert: int, stored: torch.Tensor) -> torch.Tensor:
        """A transposed tensor's stored block of one expert (``stored``, a view of the file's map), read
        whole and exactly on the disk tier: a chunk's rows are columns spread over all of it. The last one
        read is kept, so that a transfer's chunks read it once, not once a chunk."""
        if not self.drop_pages:
            return stored
        last = self._last_block
        if last is not None and last[0] == (ckey, expert):
            return last[1]
        whole = torch.empty(stored.shape, dtype=stored.dtype)
        if not self.ckpt.read_into(ckey, stored, whole):
            return stored
        self._last_block = ((ckey, expert), whole)
        return whole

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
            if self.packed is not None:  # read as bytes (``as_bytes``)
                size = _ITEMSIZE.get(str(self.ckpt.dtype(ckey)), 0)
                if size > 1:
                    shape = (*shape, size)
                elif not size:
                    raise ExpertcacheError(f"{self.ckpt.path}: {ckey} has dtype {self.ckpt.dtype(ckey)}, "
                                           "which this expertcache does not read")  # fmt: skip
            if fused:
                if shape[0] != self.num_experts:
                    raise ExpertcacheError(
                        f"{self.ckpt.path}: {ckey} holds {shape[0]} experts, not {self.num_experts}"
                    )
                shape = shape[1:]
                if len(srcs) == 1 and len(shape) == 2 and tuple(shape) == tuple(want)[::-1] != tuple(want):
                    if self.family.transposed_ok:
                        self._transposed.add(ckey)
                        shape = tuple(want)
                    else:
                        raise ExpertcacheError(
                            f"{self.ckpt.path}: {ckey} stores each expert transposed ({tuple(shape)}; the "
                            f"model takes {tuple(want)}), as checkpoints written for transformers 4 do; "
                            "expertcache reads experts as transformers 5 saves them: load the checkpoint "
                            "once with transformers 5 and save_pretrained it (where the expert's other "
                            "matrix is square, neither can tell whether it is transposed: check that one "
                            "against the model card)"
                        )
            if tuple(shape[1:]) != tuple(want[1:]):
                raise ExpertcacheError(
                    f"{self.ckpt.path}: {ckey} has shape {shape}, model expects rows of {want[1:]}"
                )
            rows += shape[0]
        if rows != want[0]:
            keys = " + ".join(k for k, _ in srcs)
            raise ExpertcacheError(
                f"{self.ckpt.path}: {keys} give {rows} for the first dimension of {name} (an expert's), "
                f"where config.json gives {want[0]} "
                "(by its shapes, and its experts' packed format if any): the weights and the config disagree"
            )
