"""Three tiers (``cache.tiers``): device slots <- a host level <- the checkpoint on disk.

The host level's decisions on hand-worked requests (inclusive and exclusive, pins, bypass), the virtual
link's disk reads, the engine bit-exact against transformers with a host level on every family, the
engine's per-level counts replayed exactly by the timing model, and the options' errors."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import threading
import time

import engine_fixtures
import pytest
import torch
from cli_fixtures import exit_code
from engine_fixtures import PATH_FAMILIES, TOP_K, assert_exact, engine_load, greedy, total_experts
from trace_fixtures import prefix, prefix_file

from expertcache.cache.tiers import HostLevel, exclusive_reserve
from expertcache.config import HostConfig
from expertcache.errors import ExpertcacheError
from expertcache.policy.base import Clock, PolicyContext
from expertcache.policy.registry import make_policy
from expertcache.sim.timing import simulate_timing
from expertcache.sim.vlink import FULL, VirtualLink

IDS = torch.tensor([engine_fixtures.PROMPT])
_one_torch_thread = engine_fixtures._one_torch_thread
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
tokenizer_dir = engine_fixtures.tokenizer_dir
reference = engine_fixtures.reference


def _level(capacity: int, exclusive: bool = False, policy: str = "lru") -> HostLevel:
    ctx = PolicyContext(capacity=capacity, num_layers=2, num_experts=8, top_k=1, clock=Clock())
    return HostLevel(make_policy(policy, ctx), num_layers=2, exclusive=exclusive)


# ------------------------------------------------------------------------------- the host level
def test_an_inclusive_level_keeps_hits_and_takes_misses_in_their_victims_place():
    level = _level(2)
    assert level.request((0, 1), (), 0) == (False, [((0, 1), None, True)])  # read from the disk
    assert level.request((0, 2), (), 0) == (False, [((0, 2), None, True)])
    assert level.request((0, 1), (), 0) == (True, [])  # a hit stays; LRU: (0, 2) is now the oldest
    assert level.request((1, 3), (), 1) == (False, [((1, 3), (0, 2), True)])
    assert (0, 1) in level and (0, 2) not in level and len(level) == 2
    s = level.stats.to_dict()
    assert (s["host_requests"], s["host_hits"], s["host_misses"], s["host_evicted"]) == (4, 1, 3, 1)
    assert s["host_decode_misses"] == 2 and s["host_prefill_misses"] == 1
    assert s["host_misses_by_layer"] == [2, 1]


def test_pinned_keys_stay_and_a_level_with_every_key_pinned_is_bypassed():
    level = _level(2)
    level.request((0, 1), (), 0)
    level.request((0, 2), (), 0)
    # (0, 1) is the LRU victim, but a transfer of it is in flight: (0, 2) goes instead
    assert level.request((0, 3), {(0, 1)}, 0) == (False, [((0, 3), (0, 2), True)])
    hit, changes = level.request((0, 4), {(0, 1), (0, 3)}, 0)  # nothing may go: read straight through
    assert not hit and changes == [(None, None, True)] and (0, 4) not in level
    assert level.stats.bypassed == 1 and level.stats.misses.sum() == 4


def test_an_exclusive_level_gives_hits_up_and_takes_the_device_s_victims():
    level = _level(2, exclusive=True)
    assert level.request((0, 1), (), 0) == (False, [])  # a miss goes to the device only
    assert (0, 1) not in level
    assert level.demote((0, 1), ()) == [((0, 1), None, False)]  # the device let it go: it comes down
    assert level.request((0, 1), (), 0) == (True, [(None, (0, 1), False)])  # and goes up again
    assert (0, 1) not in level and level.stats.demoted == 1
    assert _level(2).demote((0, 1), ()) == []  # an inclusive level takes nothing from the device


def test_host_config_refuses_what_the_host_level_cannot_serve():
    assert HostConfig("1GiB").bytes_of(10 << 30) == 1 << 30 and HostConfig("25%").bytes_of(400) == 100
    assert HostConfig("8GiB").bytes_of(1 << 30) == 1 << 30  # capped at all experts
    assert HostConfig("8GiB").exceeds(1 << 30) and not HostConfig("1GiB").exceeds(1 << 30)
    assert not HostConfig("60%").exceeds(1 << 30) and not HostConfig("100%").exceeds(1 << 30)  # a share never
    assert not HostConfig().enabled and HostConfig("1GiB", "lfu").name == "lfu"
    assert HostConfig("1GiB", " lru ").policy == "lru"  # as shown and recorded, not " lru "
    for bad, match in [
        (dict(memory="1GiB", policy="tlfu"), "router's requests"),
        (dict(memory="1GiB", policy="opt"), "needs the future"),
        (dict(memory="150%"), r"share in \(0%, 100%\]"),
        (dict(memory="lots"), "host memory"),
        (dict(memory="1GiB", policy="nope"), "nope"),
    ]:
        with pytest.raises(ExpertcacheError, match=match):
            HostConfig(**bad)


# ------------------------------------------------------------------------------- the timing model
def test_the_virtual_link_reads_from_the_disk_what_the_host_level_does_not_hold_read():
    link = VirtualLink([1.0], read_s=10.0)
    link.host_moved((0, 1), None)  # entered, unread
    first = link.submit((0, 1), None, 0)
    link.wait(first)
    assert link.now == 11.0 and link.disk_reads == 1  # the read, then the link
    again = link.submit((0, 1), None, 0)  # held and read: the link only
    link.wait(again)
    assert link.now == 12.0 and link.disk_reads == 1
    bypassed = link.submit((0, 2), None, 0)  # not in the host level: read straight through
    link.wait(bypassed)
    assert link.now == 23.0 and link.disk_reads == 2
    link.host_moved((0, 3), None)
    link.submit((0, 4), None, 0)  # on the link now ...
    dropped = link.submit((0, 3), None, 1)
    assert link.cancel(dropped)  # ... and the prefetch behind it is dropped before it read anything
    link.advance(100.0)
    assert link.unread == {(0, 3)}  # its next transfer reads it
    link.host_moved(None, (0, 3))
    assert not link.unread and (0, 3) not in link.host_keys


def test_the_virtual_link_reads_a_chunked_prefetch_chunk_by_chunk_and_a_demand_goes_between():
    """As the engine's worker: each chunk of a prefetch reads its share of the expert (by bytes) before
    crossing the link, so a demand transfer waits for one chunk's read and copy, not the whole read; a
    prefetch dropped after one chunk leaves its expert unread, one disk read counted for the key."""
    from expertcache.cache.transfers import DEMAND, SPECULATIVE

    link = VirtualLink([1.0] * 4, [100] * 4, read_s=8.0, whole={FULL: ([4.0], [400])})
    for key in ((0, 1), (0, 2), (0, 3)):
        link.host_moved(key, None)
    prefetch = link.submit((0, 1), None, SPECULATIVE)
    link.advance(1.0)  # the prefetch's first chunk (2 s of reading, 1 s of link) is under way
    demand = link.submit((0, 2), None, DEMAND)
    link.wait(demand)
    assert link.now == 3.0 + 12.0  # after that one chunk: the demand's whole read (8 s) and copy (4 s)
    link.wait(prefetch)
    assert link.now == 15.0 + 3 * 3.0 and link.disk_reads == 2 and link.unread == {(0, 3)}
    dropped = link.submit((0, 3), None, SPECULATIVE)
    link.advance(1.0)  # its first chunk is under way; a demand (read already: the link only) goes next
    link.submit((0, 1), None, DEMAND)
    link.advance(3.0)  # the demand is on the link: the prefetch's three other chunks are dropped
    assert dropped.moved == 1 and link.cancel(dropped)
    link.advance(10.0)
    assert (0, 3) in link.unread and link.disk_reads == 3  # begun, not read: one read counted
    link.wait(link.submit((0, 3), None, DEMAND))
    assert link.disk_reads == 3 and not link.unread  # read again, whole, as the same read


def test_timing_counts_levels_and_exclusive_holds_more_distinct_experts():
    from expertcache.trace.default import default_trace

    tr = default_trace()
    inclusive = simulate_timing(tr, 24, host=HostConfig(None), host_capacity=60)
    exclusive = simulate_timing(tr, 24, host=HostConfig(None, exclusive=True), host_capacity=60)
    for r in (inclusive, exclusive):
        c = r.cache
        assert c["host_requests"] == r.misses and c["host_hits"] + c["host_misses"] == c["host_requests"]
        assert c["disk_reads"] == c["host_misses"] and c["host_capacity"] == 60
    assert exclusive.cache["host_misses"] < inclusive.cache["host_misses"]
    assert exclusive.cache["host_demoted"] > 0 and inclusive.cache["host_demoted"] == 0
    from expertcache.costs import CostModel

    copying = simulate_timing(
        tr, 24, cost=CostModel(demote_s=1e-3), host=HostConfig(None, exclusive=True), host_capacity=60
    )  # each copy down is the compute thread's (a CPU's): a millisecond each, on the clock (while
    # transfers submitted before it move: a layer's first misses are on the link as its later ones come down)
    demoted = exclusive.cache["host_demoted"]
    assert exclusive.total_s + 0.5e-3 * demoted < copying.total_s <= exclusive.total_s + 1e-3 * demoted + 1e-9
    assert copying.cache["host_misses"] == exclusive.cache["host_misses"]
    none = simulate_timing(tr, 24)
    assert "host_requests" not in none.cache and none.misses == inclusive.misses  # the device's unchanged


def test_timing_caps_a_cache_beyond_every_expert_and_then_uses_no_host_level_as_the_engine():
    from expertcache.sim.planner import make_plan
    from expertcache.trace.default import default_trace

    tr = default_trace()
    total = tr.num_layers * tr.num_experts
    big = simulate_timing(tr, 5000)
    assert big.capacity == total and f"a cache of 5000 experts is more than all {total}" in big.notes[0]
    assert big.misses == simulate_timing(tr, total).misses
    # every expert in the expert memory: the engine leaves the host level out ("not used"), so must these
    r = simulate_timing(tr, total, host=HostConfig(None), host_capacity=60)
    assert "host_requests" not in r.cache and "the host level is not used" in r.notes[-1]
    plan = make_plan(tr, total, host=HostConfig(None), host_capacity=60)
    assert plan.host_policy is None and plan.host_capacity is None
    assert any("so it is not used" in s for s in plan.source["skipped"])


def test_a_host_policy_s_parameters_are_kept_in_every_report(ckpt):
    from expertcache.trace.default import default_trace

    spec = "lcp:rho=0.05,omega=1000"
    r = simulate_timing(default_trace(), 24, host=HostConfig(None, spec), host_capacity=60)
    assert r.cache["host_policy"] == spec
    with engine_load(ckpt("mixtral"), TOP_K + 1, host_memory="50%", host_policy=spec) as model:
        greedy(model, IDS)
        assert model.stats["host_policy"] == spec


# ------------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("family", PATH_FAMILIES)
def test_the_engine_with_a_host_level_is_exact_and_replays_to_the_same_counts(family, ckpt, reference):
    path = ckpt(family)
    want = reference(path, IDS)
    total = total_experts(family)
    device, host = TOP_K + 1, max(TOP_K + 2, total // 2)
    with engine_load(path, device, host_memory=f"{100 * host / total}%", deterministic=True) as model:
        assert_exact(greedy(model, IDS), want)
        stats, trace = model.stats, model.trace()
    assert stats["slow_tier"] == "stack" and stats["host_capacity"] == host
    assert stats["host_requests"] == stats["misses"] > 0
    assert 0 < stats["host_misses"] < stats["host_requests"]  # the host level served some
    assert stats["disk_reads"] == stats["host_misses"]  # nothing bypassed, nothing dropped
    assert stats["host_memory_bytes"] == host * (stats["expert_memory_bytes"] // device)
    replay = simulate_timing(
        trace, trace.meta["capacity"], cache=trace.meta["policy"],
        capacities=json.loads(trace.meta["capacities"]), host=HostConfig(None, trace.meta["host_policy"]),
        host_capacity=trace.meta["host_capacity"],
    )  # fmt: skip
    for key in ("misses", "host_requests", "host_misses", "host_evicted", "host_misses_by_layer"):
        assert replay.cache[key] == stats[key], key


@pytest.mark.parametrize("family", PATH_FAMILIES)
def test_an_exclusive_host_level_is_exact_and_replays_to_the_same_counts(family, ckpt, reference):
    path = ckpt(family)
    want = reference(path, IDS)
    total = total_experts(family)
    device, memory = TOP_K + 1, max(TOP_K + 3, total // 2)  # experts the host memory holds
    reserve = exclusive_reserve(TOP_K)
    with engine_load(
        path, device, host_memory=f"{100 * memory / total}%", host_exclusive=True, deterministic=True
    ) as model:
        assert_exact(greedy(model, IDS), want)
        stats, trace = model.stats, model.trace()
    assert stats["host_exclusive"] and stats["host_capacity"] == memory - reserve
    assert stats["host_reserve"] == reserve  # the memory holds the level and the hits in flight
    slots = device + stats["device_spare_slots"]  # on a GPU one beyond the expert memory
    assert stats["host_memory_bytes"] == memory * (stats["expert_memory_bytes"] // slots)
    assert stats["host_requests"] == stats["misses"] > 0
    assert 0 < stats["host_misses"] < stats["host_requests"]  # hits: experts the device let go came back
    assert stats["host_demoted"] > 0  # every victim came down (none bypassed: nothing pinned for long)
    assert stats["disk_reads"] == stats["host_misses"]  # a miss is read straight through, a hit not at all
    assert stats["host_slot_waits"] == 0  # deterministic: each transfer lands before the next decision
    assert trace.meta["host_exclusive"] and trace.meta["host_capacity"] == memory - reserve
    replay = simulate_timing(
        trace, trace.meta["capacity"], cache=trace.meta["policy"],
        capacities=json.loads(trace.meta["capacities"]),
        host=HostConfig(None, trace.meta["host_policy"], exclusive=True),
        host_capacity=trace.meta["host_capacity"],
    )  # fmt: skip
    for key in ("misses", "host_requests", "host_misses", "host_evicted", "host_demoted",
                "host_misses_by_layer", "disk_reads"):  # fmt: skip
        assert replay.cache[key] == stats[key], key


def test_an_exclusive_level_holds_more_than_an_inclusive_one_in_the_same_memory(ckpt):
    path = ckpt("mixtral")
    total = total_experts("mixtral")
    got = {}
    for exclusive in (False, True):
        with engine_load(
            path, TOP_K + 2, host_memory=f"{100 * (total // 2) / total}%", host_exclusive=exclusive,
            deterministic=True,
        ) as model:  # fmt: skip
            greedy(model, IDS)
            got[exclusive] = model.stats
    assert got[True]["misses"] == got[False]["misses"]  # the device decides alone
    assert got[True]["host_misses"] < got[False]["host_misses"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_an_exclusive_level_with_prefetches_in_flight_over_a_slow_link_is_exact(family, make_ckpt, reference):
    # transfers in flight while later decisions take host slots: an exclusive hit's slot is read until
    # its transfer lands (decisions wait for one when the reserve is taken), a device victim's copy down
    # comes before the transfer into its slot, and a dropped prefetch of a hit comes back
    path = make_ckpt(family, experts=16, layers=4)
    with engine_load(
        path, 12, host_memory="50%", host_exclusive=True, prefetch="next-gate", link_bandwidth="5MB/s",
        link_latency="200us",
    ) as model:  # fmt: skip
        assert_exact(greedy(model, IDS), reference(path, IDS))
        stats = model.stats
    assert stats["host_exclusive"] and stats["host_requests"] >= stats["misses"] > 0
    assert stats["host_hits"] > 0 and stats["host_demoted"] > 0
    assert stats["host_slot_waits"] >= 0 and stats["host_slot_wait_s"] >= 0.0
    assert stats["disk_reads"] <= stats["host_misses"]  # one read a miss (less those dropped unread)
    # on a GPU one slot beyond the expert memory: a transfer need not wait for its victim's copy down
    assert stats["device_spare_slots"] == (1 if engine_fixtures.DEVICE == "cuda" else 0)


def test_an_exclusive_hit_s_slot_is_given_again_only_after_its_transfer_ended():
    from expertcache.engine.memory import SlotLayout
    from expertcache.engine.transfer import StackTier

    layout = SlotLayout.of({"w": (4,)}, torch.float32)
    tier = StackTier(_NoDisk(), layout, capacity=2, pin=False, reserve=1)
    device = {k: (layout.views(torch.full((layout.slot_numel,), float(k[1])))) for k in ((0, 5), (0, 6))}
    for key in ((0, 1), (0, 2)):  # the level holds two experts, read from the disk
        tier.host_moved(key, None, True)
    one = tier.slot_of[(0, 1)]
    tier.host_moved(None, (0, 1), False)  # an exclusive hit: it leaves, its slot still read
    tier.host_moved((0, 5), None, False, (device[(0, 5)], None))  # the device's victim takes the spare
    assert tier.pool.views[tier.slot_of[(0, 5)]]["w"].tolist() == [5.0] * 4  # copied down
    assert tier._slot((0, 1)) == one and one not in tier.slot_of.values()
    two = tier.slot_of[(0, 2)]
    tier.host_moved(None, (0, 2), False)  # another hit leaves: no free slot is left now
    ender = threading.Thread(target=tier.ended, args=((0, 1),))  # (0, 1)'s transfer lands meanwhile
    ender.start()
    tier.host_moved((0, 6), None, False, (device[(0, 6)], None))  # waits for it if need be
    ender.join()
    assert tier.slot_of[(0, 6)] == one and tier._slot((0, 2)) == two  # never the slot still being read
    assert tier.pool.views[one]["w"].tolist() == [6.0] * 4
    assert tier._slot((0, 1)) is None  # gone from both levels: its next transfer reads the disk
    tier.ended((0, 2))  # dropped before it landed: it comes back, in its slot, (0, 5) making room
    five = tier.slot_of[(0, 5)]
    tier.host_back((0, 2), (0, 5))
    assert tier.slot_of == {(0, 6): one, (0, 2): two} and tier.free == [five] and not tier._released


class _Submits:
    """A transfer worker that records each submit (key, slot, the event it waits for)."""

    def __init__(self) -> None:
        self.submits: list[tuple] = []

    def submit(self, key, slot, priority, part, after=None):
        self.submits.append((key, slot, after))
        return object()


def test_a_transfer_takes_the_spare_slot_while_its_victim_is_copied_down():
    """Under an exclusive host level on a GPU the whole experts' pool has a slot beyond its capacity: a
    transfer whose victim is being copied down takes the spare (free, or the one whose copy down began
    first) and waits for nothing newer; the victim's slot becomes the spare at once, the next transfer
    into it waiting for its copy. Without a spare, the transfer takes its victim's slot after the copy."""
    from types import SimpleNamespace

    from expertcache.engine.slots import SlotTable, SlotTransport

    for spare in (1, 0):
        capacity = 2
        target = SimpleNamespace(pool=[None] * (capacity + spare))
        worker, table = _Submits(), SlotTable(1, 8, capacity + spare)
        link = SlotTransport({(FULL, None): target}, worker, tables={(FULL, None): table})
        link.submit((0, 1), None, 0)
        link.submit((0, 2), None, 0)  # full: the spare, if any, is free
        one, two = link.slot_of[(FULL, (0, 1))], link.slot_of[(FULL, (0, 2))]
        link._after[(0, 1)] = "copy of (0, 1)"  # (0, 1) is the victim, coming down (``host_moved``)
        link.submit((0, 3), (0, 1), 0)
        if spare:
            three = link.slot_of[(FULL, (0, 3))]
            assert three not in (one, two) and worker.submits[-1] == ((0, 3), three, None)
            link._after[(0, 2)] = "copy of (0, 2)"
            link.submit((0, 4), (0, 2), 0)  # the spare now is (0, 1)'s old slot, its copy begun first
            assert worker.submits[-1] == ((0, 4), one, "copy of (0, 1)")
            assert link._spare[(FULL, None)] == [(two, "copy of (0, 2)")]
            link.submit((0, 5), (0, 3), 0)  # a victim not copied down: its own slot, nothing to wait for
            assert worker.submits[-1] == ((0, 5), three, None)
            assert table.host[0, 5] == three and table.host[0, 3] == table.sentinel
        else:
            assert worker.submits[-1] == ((0, 3), one, "copy of (0, 1)")
            assert not link._spare


