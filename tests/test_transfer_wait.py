"""Waiting for a transfer blocks: the compute thread sleeps on the worker's condition until the slot is
filled, rather than polling it (a disk read takes milliseconds, and a poll burns a processor the read's
copy and the rest of the machine need). Behaviour, not time: the waiting thread's calls on the
condition are counted while a read is held in flight."""

from __future__ import annotations

import threading
import time

import torch

from expertcache.engine.memory import SlotLayout, SlotPool
from expertcache.engine.transfer import DEMAND, TransferWorker


class _HeldRead:
    """A tier that reads a device (the disk tier's kind: its demand transfers go to the worker at once)
    and holds every copy until ``release`` is set."""

    concurrent = True
    reads_device = True

    def __init__(self) -> None:
        self.release = threading.Event()
        self.reading = threading.Event()

    def copy_chunk(self, key, views, chunk, flat=None) -> None:
        self.reading.set()
        assert self.release.wait(30)
        for name, start, stop, _ in chunk:
            views[name][start:stop].fill_(key[1])


class _CountingCondition(threading.Condition):
    """The worker's completion condition, recording each ``wait`` of the test's thread (its timeout)."""

    def __init__(self, thread: int) -> None:
        super().__init__(threading.Lock())
        self.thread, self.waits, self.waiting = thread, [], threading.Event()

    def wait(self, timeout=None):
        if threading.get_ident() == self.thread:
            self.waits.append(timeout)
            self.waiting.set()
        return super().wait(timeout)


def test_the_waiting_thread_blocks_on_the_condition_rather_than_polling():
    tier = _HeldRead()
    pool = SlotPool(SlotLayout.of({"w": (4, 4)}, torch.float32), 4, torch.device("cpu"))
    worker = TransferWorker(tier, pool)
    cv = worker._finished = _CountingCondition(threading.get_ident())

    def read_later() -> None:  # the read lands a while after the compute thread began to wait
        assert cv.waiting.wait(30)
        time.sleep(0.2)
        tier.release.set()

    releaser = threading.Thread(target=read_later, daemon=True)
    try:
        t = worker.submit((0, 3), 1, DEMAND)
        assert tier.reading.wait(30)  # the worker took it: the waiter has nothing to copy itself
        releaser.start()
        worker.wait(t)
        assert (pool.buffer[1] == 3).all() and worker.stolen == 0
        # one wait without a timeout: woken once, by the worker's notify; a poll would wake again and
        # again through the 0.2 s the read was held (or wait with a timeout)
        assert cv.waits == [None]
    finally:
        tier.release.set()
        releaser.join(5)
        worker.close()
