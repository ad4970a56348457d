"""Memory: the layout of one expert in a slot, the fixed pool of slots, and what the process holds.

Every expert occupies one contiguous buffer (a slot) holding its tensors back to back, each one
starting on a 64-byte boundary so that kernels see the same alignment as in a freshly allocated
parameter. The pool is allocated once; loading an expert is a copy into a free slot.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from expertcache.errors import ExpertcacheError, first_line
from expertcache.units import format_bytes

_ALIGN_BYTES = 64


@dataclass(frozen=True)
class SlotLayout:
    """Where each tensor of one expert lives inside its slot (element offsets, aligned)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    slot_numel: int  # padded size of one slot, in elements
    dtype: torch.dtype

    @classmethod
    def of(cls, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> SlotLayout:
        align = max(1, _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
        offsets, pos = [], 0
        for shape in shapes.values():
            offsets.append(pos)
            pos += -(-math.prod(shape) // align) * align
        return cls(tuple(shapes), tuple(tuple(s) for s in shapes.values()), tuple(offsets), pos, dtype)

    @property
    def numel(self) -> int:
        """Elements of real data in one expert (without padding)."""
        return sum(math.prod(s) for s in self.shapes)

    @property
    def nbytes(self) -> int:
        """Bytes one expert moves over the link."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot occupies in the pool (what the budget is charged per expert)."""
        return self.slot_numel * torch.empty((), dtype=self.dtype).element_size()

    def chunks(self, chunk_bytes: int | None) -> tuple[tuple[tuple[str, int, int, int], ...], ...]:
        """How a transfer moves one expert: chunks, each a tuple of ``(tensor, first row, end row,
        bytes)`` pieces. With ``chunk_bytes`` every chunk is one piece of at most that many bytes (at
        least one row), tensor by tensor; with None the whole expert is one chunk (one piece per tensor)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        pieces = []
        for name, shape in zip(self.names, self.shapes, strict=True):
            rows = shape[0]
            row_bytes = math.prod(shape[1:]) * size
            step = rows if not chunk_bytes else max(1, min(rows, chunk_bytes // row_bytes))
            for start in range(0, rows, step):
                stop = min(rows, start + step)
                pieces.append((name, start, stop, (stop - start) * row_bytes))
        if not chunk_bytes:
            return (tuple(pieces),)
        return tuple((p,) for p in pieces)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The expert's tensors as views into one slot's flat buffer."""
        return {
            name: flat[off : off + math.prod(shape)].view(shape)
            for name, shape, off in zip(self.names, self.shapes, self.offsets, strict=True)
        }


class SlotPool:
    """``num_slots`` slots allocated once on ``device`` as one [num_slots, slot_numel] tensor.

    ``prefault``: write every page of a host pool now (``progress`` wraps the slots' iteration: a bar).
    The allocator only reserves address space; left so, the first request pays a page fault for each
    4 KB of every slot it fills (at 100 % of a 2.7 GB model's experts, several seconds of TTFT). Pinned
    and device memory are backed when allocated."""

    def __init__(
        self,
        layout: SlotLayout,
        num_slots: int,
        device: torch.device,
        pin: bool = False,
        prefault: bool = False,
        progress=None,
    ) -> None:
        self.layout = layout
        self.device = torch.device(device)
        # the pool whose buffer this one's is a part of, from slot ``offset`` (``regions``); None: its own
        self.joint: SlotPool | None = None
        self.offset = 0
        try:
            self.buffer = torch.empty(
                (num_slots, layout.slot_numel), dtype=layout.dtype, device=self.device, pin_memory=pin
            )
        except RuntimeError as exc:
            raise ExpertcacheError(
                f"cannot allocate {num_slots} expert slots ({format_bytes(num_slots * layout.slot_bytes)}) "
                f"on {self.device}: {first_line(exc)}"
            ) from None
        self.views = [layout.views(self.buffer[s]) for s in range(num_slots)]
        if self.device.type == "cpu" and not pin:
            advise_huge_pages(self.buffer)
        if prefault and self.device.type == "cpu" and not pin:
            for slot in progress(range(num_slots)) if progress else range(num_slots):
                self.buffer[slot].zero_()

    def __len__(self) -> int:
        return len(self.views)

    def regions(self, sizes: list[int]) -> list[SlotPool]:
        """The pool as consecutive pools of ``sizes`` slots, each its own slots' rows of this buffer (the
        cache's slots and a stream buffer's of one layout: one buffer, so the grouped kernel computes
        experts of both in one call)."""
        if sum(sizes) != len(self):
            raise ValueError(f"regions of {sizes} slots in a pool of {len(self)}")
        out, start = [], 0
        for n in sizes:
            region = SlotPool.__new__(SlotPool)
            region.layout, region.device = self.layout, self.device
            region.buffer, region.views = self.buffer[start : start + n], self.views[start : start + n]
            region.joint, region.offset = self, start
            out.append(region)
            start += n
        return out


_MADV_HUGEPAGE = 14  # Linux's madvise advice (asm-generic/mman-common.h)
_HUGE = 2 << 20


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back ``tensor``'s memory (a CPU tensor not yet written) with 2 MiB pages where it can
    (``madvise(MADV_HUGEPAGE)``; transparent huge pages in their default ``madvise`` mode): a decode step
    reads a few MiB of each of many experts scattered over a pool of GiBs, and with 4 KiB pages every
    one of them also walks the page tables. A decode step's 8 int8 experts at Granite's shapes took 1036
    against 1136 us from a 1.1 GiB pool on the development VM (``bench/packed_width_cpu.py``); backing the
    pages costs at load (a 1.2 GB pool prefaulted in 0.4-1 s more). Only the whole 2 MiB pages inside the
    tensor are advised, so nothing outside it changes; a pool is backed whole either way (prefaulted, or
    filled by its experts), so the memory it is charged is the same. Returns whether the advice was taken
    (False on other systems, or where it was refused)."""
    if tensor.device.type != "cpu" or tensor.is_pinned() or not sys.platform.startswith("linux"):
        return False
    start = tensor.data_ptr()
    first = -(-start // _HUGE) * _HUGE
    last = (start + tensor.numel() * tensor.element_size()) // _HUGE * _HUGE
    if last <= first:
        return False
    libc = _libc()
    if libc is None or not hasattr(libc, "madvise"):
        return False
    return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_HUGEPAGE) == 0


def release_freed() -> bool:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``). A load frees much on the way
    (each dense weight read, quantised and dropped; the skeleton's temporaries; the warm-up's activations),
    and glibc keeps what lay below its mapping threshold in its heaps: resident and charged to the process's
    cgroup although unused. On the Granite-3.1-1B-A400M configuration with int8 experts and dense layers,
    trimming after load gave back 161 MiB (bfloat16) and 172 MiB (float32) of anonymous memory
    (``/proc/self/status``, one load each). Returns whether it ran (False without glibc: macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim(ctypes.c_size_t(0))
    return True


def resident_memory(files: Iterable[Path] = ()) -> dict[str, int | None]:
    """What this process holds in memory now, in bytes (Linux; None elsewhere): ``rss`` (VmRSS), its
    ``rss_anon`` (slots, dense weights, activations), ``rss_file`` (file pages mapped here: libraries, and
    a checkpoint's pages with the mapped tier) and ``rss_shmem`` (shared memory: a file on tmpfs) shares,
    and
    ``page_cache`` (the pages of ``files``, the checkpoint, in the page cache, whoever mapped or read
    them: memory the kernel may reclaim, but which a memory cgroup charges)."""
    out: dict[str, int | None] = dict.fromkeys(("rss", "rss_anon", "rss_file", "rss_shmem", "page_cache"))
    fields = {"VmRSS:": "rss", "RssAnon:": "rss_anon", "RssFile:": "rss_file", "RssShmem:": "rss_shmem"}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, rest = line.partition("\t") if "\t" in line else line.partition(" ")
            if name in fields:
                out[fields[name]] = int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return out
    cached = [_cached_bytes(f) for f in dict.fromkeys(files)]
    out["page_cache"] = None if any(c is None for c in cached) else sum(c for c in cached if c)
    return out


def _cached_bytes(file: Path) -> int | None:
    """Bytes of ``file`` in the page cache (``mincore`` over a fresh read-only map of it), None if it
    cannot be told."""
    import ctypes
    import mmap

    libc = _libc()
    if libc is None:
        return None
    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
            view = np.frombuffer(m, dtype=np.uint8)
            page = mmap.PAGESIZE
            vec = np.zeros(-(-size // page), dtype=np.uint8)
            rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size),
                              vec.ctypes.data_as(ctypes.c_void_p))  # fmt: skip
            del view  # before the map closes: it exports the buffer
            if rc != 0:
                return None
            return int(np.count_nonzero(vec & 1)) * page
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


_LIBC: list = []


def _libc():
    """The C library with ``mincore`` (and ``madvise``, where it has it) typed (Linux and most Unixes), or
    None."""
    if not _LIBC:
        import ctypes.util

        lib = None
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            if hasattr(lib, "madvise"):
                lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            lib = None
        _LIBC.append(lib)
    return _LIBC[0]


def available_memory() -> tuple[int, str] | None:
    """Bytes this process may still allocate, and how that was found: the smaller of the system's
    ``MemAvailable`` and its memory cgroup's room (limit - working set: usage less inactive file
    pages; cgroup v1 or v2). None where neither can be read (not Linux)."""
    found: list[tuple[int, str]] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "available system memory"))
    except (OSError, ValueError, IndexError):
        pass
    room = _cgroup_room()
    if room is not None:
        found.append(room)
    return min(found) if found else None


def _cgroup_room(root: Path = Path("/")) -> tuple[int, str] | None:
    """limit - working set of this process's memory cgroup, if it has a limit (cgroup v1 or v2; ``root``:
    where ``proc`` and ``sys`` are, for tests). The working set is the usage less the inactive file
    pages (``memory.stat``: v1's ``total_inactive_file``, else ``inactive_file``; v2's ``inactive_file``),
    as docker and the kubelet count it: page cache (a checkpoint just read) that the kernel reclaims
    before the cgroup runs out of memory. Counted as used, a 2.05 GiB limit refused 1.1 GiB of slots.
    The cgroup's folder is ``/proc/self/cgroup``'s path under the hierarchy's mount, or the mount itself
    where that path is not there (a container without a cgroup namespace mounts its own cgroup there)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if "memory" in controllers.split(","):  # v1
            mount, names = root / "sys/fs/cgroup/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
            inactive = ("total_inactive_file", "inactive_file")
        elif controllers == "":  # v2's unified hierarchy
            mount, names = root / "sys/fs/cgroup", ("memory.max", "memory.current")
            inactive = ("inactive_file",)
        else:
            continue
        base = mount / rel if (mount / rel / names[0]).is_file() else mount
        try:
            limit_text = (base / names[0]).read_text().strip()
            if limit_text == "max" or int(limit_text) >= 1 << 60:  # no limit
                continue
            limit, usage = int(limit_text), int((base / names[1]).read_text())
        except (OSError, ValueError):
            continue
        usage -= min(usage, _stat_field(base / "memory.stat", inactive))
        return max(0, limit - usage), f"its memory cgroup's room ({format_bytes(limit)} limit)"
    return None


def _stat_field(stat: Path, names: tuple[str, ...]) -> int:
    """The first of ``names`` found in a cgroup's ``memory.stat`` (bytes), 0 where none can be read."""
    try:
        fields = dict(line.split(None, 1) for line in stat.read_text().splitlines() if " " in line)
    except OSError:
        return 0
    for name in names:
        try:
            return max(0, int(fields[name]))
        except (KeyError, ValueError):
            continue
    return 0
