"""What the expert budget bounds on a CPU.

- The ``disk`` tier (the CPU default) reads an expert's bytes exactly and leaves none of them in memory:
  not mapped in the process, not in the page cache; the ``mapped`` tier leaves them to the page cache.
  Both give the reference's bytes (O_DIRECT, and the buffered fallback).
- Host slot pools are backed when allocated (``prefault``), not at the first request.
- A budget that holds every expert has nothing to offload: the experts are read at load, and the first
  request finds them resident; a warm-up generation at load takes the first request's one-time costs
  and leaves no trace in the counters, the recorded routing or the outputs.
- ``stats["memory"]`` says what the process holds.
"""

from __future__ import annotations

import os
from pathlib import Path

import engine_fixtures
import numpy as np
import pytest
import torch
from engine_fixtures import assert_exact, engine_load, greedy, total_experts

from expertcache.cli import main
from expertcache.engine.loader import build_skeleton
from expertcache.engine.memory import SlotLayout, SlotPool, _cached_bytes
from expertcache.engine.transfer import DiskTier

IDS = torch.tensor([engine_fixtures.PROMPT])
_one_torch_thread = engine_fixtures._one_torch_thread
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
reference = engine_fixtures.reference
tokenizer_dir = engine_fixtures.tokenizer_dir
LINUX = Path("/proc/self/status").is_file()