def test_a_transfer_that_ends_unbegun_still_orders_its_slot_after_the_copy_down():
    """A transfer dropped or failed before its first chunk never waited for its slot's copy down; the slot
    is free for the next transfer then, so the copies wait for it as the transfer ends (on a GPU)."""
    from expertcache.engine.memory import SlotLayout, SlotPool
    from expertcache.engine.transfer import Transfer, TransferWorker

    class Stream:
        waited: list = []

        def wait_event(self, event):
            self.waited.append(event)

    pool = SlotPool(SlotLayout.of({"w": (4,)}, torch.float32), 2, torch.device("cpu"))
    worker = TransferWorker(_NoDisk(), pool)
    try:
        worker.cuda, worker.stream = True, Stream()  # as on a GPU: only the stream's waits are looked at
        t = Transfer((0, 1), 0, 0, 0)
        t.after = "copy down of slot 0"
        worker._ended(t)
        assert worker.stream.waited == ["copy down of slot 0"]
        worker._ended(Transfer((0, 2), 1, 0, 1))  # nothing copied down from its slot: nothing to wait for
        assert worker.stream.waited == ["copy down of slot 0"]
    finally:
        worker.cuda = False
        worker.close()


def test_the_spare_slot_is_a_gpu_s_exclusive_level_s_alone():
    from types import SimpleNamespace

    from expertcache.engine.builder import Builder
    from expertcache.engine.memory import SlotLayout

    def spare(device: str, exclusive: bool, host_capacity: int = 8) -> tuple[int, list[str]]:
        b = SimpleNamespace(
            host_capacity=host_capacity, device=torch.device(device), parts={FULL: None},
            capacities={FULL: 4}, capacity=4, notes=[], layout=SlotLayout.of({"w": (256,)}, torch.float32),
        )  # fmt: skip
        return Builder._spare_slots(b, HostConfig("50%", "lru", exclusive=exclusive)), b.notes

    assert spare("cuda", True)[0] == 1 and "spare" in spare("cuda", True)[1][0]
    assert (
        spare("cuda", False) == (0, [])
        and spare("cpu", True) == (0, [])
        and spare("cuda", True, 0) == (0, [])
    )


