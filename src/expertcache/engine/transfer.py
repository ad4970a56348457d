"""Moving experts from the slow tier into slots: the tiers, and the transfer worker.

The worker is one thread serving a priority queue (lower number first, FIFO within a priority).
Demand loads (known misses of the layer being computed) use ``DEMAND``; ``SPECULATIVE`` is there
for the prefetcher, and a queued transfer can be cancelled before it starts (preemption drops a
layer's speculative work). On CUDA the copies run on the worker's own stream from pinned host
memory, non-blocking, and the compute stream waits on the transfer's event; on CPU the same code
copies from the memory-mapped checkpoint into the slot.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time

import torch

from expertcache.engine.link import EmulatedLink
from expertcache.engine.memory import SlotLayout, SlotPool
from expertcache.engine.store import ExpertStore, copy_tensor
from expertcache.errors import ExpertcacheError
from expertcache.policy.base import Key

DEMAND, SPECULATIVE = 0, 1


class DiskTier:
    """Slow tier = the memory-mapped checkpoint (via a pinned staging buffer when the slot is on CUDA)."""

    name = "disk"

    def __init__(self, store: ExpertStore, layout: SlotLayout, device: torch.device) -> None:
        self.store = store
        self.staging = None
        if device.type == "cuda":
            self.staging = SlotPool(layout, 1, torch.device("cpu"), pin=True)

    def copy_into(self, key: Key, views: dict[str, torch.Tensor], flat: torch.Tensor) -> None:
        if self.staging is None:
            self.store.read(key, views)
        else:  # the worker waits for each copy to finish before the staging buffer is reused
            self.store.read(key, self.staging.views[0])
            flat.copy_(self.staging.buffer[0], non_blocking=True)


class HostTier:
    """Slow tier = every expert in (pinned) host memory, filled once from the checkpoint at load."""

    name = "host"

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

    def copy_into(self, key: Key, views: dict[str, torch.Tensor], flat: torch.Tensor) -> None:
        layer, expert = key
        src = self.pool.buffer[layer * self.num_experts + expert]
        if flat.device.type == "cpu":
            copy_tensor(flat, src)
        else:
            flat.copy_(src, non_blocking=True)


class Transfer:
    """One expert moving into one slot; ``done`` is set when the slot holds it (or it failed)."""

    __slots__ = ("key", "slot", "priority", "seq", "done", "error", "cancelled", "event", "ready", "nbytes")

    def __init__(self, key: Key, slot: int, priority: int, seq: int, nbytes: int) -> None:
        self.key, self.slot, self.priority, self.seq, self.nbytes = key, slot, priority, seq, nbytes
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.cancelled = False
        self.event = None  # CUDA: recorded on the transfer stream when the copy is issued
        self.ready = None  # CUDA: recorded on the compute stream at submit (the slot's last reader)

    def __lt__(self, other: Transfer) -> bool:
        return (self.priority, self.seq) < (other.priority, other.seq)


class TransferWorker:
    """A thread that performs queued transfers in priority order, one at a time (the link is serial)."""

    def __init__(self, tier, pool: SlotPool, link: EmulatedLink | None = None) -> None:
        self.tier, self.pool, self.link = tier, pool, link
        self.cuda = pool.device.type == "cuda"
        self.stream = torch.cuda.Stream(pool.device) if self.cuda else None
        self._heap: list[Transfer] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self.busy_s = 0.0  # time the link was occupied
        self._thread = threading.Thread(target=self._run, name="expertcache-transfer", daemon=True)
        self._thread.start()

    def submit(self, key: Key, slot: int, priority: int = DEMAND) -> Transfer:
        t = Transfer(key, slot, priority, next(self._seq), self.pool.layout.nbytes)
        if self.cuda:  # kernels already queued may still read the slot's previous expert
            t.ready = torch.cuda.Event()
            t.ready.record(torch.cuda.current_stream(self.pool.device))
        with self._cv:
            if self._closed:
                raise ExpertcacheError("the transfer worker is closed")
            heapq.heappush(self._heap, t)
            self._cv.notify()
        return t

    def cancel(self, t: Transfer) -> bool:
        """Drop a queued transfer that has not started; True when it will not run."""
        with self._cv:
            if t.done.is_set() or t not in self._heap:
                return False
            t.cancelled = True
            return True

    def wait(self, t: Transfer) -> None:
        """Block until the transfer's slot is usable by the compute stream."""
        t.done.wait()
        if t.error is not None:
            raise ExpertcacheError(f"transfer of expert {t.key} failed: {t.error}") from t.error
        if t.cancelled:
            raise ExpertcacheError(f"transfer of expert {t.key} was cancelled")
        if t.event is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(t.event)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=10)

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
        while (t := self._next()) is not None:
            started = time.perf_counter()
            try:
                flat = self.pool.buffer[t.slot]
                if self.cuda:
                    with torch.cuda.stream(self.stream):
                        self.stream.wait_event(t.ready)
                        self.tier.copy_into(t.key, self.pool.views[t.slot], flat)
                        t.event = torch.cuda.Event()
                        t.event.record(self.stream)
                    t.event.synchronize()
                else:
                    self.tier.copy_into(t.key, self.pool.views[t.slot], flat)
                if self.link is not None:
                    self.link.finish(started, t.nbytes)
            except BaseException as exc:  # reported to the waiter, never lost in the thread
                t.error = exc
            self.busy_s += time.perf_counter() - started
            t.done.set()