def _files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _evict(files: list[Path]) -> bool:
    """Drop the files from the page cache; False where the file system keeps them (tmpfs)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)  # just written: dirty pages are never dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return sum(_cached_bytes(f) or 0 for f in files) == 0


def _all_experts(store, layout) -> list[np.ndarray]:
    views = SlotPool(layout, 1, torch.device("cpu")).views[0]
    out = []
    for layer in range(len(store.prefixes)):
        for e in range(store.num_experts):
            store.read((layer, e), views)
            out.append(torch.cat([v.reshape(-1).view(torch.uint8) for v in views.values()]).numpy().copy())
    return out


@pytest.mark.skipif(not LINUX or not hasattr(os, "posix_fadvise"), reason="page-cache advice is Linux's")
def test_the_disk_tier_leaves_no_expert_pages_behind_and_reads_the_same_bytes(ckpt):
    path = ckpt("mixtral")
    files = _files(path)
    if not _evict(files):
        pytest.skip("this file system keeps its pages (tmpfs)")
    sk = build_skeleton(path)
    layout = SlotLayout.of(sk.shapes, sk.dtype)
    mapped = _all_experts(sk.store, layout)  # the mapped path: copies from the memory map
    assert sum(_cached_bytes(f) for f in files) > 0.5 * sum(f.stat().st_size for f in files)

    DiskTier(sk.store, layout, torch.device("cpu"), drop=True)  # dense weights copied: all pages go
    assert sum(_cached_bytes(f) for f in files) == 0
    direct = _all_experts(sk.store, layout)
    assert all(np.array_equal(a, b) for a, b in zip(direct, mapped, strict=True))
    assert sum(_cached_bytes(f) for f in files) == 0  # O_DIRECT: the page cache never saw them
    for mapping in sk.store.ckpt._mappings.values():
        mapping._direct = -1  # the fallback: buffered reads, dropped after each
    buffered = _all_experts(sk.store, layout)
    assert all(np.array_equal(a, b) for a, b in zip(buffered, mapped, strict=True))
    assert sum(_cached_bytes(f) for f in files) <= 2 * len(mapped) * 4096  # at most a page at each end


@pytest.mark.skipif(not LINUX, reason="mincore over the pool's pages")
def test_host_pools_are_backed_when_allocated():
    import ctypes
    import mmap

    from expertcache.engine.memory import _libc

    layout = SlotLayout.of({"w": (1024, 1024)}, torch.float32)  # 4 MiB a slot

    def resident_share(prefault: bool) -> float:
        pool = SlotPool(layout, 16, torch.device("cpu"), prefault=prefault)
        page = mmap.PAGESIZE
        start = pool.buffer.data_ptr() // page * page
        end = pool.buffer.data_ptr() + pool.buffer.numel() * pool.buffer.element_size()
        vec = np.zeros(-(-(end - start) // page), dtype=np.uint8)
        assert _libc().mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                               vec.ctypes.data_as(ctypes.c_void_p)) == 0  # fmt: skip
        return float(np.count_nonzero(vec & 1)) / len(vec)

    assert resident_share(True) > 0.99  # every page of the pool is backed at allocation


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return []


@pytest.mark.skipif(not LINUX, reason="transparent huge pages are Linux's")
def test_host_pools_ask_for_huge_pages_and_keep_their_bytes():
    from expertcache.engine.memory import advise_huge_pages

    layout = SlotLayout.of({"w": (1024, 1024)}, torch.float32)  # 4 MiB a slot: whole 2 MiB pages inside
    pool = SlotPool(layout, 4, torch.device("cpu"), prefault=True)
    if not Path("/sys/kernel/mm/transparent_hugepage/enabled").is_file():
        pytest.skip("this kernel has no transparent huge pages")
    assert "hg" in _vm_flags(pool.buffer.data_ptr() + (4 << 20))  # MADV_HUGEPAGE on the pool's pages
    small = torch.arange(1000, dtype=torch.float32)  # no whole 2 MiB page inside: nothing asked
    assert not advise_huge_pages(small)
    assert torch.equal(small, torch.arange(1000, dtype=torch.float32))
    assert not advise_huge_pages(torch.empty(0))
    big = torch.arange(3 << 20, dtype=torch.int32)  # advised after it was written: the values stay
    assert advise_huge_pages(big)
    assert torch.equal(big, torch.arange(3 << 20, dtype=torch.int32))


@pytest.mark.skipif(not LINUX, reason="glibc's malloc_trim")
def test_memory_a_load_freed_is_given_back():
    """``release_freed`` returns the C heap's free pages: blocks below glibc's mapping threshold, freed in
    between blocks still held (as a load frees its dense weights), stay resident until it runs."""
    from expertcache.engine.memory import release_freed

    def anon() -> int:
        return next(int(s.split()[1]) << 10 for s in open("/proc/self/status") if s.startswith("RssAnon:"))

    blocks = [bytearray(b"x" * (64 << 10)) for _ in range(1024)]  # 64 MiB in 64 KiB blocks, written
    del blocks[::2]  # half freed, each between two held: not at the heap's top, so not trimmed by free
    before = anon()
    if not release_freed():
        pytest.skip("no glibc malloc_trim here")
    assert before - anon() >= 16 << 20  # most of the 32 MiB freed is no longer resident
    assert all(len(b) == 64 << 10 and b[-1:] == b"x" for b in blocks)  # what is held is untouched


def test_a_budget_that_holds_every_expert_reads_them_at_load(ckpt, reference):
    path = ckpt("mixtral")
    want = reference(path, IDS)
    with engine_load(path) as model:  # 100 %
        assert model.stats["preloaded_experts"] == total_experts("mixtral")
        assert model.stats["bytes_transferred"] == 0 and model.stats["stall_s"] == 0  # counted from here
        assert_exact(greedy(model, IDS), want)
        assert model.stats["misses"] == 0 and model.stats["hits"] > 0
    with engine_load(path, total_experts("mixtral") - 1) as model:  # one short: offloaded, cold
        assert model.stats["preloaded_experts"] == 0
        assert_exact(greedy(model, IDS), want)
        assert model.stats["misses"] > 0
    for miss in ("host", "hybrid"):  # paths of whole experts keep them all too: nothing to offload
        with engine_load(path, miss=miss) as model:
            assert model.stats["preloaded_experts"] == total_experts("mixtral")
            assert_exact(greedy(model, IDS), want)
            assert model.stats["misses"] == 0 and model.stats["host_computed"] == 0
    with engine_load(path, miss="batch") as model:  # its stream buffer takes slots: cold, and said
        assert model.stats["preloaded_experts"] == 0
        assert any("its stream buffer takes" in note for note in model.notes)
    with engine_load(path, miss="placement:first=1") as model:  # a layer placed on the host by design
        assert model.stats["preloaded_experts"] == 0


def test_the_warm_up_at_load_leaves_no_trace(ckpt, reference):
    path = ckpt("mixtral")
    want = reference(path, IDS)
    runs = {}
    for warmup in (True, False):
        with engine_load(path, warmup=warmup) as model:  # 100 %
            stats = model.stats
            assert (stats["warmup_s"] is not None) == warmup and (model.warmup_s or 0) >= 0
            assert stats["requests"] == 0 and stats["hits"] == 0 and stats["misses"] == 0
            got = greedy(model, IDS)
            assert_exact(got, want)
            trace = model.trace()
            steps = len(np.unique(trace.step_id))
            runs[warmup] = (model.stats["hits"], model.stats["requests"], trace.num_tokens, steps)
            assert int(trace.seq_id.min()) == 0  # the warm-up's request is not counted either
    assert runs[True] == runs[False]  # the same counters and the same recorded steps, with or without it
    with engine_load(path, total_experts("mixtral") - 1) as model:  # offloaded: no warm-up (it would move)
        assert model.warmup_s is None and model.stats["misses"] == 0


def test_cli_no_warmup(ckpt, capsys):
    import json

    path = ckpt("mixtral")
    base = ["generate", "--model", str(path), "--prompt", "a b", "--max-new-tokens", "2", "--device", "cpu"]
    for flag, warmed in (([], True), (["--no-warmup"], False)):
        assert main([*base, *flag, "--json", "--prefetch", "none"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["warmup_s"] is not None) == warmed


@pytest.mark.skipif(not LINUX, reason="reads /proc/self/status")
@pytest.mark.parametrize("tier", ["disk", "mapped", "host"])
def test_stats_report_the_memory_the_process_holds(ckpt, tier):
    path = ckpt("mixtral")
    with engine_load(path, 2 * engine_fixtures.TOP_K * 2, slow_tier=tier) as model:
        out = model.generate_text("hello", max_new_tokens=4)
        mem = out.stats["memory"]
        assert mem["rss"] >= mem["rss_anon"] > 0 and mem["rss_file"] >= 0
        assert out.stats["slow_tier"] == tier and out.stats["expert_memory_bytes"] > 0
        assert model.stats["memory"]["page_cache"] is not None


def test_the_cli_takes_each_tier_and_prints_the_memory_line(capsys):
    for tier in ("disk", "mapped"):
        rc = main(["generate", "--prompt", "def f(x):", "--max-new-tokens", "2", "--expert-memory", "30%",
                   "--slow-tier", tier, "--device", "cpu"])  # fmt: skip
        assert rc == 0
        err = capsys.readouterr().err
        if LINUX:
            assert f"slow tier {tier}" in err and "memory: resident" in err
    with pytest.raises(SystemExit) as bad:
        main(["generate", "--prompt", "x", "--slow-tier", "ssd"])
    assert bad.value.code == 2 and "invalid choice: 'ssd'" in capsys.readouterr().err


def test_a_budget_the_machine_cannot_hold_is_refused_before_loading(ckpt, monkeypatch):
    """Not killed for memory at load (the 100 % row of bench/memory_cpu.py under a 3 GiB cgroup was):
    one line naming both sizes."""
    from expertcache.engine import builder
    from expertcache.errors import ExpertcacheError

    path = ckpt("mixtral")
    engine_fixtures._slot_bytes(path)  # measured by a load at 100 %, which the patched room would refuse
    monkeypatch.setattr(
        builder, "available_memory", lambda: (1000, "its memory cgroup's room (2.0 KiB limit)")
    )
    with pytest.raises(ExpertcacheError, match=r"the expert slots need .* more than this process may use "
                       r"\(1000 B: its memory cgroup's room"):  # fmt: skip
        engine_load(path)
    with pytest.raises(ExpertcacheError, match="host tier's copy of every expert.*or slow_tier=disk"):
        engine_load(path, 4, slow_tier="host")
    monkeypatch.setattr(builder, "available_memory", lambda: None)  # not Linux: no check
    with engine_load(path, 4) as model:
        assert model.capacity == 4


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_available_memory_is_read_from_the_system():
    from expertcache.engine.memory import available_memory

    room = available_memory()
    assert room is not None and room[0] > 0 and isinstance(room[1], str)


GiB = 1 << 30


def _fake_cgroup(root: Path, cgroup: str, folder: str, files: dict[str, str]) -> Path:
    """A fake ``/proc/self/cgroup`` line and cgroup folder ``folder`` (under ``root/sys/fs/cgroup``)."""
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    base = root / "sys/fs/cgroup" / folder
    base.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (base / name).write_text(text)
    return base


def test_the_cgroup_room_counts_inactive_file_pages_as_room_v1(tmp_path):
    """Under a 2.05 GiB limit a 1.1 GiB budget was refused: the checkpoint's pages in the page cache,
    which the kernel reclaims first, counted as used. The working set is usage less inactive file pages
    (v1: the hierarchy's ``total_inactive_file``), as docker and the kubelet count it."""
    from expertcache.engine.memory import _cgroup_room
    from expertcache.units import format_bytes

    stat = f"cache {int(1.5 * GiB)}\ninactive_file {GiB // 4}\ntotal_inactive_file {int(1.4 * GiB)}\n"
    _fake_cgroup(tmp_path, "5:cpu:/\n4:memory:/job/7\n0::/\n", "memory/job/7", {
        "memory.limit_in_bytes": f"{int(2.05 * GiB)}\n",
        "memory.usage_in_bytes": f"{int(1.9 * GiB)}\n",
        "memory.stat": stat,
    })  # fmt: skip
    room, why = _cgroup_room(tmp_path)
    assert room == int(2.05 * GiB) - (int(1.9 * GiB) - int(1.4 * GiB)) and room > int(1.1 * GiB)
    assert why == f"its memory cgroup's room ({format_bytes(int(2.05 * GiB))} limit)"
    # a kernel without the hierarchical field: the cgroup's own
    (tmp_path / "sys/fs/cgroup/memory/job/7/memory.stat").write_text(f"inactive_file {GiB // 4}\n")
    assert _cgroup_room(tmp_path)[0] == int(2.05 * GiB) - int(1.9 * GiB) + GiB // 4
    # no memory.stat: usage as it is; more inactive pages than usage: never more room than the limit
    (tmp_path / "sys/fs/cgroup/memory/job/7/memory.stat").unlink()
    assert _cgroup_room(tmp_path)[0] == int(2.05 * GiB) - int(1.9 * GiB)
    (tmp_path / "sys/fs/cgroup/memory/job/7/memory.stat").write_text(f"total_inactive_file {3 * GiB}\n")
    assert _cgroup_room(tmp_path)[0] == int(2.05 * GiB)


def test_the_cgroup_room_v2_and_a_container_that_mounts_its_own_cgroup(tmp_path):
    from expertcache.engine.memory import _cgroup_room

    files = {"memory.max": f"{2 * GiB}\n", "memory.current": f"{GiB}\n",
             "memory.stat": f"anon {GiB // 2}\nfile {GiB // 2}\ninactive_file {GiB // 4}\n"}  # fmt: skip
    _fake_cgroup(tmp_path, "0::/user.slice/job.scope\n", "user.slice/job.scope", files)
    assert _cgroup_room(tmp_path) == (2 * GiB - (GiB - GiB // 4), "its memory cgroup's room (2.0 GiB limit)")
    # a container without a cgroup namespace: its path is the host's, its own cgroup is the mount
    other = tmp_path / "container"
    _fake_cgroup(other, "0::/system.slice/docker-abc.scope\n", "", files)
    assert _cgroup_room(other)[0] == 2 * GiB - (GiB - GiB // 4)


@pytest.mark.parametrize(
    ("cgroup", "folder", "files"),
    [
        ("4:memory:/\n", "memory", {"memory.limit_in_bytes": "9223372036854771712\n",
                                     "memory.usage_in_bytes": "6142480384\n"}),
        ("0::/job\n", "job", {"memory.max": "max\n", "memory.current": "1000\n"}),
        ("0::/job\n", "job", {}),  # no memory controller in the cgroup
        ("4:memory:/job\n", "memory/job", {"memory.limit_in_bytes": "a lot\n"}),
    ],
)  # fmt: skip
def test_the_cgroup_room_without_a_limit_is_none(tmp_path, cgroup, folder, files):
    from expertcache.engine.memory import _cgroup_room

    _fake_cgroup(tmp_path, cgroup, folder, files)
    assert _cgroup_room(tmp_path) is None
    assert _cgroup_room(tmp_path / "nowhere") is None  # no /proc (not Linux)


def test_the_cli_offers_the_engines_tiers():
    from expertcache.cli.generate import SLOW_TIERS
    from expertcache.engine.transfer import SLOW_TIERS as ENGINE_TIERS

    assert list(ENGINE_TIERS) == SLOW_TIERS


# ------------------------------------------------------------------------ the copy path of a miss
TIERS = ("disk", "mapped", "host")


@pytest.mark.parametrize(
    ("family", "tier", "parallel"),
    [
        (family, tier, parallel)
        for i, family in enumerate(engine_fixtures.PATH_FAMILIES)
        for tier in TIERS
        for parallel in (False, True)
        if not parallel or tier == TIERS[i % len(TIERS)]  # torch's threads: one tier a family, in turn
    ],
    ids=lambda v: ("numpy", "torch-threads")[v] if isinstance(v, bool) else v,
)
def test_a_copy_plan_fills_a_slot_with_the_bytes_of_the_tensor_by_tensor_copy(
    ckpt, family, tier, parallel, monkeypatch
):
    """The byte-range copy (one read per run of an expert's bytes in the file, one copy per run of a
    slot's bytes) and the tensor-by-tensor copy give the same slot, byte for byte, for every expert,
    whole and in chunks (a chunk may take rows of two checkpoint tensors, or part of one), from every
    tier; with every run long enough to go through torch's intra-op threads (``copy_bytes``) as well, from
    one tier a family (each tier in turn: the threads split the same runs whatever the tier reads)."""
    from expertcache.engine import store

    if parallel:
        monkeypatch.setattr(store, "PARALLEL_BYTES", 1)
        monkeypatch.setattr(store.torch, "get_num_threads", lambda: 2)
        assert store.copies_in_parallel(1)
    with engine_load(ckpt(family), 2 * engine_fixtures.TOP_K * 2, slow_tier=tier) as model:
        target = next(iter(model.targets.values()))
        layout = model.layout
        pool = SlotPool(layout, 2, torch.device("cpu"))
        planned, flat = pool.views[0], pool.buffer[0].view(torch.uint8).numpy()
        for chunk_bytes in (None, 3 * layout.dtype.itemsize * layout.shapes[0][-1], 100):
            chunks = layout.chunks(chunk_bytes)
            for key in [(layer, e) for layer in range(model.num_layers) for e in range(model.num_experts)]:
                pool.buffer.fill_(7)
                for chunk in chunks:
                    target.source.copy_chunk(key, planned, chunk, flat)
                    target.source.copy_chunk(key, pool.views[1], chunk)  # no bytes: tensor by tensor
                for name in layout.names:
                    assert torch.equal(planned[name], pool.views[1][name]), (key, name, chunk_bytes)
        if tier != "host":
            assert model.tier.store._plans and all(p is not None for p in model.tier.store._plans.values())


def test_long_copies_on_the_models_thread_go_through_torchs_threads(monkeypatch):
    """``copy_bytes``: a run of ``PARALLEL_BYTES`` or more, on a thread that is not ``copy_alone`` (the
    transfer worker's), while torch has several intra-op threads, is copied by them; anything else by
    numpy. Both copy the same bytes, from a read-only source too (the checkpoint's map)."""
    import threading

    from expertcache.engine import store
    from expertcache.engine.transfer import SPECULATIVE, TransferWorker

    n = store.PARALLEL_BYTES
    monkeypatch.setattr(store.torch, "get_num_threads", lambda: 2)
    assert store.copies_in_parallel(n) and not store.copies_in_parallel(n - 1)
    seen = []

    def alone():
        store.copy_alone()
        seen.append(store.copies_in_parallel(n))

    thread = threading.Thread(target=alone)
    thread.start()
    thread.join()
    assert seen == [False] and store.copies_in_parallel(n)  # per thread
    monkeypatch.setattr(store.torch, "get_num_threads", lambda: 1)
    assert not store.copies_in_parallel(n)
    monkeypatch.setattr(store.torch, "get_num_threads", lambda: 2)

    src = np.random.default_rng(0).integers(0, 256, n + 3, dtype=np.uint8)
    src.flags.writeable = False
    dst = np.zeros(n + 3, dtype=np.uint8)
    store.copy_bytes(dst, src, torch.from_numpy(src.copy()))  # a read-only source comes with its tensor
    assert np.array_equal(dst, src)
    dst[:] = 0
    store.copy_bytes(dst[:100], src[:100])  # numpy: no tensor needed
    assert np.array_equal(dst[:100], src[:100]) and not dst[100:].any()

    class Tier:  # records what the worker's thread would do with a long copy
        concurrent, reads_device = True, False

        def copy_chunk(self, key, views, chunk, flat=None):
            seen.append((threading.current_thread().name, store.copies_in_parallel(n)))

    worker = TransferWorker(
        Tier(), SlotPool(SlotLayout.of({"w": (4, 4)}, torch.float32), 2, torch.device("cpu"))
    )
    try:
        t = worker.submit((0, 0), 0, SPECULATIVE)  # the worker copies it
        assert t.done.wait(30)
    finally:
        worker.close()
    assert seen[-1] == ("expertcache-transfer", False)


def test_a_copy_plan_reads_an_experts_neighbouring_tensors_at_once(ckpt, make_ckpt):
    """Mixtral keeps an expert's w1, w2 and w3 side by side in the file: one read for the whole expert.
    In a sharded checkpoint whose shards split experts, each file's bytes are a read of their own, and
    the slot is still the tensor-by-tensor copy's."""
    with engine_load(ckpt("mixtral"), 2 * engine_fixtures.TOP_K * 2, slow_tier="disk") as model:
        store, layout = model.tier.store, model.layout
        for key in [(0, 0), (1, 3)]:
            plan = store.copy_plan(key, layout.chunks(None)[0], layout)
            assert len(plan) == 1 and len(plan[0].pieces) == 3
            assert plan[0].stop - plan[0].start == layout.nbytes
    path = make_ckpt("mixtral", max_shard_size="100KB")
    with engine_load(path, 2 * engine_fixtures.TOP_K * 2, slow_tier="disk") as model:
        store, layout, source = model.tier.store, model.layout, model.tier
        pool = SlotPool(layout, 2, torch.device("cpu"))
        flat, files = pool.buffer[0].view(torch.uint8).numpy(), set()
        for key in [(layer, e) for layer in range(model.num_layers) for e in range(model.num_experts)]:
            whole = layout.chunks(None)[0]
            files.update(read.mapping.file for read in store.copy_plan(key, whole, layout))
            source.copy_chunk(key, pool.views[0], whole, flat)
            source.copy_chunk(key, pool.views[1], whole)
            assert all(torch.equal(pool.views[0][n], pool.views[1][n]) for n in layout.names), key
        assert len(files) > 1


def test_a_dtype_conversion_has_no_copy_plan_and_is_still_exact(make_ckpt):
    """A bfloat16 checkpoint computed in float32: no byte copy can convert, so the tensor-by-tensor
    copy does it (and the output is the reference's in float32)."""
    path = make_ckpt("mixtral", dtype="bfloat16")
    with engine_load(path, 2 * engine_fixtures.TOP_K * 2, slow_tier="disk", dtype="float32") as model:
        layout = model.layout
        assert model.tier.store.copy_plan((0, 0), layout.chunks(None)[0], layout) is None
        got = greedy(model, IDS)
        assert model.stats["misses"] > 0
    from expertcache.engine.loader import load_reference

    assert_exact(got, greedy(load_reference(path, dtype=torch.float32), IDS))