class _GatedDisk:
    """A disk tier that records each read (key, rows of each tensor) and fills the rows with the expert's
    number; the first read waits for ``gate`` (set ``started`` first)."""

    name, concurrent, reads_device = "disk", True, True

    def __init__(self) -> None:
        self.reads: list[tuple] = []
        self.gate, self.started = threading.Event(), threading.Event()
        self.fail: set = set()  # keys whose next read raises

    def copy_chunk(self, key, views, chunk, flat=None):
        if key in self.fail:
            self.fail.discard(key)
            raise OSError("the disk failed")
        self.reads.append((key, tuple((name, a, b) for name, a, b, _ in chunk)))
        if len(self.reads) == 1:
            self.started.set()
            assert self.gate.wait(30)
        for name, a, b, _ in chunk:
            views[name][a:b] = float(key[1])


def test_a_demand_transfer_preempts_a_prefetch_between_two_of_its_disk_reads():
    """A prefetch from the disk through the host level reads one chunk at a time, each before its copy: a
    demand transfer submitted during its first chunk's read goes next, and the prefetch's other chunks
    are read after it; a prefetch that fails after one chunk leaves its expert unread, and the next
    transfer of it reads only the rows still missing; a failed read is counted, and leaves its expert
    unread. Every slot holds its expert's bytes."""
    from expertcache.engine.memory import SlotLayout, SlotPool
    from expertcache.engine.transfer import DEMAND, SPECULATIVE, StackTier, TransferWorker

    layout = SlotLayout.of({"w": (64, 16)}, torch.float32)  # 4 KiB: four chunks of 1 KiB
    disk = _GatedDisk()
    tier = StackTier(disk, layout, capacity=3, pin=False)
    for key in ((0, 1), (0, 2), (0, 3)):
        tier.host_moved(key, None, True)
    pool = SlotPool(layout, 3, torch.device("cpu"))
    worker = TransferWorker(tier, pool, chunk_bytes=1024, steal=False)
    try:
        prefetch = worker.submit((0, 1), 0, SPECULATIVE)
        assert disk.started.wait(30)  # the worker is reading the prefetch's first chunk
        demand = worker.submit((0, 2), 1, DEMAND)
        disk.gate.set()
        worker.wait(demand)
        worker.wait(prefetch)
        assert disk.reads == [
            ((0, 1), (("w", 0, 16),)),
            ((0, 2), (("w", 0, 64),)),  # whole: a demand transfer is not chunked
            ((0, 1), (("w", 16, 32),)),
            ((0, 1), (("w", 32, 48),)),
            ((0, 1), (("w", 48, 64),)),
        ]
        assert pool.views[0]["w"].eq(1.0).all() and pool.views[1]["w"].eq(2.0).all()
        assert tier.disk_reads == 2 and tier.unread == {(0, 3)}

        disk.reads.clear()

        def fail_second_chunk(t, chunk, attempt):
            if chunk == 1:
                raise OSError("the link failed")

        worker.fault, worker.retries = fail_second_chunk, 0
        failed = worker.submit((0, 3), 2, SPECULATIVE)  # fails before its second chunk
        with pytest.raises(ExpertcacheError, match=r"transfer of expert \(0, 3\) failed: the link failed"):
            worker.wait(failed)
        worker.fault = None
        assert (0, 3) in tier.unread and disk.reads == [((0, 3), (("w", 0, 16),))]
        worker.wait(worker.submit((0, 3), 2, SPECULATIVE))  # its rows 0..16 are not read again
        assert disk.reads[1:] == [((0, 3), (("w", a, a + 16),)) for a in (16, 32, 48)]
        assert pool.views[2]["w"].eq(3.0).all() and tier.unread == set() and tier.disk_reads == 3

        tier.host_moved((0, 4), (0, 1), True)  # a staging read that fails leaves its expert unread
        disk.fail.add((0, 4))
        with pytest.raises(OSError, match="the disk failed"):
            tier.stager.copy_chunk((0, 4), None, tier.whole)
        assert tier.disk_read_errors == 1 and (0, 4) in tier.unread and tier.disk_reads == 3
        worker.wait(worker.submit((0, 4), 0, DEMAND))  # its transfer reads it: the first read counted
        assert pool.views[0]["w"].eq(4.0).all() and tier.disk_reads == 4 and not tier.unread
    finally:
        worker.close()


