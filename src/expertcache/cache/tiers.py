"""The host level of a tier stack: device slots <- a host cache <- the checkpoint on disk.

Without it the expert cache (``cache.expert_cache``) has one slow tier below it: every expert in host
memory, or the checkpoint on disk. With it the slow tier is itself a bounded cache of experts in host
memory (pinned on a GPU) over the checkpoint on disk, MoE-Infinity's three tiers: a model larger than
host memory runs on a GPU, and a CPU keeps a second, larger cache of experts in RAM below its slots.

- **Requests.** Every transfer of a whole expert into the device's cache (part ``full``: a demand miss,
  a prefetch, a host-computed expert filled in the background) is one request of the host level, made
  when the transfer is submitted, in submission order: the engine and the simulator submit the same
  transfers in the same order, so the host level sees the same requests in both.
- **Decisions** are a library policy's, on (layer, expert) keys, as the device's: ``HostLevel`` is a
  ``Residency`` of its own with its own capacity. A victim is never pinned: pinned are the keys of the
  layer being served and those with a device transfer in flight (their host slots may be being read).
  When every key is pinned the expert bypasses the host level (read from the disk straight through).
- **Inclusive** (default): a host hit stays in the host level; a host miss enters it, in its victim's
  place, and its transfer first reads it from the disk into that slot, then moves it over the link.
  **Exclusive**: a hit leaves the host level (it lives on the device now), a miss does not enter it,
  and the device's victim comes down into the host level instead (``demoted``; one the level has no
  evictable room for is gone from both memories, ``dropped``). Exclusive holds more distinct experts in
  the two memories; inclusive never moves an expert back down. An exclusive hit's host slot is still
  read by its device transfer after the key has left: the engine keeps ``exclusive_reserve`` slots
  beyond the level's capacity for them (the budget holds both). A hit whose transfer is dropped before
  it lands (a prefetch the router did not choose) comes back into the level, in the slot it never left
  (``host_back``; ``returned``), rather than be lost to both memories.
- **What moves** is the transport's: ``TieredTransport`` tells it each change of the host level
  (``host_moved(entered, left, read)``) before it submits the device transfer; the transport reads from the
  disk a key that entered and has not been read yet (the engine's ``StackTier``, the simulator's
  ``VirtualLink`` with a read time). A key whose transfer was dropped before it read anything stays in
  the host level unread, and its next transfer reads it.
- **Staging** (``stage`` experts per predicted layer, default 0): predicted experts beyond what the
  device's prefetch takes (its limit), and those it had no room for, enter the host level early and are
  read from the disk in the background (``TieredTransport.stage``), so that if the router then chooses
  them their device transfer only crosses the link. A staged key's read pins it in the host level until
  it is done.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from expertcache.cache.residency import Residency
from expertcache.cache.transfers import PENDING
from expertcache.errors import NoVictim
from expertcache.miss.base import FULL
from expertcache.policy.base import Key, Policy

HOST_LEVEL_UNUSED = "every expert fits the expert memory: the host level is not used"  # the note


def exclusive_reserve(top_k: int) -> int:
    """Host slots an exclusive level keeps beyond its capacity, out of the same memory: an exclusive hit
    leaves the level at once, but its host slot is read until its device transfer lands, while the
    device's victim comes down into a slot of its own (a layer's top-k hits in flight at once, and no
    fewer than one). The engine waits for a landing when more are in flight (``host_slot_waits``)."""
    return max(1, int(top_k))


def level_experts(memory_experts: int, exclusive: bool, top_k: int) -> int:
    """The capacity of a host level in ``memory_experts`` experts' memory: all of them, less the
    reserve of an exclusive one (``exclusive_reserve``)."""
    return memory_experts - exclusive_reserve(top_k) if exclusive else memory_experts


class LevelStats:
    """The host level's counts, per phase and layer ([2, L], row 1 = prefill): ``requests`` (device
    transfers of whole experts), ``misses`` (not in the host level: read from the disk); and in total
    ``evicted``, ``bypassed`` (no evictable key: read straight through), ``demoted`` (exclusive: device
    victims taken in), ``dropped`` (exclusive: device victims with no evictable key to make room: in
    neither memory now), ``returned`` (exclusive: hits whose transfer was dropped, back in the level),
    ``staged`` (predicted experts taken in early, to be read in the background)."""

    def __init__(self, num_layers: int) -> None:
        self.requests = np.zeros((2, num_layers), dtype=np.int64)
        self.misses = np.zeros((2, num_layers), dtype=np.int64)
        self.evicted = self.bypassed = self.demoted = self.dropped = self.returned = self.staged = 0

    def to_dict(self) -> dict[str, object]:
        req, miss = int(self.requests.sum()), int(self.misses.sum())
        return {
            "host_requests": req,
            "host_hits": req - miss,
            "host_misses": miss,
            "host_miss_ratio": miss / req if req else 0.0,
            "host_misses_by_layer": self.misses.sum(axis=0).tolist(),
            "host_decode_misses": int(self.misses[0].sum()),
            "host_prefill_misses": int(self.misses[1].sum()),
            "host_evicted": self.evicted,
            "host_bypassed": self.bypassed,
            "host_demoted": self.demoted,
            "host_dropped": self.dropped,
            "host_returned": self.returned,
            "host_staged": self.staged,
        }


class HostLevel:
    """The host cache's keys under a policy: ``request`` for each device transfer, ``demote`` for each
    device victim (exclusive only). Counts in ``stats``."""

    def __init__(self, policy: Policy, num_layers: int, exclusive: bool = False, stage: int = 0) -> None:
        self.residency = Residency(policy)
        self.policy, self.exclusive, self.stage_limit = policy, bool(exclusive), int(stage)
        self.stats = LevelStats(num_layers)

    def __contains__(self, key: object) -> bool:
        return key in self.residency

    def __len__(self) -> int:
        return len(self.residency)

    def request(self, key: Key, pinned: Collection[Key], phase: int) -> tuple[bool, list[tuple]]:
        """A device transfer of ``key``: (host hit, the host level's changes as ``(entered, left,
        read)``: ``entered`` (or None) is to be read from the disk when ``read``, else it came down from
        the device; ``left`` (or None) left the host level)."""
        stats, res = self.stats, self.residency
        stats.requests[phase, key[0]] += 1
        if key in res:
            self.policy.on_hit(key)
            if self.exclusive:
                res.remove(key)
                return True, [(None, key, False)]
            return True, []
        stats.misses[phase, key[0]] += 1
        if self.exclusive:
            return False, []
        return False, [self._insert(key, pinned, True)]

    def demote(self, key: Key, pinned: Collection[Key]) -> list[tuple]:
        """Exclusive: the device evicted ``key``; it comes down into the host level."""
        if not self.exclusive or key in self.residency:
            return []
        change = self._insert(key, pinned, False, counted=False)
        if change[0] is None:
            self.stats.dropped += 1
            return []
        self.stats.demoted += 1
        return [change]

    def back(self, key: Key, pinned: Collection[Key]) -> tuple | None:
        """Exclusive: the transfer of hit ``key`` was dropped before it landed; it comes back, its bytes
        still in host memory: ``(key, left)``, or None where nothing may make room (then it is lost)."""
        if not self.exclusive or key in self.residency:
            return None
        change = self._insert(key, pinned, False, counted=False)
        if change[0] is None:
            self.stats.dropped += 1
            return None
        self.stats.returned += 1
        return change[:2]

    def stage(self, key: Key, pinned: Collection[Key]) -> tuple | None:
        """A predicted expert enters early, to be read in the background: its change, or None (held
        already, or nothing evictable)."""
        if key in self.residency:
            return None
        change = self._insert(key, pinned, True, counted=False)
        if change[0] is None:
            return None
        self.stats.staged += 1
        return change

    def _insert(self, key: Key, pinned: Collection[Key], read: bool, counted: bool = True) -> tuple:
        """``key`` in, its victim out: ``(key, victim, read)``; ``(None, None, read)`` where every key is
        pinned (``counted``: a request's miss, read straight through: ``bypassed``)."""
        try:
            victim = self.residency.insert(key, pinned)
        except NoVictim:  # every key pinned: read straight through (any other choice is the policy's fault)
            if counted:
                self.stats.bypassed += 1
            return (None, None, read)
        if victim is not None:
            self.stats.evicted += 1
        return (key, victim, read)


class _LevelPins:
    """Keys of the host level that may not be evicted: the layer being served, those with a device
    transfer in flight (their host slots may be being read) and those being staged (being written)."""

    __slots__ = ("cache", "transport")

    def __init__(self, cache, transport: TieredTransport) -> None:
        self.cache, self.transport = cache, transport

    def __contains__(self, key: object) -> bool:
        if key in self.cache._current or (FULL, key) in self.cache.inflight:
            return True
        staging = self.transport.staging
        if not staging or key not in staging:
            return False
        if self.transport.inner.poll(staging[key]) == PENDING:
            return True
        del staging[key]  # read: no longer pinned
        return False


class TieredTransport:
    """A ``Transport`` with a host level between it and the disk: each whole-expert transfer is first a
    request of the host level, whose changes the inner transport hears (``host_moved``) before the
    transfer is submitted to it. Everything else is the inner transport's."""

    def __init__(self, inner, level: HostLevel, phase: Callable[[], int] = lambda: 0) -> None:
        self.inner, self.level, self.phase = inner, level, phase
        self.pins: Collection[Key] = ()  # set by ``bind``: the cache's pins
        self.stage_limit = level.stage_limit  # predicted experts a layer staged beyond the device's limit
        self.staging: dict[Key, object] = {}  # staged keys -> their reads' handles (pinned while pending)
        self._up: dict[int, Key] = {}  # exclusive: id of a hit's transfer in flight -> its key

    def bind(self, cache) -> None:
        """The expert cache whose layer and transfers in flight pin keys, and whose phase counts."""
        self.pins = _LevelPins(cache, self)
        self.phase = lambda: cache.phase

    def stage(self, keys: Collection[Key]) -> int:
        """Predicted experts the device does not take now: into the host level, read in the background
        (``inner.stage``). Returns how many were staged."""
        level, inner, staged = self.level, self.inner, 0
        for key in keys:
            change = level.stage(key, self.pins)
            if change is None:
                continue
            inner.host_moved(*change)
            self.staging[key] = inner.stage(key)
            staged += 1
        return staged

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def submit(self, key: Key, victim: Key | None, priority: int, part: str = FULL) -> object:
        if part != FULL:
            return self.inner.submit(key, victim, priority, part)
        level, moved = self.level, self.inner.host_moved
        hit, changes = level.request(key, self.pins, self.phase())
        if victim is not None and level.exclusive:
            changes += level.demote(victim, self.pins)
        for entered, left, read in changes:
            if entered is not None or left is not None:
                moved(entered, left, read)
        handle = self.inner.submit(key, victim, priority, part)
        if hit and level.exclusive:
            self._up[id(handle)] = key
        return handle

    def cancel(self, handle: object) -> bool:
        """Drop a transfer; an exclusive hit's comes back into the host level (``HostLevel.back``)."""
        if not self.inner.cancel(handle):
            return False
        key = self._up.pop(id(handle), None)
        if key is not None:
            change = self.level.back(key, self.pins)
            if change is not None:
                self.inner.host_back(*change)
        return True

    def promote(self, handle: object) -> None:
        self.inner.promote(handle)

    def poll(self, handle: object) -> int:
        state = self.inner.poll(handle)
        if state != PENDING and self._up:
            self._up.pop(id(handle), None)
        return state

    def started(self, handle: object) -> bool:
        return self.inner.started(handle)

    def wait(self, handle: object) -> None:
        try:
            self.inner.wait(handle)
        finally:
            if self._up:
                self._up.pop(id(handle), None)

    def release(self, key: Key, part: str = FULL) -> None:
        self.inner.release(key, part)
