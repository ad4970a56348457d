"""Moving experts from the slow tier into slots: the tiers, and the transfer worker.

The worker is one thread serving a priority queue (lower number first, FIFO within a priority),
one chunk at a time. Demand loads (known misses of the layer being computed) use ``DEMAND``,
prefetches ``SPECULATIVE``; a queued transfer can be promoted, or cancelled while it is not being
copied (early preemption drops a layer's speculative work). On CUDA the copies run on the worker's
own stream from pinned host memory, non-blocking, and the compute stream waits on the transfer's
event; on CPU the same code copies from the memory-mapped checkpoint into the slot, and a small
demand copy from memory is made by the thread that submits it, without the queue (``TransferWorker``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time

import numpy as np
import torch

from expertcache.cache.transfers import DEMAND, SPECULATIVE  # noqa: F401 (re-exported)
from expertcache.config import SLOW_TIERS  # noqa: F401  (the engine's name of them)
from expertcache.engine.link import EmulatedLink, tighten_timer_slack
from expertcache.engine.memory import SlotLayout, SlotPool
from expertcache.engine.store import ExpertStore, copy_alone, copy_bytes, copy_tensor
from expertcache.errors import ExpertcacheError, first_line
from expertcache.miss.base import FULL
from expertcache.policy.base import Key
from expertcache.workers import usable_cpus

STAGE_PART = ("stage", None)  # the worker's target of staging reads: the host level's slots (``StackTier``)


class DiskTier:
    """Slow tier = the checkpoint on disk, read through its memory map (via a pinned staging buffer when
    the slot is on CUDA).

    ``drop`` (the ``disk`` tier): an expert's pages leave this process's page tables and the page cache as
    soon as they are copied, so resident memory is the budget's slots, the dense weights and a stated
    overhead, whatever the checkpoint's size; a miss reads from the disk. Without it (the ``mapped``
    tier) they stay for the kernel to evict: misses are copies from memory while the page cache holds the
    checkpoint, and the memory the budget was meant to bound is not bounded.

    ``copy_chunk`` may run on several threads at once (``concurrent``): a copy plan's reads use a scratch
    buffer of the calling thread; the tensor-by-tensor path (a dtype conversion, a tensor that
    ``safe_open`` reads) takes a lock. ``reads_device``: with ``drop`` a copy waits on the disk, so a
    demand transfer is started at once, to read while compute goes on (``TransferWorker``)."""

    concurrent = True

    def __init__(
        self, store: ExpertStore, layout: SlotLayout, device: torch.device, drop: bool = True
    ) -> None:
        self.name = "disk" if drop else "mapped"
        self.reads_device = drop
        store.drop_pages = drop
        if drop:
            store.ckpt.forget_all()  # the dense weights are copied; the rest is read on demand
        self.store, self.layout = store, layout
        # CUDA: a pinned staging buffer per thread that copies (the transfer worker, a host level's staging
        # worker): one shared by two threads gave one expert's rows to another
        self.staging = threading.local() if device.type == "cuda" else None
        self._scratch: SlotPool | None = None
        self._whole = None  # the layout's one chunk of a whole expert (``_read``)
        self._lock = threading.Lock()

    def host_views(self, key: Key) -> dict[str, torch.Tensor]:
        """The expert's tensors in host memory, for computing it there: read into a scratch slot (valid
        until the next call; one caller at a time)."""
        if self._scratch is None:
            self._scratch = SlotPool(self.layout, 1, torch.device("cpu"))
        return self._read(key, self._scratch)

    def reader(self):
        """A ``key -> tensors in host memory`` function with a scratch slot of its own, which keeps the
        last expert read (the chunks of one transfer come one after another): for one thread."""
        scratch, last = SlotPool(self.layout, 1, torch.device("cpu")), [None]

        def read(key: Key) -> dict[str, torch.Tensor]:
            if last[0] != key:
                self._read(key, scratch)
                last[0] = key
            return scratch.views[0]

        return read

    def _read(self, key: Key, scratch: SlotPool) -> dict[str, torch.Tensor]:
        """Expert ``key`` into ``scratch``'s one slot, whole: by the store's copy plan, as a transfer reads
        it (one read per run of its bytes in the file), where there is one; tensor by tensor where not.
        Tensor by tensor took 58 us for the embedded model's 180 KiB expert, the plan 19 us."""
        whole = self._whole
        if whole is None:
            whole = self._whole = self.layout.chunks(None)[0]
        plan = self.store.copy_plan(key, whole, self.layout)
        if plan is None:
            with self._lock:
                self.store.read(key, scratch.views[0])
        else:
            self.store.run_plan(plan, scratch.buffer[0].view(torch.uint8).numpy())
        return scratch.views[0]

    def copy_chunk(
        self, key: Key, views: dict[str, torch.Tensor], chunk, flat: np.ndarray | None = None
    ) -> None:
        """Copy one chunk (``(tensor, first row, end row, bytes)`` pieces) of ``key`` into ``views``;
        ``flat``, the slot's bytes (a host slot of this tier's layout), takes the store's copy plan: the
        chunk's bytes in one read per run of them in the file (``ExpertStore.copy_plan``)."""
        if flat is not None:
            plan = self.store.copy_plan(key, chunk, self.layout)
            if plan is not None:
                self.store.run_plan(plan, flat)
                return
        if self.staging is None:
            with self._lock:
                for name, start, stop, _ in chunk:
                    self.store.read_rows(key, name, start, stop, views[name])
            return
        staged = getattr(self.staging, "views", None)  # this thread's: it waits for each copy out of it
        if staged is None:  # before it reads into it again (``TransferWorker._copy``)
            staged = self.staging.views = SlotPool(self.layout, 1, torch.device("cpu"), pin=True).views[0]
        with self._lock:
            for name, start, stop, _ in chunk:
                self.store.read_rows(key, name, start, stop, staged[name])
        for name, start, stop, _ in chunk:
            views[name][start:stop].copy_(staged[name][start:stop], non_blocking=True)