class _NoDisk:
    """A disk tier that is never read (the test moves experts down, not up)."""

    name = "disk"

    def copy_chunk(self, *args):
        raise AssertionError("read from the disk")


def test_a_host_level_under_another_policy_with_prefetching_is_exact(ckpt, reference):
    path = ckpt("mixtral")
    total = total_experts("mixtral")
    with engine_load(path, TOP_K + 1, host_memory="50%", host_policy="lfu", prefetch="next-gate") as model:
        assert_exact(greedy(model, IDS), reference(path, IDS))
        stats = model.stats
    assert stats["host_policy"] == "lfu" and stats["host_capacity"] == total // 2
    assert stats["host_requests"] >= stats["misses"]  # prefetches are requests too


def test_host_level_options_that_cannot_work_are_refused(ckpt):
    path = ckpt("mixtral")
    for kwargs, match in [
        (dict(slow_tier="host"), "slow tier host holds every expert"),
        (dict(miss="host"), "serves the fetch miss path"),
        (dict(host_policy="lru:nope=1"), "nope"),
    ]:
        with pytest.raises(ExpertcacheError, match=match):
            engine_load(path, TOP_K, host_memory="50%", **kwargs)
    with pytest.raises(ExpertcacheError, match="takes experts only from the device"):
        engine_load(path, TOP_K, host_memory="50%", host_exclusive=True, host_stage=1, prefetch="next-gate")
    slot = engine_fixtures._slot_bytes(path)
    # (it said the reserve was "beyond what it holds", where a memory one expert larger was said to hold
    # experts "beside its reserve": the reserve is in the memory)
    with pytest.raises(
        ExpertcacheError, match=rf"all of them the reserve .* give at least {2 * TOP_K} experts'"
    ):
        engine_load(path, TOP_K, host_memory=TOP_K * slot, host_exclusive=True)  # all of it the reserve
    with pytest.raises(ExpertcacheError, match="holds no expert of"):
        engine_load(path, TOP_K, host_memory="1B")
    with pytest.raises(
        ExpertcacheError, match=r"holds 1 expert\(s\); a host level under policy lru needs at least 2"
    ):
        engine_load(path, TOP_K, host_memory=engine_fixtures._slot_bytes(path) + 1)


