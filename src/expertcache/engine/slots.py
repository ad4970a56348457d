"""The engine's transport: the shared expert cache's decisions, bound to slots and the transfer worker.

``cache.expert_cache.ExpertCache`` decides hits, misses, victims, prefetches, preemption, routes and the
order units are computed in; this class gives each admitted key a slot of its part (its victim's, or a
free one), hands the copy to the transfer worker, and measures the time compute waits for transfers.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from expertcache.cache.transfers import FAILED, PENDING, READY, SPECULATIVE
from expertcache.engine.transfer import STAGE_PART, Target, Transfer, TransferWorker
from expertcache.miss.base import FULL
from expertcache.policy.base import Key

PoolId = tuple[str, int | None]  # (part, layer) for a part whose slots differ by layer, else (part, None)


class SlotTable:
    """(layer, expert) -> slot of one pool, ``sentinel`` (the pool's size) where the expert has none: what
    the grouped kernel maps a layer's routing through. ``host`` [L, E] is kept by the transport as it
    gives and takes slots; ``on(device)`` is the table on the compute device (on a CPU the same memory;
    on a GPU a copy made again only after a change)."""

    def __init__(self, num_layers: int, num_experts: int, num_slots: int) -> None:
        self.sentinel = num_slots
        self.host = np.full((num_layers, num_experts), num_slots, dtype=np.int64)
        self._cpu = torch.from_numpy(self.host)
        self._device: torch.Tensor | None = None
        self._stale = True

    def set(self, key: Key, slot: int) -> None:
        self.host[key] = slot
        self._stale = True

    def clear(self, key: Key) -> None:
        self.host[key] = self.sentinel
        self._stale = True

    def on(self, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self._cpu
        if self._stale or self._device is None:
            self._device = self._cpu.to(device)  # [L, E]: a few kilobytes, copied once per change
            self._stale = False
        return self._device


class SlotTransport:
    """Slots of every cache part, filled by one transfer worker (``cache.transfers.Transport``)."""

    def __init__(
        self,
        targets: dict[PoolId, Target],
        worker: TransferWorker,
        settle: bool = False,
        tables: dict[PoolId, SlotTable] | None = None,
        stage_worker: TransferWorker | None = None,
    ) -> None:
        self.targets, self.worker = targets, worker
        self.stage_worker = stage_worker  # reads staged experts into the host level (``StackTier``)
        self.tables = tables or {}  # pools the grouped kernel computes from: their slot tables
        self._by_layer = any(layer is not None for _, layer in targets)  # some part's pools differ by layer
        self.slot_of: dict[tuple[str, Key], int] = {}
        self.free = {pid: list(range(len(t.pool)))[::-1] for pid, t in targets.items()}
        self.stall_s = 0.0
        self.stall_by_phase = [0.0, 0.0]  # [decode, prefill]
        self.phase = 0  # set by the engine at each step
        self.transfers = 0  # submitted
        self.settle = settle  # deterministic runs: a transfer lands before submit returns (see below)
        self._after: dict[Key, object] = {}  # a device victim copied down (CUDA): the event its slot's
        # next transfer waits for
        # slots whose last expert is being copied down (CUDA), with that copy's event, the oldest first: a
        # pool with a slot beyond its capacity (``Builder``: an exclusive host level on a GPU) lets a
        # transfer take one of these or a free one rather than wait for its victim's copy down
        self._spare: dict[PoolId, list[tuple[int, object]]] = {}

    def pool_id(self, part: str, key: Key) -> PoolId:
        return (part, key[0]) if self._by_layer and (part, key[0]) in self.targets else (part, None)

    def views(self, key: Key, part: str = FULL) -> dict[str, torch.Tensor]:
        """The tensors of a resident key's slot (asked for every expert computed)."""
        return self.targets[self.pool_id(part, key)].views(key, self.slot_of[(part, key)])

    @property
    def bytes_moved(self) -> int:
        return self.worker.bytes_moved

    @property
    def busy_s(self) -> float:
        return self.worker.busy_s

    @property
    def active_s(self) -> float:
        return self.worker.active_s

    # -- Transport -------------------------------------------------------------------------------
    def submit(self, key: Key, victim: Key | None, priority: int, part: str = FULL) -> Transfer:
        pid = self.pool_id(part, key)  # a victim of a per-layer part is of the same layer: the same pool
        after = self._after.pop(victim, None) if self._after and victim is not None else None
        if victim is None:
            slot, after = self._take(pid)
        else:
            slot = self.slot_of.pop((part, victim))
            if after is not None and (self.free[pid] or self._spare.get(pid)):
                # the victim's slot is being copied down: the transfer takes a spare slot (a free one, or
                # the one whose copy down began first) and the victim's becomes a spare at once, the next
                # transfer into it waiting for its copy; the copy down and this transfer cross the link at
                # once, one each way, rather than one after the other
                self._spare.setdefault(pid, []).append((slot, after))
                slot, after = self._take(pid)
        self.slot_of[(part, key)] = slot
        table = self.tables.get(pid) if self.tables else None
        if table is not None:
            if victim is not None:
                table.clear(victim)
            table.set(key, slot)
        self.transfers += 1
        handle = self.worker.submit(key, slot, priority, pid, after=after)
        if self.settle:  # nothing in flight at the cache's next decision: no victim or cancel depends on time
            try:
                self.wait(handle)
            except Exception:  # noqa: BLE001 (kept in the handle: poll says FAILED, wait raises it again)
                pass
        return handle

    def _take(self, pid: PoolId) -> tuple[int, object | None]:
        """A slot of pool ``pid`` for a transfer, with the event it waits for: a free one (none), else the
        spare whose copy down began first (its event)."""
        if self.free[pid]:
            return self.free[pid].pop(), None
        return self._spare[pid].pop(0)

    def cancel(self, handle: Transfer) -> bool:
        return False if self.settle else self.worker.cancel(handle)

    def promote(self, handle: Transfer) -> None:
        self.worker.promote(handle)

    def poll(self, handle: Transfer) -> int:
        if not handle.done.is_set():
            return PENDING
        return FAILED if handle.error is not None or handle.cancelled else READY

    def started(self, handle: Transfer) -> bool:
        return self.settle or handle.started

    def wait(self, handle: Transfer) -> None:
        start = time.perf_counter()
        try:
            self.worker.wait(handle)
        finally:
            waited = time.perf_counter() - start
            self.stall_s += waited
            self.stall_by_phase[self.phase] += waited

    def stage(self, key: Key) -> Transfer:
        """Read a staged key from the disk into its host slot in the background (``cache.tiers``), on a
        thread of its own: the disk reads while the link moves other experts (MoE-Infinity's pipeline)."""
        slot = self.targets[(FULL, None)].source.slot_of[key]
        handle = self.stage_worker.submit(key, slot, SPECULATIVE, STAGE_PART)
        if self.settle:  # deterministic: read before the next decision, whose pins it would change (stall,
            start = time.perf_counter()  # as the timing model's settled link counts it)
            try:
                self.stage_worker.wait(handle)
            except Exception:  # noqa: BLE001 (kept in the handle: its read failed, the next transfer reads)
                pass
            waited = time.perf_counter() - start
            self.stall_s += waited
            self.stall_by_phase[self.phase] += waited
        return handle

    def host_moved(self, entered: Key | None, left: Key | None, read: bool = True) -> None:
        """A change of the host level (``cache.tiers``): the whole experts' source's (``StackTier``). A
        device victim coming down (exclusive: ``entered`` not ``read``) is copied from its slot, which it
        still holds: the transfer that takes the slot is submitted after this."""
        target = self.targets[(FULL, None)]
        device = None
        if entered is not None and not read:
            slot = self.slot_of[(FULL, entered)]
            device = (target.views(entered, slot), target.flat(slot))
        after = target.source.host_moved(entered, left, read, device)
        if after is not None:
            self._after[entered] = after

    def host_back(self, key: Key, left: Key | None) -> None:
        """An exclusive hit whose transfer was dropped is the host level's again (``cache.tiers``)."""
        self.targets[(FULL, None)].source.host_back(key, left)

    def release(self, key: Key, part: str = FULL) -> None:
        pid = self.pool_id(part, key)
        self.free[pid].append(self.slot_of.pop((part, key)))
        table = self.tables.get(pid) if self.tables else None
        if table is not None:
            table.clear(key)