class HostTier:
    """Slow tier = every expert in (pinned) host memory, filled once from the checkpoint at load.
    ``copy_chunk`` may run on several threads at once (``concurrent``); its copies are from memory
    (not ``reads_device``)."""

    name = "host"
    concurrent = True
    reads_device = False

    def __init__(
        self,
        store: ExpertStore,
        layout: SlotLayout,
        num_layers: int,
        num_experts: int,
        pin: bool,
        progress=None,
    ) -> None:
        self.num_experts = num_experts
        self.pool = SlotPool(layout, num_layers * num_experts, torch.device("cpu"), pin=pin)
        keys = [(layer, e) for layer in range(num_layers) for e in range(num_experts)]
        for i, key in enumerate(progress(keys) if progress else keys):
            store.read(key, self.pool.views[i])
        store.ckpt.forget_all(cache=False)  # the copies are the tier: no second one mapped here
        self.layout = layout
        self._bytes = self.pool.buffer.view(torch.uint8).numpy()  # [experts, slot bytes]
        self._spans: dict[tuple, tuple[tuple[int, int], ...]] = {}

    def _ranges(self, chunk) -> tuple[tuple[int, int], ...]:
        """The chunk's bytes in a slot as ``(first, end)`` ranges, neighbours joined (a tensor's
        alignment padding included: a whole expert is one range)."""
        got = self._spans.get(chunk)
        if got is None:
            size, layout = self.layout.dtype.itemsize, self.layout
            ranges: list[list[int]] = []
            for name, start, _, nbytes in chunk:
                i = layout.names.index(name)
                row_bytes = math.prod(layout.shapes[i][1:]) * size
                lo = layout.offsets[i] * size + start * row_bytes
                if ranges and 0 <= lo - ranges[-1][1] < _JOIN:
                    ranges[-1][1] = lo + nbytes
                else:
                    ranges.append([lo, lo + nbytes])
            got = self._spans[chunk] = tuple((lo, hi) for lo, hi in ranges)
        return got

    def host_views(self, key: Key) -> dict[str, torch.Tensor]:
        """The expert's tensors in host memory, for computing it there (no copy)."""
        return self.pool.views[key[0] * self.num_experts + key[1]]

    def reader(self):
        """``host_views``: every thread may read the host tier at once."""
        return self.host_views

    def copy_chunk(
        self, key: Key, views: dict[str, torch.Tensor], chunk, flat: np.ndarray | None = None
    ) -> None:
        """Copy one chunk of ``key`` into ``views``; with ``flat`` (the slot's bytes: a host slot of this
        tier's layout) the chunk's bytes at once, one copy per run of them (a whole expert: one)."""
        layer, expert = key
        index = layer * self.num_experts + expert
        if flat is not None:
            src = self._bytes[index]
            for lo, hi in self._ranges(chunk):
                copy_bytes(flat[lo:hi], src[lo:hi])
            return
        src = self.pool.views[index]
        for name, start, stop, _ in chunk:
            dst = views[name][start:stop]
            if dst.device.type == "cpu":
                copy_tensor(dst, src[name][start:stop])
            else:
                dst.copy_(src[name][start:stop], non_blocking=True)