def test_a_host_cache_the_machine_cannot_hold_is_refused_before_loading(ckpt, monkeypatch):
    from expertcache.engine import builder

    path = ckpt("mixtral")
    engine_fixtures._slot_bytes(path)  # measured by a load at 100 %, which the patched room would refuse
    slots = TOP_K * engine_fixtures._slot_bytes(path)
    monkeypatch.setattr(builder, "available_memory", lambda: (slots + 1, "its memory cgroup's room"))
    with engine_load(path, TOP_K, slow_tier="disk") as model:  # the slots alone fit (on a GPU: nothing)
        assert model.capacity == TOP_K
    what = "the expert slots and the host cache" if engine_fixtures.DEVICE == "cpu" else "the host cache"
    with pytest.raises(ExpertcacheError, match=rf"{what} \(host_memory\) need"):
        engine_load(path, TOP_K, host_memory="50%")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--prompt", "hi", "--host-policy", "lfu"], "--host-policy needs --host-memory"),
        (["generate", "--prompt", "hi", "--host-memory", "lots"], "host memory"),
        (["timing", "--host-exclusive"], "--host-exclusive needs --host-memory or --host-capacity"),
        (["timing", "--host-memory", "10%", "--host-capacity", "9"], "not both"),
        (["timing", "--host-capacity", "0"], "a whole number of experts, 1 or more"),
        (["timing", "--host-capacity", "2", "--host-exclusive"], "which leaves it none; give at least 4"),
        (["timing", "--host-capacity", "0", "--host-exclusive"], "a whole number of experts, 1 or more"),
        (["timing", "--host-capacity", "3", "--host-exclusive"], "which leaves it 1, fewer than the top-2"),
        (["timing", "--host-capacity", "50%"], "'50%' is not a whole number of experts (a share or a size"),
        (
            ["timing", "--host-memory", "30%", "--host-policy", "nosuch"],
            "unknown host policy 'nosuch'; a host",
        ),
        (["plan", "--capacity", "24", "--host-memory", "512MiB"], "a host level of 1 expert is too small"),
        (["plan", "--expert-memory", "20%", "--host-memory", "0"], "host memory 0 holds no expert"),
        (["doctor", "--expert-memory", "20%", "--host-memory", "0"], "host memory 0 holds no expert"),
        (["generate", "--prompt", "hi", "--host-stage", "2"], "--host-stage needs --host-memory"),
        (["generate", "--prompt", "hi", "--host-memory", "0"], "host memory 0 holds no expert of"),
        (  # 3 experts: 1 beside the reserve, which the message left unsaid
            [
                "generate",
                "--prompt",
                "hi",
                "--expert-memory",
                "20%",
                "--host-memory",
                "540KiB",
                "--host-exclusive",
            ],
            "holds 1 expert(s) beside its reserve of 2 for hits in flight; a host level under policy lru",
        ),
        (
            ["generate", "--prompt", "hi", "--host-memory", "50%", "--host-stage", "1", "--prefetch", "none"],
            "give a predictor",
        ),
        (["timing", "--capacity", "24", "--host-capacity", "60", "--host-stage", "1"], "give a predictor"),
        (
            ["timing", "--capacity", "24", "--host-capacity", "60", "--miss", "host"],
            "serves the fetch miss path",
        ),
        (["timing", "--capacity", "24", "--disk-time", "5ms"], "--disk-time needs --host-memory"),
        # an empty policy was taken as lru (generate, timing, doctor) or ignored without a host level
        (
            ["generate", "--prompt", "hi", "--host-memory", "50%", "--host-policy", ""],
            "--host-policy is empty",
        ),
        (["generate", "--prompt", "hi", "--host-policy", ""], "--host-policy is empty"),
        (
            ["timing", "--capacity", "24", "--host-capacity", "60", "--host-policy", ""],
            "--host-policy is empty",
        ),
        (
            ["doctor", "--capacity", "24", "--host-capacity", "60", "--host-policy", ""],
            "--host-policy is empty",
        ),
        (
            ["plan", "--capacity", "24", "--host-capacity", "60", "--host-policy", " "],
            "--host-policy is empty",
        ),
        (["timing", "--capacity", "24", "--host-policy", ""], "--host-policy is empty"),
        (["plan", "--capacity", "24", "--disk-time", "5ms"], "--disk-time needs --host-memory"),
        (["doctor", "--capacity", "24", "--host-exclusive"], "doctor weighs an inclusive and an exclusive"),
        (["timing", "--host-capacity", "9", "--host-stage", "-1"], "host stage: a number of experts"),
        (["timing", "--host-memory", "1KiB"], "holds no expert"),
        (["generate", "--prompt", "hi", "--host-exclusive"], "--host-exclusive needs --host-memory"),
        (["plan", "--capacity", "24", "--host-exclusive"], "plan weighs an inclusive and an"),
        (["plan", "--capacity", "24", "--policy", "tlfu", "--policy", "lru"], "--policy: given twice"),
        (["timing", "--demote-time", "1ms"], "--demote-time needs --host-memory or --host-capacity"),
        (
            ["timing", "--capacity", "24", "--host-capacity", "60", "--demote-time", "1ms"],
            "give --host-exclusive",
        ),
        (
            [
                "plan",
                "--capacity",
                "24",
                "--host-capacity",
                "60",
                "--host-policy",
                "lru",
                "--host-policy",
                "lfu",
            ],
            "--host-policy: given twice",
        ),  # fmt: skip
    ],
)
def test_cli_refuses_bad_host_level_options_in_one_line(argv, message, capsys):
    """In this process; a command's own process is
    ``test_the_console_script_refuses_a_host_option_in_one_line``'s."""
    code = exit_code(argv)
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_console_script_refuses_a_host_option_in_one_line():
    argv = ["generate", "--prompt", "hi", "--host-memory", "0"]
    done = subprocess.run([sys.executable, "-m", "expertcache", *argv], capture_output=True, text=True)
    assert done.returncode == 2 and "host memory 0 holds no expert of" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_api_host_level_sizes_are_checked_in_one_place():
    from expertcache.costs import CostModel
    from expertcache.sim.doctor import diagnose
    from expertcache.trace.default import default_trace

    tr = default_trace()
    for kwargs, match in [
        (dict(host=HostConfig("30%"), host_capacity=60), "not both"),
        (dict(host_capacity=0), "1 or more"),
        (dict(host_capacity=10.5), "a whole number"),
        (dict(host=HostConfig(None)), "needs its memory"),
        (dict(host=HostConfig("1KiB")), "holds no expert"),
    ]:
        with pytest.raises(ExpertcacheError, match=match):
            simulate_timing(tr, 24, **kwargs)
    capped = simulate_timing(tr, 24, host_capacity=500)
    assert capped.cache["host_capacity"] == 96 and any("capped at 96" in n for n in capped.notes)
    assert any("disk_read_s is 0" in n for n in capped.notes)  # a host level whose misses cost nothing
    cost = CostModel(disk_read_s=2e-3)
    with pytest.raises(ExpertcacheError, match="needs its memory"):
        diagnose(tr, 24, cost, host=HostConfig(None))
    r = diagnose(tr, 24, cost, host=HostConfig("60%"))  # its size from its memory: 57 experts
    assert r["levels"]["host_capacity"] == 57 and "host level of 57 experts" in " ".join(r["verdict"])
    with_level = simulate_timing(tr, 24, cost=cost, host=HostConfig("60%"))
    assert r["tpot_s"]["on_demand"] == with_level.tpot_s  # the doctor's figures count the host level
    assert "host level lru (55 experts, exclusive)" in r["plan"]  # 57 less its reserve of 2: it wins


def test_api_load_refuses_host_options_without_a_host_level(ckpt):
    path = ckpt("mixtral")
    for kwargs in (dict(host_policy="lfu"), dict(host_stage=2), dict(host_exclusive=True)):
        with pytest.raises(ExpertcacheError, match="need host_memory"):
            engine_load(path, TOP_K, **kwargs)
    with engine_load(path, TOP_K, host_memory="50%") as model:
        assert model.stats["disk_reads"] == 0  # the measurements at load are not the host level's work
        assert model.stats["host_over"] == "disk"
    with engine_load(path, TOP_K, host_memory="50%", host_policy=None) as model:  # None: the default
        assert model.host_config.policy == "lru"
    with pytest.raises(ExpertcacheError, match="host_policy: a policy's name"):
        engine_load(path, TOP_K, host_memory="50%", host_policy=3)


def test_metrics_carry_the_host_level(ckpt):
    from expertcache.serve.metrics import _CacheCollector

    with engine_load(ckpt("mixtral"), TOP_K + 1, host_memory="50%") as model:
        greedy(model, IDS)
        names = {m.name: m for m in _CacheCollector(model).collect()}
        stats = model.stats
    assert names["expertcache_host_level_misses"].samples[0].value == stats["host_misses"] > 0
    assert names["expertcache_host_level_disk_read_errors"].samples[0].value == stats["disk_read_errors"] == 0
    assert names["expertcache_host_level_capacity_experts"].samples[0].value == stats["host_capacity"]


