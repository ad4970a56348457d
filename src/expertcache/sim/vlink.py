"""The timing simulator's link: ``cache.transfers.Transport`` in virtual time.

One serial link moves experts (or parts of them: a low-precision copy, a segment) chunk by chunk, each
chunk taking a fixed time (latency + its bytes over the bandwidth). Two clocks: ``now`` is the compute
clock, which the simulator advances (``advance``) and which ``wait`` moves on to a transfer's end (that
wait is stall); ``free_at`` is when the link finishes the last chunk it started. The link works in the
background of compute: before every call it starts, one after another, every chunk whose start time
``max(free_at, submit time)`` is <= now (a chunk starting exactly at ``now`` has started). After each
chunk it chooses again: DEMAND before SPECULATIVE, first submitted first within one priority, so a
demand transfer overtakes a speculative one between two chunks and the interrupted one resumes later,
keeping its place. As in the engine, only a transfer submitted as speculative moves in chunks; a demand
transfer moves whole (``whole``: its one-chunk plan per part). A started chunk always runs to its end;
a transfer may be cancelled unless one of its chunks is on the link right now or all of them have
started.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence

from expertcache.cache.transfers import DEMAND, FAILED, PENDING, READY, SPECULATIVE
from expertcache.errors import ExpertcacheError
from expertcache.miss.base import FULL
from expertcache.policy.base import Key

STAGE = "stage"  # a transfer that reads an expert from the disk into the host level only


class VTransfer:
    """One expert on the virtual link: how many of its chunks have started, when it completes."""

    __slots__ = (
        "key", "priority", "seq", "submitted", "moved", "done_at", "cancelled", "chunks", "part", "reads"
    )  # fmt: skip

    def __init__(self, key: Key, priority: int, seq: int, submitted: float, chunks, part=FULL) -> None:
        self.key, self.priority, self.seq, self.submitted, self.part = key, priority, seq, submitted, part
        self.chunks = chunks  # (seconds, bytes) of each chunk
        self.moved = 0  # chunks started (each runs to its end)
        self.done_at: float | None = None  # end of its last chunk, once that chunk has started
        self.cancelled = False
        self.reads = False  # each chunk reads its share of the expert from the disk first (a host level)


class VirtualLink:
    """A serial link in virtual time, with chunked, prioritised, cancellable transfers."""

    def __init__(
        self,
        chunk_s: Sequence[float],
        chunk_bytes: Sequence[int] | None = None,
        wake_s: float = 0.0,
        submit_s: float = 0.0,
        parts: dict[object, tuple[Sequence[float], Sequence[int]]] | None = None,
        whole: dict[object, tuple[Sequence[float], Sequence[int]]] | None = None,
        read_s: float | None = None,
        demote_s: float = 0.0,
        settle: bool = False,
    ) -> None:
        """``chunk_s`` / ``chunk_bytes``: each chunk of a whole expert; ``parts``: the same for other
        parts, keyed by part name, or by (part, layer) for parts whose size differs by layer. ``whole``:
        the plans of demand transfers by the same keys (None: the same plans as speculative ones).
        ``read_s``: with a host level (``cache.tiers``), the seconds of reading one whole expert from
        the disk into host memory: each chunk of a whole expert's transfer takes its share of them (by
        bytes) first, where the host level does not hold the expert or holds it unread (the engine's
        worker reads each chunk, then copies it, on one thread: a demand transfer goes between two).
        ``demote_s``: compute time spent copying a device victim down into an exclusive host level (the
        engine's copy on a CPU; its link time is free: a GPU's link is full duplex, and its copy down runs
        on a stream of its own). ``settle``: a deterministic run's link (``PrefetchConfig.deterministic``,
        the engine's ``SlotTransport``): compute waits for each transfer and staging read as it is submitted
        (stall), so nothing is in flight, and nothing can be cancelled, at the cache's next decision."""
        self.settle = bool(settle)
        self.plans = self._plans({FULL: (chunk_s, chunk_bytes), **(parts or {})})
        self.whole = self._plans(whole) if whole is not None else self.plans
        self.wake_s = float(wake_s)  # compute resumes this long after a waited-for transfer lands
        self.submit_s = float(submit_s)  # compute time spent issuing one transfer
        self.blocked = 0  # waits that found their transfer still moving
        self.now = 0.0  # the compute clock
        self.free_at = 0.0  # end of the last started chunk
        self.current: VTransfer | None = None  # the transfer whose chunk ends at free_at
        self.stall_s = 0.0  # compute time spent in wait()
        self.host_wait_s = 0.0  # compute time spent in join(): waiting for the host's experts
        self.host_busy_s = 0.0  # the host's time computing experts (the timing model adds it)
        self.busy_s = 0.0  # link time of every started chunk
        self.bytes_moved = 0
        self.transfers = 0  # submitted
        self.read_s = read_s
        self.demote_s = float(demote_s)
        self.host_keys: set[Key] = set()  # in the host level
        self.unread: set[Key] = set()  # in the host level, not read from the disk yet
        self.began: set[Key] = set()  # of those, the ones a transfer has begun to read (one disk read)
        self.leaving: set[Key] = set()  # left an exclusive host level for the device: read from host memory
        self.disk_reads = 0
        self.disk_busy_s = 0.0
        self.link_read_s = 0.0  # the reads inside transfers' chunks (in ``busy_s`` too)
        self.disk_free_at = 0.0  # end of the last staging read started (the disk's own timeline)
        self._disk_queue: deque[VTransfer] = deque()  # staging reads not started, in submission order
        self.reading: dict[Key, float] = {}  # key -> when its staging read ends
        self._heap: list[tuple[int, int, VTransfer]] = []  # (priority, seq, transfer), lazily cleaned
        self._seq = itertools.count()

    @staticmethod
    def _plans(plans) -> dict[object, list[tuple[float, int]]]:
        out = {}  # -> (seconds, bytes) of each chunk
        for part, (times, sizes) in plans.items():
            if not times or min(times) < 0:
                raise ExpertcacheError(f"a virtual link needs one non-negative duration per chunk of {part}")
            sizes = list(sizes) if sizes is not None else [0] * len(times)
            out[part] = [(float(t), int(b)) for t, b in zip(times, sizes, strict=True)]
        return out

    @property
    def active_s(self) -> float:
        """One chunk at a time: the link is active while busy."""
        return self.busy_s

    # -- the simulator's clock ------------------------------------------------------------------
    def advance(self, seconds: float) -> None:
        """Compute runs for ``seconds``; the link works meanwhile."""
        if seconds < 0:
            raise ExpertcacheError(f"cannot advance time by a negative {seconds} s")
        self.now += seconds
        self._run(self.now)

    # -- Transport ------------------------------------------------------------------------------
    def submit(self, key: Key, victim: Key | None, priority: int, part: str = FULL) -> VTransfer:
        if self.submit_s:  # the compute thread's own cost of issuing it, before the link can start it
            self.advance(self.submit_s)
        plans = self.whole if priority == DEMAND else self.plans
        plan = plans.get(part) or plans[(part, key[0])]
        t = VTransfer(key, priority, next(self._seq), self.now, plan, part)
        heapq.heappush(self._heap, (priority, t.seq, t))
        self.transfers += 1
        self._run(self.now)
        if self.settle:
            self.wait(t)
        return t

    def cancel(self, handle: VTransfer) -> bool:
        self._run(self.now)
        if self.settle:
            return False
        if handle.cancelled:
            return True
        if handle.done_at is not None or (handle is self.current and self.free_at > self.now):
            return False  # complete, or one of its chunks is on the link right now
        handle.cancelled = True
        if handle.moved == 0:  # an exclusive hit whose move up never started: it comes back into the host
            self.leaving.discard(handle.key)  # level (``host_back``) or is lost, and is read as such
        return True

    def promote(self, handle: VTransfer) -> None:
        self._run(self.now)
        if handle.priority != DEMAND and handle.done_at is None and not handle.cancelled:
            handle.priority = DEMAND  # the old heap entry is stale from now on
            heapq.heappush(self._heap, (DEMAND, handle.seq, handle))

    def poll(self, handle: VTransfer) -> int:
        self._run(self.now)
        if handle.cancelled:
            return FAILED
        return READY if handle.done_at is not None and handle.done_at <= self.now else PENDING

    def started(self, handle: VTransfer) -> bool:
        self._run(self.now)
        return self.settle or handle.moved > 0

    def wait(self, handle: VTransfer) -> None:
        """Compute blocks until the transfer has arrived: the link runs on (nothing new is submitted
        meanwhile), then ``now`` moves to the transfer's end and the difference counts as stall."""
        if handle.cancelled:
            raise ExpertcacheError(f"transfer of expert {handle.key} was cancelled")
        self._run(self.now)
        while handle.done_at is None:
            t = self._next()  # the handle itself is still queued
            self._reads_before(max(self.free_at, t.submitted))  # type: ignore[union-attr]
            self._move(t)  # type: ignore[arg-type]
        if handle.done_at > self.now:
            self.blocked += 1
            resume = handle.done_at + self.wake_s
            self.stall_s += resume - self.now
            self.now = resume
            self._run(self.now)

    def join(self, until: float) -> None:
        """Compute waits for other work that ends at ``until`` (the host's experts): host wait, not stall."""
        if until > self.now:
            self.host_wait_s += until - self.now
            self.now = until
            self._run(self.now)

    def release(self, key: Key, part: str = FULL) -> None:
        """Nothing to free: the virtual link holds no buffers."""

    def stage(self, key: Key) -> VTransfer:
        """Read ``key`` from the disk into the host level in the background (``cache.tiers``): a read of
        ``read_s`` on the disk's own timeline, beside the link's (the engine's staging worker), one after
        another in submission order; none where a device transfer has read it first. A device transfer
        that starts before the read has ended reads it again (the engine's does: the expert is unread
        until the read is done), one disk read counted for the two."""
        t = VTransfer(key, SPECULATIVE, next(self._seq), self.now, [(0.0, 0)], STAGE)
        self._disk_queue.append(t)
        self._run(self.now)
        if self.settle:  # the read ends before the next decision, whose pins it would change: stall
            while t.done_at is None:
                self._reads_before(max(self.disk_free_at, t.submitted), inclusive=True)
            if t.done_at > self.now:
                self.stall_s += t.done_at - self.now
                self.now = t.done_at
                self._run(self.now)
        return t

    def host_moved(self, entered: Key | None, left: Key | None, read: bool = True) -> None:
        """The host level took ``entered`` in (to be read from the disk when ``read``) and let ``left``
        go (``cache.tiers``)."""
        if left is not None:
            self.host_keys.discard(left)
            self.reading.pop(left, None)
            up = entered is None and not read  # an exclusive hit moving up: its transfer reads on
            if up and left not in self.unread:
                self.leaving.add(left)
            self.unread.discard(left)
            if not up:
                self.began.discard(left)
        if entered is not None:
            self.host_keys.add(entered)
            self.began.discard(entered)
            if read:
                self.unread.add(entered)
            else:  # a device victim copied down (exclusive): its copy is the compute thread's
                self.unread.discard(entered)
                self.leaving.discard(entered)
                if self.demote_s:
                    self.advance(self.demote_s)

    def host_back(self, key: Key, left: Key | None) -> None:
        """An exclusive hit whose transfer was dropped is back in the host level, read (``cache.tiers``);
        ``left`` left it to make room."""
        self.leaving.discard(key)
        self.host_keys.add(key)
        if left is not None:
            self.host_moved(None, left)

    # -- the link's work ------------------------------------------------------------------------
    def _next(self) -> VTransfer | None:
        """The transfer the link serves next (stale, cancelled and finished entries dropped)."""
        heap = self._heap
        while heap:
            priority, _, t = heap[0]
            if t.cancelled or t.done_at is not None or priority != t.priority:
                heapq.heappop(heap)
                continue
            return t
        return None

    def _run(self, limit: float) -> None:
        """Start every chunk, and every staging read, whose start time is at most ``limit``, in the order
        of their start times (the link's first at a tie)."""
        while (t := self._next()) is not None and (at := max(self.free_at, t.submitted)) <= limit:
            self._reads_before(at)
            self._move(t)
        self._reads_before(limit, inclusive=True)

    @staticmethod
    def _share(chunks, i: int) -> float:
        """Chunk ``i``'s share of a whole expert: its bytes' (equal shares where bytes are not given)."""
        total = sum(b for _, b in chunks)
        return chunks[i][1] / total if total else 1.0 / len(chunks)

    def _reads_before(self, limit: float, inclusive: bool = False) -> None:
        """Start the staging reads that start before ``limit`` (at it too, ``inclusive``)."""
        queue = self._disk_queue
        while queue:
            at = max(self.disk_free_at, queue[0].submitted)
            if at > limit or (at == limit and not inclusive):
                return
            self._read(queue.popleft(), at)

    def _read(self, t: VTransfer, start: float) -> None:
        """Start staging read ``t`` on the disk at ``start``."""
        seconds, key = 0.0, t.key
        if key in self.unread:  # else read already by a device transfer (one begun reads it again, whole)
            self.unread.discard(key)
            seconds = self.read_s
            self.disk_reads += key not in self.began  # the key's first read counts; a device transfer
            self.began.add(key)  # reading it again before this read ends reads the same read
            self.disk_busy_s += seconds
            self.reading[key] = start + seconds
        self.disk_free_at = start + seconds
        t.moved, t.done_at = 1, start + seconds

    def _move(self, t: VTransfer) -> None:
        """Start the next chunk of ``t`` on the link."""
        start = max(self.free_at, t.submitted)
        seconds, nbytes = t.chunks[t.moved]
        if self.read_s is not None and t.part == FULL:
            key = t.key
            if t.moved == 0:
                ready = self.reading.pop(key, None)  # a staging read of it, ending then
                if key in self.leaving:  # from host memory, which lets it go
                    self.leaving.discard(key)
                elif key in self.unread or key not in self.host_keys or (ready is not None and ready > start):
                    t.reads = True
                    self.disk_reads += key not in self.began  # one read a key, over the transfers reading it
                    if key in self.unread:
                        self.began.add(key)
            if t.reads:
                read = self.read_s * self._share(t.chunks, t.moved)
                self.disk_busy_s += read
                self.link_read_s += read
                seconds += read
                if t.moved + 1 == len(t.chunks):  # its last chunk read: the host level holds it read
                    self.unread.discard(key)
                    self.began.discard(key)
        self.free_at = start + seconds
        self.busy_s += seconds
        self.bytes_moved += nbytes
        self.current = t
        t.moved += 1
        if t.moved == len(t.chunks):
            t.done_at = self.free_at