class StackTier:
    """Slow tier = a host level (``cache.tiers``) over the checkpoint on disk: ``capacity`` experts in
    (pinned) host memory, each read from the disk the first time a transfer needs it after it entered.

    The host level's decisions are the cache's (``TieredTransport``); this tier is told each change
    (``host_moved``) before the transfer it concerns is submitted, and gives the entering key its victim's
    host slot (or a free one). A transfer of a key the host level holds reads each chunk from the disk into
    its host slot, if those rows have not been read since the key entered, just before copying that chunk
    from the host slot (so the worker can preempt a prefetch between two chunks' reads, as between two
    chunks' copies); a key the host level does not hold (bypassed: every host key pinned) is read from
    the disk straight into the device slot, chunk by chunk. A key's
    host slot is never given away while a transfer of it is in flight (the cache pins it), so the reads
    and copies of different keys on different threads never touch one slot.

    Exclusive (``reserve`` slots beyond the capacity, ``cache.tiers.exclusive_reserve``): a hit leaves
    the level, but its slot stays its transfer's (``leaving``) until that transfer has landed, failed or
    was dropped (the worker calls ``ended``); the device's victim comes down into a slot of the
    level, copied there from its device slot as the decision is made (``host_moved(..., read=False)``),
    before the transfer that takes its device slot is submitted: on a CPU a copy on the calling thread,
    on a GPU an asynchronous copy on a stream of its own (the link is full duplex), whose event the
    transfer into the device slot and every later use of the host slot wait for. When every spare slot
    is still being read, the caller waits for the oldest of those transfers to land
    (``slot_waits``, ``slot_wait_s``)."""

    name = "stack"
    concurrent = True
    reads_device = True

    def __init__(
        self, disk: DiskTier, layout: SlotLayout, capacity: int, pin: bool, progress=None, reserve: int = 0
    ) -> None:
        self.disk, self.layout = disk, layout
        self.pool = SlotPool(layout, capacity + reserve, torch.device("cpu"), pin=pin, progress=progress)
        self._bytes = self.pool.buffer.view(torch.uint8).numpy()  # [slots, slot bytes]
        self.slot_of: dict[Key, int] = {}
        self.free = list(range(capacity + reserve))[::-1]
        self.unread: set[Key] = set()
        self._rows: dict[Key, _RowsRead] = {}  # unread keys whose reading has begun: the rows read
        self.whole = layout.chunks(None)[0]
        self.disk_reads = 0
        self.disk_read_s = 0.0
        self.disk_read_errors = 0  # reads that raised (a transfer retries; a staging read leaves it unread)
        self._counting = threading.Lock()  # the counters: the workers and the model's thread all read
        self._spans: dict[tuple, tuple[tuple[int, int], ...]] = {}
        # exclusive: keys that left for the device -> their slots, read by their transfers in flight (one
        # transfer of a key at a time); the slots of those that ended, free again
        self.leaving: dict[Key, int] = {}
        self._ended = threading.Condition(threading.Lock())
        self._released: list[tuple[Key, int]] = []  # (key, its slot), the newest last
        self.demote_copies = 0  # device victims copied down
        self.slot_waits, self.slot_wait_s = 0, 0.0
        self._down = None  # CUDA: the stream of the copies down
        self._pending: dict[int, object] = {}  # host slot -> the CUDA event of its copy down

    _ranges = HostTier._ranges

    def host_moved(
        self, entered: Key | None, left: Key | None, read: bool = True, device=None
    ) -> object | None:
        """A change of the host level: ``entered`` (None: none) takes ``left``'s slot or a free one, to be
        read from the disk when ``read``, else copied down from its device slot (``device``: its tensors
        and, on a CPU, its bytes); ``left`` leaves, its slot kept while an exclusive hit's transfer reads
        it. Returns the CUDA event of a copy down (the transfer into the device slot waits for it)."""
        slot = None
        if left is not None:
            slot = self.slot_of.pop(left)
            if entered is None and not read:  # an exclusive hit: its transfer reads the slot
                self.leaving[left] = slot  # (if still unread, the transfer reads it first)
                return None
            self._forget(left)
        if entered is None:
            if slot is not None:
                self.free.append(slot)
            return None
        if slot is None:
            slot = self._free_slot()
        self.slot_of[entered] = slot
        self._forget(entered)
        if read:
            self.unread.add(entered)
            return None
        views, flat = device
        return self._copy_down(slot, views, flat)

    def ended(self, key: Key) -> None:
        """A transfer of ``key`` landed, failed or was dropped (the worker's call, on any thread): the
        slot it read as an exclusive hit is free again."""
        if key not in self.leaving:
            return
        with self._ended:  # taken from ``leaving`` and given to ``_released`` at once, for ``_free_slot``
            slot = self.leaving.pop(key, None)
            if slot is not None:
                self._released.append((key, slot))
                self._ended.notify()

    def host_back(self, key: Key, left: Key | None) -> None:
        """Exclusive: ``key``'s transfer was dropped (``ended`` has its slot, which still holds it): it is
        the level's again, in that slot; ``left`` leaves to make room."""
        with self._ended:
            at = [i for i, (k, _) in enumerate(self._released) if k == key]
            if not at:  # its transfer had not ended: cannot be (a dropped transfer ends as it is dropped)
                raise ExpertcacheError(f"expert {key} came back to the host level without its slot")
            _, slot = self._released.pop(at[-1])
        self.slot_of[key] = slot
        if left is not None:
            self.free.append(self.slot_of.pop(left))
            self._forget(left)

    def _free_slot(self) -> int:
        """A free host slot: a free one, else one an exclusive hit's transfer has finished reading
        (waiting for the next to end when none has: those in flight end on the worker)."""
        if self.free:
            return self.free.pop()
        with self._ended:
            if not self._released:
                started = time.perf_counter()
                while not self._released:
                    if not self.leaving:  # the reserve is at least one slot: cannot happen
                        raise ExpertcacheError("the host level has no free slot and no transfer to wait for")
                    self._ended.wait(timeout=1.0)
                self.slot_waits += 1
                self.slot_wait_s += time.perf_counter() - started
            return self._released.pop(0)[1]

    def _copy_down(self, slot: int, views: dict[str, torch.Tensor], flat: np.ndarray | None) -> object | None:
        """Copy a device victim's tensors into host slot ``slot`` (exclusive: it comes down)."""
        self.demote_copies += 1
        dst = self.pool.views[slot]
        first = next(iter(views.values()))
        if first.device.type != "cuda":
            self._settle(slot)
            if flat is not None and flat.nbytes == self._bytes[slot].nbytes:
                copy_bytes(self._bytes[slot], flat)
            else:
                for name, src in views.items():
                    copy_tensor(dst[name], src)
            return None
        if self._down is None:
            self._down = torch.cuda.Stream(first.device)
        done = torch.cuda.Event()
        with torch.cuda.stream(self._down):  # after this slot's earlier copy down (the same stream)
            for name, src in views.items():
                dst[name].copy_(src, non_blocking=True)
            done.record(self._down)
        self._pending[slot] = done
        return done

    def _settle(self, slot: int) -> None:
        """Before the host writes or reads host slot ``slot``: its copy down (CUDA) has landed."""
        done = self._pending.pop(slot, None)
        if done is not None:
            done.synchronize()

    def _slot(self, key: Key) -> int | None:
        """``key``'s host slot: held by the level, or left for the device and still being read."""
        slot = self.slot_of.get(key)
        return self.leaving.get(key) if slot is None else slot

    def _forget(self, key: Key) -> None:
        """``key`` is no longer the level's unread expert (it left, or entered anew)."""
        with self._counting:
            self.unread.discard(key)
            self._rows.pop(key, None)

    def _read(self, key: Key, slot: int, chunk=None) -> float:
        """Read ``chunk`` of ``key`` (None: the whole expert) from the disk into host slot ``slot`` unless
        its rows were read since the key entered; the key is read once every row is. The first read of
        a key counts as its disk read. Two threads may read one key at once (a staging read and a device
        transfer's): the same bytes. Returns the seconds the read took."""
        chunk = self.whole if chunk is None else chunk
        with self._counting:
            rows = self._rows.get(key)
            if key not in self.unread or (rows is not None and rows.covers(chunk)):
                return 0.0
            first = rows is None
            if first:
                rows = self._rows[key] = _RowsRead()
        self._settle(slot)
        started = time.perf_counter()
        try:
            self.disk.copy_chunk(key, self.pool.views[slot], chunk, self._bytes[slot])
        except BaseException:
            with self._counting:
                self.disk_read_errors += 1
                if first and not rows.runs:  # nothing read (by another thread either): the next is the first
                    self._rows.pop(key, None)
            raise
        took = time.perf_counter() - started
        with self._counting:
            self.disk_read_s += took
            self.disk_reads += first
            rows.add(chunk)
            if rows.covers(self.whole):
                self.unread.discard(key)
                self._rows.pop(key, None)
        return took

    def copy_chunk(
        self, key: Key, views: dict[str, torch.Tensor], chunk, flat: np.ndarray | None = None
    ) -> float:
        """Copy one chunk of ``key`` into ``views`` (``flat``: the slot's bytes, a host slot); returns
        the seconds spent reading from the disk first (for an emulated link, which starts after it)."""
        slot = self._slot(key)
        if slot is None:  # not held (bypassed, or an exclusive level's miss): the disk tier's own copy
            started = time.perf_counter()
            self.disk.copy_chunk(key, views, chunk, flat)
            took = time.perf_counter() - started
            first = chunk[0][1] == 0 and chunk[0][0] == next(iter(views))  # one read a transfer
            with self._counting:
                self.disk_reads += first
                self.disk_read_s += took
            return took
        read = self._read(key, slot, chunk) if key in self.unread else 0.0
        if flat is not None:
            self._settle(slot)
            src = self._bytes[slot]
            for lo, hi in self._ranges(chunk):
                copy_bytes(flat[lo:hi], src[lo:hi])
            return read
        src_views = self.pool.views[slot]
        down = self._pending.get(slot)
        for name, start, stop, _ in chunk:
            dst = views[name][start:stop]
            if dst.device.type == "cpu":
                self._settle(slot)
                copy_tensor(dst, src_views[name][start:stop])
            else:
                if down is not None:  # on the worker's stream: after the copy down into the slot
                    torch.cuda.current_stream(dst.device).wait_event(down)
                    down = None
                dst.copy_(src_views[name][start:stop], non_blocking=True)
        return read

    @property
    def stager(self) -> _Stager:
        """The source of staging transfers: reads a staged expert into its host slot, nothing more."""
        return _Stager(self)

    def host_views(self, key: Key) -> dict[str, torch.Tensor]:
        """The expert's tensors in host memory, for computing it there: its host slot where the host
        level holds it (reading it first if need be; its transfer or layer pins it), else the disk
        tier's scratch read."""
        slot = self._slot(key)
        if slot is None:
            return self.disk.host_views(key)
        if key in self.unread:
            self._read(key, slot)
        self._settle(slot)
        return self.pool.views[slot]

    def reader(self):
        disk = self.disk.reader()

        def read(key: Key) -> dict[str, torch.Tensor]:
            slot = self._slot(key)
            if slot is None or key in self.unread:
                return disk(key)
            self._settle(slot)
            return self.pool.views[slot]

        return read