def test_cli_timing_prints_the_host_level():
    argv = ["timing", "--capacity", "24", "--host-capacity", "60", "--disk-time", "100ms"]
    done = subprocess.run([sys.executable, "-m", "expertcache", *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("host level"))
    assert "lru, 60 experts" in line and "disk reads" in line
    # --json's link_busy_s is the table's "link busy": the reads the link waits on aside (it had them in)
    busy = float(re.search(r"link busy ([0-9.]+) s", done.stdout).group(1))
    js = subprocess.run([sys.executable, "-m", "expertcache", *argv, "--json"], capture_output=True)
    row = json.loads(js.stdout)
    assert row["link_busy_s"] == pytest.approx(busy, abs=1e-3) and row["link_read_s"] > 0


# ------------------------------------------------------------------------------- planner and doctor
def test_a_share_of_the_experts_is_never_said_to_be_more_than_all_of_them(ckpt):
    # a share over half was said to be "more than all experts; capped" (a new user found it)
    path = ckpt("mixtral")
    with engine_load(path, TOP_K, host_memory="60%") as model:
        assert not any("more than all" in n for n in model.notes)
    with engine_load(path, TOP_K, host_memory="1TiB") as model:
        assert any("more than all" in n for n in model.notes)


def test_the_planner_compares_frequency_host_policies_where_they_fit():
    """By default the planner also tries -dist host policies (a frequency policy often reads fewer experts
    below the device's cache: ``bench/host_policies_sim.py``), each only where the level holds a layer's
    top-k in every layer; the rest are said in the plan's skipped list, and none fitting is one line."""
    from expertcache.costs import CostModel
    from expertcache.sim.planner import HOST_POLICIES, make_plan
    from expertcache.trace import synthesize

    assert {"lfu-dist", "lru-dist"} <= set(HOST_POLICIES)
    trace = synthesize("sticky", tokens=300, layers=4, experts=8, top_k=2, seed=3, sequences=2, prompt_len=10)
    cost = CostModel(disk_read_s=5e-3)
    plan = make_plan(trace, 8, cost, host_capacity=12)  # exclusive: 12 less its reserve of 2, still 8
    assert {c["host_policy"] for c in plan.candidates} == set(HOST_POLICIES)
    # a -dist level needs a layer's top-2 in each of the 4 layers, 8: inclusive only at 9 (exclusive: 7)
    mid = make_plan(trace, 8, cost, host_capacity=9)
    kinds = {(c["host_policy"], c["host_exclusive"]) for c in mid.candidates}
    assert ("lfu-dist", False) in kinds and ("lfu-dist", True) not in kinds and ("lru", True) in kinds
    assert any(
        "host policy lfu-dist, exclusive (its memory less the reserve for hits in flight): needs 8 host "
        "experts, the level holds 7" in s
        for s in mid.source["skipped"]
    )
    assert len(mid.source["skipped"]) == len(set(mid.source["skipped"]))  # each said once
    with pytest.raises(
        ExpertcacheError, match="too small for every host policy given .lfu-dist.: the least needs 8"
    ):
        make_plan(trace, 8, cost, host_capacity=4, host_policies=("lfu-dist",))
    with pytest.raises(ExpertcacheError, match="needs at least one policy"):
        make_plan(trace, 8, cost, host_capacity=12, host_policies=())


def test_the_planner_chooses_the_host_policy_and_the_engine_runs_its_plan(ckpt, tmp_path):
    from expertcache.costs import CostModel
    from expertcache.plan import Plan
    from expertcache.sim.planner import make_plan

    path = ckpt("mixtral")
    with engine_load(path, TOP_K + 1) as model:
        greedy(model, IDS)
        trace = model.trace()
    total = total_experts("mixtral")
    cost = CostModel(disk_read_s=5e-3)
    plan = make_plan(trace, TOP_K + 1, cost, host_capacity=total // 2, host_policies=("lru", "fifo"))
    # the same memory, inclusive or exclusive (less its reserve for hits in flight), each policy
    assert plan.host_capacity == total // 2 - (exclusive_reserve(TOP_K) if plan.host_exclusive else 0)
    assert plan.host_policy in ("lru", "fifo")
    kinds = {(c["host_policy"], c["host_exclusive"]) for c in plan.candidates}
    assert kinds == {("lru", False), ("lru", True), ("fifo", False), ("fifo", True)}
    assert all(c["host_misses"] > 0 and c["disk_read_s"] > 0 for c in plan.candidates)
    assert "host level" in plan.describe()
    plan.save(tmp_path / "plan.json")
    again = Plan.load(tmp_path / "plan.json")
    assert (again.host_capacity, again.host_policy, again.host_exclusive) == (
        plan.host_capacity, plan.host_policy, plan.host_exclusive
    )  # fmt: skip
    from expertcache.engine import load

    with load(path, plan=again, device=engine_fixtures.DEVICE, progress=False) as model:
        greedy(model, IDS)
        stats = model.stats
    assert stats["host_capacity"] == plan.host_capacity and stats["host_policy"] == plan.host_policy
    assert stats["host_exclusive"] == plan.host_exclusive
    for exclusive in (False, True):  # a plan's level runs in the engine at its capacity, either kind
        forced = dataclasses.replace(plan, host_exclusive=exclusive, host_capacity=3)
        with load(path, plan=forced, device=engine_fixtures.DEVICE, progress=False) as model:
            assert (model.stats["host_capacity"], model.stats["host_exclusive"]) == (3, exclusive)
    with pytest.raises(ExpertcacheError, match="host_exclusive without a host level"):
        Plan(layers=2, experts=8, top_k=2, capacity=4, host_exclusive=True)
    with pytest.raises(ExpertcacheError, match="does not plan staging"):
        make_plan(trace, TOP_K + 1, cost, host=HostConfig("50%", stage=1), host_policies=("lru",))
    with pytest.raises(ExpertcacheError, match="the plan sets a host level"):
        load(path, plan=again, device=engine_fixtures.DEVICE, progress=False, host_memory="50%")
    with pytest.raises(ExpertcacheError, match="serves the fetch miss path"):
        make_plan(trace, TOP_K + 1, cost, misses=("host",), host_capacity=total // 2)
    with pytest.raises(ExpertcacheError, match="go together"):
        Plan(layers=2, experts=8, top_k=2, capacity=4, host_capacity=4)


def test_doctor_says_which_level_bounds_the_step():
    from expertcache.costs import CostModel
    from expertcache.sim.doctor import diagnose

    tr = prefix(1280)  # the same verdicts as the whole trace's, in a quarter of the time
    slow_disk = CostModel(disk_read_s=1.0, link_bandwidth=1e12)
    slow_link = CostModel(disk_read_s=1e-6, link_bandwidth=1e8)
    for cost, bound in ((slow_disk, "disk"), (slow_link, "link")):
        r = diagnose(tr, 24, cost, host=HostConfig(None), host_capacity=60)
        lv = r["levels"]
        assert lv["inclusive"]["bound"] == bound and lv["host_capacity"] == 60
        assert lv["exclusive"]["host_misses"] < lv["inclusive"]["host_misses"]
        assert any(f"bound by the {bound}" in line for line in r["verdict"])
        # the on-demand TPOT's level is the one given, inclusive (a new user's trial read it as exclusive)
        assert any("on-demand LRU over the inclusive host level (60 experts)" in x for x in r["verdict"])
    assert diagnose(tr, 24)["levels"] is None
    small = diagnose(tr, 24, slow_disk, host=HostConfig(None), host_capacity=2)["levels"]["exclusive"]
    assert small["error"] == "its 2 experts of memory are all kept for hits in flight, a layer's top-2"
    every = diagnose(tr, 96, slow_disk, host=HostConfig(None), host_capacity=60)  # all fit: no level used
    assert (
        every["levels"]["unused"] in every["verdict"]
        and "host level is not used" in every["levels"]["unused"]
    )
    assert not any("host level (" in line and "on-demand" in line for line in every["verdict"])
    assert not any("by chance" in line for line in every["verdict"])  # every expert fits: nothing by chance


def test_doctor_says_the_batch_path_means_giving_the_host_level_up():
    # its batch advice was timed without the host level, which serves the fetch path only (a new user
    # took it and every command refused it)
    from expertcache.sim.doctor import diagnose
    from expertcache.trace.batch import batch_requests

    batched = batch_requests(prefix(256), 8)
    line = next(
        x
        for x in diagnose(batched, 24, host=HostConfig(None), host_capacity=60)["verdict"]
        if "miss path batch under policy tlfu" in x
    )  # fmt: skip (Python's words; the CLI's flags)
    assert "without the host level: it serves the fetch miss path only" in line
    line = next(x for x in diagnose(batched, 24)["verdict"] if "miss path batch under policy tlfu" in x)
    assert "host level" not in line


def test_cli_plan_and_doctor_take_a_host_level(short_trace):
    level = ["--capacity", "24", "--host-capacity", "60", "--disk-time", "2ms"]
    argv = ["plan", "--trace", short_trace, *level, "--host-policy", "lru", "lfu"]
    done = subprocess.run([sys.executable, "-m", "expertcache", *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "host level" in done.stdout.splitlines()[-1] and "host lfu" in done.stdout
    marked = [line for line in done.stdout.splitlines() if line.startswith("* ")]
    assert len(marked) == 1, marked  # the chosen row alone, not its policy's other kind beside it
    done = subprocess.run(
        [sys.executable, "-m", "expertcache", "doctor", "--trace", short_trace, "--capacity", "24",
         "--host-memory", "60%"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0 and "with a host level of 57 experts (lru)" in done.stdout, done.stderr
    assert "an exclusive host level in the same memory (55 experts" in done.stdout
    # --host-capacity is the host memory in experts in every command: timing's exclusive level is the
    # doctor's twin (its memory less the reserve), not a level of that many experts
    said = {}
    for command in ("doctor", "timing"):
        argv = [command, "--trace", short_trace, *level]
        if command == "timing":
            argv += ["--host-exclusive", "--json"]
        run = subprocess.run([sys.executable, "-m", "expertcache", *argv], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        said[command] = run.stdout
    assert json.loads(said["timing"])["host_capacity"] == 58
    assert "in the same memory (58 experts" in said["doctor"]
    assert "disk_read_s is 0" in done.stderr  # as timing says: the host level's misses cost nothing here


@pytest.fixture(scope="module")
def short_trace(tmp_path_factory):
    """``prefix(256)`` as a file, for the command line."""
    return prefix_file(tmp_path_factory.mktemp("short"), 256)


@pytest.mark.parametrize("command", ["timing", "plan", "doctor"])
def test_every_command_notes_a_host_level_capped_or_no_larger_than_the_cache(command, short_trace, capsys):
    """A host level beyond all experts is capped, and an inclusive one no larger than the cache hits only
    what the cache let go: timing, plan and doctor say both alike (plan and doctor said neither)."""
    from expertcache.cli import main

    for host, said in (
        (["--host-capacity", "300"], "a host level of 300 experts is more than all 96; capped at 96"),
        (["--host-memory", "64GiB"], "a host level of 64GiB is more than all 96 experts take"),
        (["--host-capacity", "10"], "the host level (10 experts) holds no more than the cache (24)"),
    ):
        assert main([command, "--trace", short_trace, "--capacity", "24", *host, "--disk-time", "1ms"]) == 0
        assert f"note: {said}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["timing", "plan", "doctor"])
def test_a_profile_of_the_disk_tier_under_a_host_level_is_noted(command, short_trace, tmp_path, capsys):
    """A CPU profile's link is the disk read: under a host level a host hit would pay it, and
    --expert-bytes rescales the link but not the disk read the profile measured; each in a note."""
    from expertcache.cli import main

    prof = tmp_path / "prof.json"
    costs = {"link_bandwidth": "1GB/s", "disk_read_s": "0.2ms"}
    prof.write_text(json.dumps({
        "format": "expertcache-profile", "version": 1, "cost": costs,
        "model": {"name": "embedded", "layers": 6, "experts": 16, "top_k": 2},
        "measured": ["link_bandwidth", "disk_read_s"], "how": {"slow_tier": "disk", "link": "disk -> cpu"},
    }))  # fmt: skip
    argv = [command, "--trace", short_trace, "--cost", str(prof), "--capacity", "24", "--host-capacity", "60"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "measured the link reading the disk tier (disk -> cpu)" in err and "--link-bandwidth" in err
    argv += ["--link-bandwidth"]
    assert main([*argv, "20GB/s", "--expert-bytes", "1MiB"]) == 0
    err = capsys.readouterr().err
    assert "measured the link" not in err and "--expert-bytes rescales the link's time, not the disk" in err
    assert main([command, "--trace", short_trace, "--cost", str(prof), "--capacity", "24"]) == 0
    # no host level: nothing to say
    assert "note:" not in capsys.readouterr().err


@pytest.mark.parametrize("command", ["timing", "plan", "doctor"])
def test_a_cpus_profile_of_the_disk_tier_prices_a_host_levels_link_at_its_copy(
    command, short_trace, tmp_path, capsys
):
    """A new user's trial: a CPU's profile of the disk tier under a host level priced each host hit as a
    disk read, and doctor called the step bound by the link, where the same profile had measured the copy
    in memory (copy down) that a host hit costs on a CPU. The link is now priced at that copy."""
    from expertcache.cli import main

    prof = tmp_path / "prof.json"
    costs = {"link_bandwidth": "100MB/s", "link_latency": "20us", "disk_read_s": "2ms", "demote_s": "100us",
             "host_parallel": False, "expert_bytes": 184320}  # fmt: skip
    prof.write_text(json.dumps({
        "format": "expertcache-profile", "version": 1, "cost": costs,
        "model": {"name": "embedded", "layers": 6, "experts": 16, "top_k": 2},
        "measured": ["link_bandwidth", "link_latency", "disk_read_s", "demote_s"],
        "how": {"slow_tier": "disk", "link": "disk -> cpu"},
    }))  # fmt: skip
    argv = [command, "--trace", short_trace, "--cost", str(prof), "--capacity", "24", "--host-capacity", "60"]
    assert main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    assert "priced at its copy of one expert in memory (100 us: 1.84 GB/s" in err
    if command == "timing":  # the replay ran on the copy's link
        cost = json.loads(out)["cost"]
        assert cost["link_bandwidth"] == pytest.approx(184320 / 100e-6) and cost["link_latency"] == 0
    assert main([*argv, "--link-bandwidth", "20GB/s"]) == 0  # given: taken as given
    assert "copy of one expert" not in capsys.readouterr().err


def test_timing_runs_a_plan_s_host_level_and_refuses_another_beside_it(short_trace, tmp_path):
    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "expertcache", *argv], capture_output=True, text=True)

    plan = tmp_path / "plan.json"
    done = cli("plan", "--trace", short_trace, "--capacity", "24", "--host-capacity", "60",
               "--disk-time", "2ms", "--miss", "fetch", "--miss", "host", "-o", str(plan))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "left out: host: the engine's host level serves the fetch miss path" in done.stdout
    chosen = json.loads(plan.read_text())
    again = cli("timing", "--trace", short_trace, "--plan", str(plan), "--json")
    assert again.returncode == 0, again.stderr
    got = json.loads(again.stdout)
    assert got["tpot_s"] == pytest.approx(
        chosen["predicted"]["tpot_s"]
    )  # the plan's prediction, host level too
    assert (got["host_capacity"], got["host_policy"], got["host_exclusive"]) == (
        chosen["host_capacity"], chosen["host_policy"], chosen["host_exclusive"]
    )  # fmt: skip
    refused = cli("timing", "--trace", short_trace, "--plan", str(plan), "--host-capacity", "60")
    assert refused.returncode == 2 and "the plan sets a host level" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    # --demote-time beside a plan's inclusive level said "give --host-exclusive", which the plan refuses
    inclusive = tmp_path / "inclusive.json"  # demoting dear: the plan keeps the level inclusive
    done = cli("plan", "--trace", short_trace, "--capacity", "24", "--host-capacity", "60", "--disk-time",
               "2ms", "--demote-time", "50ms", "--host-policy", "lru", "-o", str(inclusive))  # fmt: skip
    assert done.returncode == 0 and json.loads(inclusive.read_text())["host_exclusive"] is False
    demoted = cli("timing", "--trace", short_trace, "--plan", str(inclusive), "--demote-time", "1ms")
    assert demoted.returncode == 2 and "the plan's host level (lru, 60 experts)" in demoted.stderr
    assert "is inclusive: leave out --demote-time" in demoted.stderr and "give" not in demoted.stderr


# ------------------------------------------------------------------------------- staging
def test_staging_reads_run_on_the_disk_beside_the_link_and_a_transfer_too_early_reads_again():
    link = VirtualLink([1.0], read_s=10.0)
    link.host_moved((0, 1), None)
    link.host_moved((0, 2), None)
    a = link.stage((0, 1))  # the disk reads (0, 1) from 0 to 10 ...
    busy = link.submit((0, 3), None, 0)  # ... while the link reads and moves (0, 3): 0 to 11
    assert link.poll(a) == 0 and link.disk_free_at == 10.0 and link.free_at == 11.0
    link.advance(12.0)
    assert link.poll(a) == 1 and link.poll(busy) == 1 and (0, 1) not in link.unread
    moved = link.submit((0, 1), None, 0)  # read by then: the link only
    link.wait(moved)
    assert link.now == 13.0 and link.disk_reads == 2  # (0, 3)'s and the staging read
    b = link.stage((0, 2))  # 13 to 23 on the disk
    early = link.submit((0, 2), None, 0)  # starts at 13, before the read ends: reads it again ...
    link.wait(early)
    assert link.now == 24.0 and link.disk_reads == 3 and link.poll(b) == 1  # ... as the same read
    assert link.disk_busy_s == 10.0 + 10.0 + 10.0 + 10.0  # (0, 3), (0, 1) staged, (0, 2) twice
    link.host_moved((0, 4), None)
    link.submit((0, 4), None, 0)  # the disk is free, the key unread: the device transfer reads it ...
    late = link.stage((0, 4))
    link.advance(100.0)
    assert late.done_at == late.submitted and link.disk_reads == 4  # ... and the staging read does nothing


def test_a_settled_link_waits_for_each_transfer_and_staging_read_as_the_deterministic_engine_does():
    """``settle`` (a deterministic run, the engine's ``SlotTransport``): compute waits for each submitted
    transfer and staging read at once (stall), nothing is in flight at the next decision, and a cancel
    finds nothing to cancel."""
    from expertcache.cache.transfers import SPECULATIVE

    link = VirtualLink([1.0], read_s=10.0, settle=True)
    link.host_moved((0, 1), None)
    staged = link.stage((0, 1))
    assert link.now == 10.0 and link.stall_s == 10.0 and staged.done_at == 10.0
    prefetch = link.submit((0, 1), None, SPECULATIVE)  # read by then: the link only
    assert link.now == 11.0 and link.stall_s == 11.0 and link.poll(prefetch) == 1
    assert link.started(prefetch) and not link.cancel(prefetch) and not prefetch.cancelled
    link.advance(2.0)
    assert link.now == 13.0 and link.stall_s == 11.0


def test_the_timing_model_stages_predicted_experts_and_a_perfect_predictor_gains():
    from expertcache.config import PrefetchConfig
    from expertcache.costs import CostModel
    from expertcache.trace.default import default_trace

    tr, cost = default_trace(), CostModel(disk_read_s=30e-3)
    pf = PrefetchConfig("oracle", limit=1)
    plain = simulate_timing(tr, 24, prefetch=pf, cost=cost, host=HostConfig(None), host_capacity=48)
    staged = simulate_timing(tr, 24, prefetch=pf, cost=cost, host=HostConfig(None, stage=1), host_capacity=48)
    assert plain.cache["host_staged"] == 0 < staged.cache["host_staged"]
    assert staged.cache["host_misses"] < plain.cache["host_misses"] and staged.tpot_s < plain.tpot_s
    assert staged.misses == plain.misses  # the device's decisions are the same
    moving = [r.link_busy_s for r in (plain, staged)]  # the link, reads aside
    assert moving[0] == pytest.approx(moving[1]) and staged.cache["link_read_s"] < staged.cache["disk_read_s"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_the_engine_stages_on_a_worker_of_its_own_and_stays_exact(family, ckpt, reference):
    path = ckpt(family)
    total = total_experts(family)
    with engine_load(path, TOP_K + 1, host_memory="60%", host_stage=2, prefetch="next-gate") as model:
        assert_exact(greedy(model, IDS), reference(path, IDS))
        stats = model.stats
        assert model.transport.stage_worker is not None
    assert stats["host_staged"] > 0 and stats["host_capacity"] == int(0.6 * total)
    with engine_load(path, TOP_K + 1, host_memory="60%", prefetch="next-gate") as model:
        assert model.transport.stage_worker is None  # no staging, no thread for it


def test_the_disk_tier_reads_through_a_staging_buffer_of_each_thread(ckpt, monkeypatch):
    # on CUDA a read that converts dtypes goes through a pinned staging buffer; the transfer worker and a
    # host level's staging worker read at once, and one buffer shared by both gave one expert's rows to
    # another (the CPU runs the same branch here, with unpinned buffers)
    from expertcache.engine import transfer
    from expertcache.engine.memory import SlotPool

    path = ckpt("mixtral")
    with engine_load(path, TOP_K, host_memory="50%", dtype=torch.bfloat16) as model:
        monkeypatch.setattr(transfer, "SlotPool", lambda layout, n, device, pin: SlotPool(layout, n, device))
        tier = model.tier
        tier.disk.staging = threading.local()  # what the disk tier has on a GPU
        keys = [(layer, e) for layer in range(2) for e in range(4)]
        want = SlotPool(tier.layout, len(keys), torch.device("cpu"))
        for i, key in enumerate(keys):
            tier.disk.store.read(key, want.views[i])

        def read(part: list[int]) -> None:
            for _ in range(3):
                for i in part:
                    tier._forget(keys[i])  # unread again: read it from the disk once more
                    tier.unread.add(keys[i])
                    tier._read(keys[i], i)

        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # the threads take turns as often as they can
        try:
            for _ in range(20):
                threads = [
                    threading.Thread(target=read, args=(part,)) for part in ([0, 1, 2, 3], [4, 5, 6, 7])
                ]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                for i in range(len(keys)):
                    for name in tier.layout.names:
                        assert torch.equal(tier.pool.views[i][name], want.views[i][name]), (keys[i], name)
        finally:
            sys.setswitchinterval(old)


def test_a_deterministic_run_with_staging_counts_the_same_whatever_the_reads_take(ckpt):
    # staged reads pin their keys while they run: a deterministic run waits for each before the next
    # decision, so how long a read takes changes no count
    import random

    path = ckpt("mixtral")
    counts = []
    for seed in (1, 2, 3):
        delays = random.Random(seed)
        with engine_load(
            path, TOP_K + 1, host_memory="60%", host_stage=2, prefetch="next-gate", deterministic=True
        ) as model:
            model.transport.stage_worker.fault = lambda t, chunk, attempt, d=delays: time.sleep(
                d.choice([0, 0.01])
            )
            greedy(model, IDS)
            stats = model.stats
        assert stats["host_staged"] > 0 and not stats["varies_by"]
        keys = ("misses", "host_misses", "host_evicted", "host_staged", "disk_reads")
        counts.append({k: stats[k] for k in keys})
    assert counts[0] == counts[1] == counts[2]


@pytest.mark.parametrize("command", ["plan", "doctor"])
def test_plan_and_doctor_say_why_they_take_no_exclusive_or_staging_flag(command, capsys):
    # they weigh both kinds of host level themselves; a bare "unrecognized arguments" left a new user guessing
    from expertcache.cli import main

    base = [command, "--capacity", "24", "--host-capacity", "48"]
    assert main([*base, "--host-exclusive"]) == 2
    err = capsys.readouterr().err
    assert f"{command} weighs an inclusive and an exclusive host level itself and reports both" in err
    assert err.count("\n") == 1
    assert main([*base, "--host-stage", "2"]) == 2
    assert f"{command} does not weigh staging (leave out --host-stage" in capsys.readouterr().err


def test_load_takes_a_host_config_as_host_or_as_host_memory(ckpt):
    """``load(host_memory=HostConfig(...))`` was refused as "not a size", and ``host=`` was in neither the
    signature nor the docstring (a new user's trial): both take the level, and options beside it are one
    line."""
    from expertcache.engine import load

    path = ckpt("mixtral")
    level = HostConfig("60%", "lfu")
    for kw in ({"host": level}, {"host_memory": level}):
        options = {"device": engine_fixtures.DEVICE, "progress": False, "slow_tier": "disk", **kw}
        with load(path, "30%", **options) as model:
            assert model.stats["host_policy"] == "lfu" and model.stats["host_capacity"] > 0
    with pytest.raises(ExpertcacheError, match="leave out host_policy, host_stage and host_exclusive"):
        load(path, "30%", progress=False, host_memory=level, host_exclusive=True)
    assert "``host``, a ``config.HostConfig``" in load.__doc__
