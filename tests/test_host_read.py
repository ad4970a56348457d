"""A host-computed expert is priced from the tier it computes from. The host tier holds every expert in
memory: the host computes it where it lies. From the disk tier (and the mapped one) the engine reads the
expert into host memory at every use (``DiskTier.host_views``; a host-computed expert enters no cache):
it costs its read plus its computation. A profile of such a tier says so (``how.slow_tier``), and the
planner then no longer prefers host compute where reads dominate (a Granite-shaped model at 25 % on the
disk tier was planned with ``--miss host`` at 216 ms a token and measured 626-880 ms, fetching 436-491)."""

from __future__ import annotations

import json
from pathlib import Path

import engine_fixtures
import pytest

from expertcache.cli import main
from expertcache.costs import PROFILE_FORMAT, CostModel
from expertcache.sim.timing import simulate_timing
from expertcache.trace import synthesize

LAYERS, EXPERTS, TOP_K = 4, 16, 2
TRACE = synthesize("sticky", tokens=300, layers=LAYERS, experts=EXPERTS, top_k=TOP_K, seed=1, sequences=2,
                   prompt_len=8)  # fmt: skip
EXPERT_BYTES = 3 << 20
READ_S = 3e-3  # one expert's read from the disk: ten times its computation for one token
# a CPU engine's profile (``expertcache profile``): host and device are one processor, one measurement
COST = dict(
    dense_s=1e-3, expert_s=0.25e-3, expert_token_s=0.05e-3, host_expert_s=0.25e-3,
    host_expert_token_s=0.05e-3, step_s=0.0, link_bandwidth=EXPERT_BYTES / READ_S, link_latency=0.0,
    expert_bytes=EXPERT_BYTES, chunk_bytes=None, host_parallel=False,
)  # fmt: skip
MEASURED = ["dense_s", "expert_s", "expert_token_s", "link_bandwidth", "link_latency", "expert_bytes",
            "host_expert_s", "host_expert_token_s"]  # fmt: skip


def _profile(tmp_path: Path, tier: str, cost: dict | None = None, measured=MEASURED) -> Path:
    out = tmp_path / f"profile-{tier}.json"
    data = {
        "format": PROFILE_FORMAT, "version": 1,
        "model": {"name": "granite-shaped", "layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K,
                  "expert_bytes": EXPERT_BYTES, "dtype": "bfloat16"},
        "cost": {**COST, **(cost or {})}, "measured": list(measured), "declared": [],
        "how": {"device": "cpu", "slow_tier": tier, "link": f"{tier} -> cpu, one expert in chunks"},
    }  # fmt: skip
    out.write_text(json.dumps(data))
    return out


def test_a_profile_of_the_disk_tier_prices_the_hosts_read(tmp_path):
    disk = CostModel.load(_profile(tmp_path, "disk"))
    assert disk.host_read_s == pytest.approx(READ_S) == pytest.approx(disk.transfer_time())
    assert disk.host_expert(1) == pytest.approx(READ_S + 0.25e-3 + 0.05e-3)
    assert disk.host_expert(1) >= disk.transfer_time() + disk.expert(1)  # never cheaper than fetching
    assert "read 3 ms" in disk.describe()
    assert CostModel.load(_profile(tmp_path, "mapped")).host_read_s == pytest.approx(READ_S)
    # the host tier: computed where it lies
    host = CostModel.load(_profile(tmp_path, "host"))
    assert host.host_read_s == 0 and host.host_expert(1) == pytest.approx(0.3e-3)
    # a declared link replaced the measured read: unknown, left out; a read the profile gives is kept
    declared = [m for m in MEASURED if m != "link_bandwidth"]
    assert CostModel.load(_profile(tmp_path, "disk", measured=declared)).host_read_s == 0
    assert CostModel.load(_profile(tmp_path, "disk", {"host_read_s": 1e-3})).host_read_s == 1e-3
    # a plain cost model: as given (0 by default)
    plain = tmp_path / "cost.json"
    plain.write_text(json.dumps(COST))
    assert CostModel.load(plain).host_read_s == 0
    plain.write_text(json.dumps({**COST, "host_read_s": "2ms"}))
    assert CostModel.load(plain).host_expert(0) == pytest.approx(2.25e-3)