class _RowsRead:
    """The rows of each tensor of one expert read from the disk so far, as joined ``[first, end)`` runs:
    chunks of different plans (a prefetch's, a demand transfer's, a staging read's whole expert) cover
    what they cover, whatever their boundaries."""

    def __init__(self) -> None:
        self.runs: dict[str, list[tuple[int, int]]] = {}

    def covers(self, chunk) -> bool:
        runs = self.runs
        return all(any(a <= lo and hi <= b for a, b in runs.get(name, ())) for name, lo, hi, _ in chunk)

    def add(self, chunk) -> None:
        for name, start, stop, _ in chunk:
            runs = sorted([*self.runs.get(name, ()), (start, stop)])
            joined = [runs[0]]
            for a, b in runs[1:]:
                if a <= joined[-1][1]:
                    joined[-1] = (joined[-1][0], max(joined[-1][1], b))
                else:
                    joined.append((a, b))
            self.runs[name] = joined


class _Stager:
    """A ``StackTier``'s staging source (``cache.tiers``): a transfer into a host slot that reads the
    expert from the disk if it is still unread (a device transfer may have read it first), on its first
    chunk, on a worker of its own with no link."""

    name = "stage"
    concurrent = True
    reads_device = True

    def __init__(self, stack: StackTier) -> None:
        self.stack = stack

    def copy_chunk(self, key: Key, views, chunk, flat=None) -> float:
        stack = self.stack
        slot = stack.slot_of.get(key)
        if slot is None or key not in stack.unread:
            return 0.0
        return stack._read(key, slot)


