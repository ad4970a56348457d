"""Start-up: a load whose budget holds every expert reads them all at once (``ExpertStore.fill``), in long
runs of the files on several threads: through the page cache where it holds them, exactly (``O_DIRECT``)
where it does not. Every slot holds its expert's bytes, the outputs are the reference's, and the page
cache is left as the load found it: pages it held stay, none is added (the ``disk`` tier)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import engine_fixtures
import numpy as np
import pytest
import torch
from engine_fixtures import assert_exact, engine_load, greedy, total_experts

from expertcache.engine import store as store_module
from expertcache.engine.loader import build_skeleton
from expertcache.engine.memory import SlotLayout, SlotPool, _cached_bytes
from expertcache.engine.store import _found, _Mapping

IDS = torch.tensor([engine_fixtures.PROMPT])
_one_torch_thread = engine_fixtures._one_torch_thread
make_ckpt = engine_fixtures.make_ckpt
reference = engine_fixtures.reference
tokenizer_dir = engine_fixtures.tokenizer_dir
LINUX = Path("/proc/self/status").is_file()


def _files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _set_cache(files: list[Path], state: str) -> bool:
    """Drop the files from the page cache, then read back all (``warm``), the first half of each
    (``half``) or none (``cold``); False where the file system keeps its pages (tmpfs)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)  # just written: dirty pages are never dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    if sum(_cached_bytes(f) or 0 for f in files):
        return False
    for f in files:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            fh.read({"warm": size, "half": size // 2, "cold": 0}[state])
    return True


def _slot_bytes(model, key) -> np.ndarray:
    views = model.transport.views(key)
    return torch.cat([v.reshape(-1).view(torch.uint8) for v in views.values()]).numpy().copy()


@pytest.mark.skipif(not LINUX or not hasattr(os, "posix_fadvise"), reason="page-cache advice is Linux's")
@pytest.mark.parametrize("family", ["granitemoe", "mixtral"])  # fused experts; one tensor per expert
def test_a_full_load_reads_every_expert_and_leaves_the_page_cache_as_it_found_it(
    make_ckpt, reference, family, monkeypatch
):
    path = make_ckpt(family, max_shard_size="100KB")  # several files
    files = _files(path)
    assert len(files) > 1
    want = reference(path, IDS)
    sk = build_skeleton(path)  # the expected bytes: each expert copied from the memory map
    layout = SlotLayout.of(sk.shapes, sk.dtype)
    scratch = SlotPool(layout, 1, torch.device("cpu")).views[0]
    expected = {}
    for layer in range(len(sk.store.prefixes)):
        for e in range(sk.store.num_experts):
            sk.store.read((layer, e), scratch)
            expected[(layer, e)] = (
                torch.cat([v.reshape(-1).view(torch.uint8) for v in scratch.values()]).numpy().copy()
            )
    sk.store.ckpt.forget_all(cache=False)  # mapped pages are never dropped from the page cache
    del sk, scratch
    monkeypatch.setattr(store_module, "RUN_BYTES", 3 * 4096)  # many runs, on several threads at once
    for state in ("cold", "half", "warm"):
        if not _set_cache(files, state):
            pytest.skip("this file system keeps its pages (tmpfs)")
        before = [_found(f) for f in files]
        with engine_load(path) as model:  # 100 %, the disk tier (the CPU's default)
            after = [_found(f) for f in files]
            assert model.stats["preloaded_experts"] == total_experts(family) == len(expected)
            for key, want_bytes in expected.items():
                assert np.array_equal(_slot_bytes(model, key), want_bytes), (state, key)
            assert_exact(greedy(model, IDS), want)
        del model  # its maps go with it
        gc.collect()
        for b, a in zip(before, after, strict=True):
            assert not (a & ~b).any(), f"{state}: the load added pages to the page cache"
            assert not (b & ~a).any(), f"{state}: the load dropped pages it found in the page cache"


@pytest.mark.skipif(not LINUX, reason="mincore")
def test_the_mapped_tier_fills_every_slot_from_the_files(make_ckpt, reference):
    path = make_ckpt("granitemoe", max_shard_size="100KB")
    want = reference(path, IDS)
    with engine_load(path, slow_tier="mapped") as model:
        assert model.stats["preloaded_experts"] == total_experts("granitemoe")
        assert_exact(greedy(model, IDS), want)


def test_forget_drops_only_pages_not_found_at_open(tmp_path):
    page = 4096
    f = tmp_path / "f.bin"
    f.write_bytes(bytes(10 * page))
    m = _Mapping(f)
    m.found = np.array([0, 0, 1, 1, 0, 1, 0, 0, 1, 1], dtype=bool)
    assert m._not_found(0, 10 * page) == [(0, 2 * page), (4 * page, 5 * page), (6 * page, 8 * page)]
    assert m._not_found(page + 5, 3 * page) == [(page + 5, 2 * page)]  # clipped to the range asked
    assert m._not_found(2 * page, 4 * page) == []
    m.found = None  # not known: everything
    assert m._not_found(0, 3 * page) == [(0, 3 * page)]
    m.found = np.zeros(2, dtype=bool)  # the file grew since: pages past those seen count as not found
    assert m._not_found(0, 4 * page) == [(0, 4 * page)]