def test_host_compute_from_the_disk_tier_is_fetched_instead_in_the_timing_model(tmp_path):
    """Fiddler's rule ``t_host(n) < t_transfer + t_device(n)`` with the read counted: on one processor,
    computing a disk-tier expert in place costs its read as fetching it does, and fetching caches it."""
    disk, host = (CostModel.load(_profile(tmp_path, t)) for t in ("disk", "host"))
    capacity = LAYERS * TOP_K * 2
    on_disk = simulate_timing(TRACE, capacity, miss="host", cost=disk)
    fetched = simulate_timing(TRACE, capacity, miss="fetch", cost=disk)
    assert on_disk.cache["host_computed"] == 0 and on_disk.tpot_s == pytest.approx(fetched.tpot_s)
    in_memory = simulate_timing(TRACE, capacity, miss="host", cost=host)
    assert in_memory.cache["host_computed"] > 0 and in_memory.tpot_s < fetched.tpot_s


@pytest.mark.parametrize(("tier", "chosen"), [("disk", "fetch"), ("mapped", "fetch"), ("host", "host")])
def test_the_plan_prefers_host_compute_only_where_the_host_reads_nothing(tmp_path, capsys, tier, chosen):
    trace = tmp_path / "trace.npz"
    TRACE.save(trace)
    cost = _profile(tmp_path, tier)
    argv = ["plan", "--trace", str(trace), "--cost", str(cost), "--capacity", str(LAYERS * TOP_K * 2),
            "--miss", "fetch", "--miss", "host", "--method", "uniform", "--json"]  # fmt: skip
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["miss"] == chosen
    tpot = {c["miss"]: c["tpot_s"] for c in plan["candidates"]}
    if chosen == "fetch":
        assert tpot["host"] >= tpot["fetch"]
        assert plan["source"]["cost"]["host_read_s"] == pytest.approx(READ_S)
    else:
        assert tpot["host"] < tpot["fetch"]


make_ckpt = engine_fixtures.make_ckpt
tokenizer_dir = engine_fixtures.tokenizer_dir


def test_costs_measured_at_load_price_the_hosts_read_on_the_disk_tier_only(make_ckpt):
    engine_load = engine_fixtures.engine_load
    path = make_ckpt("mixtral")
    with engine_load(path, expert_memory="50%", miss="host", slow_tier="disk") as disk:
        assert disk.costs.host_read_s > 0
    with engine_load(path, expert_memory="50%", miss="host", slow_tier="host") as host:
        assert host.costs.host_read_s == 0


@pytest.mark.parametrize("tier", ["disk", "mapped"])
@pytest.mark.parametrize("dtype", [None, "bfloat16"])  # the checkpoint's (a copy plan), converted (none)
def test_the_hosts_read_gives_each_experts_bytes_whichever_way_it_reads(make_ckpt, tier, dtype):
    """``DiskTier.host_views`` reads a whole expert by the store's copy plan where there is one (one read
    per run of its bytes, as a transfer reads: 19 against 58 us tensor by tensor for the embedded model's
    expert), tensor by tensor where there is none (a dtype conversion): the same values either way."""
    import torch

    from expertcache.engine.memory import SlotPool

    path = make_ckpt("mixtral")  # w1 and w3 apart in the checkpoint, one gate_up_proj in a slot
    load = engine_fixtures.engine_load
    with load(path, expert_memory="50%", miss="host", slow_tier=tier, dtype=dtype) as m:
        tier_, store = m.tier, m.tier.store
        whole = m.layout.chunks(None)[0]
        assert (store.copy_plan((0, 0), whole, m.layout) is None) == (dtype is not None)
        want = SlotPool(m.layout, 1, torch.device("cpu")).views[0]
        read = tier_.reader()
        for key in [(layer, e) for layer in range(m.num_layers) for e in range(m.num_experts)]:
            store.read(key, want)
            for got in (tier_.host_views(key), read(key)):
                for name in want:
                    assert torch.equal(got[name], want[name]), (key, name)