# a demand copy from memory of a slot this size or less is made by the thread that submits it
# (``TransferWorker``): at memory speed it takes about as long as waking the worker would
LEAVE_BYTES = 1 << 20
_PROCESSORS = usable_cpus()

_JOIN = 64  # bytes of padding between two tensors of a slot (SlotLayout's alignment): copied along


class Target:
    """Where one pool's transfers go: the source that fills a slot, the pool, and the layout of each
    layer's key inside a slot when the pool is shared by layers of different layouts (else the pool's)."""

    def __init__(self, source, pool: SlotPool, layouts: dict[int, SlotLayout] | None = None) -> None:
        self.source, self.pool, self.layouts = source, pool, layouts
        self.ended = getattr(source, "ended", None)  # told each transfer's end (``StackTier``)
        self._views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._plans: dict[tuple[int | None, int | None], tuple] = {}  # (layer, chunk bytes) -> chunks
        # a host pool of one layout: each slot's bytes, for sources that copy by byte ranges
        self._bytes = None
        if layouts is None and pool.device.type == "cpu":
            self._bytes = pool.buffer.view(torch.uint8).numpy()

    def flat(self, slot: int) -> np.ndarray | None:
        """Slot ``slot``'s bytes (a host pool of one layout), else None."""
        return None if self._bytes is None else self._bytes[slot]

    def layout(self, key: Key) -> SlotLayout:
        return self.pool.layout if self.layouts is None else self.layouts[key[0]]

    def views(self, key: Key, slot: int) -> dict[str, torch.Tensor]:
        if self.layouts is None:
            return self.pool.views[slot]
        got = self._views.get((key[0], slot))
        if got is None:
            got = self._views[(key[0], slot)] = self.layouts[key[0]].views(self.pool.buffer[slot])
        return got

    def plan(self, key: Key, chunk_bytes: int | None) -> tuple:
        """The chunks that move ``key`` into a slot, at most ``chunk_bytes`` each (None: whole)."""
        at = (None if self.layouts is None else key[0], chunk_bytes)
        got = self._plans.get(at)
        if got is None:
            got = self._plans[at] = self.layout(key).chunks(chunk_bytes)
        return got


_ALWAYS, _NEVER, _NO_SPARE = "always", "never", "when no processor is spare"


class Done:
    """A transfer's completion flag, with ``threading.Event``'s ``is_set``, ``set`` and ``wait``: the
    transfers of one worker share one condition (an ``Event`` each was a lock and a condition made for
    every miss, a few microseconds of the compute thread's)."""

    __slots__ = ("_cv", "_set")

    def __init__(self, cv: threading.Condition) -> None:
        self._cv, self._set = cv, False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._cv:
            self._set = True
            self._cv.notify_all()

    def set_unseen(self) -> None:
        """Set, when no other thread can be waiting (its transfer was never handed to one)."""
        self._set = True

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        with self._cv:
            return self._cv.wait_for(self.is_set, timeout)


class Transfer:
    """One expert (one part of it) moving into one slot, chunk by chunk; ``done`` is set when the slot
    holds it, or when it failed or was cancelled. ``finished``: the condition its ``done`` shares (its
    worker's), else one of its own."""

    __slots__ = (
        "key",
        "part",
        "slot",
        "priority",
        "seq",
        "done",
        "error",
        "cancelled",
        "event",
        "ready",
        "next_chunk",
        "moved",
        "submitted",
        "chunked",
        "after",
    )

    def __init__(
        self,
        key: Key,
        slot: int,
        priority: int,
        seq: int,
        part: str = FULL,
        finished: threading.Condition | None = None,
    ) -> None:
        self.key, self.slot, self.priority, self.seq, self.part = key, slot, priority, seq, part
        self.done = Done(finished if finished is not None else threading.Condition(threading.Lock()))
        self.error: BaseException | None = None
        self.cancelled = False
        self.event = None  # CUDA: recorded on the transfer stream after the last chunk is issued
        self.ready = None  # CUDA: recorded on the compute stream at submit (the slot's last reader)
        self.after = None  # CUDA: the copy down of the slot's last expert (an exclusive host level)
        self.next_chunk = 0  # chunks already copied
        self.moved = 0  # bytes already copied
        self.submitted = time.perf_counter()
        self.chunked = priority != DEMAND  # its plan for its whole life, promoted or not

    @property
    def started(self) -> bool:
        return self.next_chunk > 0

    def __lt__(self, other: Transfer) -> bool:
        return (self.priority, self.seq) < (other.priority, other.seq)


class TransferWorker:
    """A thread performing queued transfers in priority order, one chunk at a time (the link is serial).

    After every chunk the highest-priority transfer goes next, so a demand transfer waits for at most
    one chunk of a speculative one; the interrupted transfer resumes later where it stopped, and can
    still be cancelled until it finishes. Only transfers submitted as speculative move in chunks of
    ``chunk_bytes``: a demand transfer has nothing to make way for (demand transfers go first submitted,
    first served, whole), and each chunk costs the link a latency of its own. A chunk whose copy raises
    is retried up to ``retries`` times before the transfer fails. ``fault`` (tests) is called before
    every chunk copy with ``(transfer, chunk index, attempt)`` and may sleep or raise.

    ``steal`` (host slots without an emulated link, by default): a thread that waits for a transfer the
    worker has not taken yet takes it out of the queue and copies it itself. It would otherwise sit
    idle while the worker wakes up and works through what is ahead of it: on the development VM the
    hand-off alone cost 22 us a miss, twice the demo expert's compute for a token, and on the disk
    tier the two threads' reads are then in flight together. An emulated link stays serial, and a
    GPU's copies stay on the worker's stream.

    With ``steal``, a demand transfer whose source copies from memory (not ``reads_device``: the host
    tier, the mapped checkpoint) is copied by the thread that submits it, there and then, without the
    queue or the worker, unless the copy is long enough to be worth overlapping with computation (a slot
    of more than ``LEAVE_BYTES``) and the computation leaves a processor for the worker (fewer torch
    threads than processors). Waking the worker costs tens of microseconds of the two threads taking
    turns on the interpreter lock, more than a 180 KiB copy. Measured on the 2-core development VM,
    decode steps at 25 % of the experts, one process, the two ways interleaved (TPOT medians): the demo
    model (180 KiB experts) 3.3 against 3.9 ms from host memory, 2.9 against 3.6 ms from the mapped
    checkpoint; the Granite-shaped model (3 MiB experts) on 2 torch threads 86 against 93 ms copied by the
    caller, on 1 thread 108 against 100 ms by the worker. A read that waits on the disk
    (``reads_device``) goes to the worker at once: those 3 MiB experts from the ``disk`` tier, 171 ms a
    step through the worker, 203 ms copied by the caller.
    """

    def __init__(
        self,
        tier=None,
        pool: SlotPool | None = None,
        link: EmulatedLink | None = None,
        chunk_bytes: int | None = None,
        retries: int = 2,
        parts: dict[object, Target] | None = None,
        steal: bool | None = None,
    ) -> None:
        """``tier`` fills ``pool`` (the ``full`` part); ``parts`` adds or replaces targets by pool id,
        each a ``Target`` (source with ``copy_chunk(key, views, chunk)``, slot pool, layouts)."""
        self.link, self.chunk_bytes = link, chunk_bytes
        self.parts: dict[object, Target] = {FULL: Target(tier, pool)} if pool is not None else {}
        self.parts.update(parts or {})
        first = next(iter(self.parts.values())).pool
        self.retries = retries
        self.fault = None
        self.device = first.device
        self.cuda = first.device.type == "cuda"
        self.stream = torch.cuda.Stream(first.device) if self.cuda else None
        self.steal = (link is None and not self.cuda) if steal is None else bool(steal)
        if self.steal and (link is not None or self.cuda):
            raise ExpertcacheError("transfers are taken by waiting threads only on host slots without a link")
        self.stolen = 0  # transfers copied by the thread that needed them (at submit or wait)
        self._by_caller: dict[object, str] = {}  # part -> when the caller copies its demand transfers
        self._finished = threading.Condition(threading.Lock())  # what the transfers' ``done`` share
        self._counting = threading.Lock()  # the link's counters: the worker and a caller may both copy
        self._heap: list[Transfer] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self.busy_s = 0.0  # time the link was occupied (emulated: at least each chunk's duration)
        self.active_s = 0.0  # wall time some chunk was moving (busy_s less the threads' overlap)
        self._moving, self._since = 0, 0.0  # chunks moving now; since when some chunk has been
        self._link_free = 0.0  # emulated link: when its last chunk ended (perf_counter timeline)
        self.bytes_moved = 0
        self.retried = 0  # chunk copies that raised and were retried
        self._thread = threading.Thread(target=self._run, name="expertcache-transfer", daemon=True)
        self._thread.start()

    def submit(
        self, key: Key, slot: int, priority: int = DEMAND, part: str = FULL, after: object | None = None
    ) -> Transfer:
        """Queue ``key``'s move into ``slot``; ``after`` (CUDA): an event its first chunk waits for."""
        t = Transfer(key, slot, priority, next(self._seq), part, self._finished)
        if self.cuda:  # kernels already queued may still read the slot's previous expert
            t.ready = torch.cuda.Event()
            t.ready.record(torch.cuda.current_stream(self.device))
            t.after = after
        if self._closed:
            raise ExpertcacheError("the transfer worker is closed")
        if priority == DEMAND and self._caller_copies(part):
            self.stolen += 1
            self._copy_here(t)
            return t
        with self._cv:
            heapq.heappush(self._heap, t)
            self._cv.notify()
        return t

    def _caller_copies(self, part) -> bool:
        """A demand transfer to ``part`` is copied by the thread that submits it (class docstring)."""
        if not self.steal:
            return False
        got = self._by_caller.get(part)
        if got is None:
            target = self.parts.get(part)
            source = None if target is None else target.source
            if not getattr(source, "concurrent", False) or getattr(source, "reads_device", True):
                got = _NEVER
            else:
                got = _ALWAYS if target.pool.layout.slot_bytes <= LEAVE_BYTES else _NO_SPARE
            self._by_caller[part] = got
        return got is _ALWAYS or (got is _NO_SPARE and torch.get_num_threads() >= _PROCESSORS)

    def cancel(self, t: Transfer) -> bool:
        """Drop a queued transfer (one not being copied right now, partly moved or not); True when
        it will not complete."""
        with self._cv:
            if t.done.is_set() or t not in self._heap:
                return False
            t.cancelled = True
        self._ended(t)
        return True

    def promote(self, t: Transfer, priority: int = DEMAND) -> None:
        """Raise a queued transfer's priority (a speculative one the router has now chosen)."""
        with self._cv:
            if t.priority > priority:
                t.priority = priority
                if t in self._heap:
                    heapq.heapify(self._heap)

    def wait(self, t: Transfer) -> None:
        """Block until the transfer's slot is usable by the compute stream (copying it here, with
        ``steal``, when the worker has not taken it yet)."""
        if self.steal and not t.done.is_set() and self._take(t):
            while self._chunk(t):
                pass
        t.done.wait()
        if t.error is not None:
            if not isinstance(t.error, Exception):  # an interrupt (Ctrl-C) in a copy on this thread
                raise t.error
            raise ExpertcacheError(f"transfer of expert {t.key} failed: {first_line(t.error)}") from t.error
        if t.cancelled:
            raise ExpertcacheError(f"transfer of expert {t.key} was cancelled")
        if t.event is not None:
            torch.cuda.current_stream(self.device).wait_event(t.event)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def _take(self, t: Transfer) -> bool:
        """Take queued transfer ``t`` out of the queue, for the calling thread to copy: only from a
        source that copies on several threads at once (``concurrent``; a split expert's source keeps
        one scratch slot for the worker's thread)."""
        target = self.parts.get(t.part)
        if target is None or not getattr(target.source, "concurrent", False):
            return False
        with self._cv:
            if t.cancelled or t not in self._heap:
                return False
            self._heap.remove(t)
            heapq.heapify(self._heap)
            self.stolen += 1
            return True

    def _next(self) -> Transfer | None:
        with self._cv:
            while True:
                while self._heap and self._heap[0].cancelled:
                    heapq.heappop(self._heap).done.set()
                if self._heap:
                    return heapq.heappop(self._heap)
                if self._closed:
                    return None
                self._cv.wait()

    def _run(self) -> None:
        copy_alone()  # this thread's copies never start an OpenMP pool of their own
        if self.link is not None:
            tighten_timer_slack()  # the emulated link sleeps for tens of microseconds at a time
        while (t := self._next()) is not None:
            if self._chunk(t):
                with self._cv:  # back in the queue: a higher priority may go first
                    heapq.heappush(self._heap, t)

    def _chunk(self, t: Transfer) -> bool:
        """Copy ``t``'s next chunk; True when chunks remain (the transfer is not done)."""
        started = self._moving_from()
        plan, nbytes = (), 0
        try:  # anything raised is the transfer's error: the thread must go on serving the others
            plan = self.parts[t.part].plan(t.key, self.chunk_bytes if t.chunked else None)
            chunk = plan[t.next_chunk]
            nbytes = sum(piece[3] for piece in chunk)
            read = self._copy(t, chunk)
            if self.link is not None:  # back to back from the last chunk, or from submission
                begin = max(self._link_free, t.submitted)
                link_start = started + read  # read from the disk first (``StackTier``): the link after
                self._link_free = self.link.finish(
                    link_start, nbytes, max(begin, link_start) if read else begin
                )
        except BaseException as exc:  # reported to the waiter, never lost in the thread
            t.error = exc
        # an emulated chunk occupies the link for its duration even when it started late
        least = self.link.duration(nbytes) if self.link is not None else 0.0
        self._moved(started, least, 0 if t.error is not None else nbytes)
        if t.error is not None:
            self._ended(t)
            t.done.set()
            return False
        t.next_chunk += 1
        t.moved += nbytes
        if t.next_chunk < len(plan):
            return True
        self._ended(t)
        t.done.set()
        return False

    def _ended(self, t: Transfer) -> None:
        """``t`` landed, failed or was dropped: its source hears of it (a slot it read is free). On a GPU
        the copies wait for its slot's copy down (``after``) even if it never began: a transfer dropped
        or failed before its first chunk leaves the slot free for the next, which must not overwrite the
        slot while the copy down still reads it (waiting again on an event waited for is free)."""
        if t.after is not None and self.cuda:
            self.stream.wait_event(t.after)
        target = self.parts.get(t.part)
        if target is not None and target.ended is not None:
            target.ended(t.key)

    def _copy_here(self, t: Transfer) -> None:
        """All of demand transfer ``t``, whole, on the calling thread, before any other thread has seen
        it (``_caller_copies``): ``_chunk``'s work without the queue's, and no one to wake when done."""
        started = self._moving_from()
        try:
            for chunk in self.parts[t.part].plan(t.key, None):
                self._copy(t, chunk)
                t.next_chunk += 1
                t.moved += sum(piece[3] for piece in chunk)
        except BaseException as exc:  # reported at the wait, as the worker's
            t.error = exc
        self._moved(started, 0.0, t.moved)
        self._ended(t)
        t.done.set_unseen()

    def _moving_from(self) -> float:
        """A copy starts now (the link's counters: the worker and a caller may both copy)."""
        started = time.perf_counter()
        with self._counting:
            if not self._moving:
                self._since = started
            self._moving += 1
        return started

    def _moved(self, started: float, least: float, nbytes: int) -> None:
        """A copy since ``started`` ended, having moved ``nbytes`` and kept the link ``least`` seconds."""
        ended = time.perf_counter()
        with self._counting:
            self._moving -= 1
            if not self._moving:
                self.active_s += ended - self._since
            self.busy_s += max(ended - started, least)
            self.bytes_moved += nbytes

    def _copy(self, t: Transfer, chunk) -> float:
        """Copy one chunk of ``t``; the seconds its source spent reading from the disk first, if it says."""
        target = self.parts[t.part]
        source, views = target.source, target.views(t.key, t.slot)
        for attempt in range(self.retries + 1):
            try:
                if self.fault is not None:
                    self.fault(t, t.next_chunk, attempt)
                if self.cuda:
                    with torch.cuda.stream(self.stream):
                        if t.next_chunk == 0:
                            self.stream.wait_event(t.ready)
                            if t.after is not None:  # the slot's expert copied down first
                                self.stream.wait_event(t.after)
                        read = source.copy_chunk(t.key, views, chunk)
                        t.event = torch.cuda.Event()
                        t.event.record(self.stream)
                    t.event.synchronize()  # the staging buffer (disk tier) is reused by the next chunk
                else:
                    read = source.copy_chunk(t.key, views, chunk, target.flat(t.slot))
                return read or 0.0
            except Exception:
                if attempt == self.retries:
                    raise
                self.retried += 1
