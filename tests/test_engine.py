"""The inference engine against its oracles: transformers' eager model, the simulator, its own budget.

- Exactness: greedy generation through the engine gives the reference's token ids and bit-identical
  logits for every family, every online policy, capacities from the minimum to everything, sharded
  checkpoints and padded batches.
- The engine's hits and misses per phase and layer equal the simulator's replay of its own trace.
- Budgets, bad input, and the pieces (sizes, slot layout, transfer worker, emulated link) alone.
"""

from __future__ import annotations

import json
import math
import threading
import time

import engine_fixtures
import numpy as np
import pytest
import torch
from engine_fixtures import (
    FAMILIES,
    MISSING_EXPERT,
    NEW,
    OFFLINE,
    ONLINE,
    PROMPT,
    PROMPT_B,
    SPECS,
    TOP_K,
    WRONG_SHAPE,
    assert_exact,
    capacities,
    engine_load,
    greedy,
    moe_layers,
    prompt_ids,
    total_experts,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertcache.cache.schedule import build_schedule
from expertcache.engine import EmulatedLink, load
from expertcache.engine.memory import SlotLayout, SlotPool
from expertcache.engine.transfer import DEMAND, SPECULATIVE, TransferWorker
from expertcache.errors import ExpertcacheError, ExpertcacheWarning
from expertcache.sim.replay import replay
from expertcache.units import format_bytes

# the shared fixtures, by name
_one_torch_thread = engine_fixtures._one_torch_thread
bad_ckpt = engine_fixtures.bad_ckpt
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
reference = engine_fixtures.reference
tokenizer_dir = engine_fixtures.tokenizer_dir

IDS = torch.tensor([PROMPT])


# ------------------------------------------------------------------------------------------------
# Exactness against transformers' eager model
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_exact_from_min_to_all_capacity(family, ckpt, reference):
    path = ckpt(family)
    want = reference(path, IDS)
    for cap in capacities(family, "lru"):
        with engine_load(path, cap) as model:
            assert model.capacity == cap
            assert_exact(greedy(model, IDS), want)
            trace = model.trace()
            distinct = len(
                {(layer, e) for layer in range(trace.num_layers) for e in trace.experts[:, layer].ravel()}
            )
            if cap == TOP_K:  # experts were evicted and loaded again
                assert model.stats["misses"] > distinct
            if cap == total_experts(family):  # nothing to offload: every expert was read at load
                assert model.stats["misses"] == 0 and model.stats["preloaded_experts"] == cap
            else:
                assert model.stats["preloaded_experts"] == 0 and model.stats["misses"] >= distinct


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("policy", ONLINE)
def test_every_online_policy_is_exact(family, policy, ckpt, reference):
    path = ckpt(family)
    want = reference(path, IDS)
    for cap in capacities(family, policy):
        with engine_load(path, cap, policy) as model:
            assert_exact(greedy(model, IDS), want)
            stats = model.stats
            assert stats["hits"] + stats["misses"] == stats["requests"] > 0


def test_host_tier_is_exact(ckpt, reference):
    path = ckpt("qwen3_moe")
    with engine_load(path, TOP_K, slow_tier="host") as model:
        assert model.stats["slow_tier"] == "host"
        assert_exact(greedy(model, IDS), reference(path, IDS))


def test_sharded_checkpoint_is_exact(make_ckpt, reference):
    path = make_ckpt("mixtral", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert not (path / "model.safetensors").exists()
    want = reference(path, IDS)
    for cap in capacities("mixtral", "lru"):
        with engine_load(path, cap) as model:
            assert_exact(greedy(model, IDS), want)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_padded_batch_is_exact(family, ckpt, reference):
    path = ckpt(family)
    ids, mask = prompt_ids(PROMPT, PROMPT_B)
    assert (mask == 0).any()
    want = reference(path, ids, mask)
    for cap in (TOP_K, total_experts(family)):
        with engine_load(path, cap) as model:
            assert_exact(greedy(model, ids, mask), want)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_any_family_policy_capacity_gives_the_reference_tokens(data, ckpt, reference):
    family = data.draw(st.sampled_from(FAMILIES), label="family")
    policy = data.draw(st.sampled_from(ONLINE), label="policy")
    caps = capacities(family, policy)
    cap = data.draw(st.integers(caps[0], caps[-1]), label="capacity")
    path = ckpt(family)
    seq, _ = reference(path, IDS)
    with engine_load(path, cap, policy) as model:
        got, _ = greedy(model, IDS)
    assert got.tolist() == seq.tolist()


# ------------------------------------------------------------------------------------------------
# The engine's counts equal the simulator's replay of its trace
# ------------------------------------------------------------------------------------------------


def _two_sequences(model) -> None:
    greedy(model, IDS)
    greedy(model, torch.tensor([PROMPT_B]))


def _agreement_capacities(family: str, policy: str) -> list[int]:
    low, *_, high = capacities(family, policy)
    return sorted({low, low + 1, (low + high) // 2, high - 1})


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("policy", ONLINE)
def test_engine_counts_equal_simulator_replay(family, policy, ckpt):
    path = ckpt(family)
    profile = None
    if policy.startswith("static"):  # the simulator ranks by the replayed trace's own counts
        with engine_load(path, TOP_K) as model:
            _two_sequences(model)
            profile = model.trace()
    for cap in _agreement_capacities(family, policy):
        kwargs = {"profile": profile} if profile is not None else {}
        with engine_load(path, cap, policy, **kwargs) as model:
            _two_sequences(model)
            trace = model.trace()
            sim = replay(build_schedule(trace, "layer"), policy, model.capacity)
            misses, requests = model.cache.stats.misses, model.cache.stats.requests
            assert misses.shape == requests.shape == (2, moe_layers(family))
            assert requests.tolist() == sim.layer_requests.tolist(), (policy, cap)
            assert misses.tolist() == sim.layer_misses.tolist(), (policy, cap)
            assert misses[0].sum() > 0 or cap == total_experts(family)
            stats = model.stats
            assert stats["misses"] == sim.misses and stats["requests"] == sim.requests
            assert stats["bytes_transferred"] == sim.misses * model.layout.nbytes


@pytest.mark.parametrize("slow_tier", ["host", "disk"])
def test_plain_layers_with_misses_take_the_full_paths_decisions(slow_tier, ckpt):
    """A layer with misses served by ``ExpertCache._plain_layer`` (nothing moving, misses fetched whole)
    makes the full path's decisions in the engine too: the same tokens and logits, counts, bytes, and
    the same expert in every slot. From host memory on a CPU each miss is copied at ``submit`` and never
    in flight; from the disk (or on a GPU) it is queued for the worker and waited for."""
    from unittest import mock

    from expertcache.cache.expert_cache import ExpertCache

    path = ckpt("mixtral")
    cap = _agreement_capacities("mixtral", "lru")[1]
    taken = []
    real = ExpertCache._plain_layer

    def spy(self, layer, needs, keys):
        before = int(self.stats.misses.sum())
        got = real(self, layer, needs, keys)
        taken.append((got is not None, int(self.stats.misses.sum()) > before, len(self.inflight)))
        return got

    def run() -> tuple:
        with engine_load(path, cap, slow_tier=slow_tier) as model:
            out = greedy(model, IDS)
            stats = {k: model.stats[k] for k in ("misses", "requests", "bytes_transferred")}
            copied_at_submit = model.engine.transport.worker.steal
            return out, stats, dict(model.engine.transport.slot_of), model.cache.inflight, copied_at_submit

    with mock.patch.object(ExpertCache, "_plain_layer", spy):
        plain = run()
    with mock.patch.object(ExpertCache, "_plain_layer", lambda self, layer, needs, keys: None):
        full = run()
    assert_exact(plain[0], full[0])
    assert plain[1] == full[1] and plain[1]["misses"] > 0
    assert plain[2] == full[2]  # the same expert in the same slot
    assert not plain[3] and not full[3]  # nothing left in flight
    with_misses = [inflight for served, missed, inflight in taken if served and missed]
    assert with_misses  # decode layers with misses took the shortcut
    if slow_tier == "host" and plain[4]:  # copied at submit (host slots): never in flight
        assert not any(with_misses)


# ------------------------------------------------------------------------------------------------
# The recorded trace
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2", "gpt_oss"])
def test_recorded_trace_holds_the_routing_of_every_token(family, ckpt, tmp_path):
    path = ckpt(family)
    L, E = moe_layers(family), SPECS[family]["experts"]
    with engine_load(path, TOP_K) as model:
        seq, _ = greedy(model, IDS)
        trace = model.trace()
        model.save_trace(tmp_path / "t.npz")
    T = len(PROMPT) + NEW - 1
    assert trace.experts.shape == (T, L, TOP_K)
    assert trace.num_experts == E
    assert ((trace.experts >= 0) & (trace.experts < E)).all()
    assert all(len(set(row)) == TOP_K for row in trace.experts.reshape(-1, TOP_K).tolist())
    assert trace.is_prefill.tolist() == [1] * len(PROMPT) + [0] * (NEW - 1)
    assert trace.token_id.tolist() == seq[0, :-1].tolist()
    assert trace.seq_id.tolist() == [0] * T
    assert trace.weights is not None and trace.weights.shape == (T, L, TOP_K)
    assert np.isfinite(trace.weights).all() and (trace.weights != 0).any()
    from expertcache.trace import load_trace

    # the run's own clock: the prompt's step, then one step a token, each forward after the last
    assert trace.step_id.tolist() == [0] * len(PROMPT) + list(range(1, NEW))
    starts, ends = trace.step_start_s[len(PROMPT) - 1 :], trace.step_end_s[len(PROMPT) - 1 :]
    assert starts[0] == 0 and (ends >= starts).all() and (starts[1:] >= ends[:-1]).all()
    saved = load_trace(tmp_path / "t.npz")
    assert np.array_equal(saved.experts, trace.experts)
    assert np.array_equal(saved.token_id, trace.token_id)
    assert np.array_equal(saved.step_start_s, trace.step_start_s)  # float64: not rounded on the way
    assert np.array_equal(saved.step_end_s, trace.step_end_s)


def test_trace_of_two_generations_numbers_the_sequences(ckpt):
    with engine_load(ckpt("olmoe"), TOP_K) as model:
        _two_sequences(model)
        trace = model.trace()
    n1, n2 = len(PROMPT) + NEW - 1, len(PROMPT_B) + NEW - 1
    assert trace.seq_id.tolist() == [0] * n1 + [1] * n2
    assert trace.is_prefill.tolist() == [1] * 8 + [0] * (NEW - 1) + [1] * 5 + [0] * (NEW - 1)
    assert trace.token_id[n1 : n1 + len(PROMPT_B)].tolist() == PROMPT_B


def test_trace_before_any_generation_is_an_error(ckpt):
    with engine_load(ckpt("mixtral")) as model, pytest.raises(ExpertcacheError, match="empty"):
        model.trace()


# ------------------------------------------------------------------------------------------------
# Budget and memory
# ------------------------------------------------------------------------------------------------


def test_budget_in_bytes_and_as_a_share_gives_the_capacity(ckpt):
    path = ckpt("mixtral")
    total = total_experts("mixtral")
    with engine_load(path) as model:
        slot = model.layout.slot_bytes
        assert model.capacity == total
    assert slot % 64 == 0 and slot >= model.layout.nbytes
    for budget, want in [
        (5 * slot, 5),
        (5 * slot + slot - 1, 5),
        (f"{3 * slot}B", 3),
        (f"{7 * slot / 1024}KiB", 7),
        ("6GiB", total),
        (10**12, total),
    ]:
        with load(path, expert_memory=budget, device="cpu", progress=False) as model:
            assert model.capacity == want, budget
            assert model.stats["expert_memory_bytes"] == want * slot
    for percent in (12.5, 30, 50, 99, 100):
        with load(path, expert_memory=f"{percent}%", device="cpu", progress=False) as model:
            assert model.capacity == math.floor(total * percent / 100), percent


@pytest.mark.parametrize(("policy", "need"), [("lru", TOP_K), ("lru-dist", 2 * TOP_K)])
def test_too_small_a_budget_states_the_minimum(policy, need, ckpt):
    path = ckpt("mixtral")
    with engine_load(path) as model:
        slot = model.layout.slot_bytes
    with pytest.raises(ExpertcacheError) as info:
        load(path, expert_memory=need * slot - 1, policy=policy, device="cpu", progress=False)
    msg = str(info.value)
    assert f"at least {need}" in msg and format_bytes(need * slot) in msg
    assert "\n" not in msg
    with load(path, expert_memory=need * slot, policy=policy, device="cpu", progress=False) as model:
        assert model.capacity == need


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss", "granitemoe"])
def test_slot_pool_holds_capacity_slots_and_the_model_no_experts(family, ckpt):
    from expertcache.engine.loader import load_reference

    path = ckpt(family)
    L, E = moe_layers(family), SPECS[family]["experts"]
    with engine_load(path, 3) as model:
        assert len(model.pool) == model.capacity == 3
        assert tuple(model.pool.buffer.shape) == (3, model.layout.slot_numel)
        assert model.pool.buffer.numel() * model.pool.buffer.element_size() == 3 * model.layout.slot_bytes
        experts = [m for m in model.model.modules() if hasattr(m, "has_gate")]
        assert len(experts) == L
        for m in experts:
            assert not hasattr(m, "gate_up_proj") and not hasattr(m, "down_proj")
            assert list(m.parameters(recurse=False)) == []
        names = [n for n, _ in model.model.named_parameters()]
        assert not [n for n in names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        assert not any(p.is_meta for p in model.model.parameters())
        engine_numel = sum(p.numel() for p in model.model.parameters())
        expert_numel = model.layout.numel
    ref_numel = sum(p.numel() for p in load_reference(path).parameters())
    assert engine_numel == ref_numel - L * E * expert_numel


# ------------------------------------------------------------------------------------------------
# Bad input: one ExpertcacheError with a clear message
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing_dir", "no such checkpoint directory"),
        ("no_config", "no config.json"),
        ("unsupported", "'llama' is not a mixture-of-experts model .*; supported: .*mixtral"),
        ("corrupt", "cannot read safetensors file"),
        ("truncated", "model.safetensors"),
        ("missing_expert", f"lacks expert tensor {MISSING_EXPERT}"),
        ("missing_dense", "lacks tensor model.norm.weight"),
        ("bad_json", "config.json: not valid JSON"),
        ("no_weights", "no model.safetensors or model.safetensors.index.json"),
        ("missing_shard", "cannot read safetensors file"),
        ("bad_index", "not a safetensors index"),
    ],
)
def test_bad_checkpoints_raise_one_clear_error(kind, message, bad_ckpt):
    with pytest.raises(ExpertcacheError, match=message) as info:
        model = load(bad_ckpt(kind), device="cpu", progress=False)
        model.generate_text("hello", 2)  # a lazily failing checkpoint must fail here at the latest
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "nope"}, "unknown policy 'nope'"),
        ({"policy": "lru:bogus=1"}, "does not take bogus"),
        ({"policy": "static"}, "profile"),
        ({"policy": "static-dist"}, "profile"),
        ({"expert_memory": "12 parsecs"}, "not a size"),
        ({"expert_memory": "150%"}, "share"),
        ({"expert_memory": "0%"}, "share"),
        ({"expert_memory": "-1GB"}, "non-negative size"),
        ({"expert_memory": "6"}, "needs a unit: 6B, 6MB or 6GiB"),
        ({"link_latency": "20"}, "link latency '20' needs a unit: 20us, 20ms or 20s"),
        ({"link_bandwidth": "16"}, "link bandwidth '16' needs a unit: 16GB/s or 16MB/s"),
        ({"expert_memory": 1}, "at least 2"),
        ({"link_bandwidth": "fast"}, "link bandwidth"),
        ({"link_bandwidth": "0GB/s"}, "must be positive"),
        ({"link_bandwidth": "1GB/s", "link_latency": "soon"}, "link latency"),
        ({"slow_tier": "tape"}, "slow tier"),
        ({"device": "cuda"} if not torch.cuda.is_available() else {"device": "tpu"}, "device"),
        ({"dtype": "int8"}, "not a compute dtype"),
        ({"dtype": "float8_e4m3fn"}, "float32, bfloat16, float16, float64"),  # a storage format
    ],
)
def test_bad_options_raise_one_clear_error(kwargs, message, ckpt):
    kwargs = {"device": "cpu", "progress": False, **kwargs}
    with pytest.raises(ExpertcacheError, match=message) as info:
        load(ckpt("mixtral"), **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("policy", OFFLINE)
def test_offline_policies_are_refused(policy, ckpt):
    with pytest.raises(ExpertcacheError, match="simulator only"):
        load(ckpt("mixtral"), policy=policy, device="cpu", progress=False)


def test_static_profile_of_the_wrong_shape_is_refused(ckpt, make_ckpt):
    with engine_load(ckpt("qwen2_moe"), TOP_K) as model:  # 6 experts, not mixtral's 8
        greedy(model, IDS)
        other = model.trace()
    with pytest.raises(ExpertcacheError, match="profile trace has 2 layers x 6 experts"):
        load(ckpt("mixtral"), policy="static", profile=other, device="cpu", progress=False)


def test_prompt_longer_than_the_context_and_zero_new_tokens(make_ckpt):
    path = make_ckpt("mixtral", max_positions=16)
    with engine_load(path) as model:
        with pytest.raises(ExpertcacheError, match="exceeds the model's context of 16"):
            model.generate_text("the quick brown fox jumps over the lazy dog " * 4, max_new_tokens=4)
        with pytest.raises(ExpertcacheError, match="at least 1"):
            model.generate_text("hello", max_new_tokens=0)
        with pytest.raises(ExpertcacheError, match="empty"):
            model.generate_text("", max_new_tokens=2)
        gen = model.generate_text("hello", max_new_tokens=3)
        assert 1 <= len(gen.tokens) <= 3


# ------------------------------------------------------------------------------------------------
# generate_text: tokens, timings and the cache's work of one call
# ------------------------------------------------------------------------------------------------


def test_generate_text_reports_the_work_of_the_call(ckpt):
    path = ckpt("mixtral")
    with engine_load(path, TOP_K) as model:
        first = model.generate_text("hello world", max_new_tokens=4)
        before = model.stats
        second = model.generate_text("the lazy dog", max_new_tokens=4)
        after = model.stats
        trace = model.trace()
    for gen in (first, second):
        assert 1 <= len(gen.tokens) <= 4
        assert isinstance(gen.text, str)
        assert gen.ttft_s > 0 and gen.tpot_s >= 0 and gen.tokens_per_s > 0
        assert gen.stats["bytes_transferred"] == gen.stats["misses"] * gen.stats["expert_bytes"]
        assert gen.stats["capacity_experts"] == TOP_K
    assert second.stats["misses"] == after["misses"] - before["misses"]
    assert second.stats["hits"] == after["hits"] - before["hits"]
    assert after["hits"] + after["misses"] == after["requests"]
    assert trace.seq_id.max() == 1
    d = second.to_dict()
    assert d["new_tokens"] == len(second.tokens) and d["prompt_tokens"] == second.prompt_tokens


# ------------------------------------------------------------------------------------------------
# The pieces alone: slot layout, transfer worker, emulated link
# ------------------------------------------------------------------------------------------------


_shapes = st.dictionaries(
    st.sampled_from(["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias", "extra"]),
    st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
    min_size=1,
    max_size=5,
)


@settings(max_examples=60, deadline=None)
@given(shapes=_shapes, dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
def test_slot_layout_is_aligned_contiguous_and_disjoint(shapes, dtype):
    layout = SlotLayout.of(shapes, dtype)
    size = torch.empty((), dtype=dtype).element_size()
    assert layout.names == tuple(shapes)
    assert layout.numel == sum(math.prod(s) for s in shapes.values())
    assert layout.nbytes == layout.numel * size
    assert layout.slot_bytes == layout.slot_numel * size and layout.slot_bytes % 64 == 0
    spans = []
    for off, shape in zip(layout.offsets, layout.shapes, strict=True):
        assert (off * size) % 64 == 0
        spans.append((off, off + math.prod(shape)))
    spans.sort()
    assert spans[0][0] == 0 and spans[-1][1] <= layout.slot_numel
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    pool = SlotPool(layout, 3, torch.device("cpu"))
    assert len(pool) == 3
    for s in range(3):
        views = pool.views[s]
        assert list(views) == list(shapes)
        for i, (name, view) in enumerate(views.items()):
            assert tuple(view.shape) == shapes[name] and view.is_contiguous()
            assert view.data_ptr() % 64 == 0
            view.fill_(s * 10 + i + 1)
    for s in range(3):  # no view overwrote another, in its own slot or a neighbour's
        for i, view in enumerate(pool.views[s].values()):
            assert (view == s * 10 + i + 1).all()


class _GateTier:
    """A fake slow tier: the first copy waits for ``gate``; records the order of copies."""

    name = "fake"

    def __init__(self, fail=()) -> None:
        self.order: list[tuple[int, int]] = []
        self.gate = threading.Event()
        self.started = threading.Event()
        self.fail = set(fail)

    def copy_chunk(self, key, views, chunk, flat=None) -> None:
        self.started.set()
        assert self.gate.wait(timeout=10)
        if key in self.fail:
            raise RuntimeError("disk on fire")
        self.order.append(key)
        for name, start, stop, _ in chunk:
            views[name][start:stop].fill_(key[0] * 100 + key[1])


def _pool(slots: int = 8, shape=(4, 4)) -> SlotPool:
    return SlotPool(SlotLayout.of({"w": shape}, torch.float32), slots, torch.device("cpu"))


def test_transfer_worker_runs_by_priority_then_fifo():
    tier, pool = _GateTier(), _pool()
    worker = TransferWorker(tier, pool, steal=False)  # the worker's own order
    try:
        first = worker.submit((0, 0), 0, SPECULATIVE)
        assert tier.started.wait(30)  # the worker is inside the first copy
        queued = [
            worker.submit((0, 1), 1, SPECULATIVE),
            worker.submit((0, 2), 2, DEMAND),
            worker.submit((0, 3), 3, 5),
            worker.submit((1, 0), 4, SPECULATIVE),
            worker.submit((1, 1), 5, DEMAND),
            worker.submit((1, 2), 6, DEMAND),
        ]
        tier.gate.set()
        for t in [first, *queued]:
            worker.wait(t)
        assert tier.order == [(0, 0), (0, 2), (1, 1), (1, 2), (0, 1), (1, 0), (0, 3)]
        for t in [first, *queued]:
            assert (pool.buffer[t.slot] == t.key[0] * 100 + t.key[1]).all()
    finally:
        tier.gate.set()
        worker.close()


def test_transfer_worker_cancel_drops_a_queued_transfer():
    tier, pool = _GateTier(), _pool()
    worker = TransferWorker(tier, pool, steal=False)
    try:
        running = worker.submit((0, 0), 0, DEMAND)
        assert tier.started.wait(30)
        dropped = worker.submit((0, 1), 1, SPECULATIVE)
        kept = worker.submit((0, 2), 2, SPECULATIVE)
        head = worker.submit((0, 3), 3, DEMAND)  # ahead of the cancelled one in the queue
        assert worker.cancel(running) is False  # already started
        assert worker.cancel(dropped) is True
        tier.gate.set()
        for t in (running, kept, head):
            worker.wait(t)
        with pytest.raises(ExpertcacheError, match="cancelled"):
            worker.wait(dropped)
        assert tier.order == [(0, 0), (0, 3), (0, 2)]
        assert worker.cancel(kept) is False  # already done
        later = worker.submit((0, 4), 4, DEMAND)
        worker.wait(later)
        assert tier.order[-1] == (0, 4)
    finally:
        tier.gate.set()
        worker.close()


def test_transfer_worker_reports_a_failing_tier_and_keeps_serving():
    tier, pool = _GateTier(fail={(0, 1)}), _pool()
    tier.gate.set()
    worker = TransferWorker(tier, pool)
    try:
        bad = worker.submit((0, 1), 0, DEMAND)
        with pytest.raises(ExpertcacheError, match=r"transfer of expert \(0, 1\) failed: disk on fire"):
            worker.wait(bad)
        good = [worker.submit((0, e), e, DEMAND) for e in (2, 3)]
        for t in good:
            worker.wait(t)
        assert tier.order == [(0, 2), (0, 3)]
        assert (pool.buffer[3] == 3).all()
    finally:
        worker.close()
    with pytest.raises(ExpertcacheError, match="closed"):
        worker.submit((0, 5), 5, DEMAND)


def test_emulated_link_is_a_lower_bound_on_transfer_time():
    link = EmulatedLink.parse("16GB/s", "20us")
    assert link.bandwidth == 16e9 and link.latency == pytest.approx(20e-6)
    assert link.duration(16 * 10**9) == pytest.approx(1 + 20e-6)
    assert "16 GB/s" in link.describe()
    tier, pool = _GateTier(), _pool(4, (64, 64))
    tier.gate.set()
    slow = EmulatedLink(bandwidth=2e6, latency=0.005)
    nbytes = pool.layout.nbytes
    assert nbytes == 64 * 64 * 4
    worker = TransferWorker(tier, pool, slow)
    try:
        start = time.perf_counter()
        transfers = [worker.submit((0, e), e, DEMAND) for e in range(3)]
        for t in transfers:
            worker.wait(t)
        elapsed = time.perf_counter() - start
    finally:
        worker.close()
    each = 0.005 + nbytes / 2e6
    assert elapsed >= 3 * each  # the link is serial
    assert worker.busy_s >= 3 * each
    started = time.perf_counter()
    slow.finish(started, 1000)
    assert time.perf_counter() - started >= 0.005 + 1000 / 2e6


def test_engine_with_an_emulated_link_is_exact_and_stalls(ckpt, reference):
    path = ckpt("mixtral")
    with engine_load(path, TOP_K, link_bandwidth="200MB/s", link_latency="0.5ms") as model:
        started = time.perf_counter()
        got = greedy(model, IDS)
        elapsed = time.perf_counter() - started
        stats = model.stats
        busy = model.worker.busy_s
        nbytes = model.layout.nbytes
    assert_exact(got, reference(path, IDS))
    assert stats["misses"] > 0 and stats["stall_s"] > 0
    assert stats["link"] == "0.2 GB/s, 500 us"
    assert busy >= stats["misses"] * (0.5e-3 + nbytes / 200e6)
    # the stalls are parts of the generation's own time (not of the link's busy time: a thread woken late
    # stalls longer while the emulated transfer it waited for ended on time)
    assert stats["stall_s"] <= elapsed


def test_an_emulated_link_under_a_budget_that_holds_every_expert_is_noted(ckpt):
    """At 100 % nothing crosses the link after the load: the options are not silently idle."""
    with pytest.warns(
        ExpertcacheWarning, match="every expert is resident from the load on.*slows only the load"
    ):
        engine_load(ckpt("mixtral"), link_latency="20us").close()


def test_a_prompts_layer_is_computed_as_its_experts_land_and_stays_exact(ckpt, reference):
    """Streaming prefill with the grouped kernel: over a slow link (20 ms an expert, against well under
    a millisecond to compute a group of the tiny model) a layer's misses are computed in groups as they
    land, not after the last, and the output is the reference's bit for bit."""
    path = ckpt("mixtral")
    with engine_load(path, 12, kernel="grouped", link_bandwidth="1GB/s", link_latency="20ms") as model:
        engine, calls = model.engine, []
        rows = engine._rows

        def counted(module, stacked, hidden, *args):
            calls.append(hidden.shape[0] > 1)  # the prompt's step
            return rows(module, stacked, hidden, *args)

        engine._rows = counted
        got = greedy(model, IDS)
        misses = model.stats["prefill_misses"]
    assert_exact(got, reference(path, IDS))
    # the cold prompt misses every expert it needs, all in one chunk: waiting for the last would compute
    # each layer in one group; landing 20 ms apart they come in more (in one each, unless compute is slow)
    assert misses > moe_layers("mixtral") and sum(calls) > moe_layers("mixtral")


# ------------------------------------------------------------------------------------------------
# Regressions: bugs found while writing these tests
# ------------------------------------------------------------------------------------------------


def test_padded_batch_trace_replays_to_the_engine_counts(ckpt):
    """A batch's decode step serves the union of its rows' experts as one group; the recorded trace
    (one sequence per row, ``step_id`` per forward step) must replay to the same counts."""
    path = ckpt("mixtral")
    ids, mask = prompt_ids(PROMPT, PROMPT_B)
    with engine_load(path, 3) as model:
        greedy(model, ids, mask)
        trace = model.trace()
        sim = replay(build_schedule(trace, "layer"), "lru", model.capacity)
        requests, misses = model.cache.stats.requests, model.cache.stats.misses
    assert requests.tolist() == sim.layer_requests.tolist()
    assert misses.tolist() == sim.layer_misses.tolist()


def test_a_mis_shaped_tensor_of_any_expert_is_refused(bad_ckpt):
    """Every expert's shapes are checked, not only expert 0's: expert 5 with half its rows would
    leave uninitialised memory in the rows the checkpoint did not fill."""
    match = WRONG_SHAPE.replace(".", r"\.")
    with pytest.raises(ExpertcacheError, match=match), engine_load(bad_ckpt("wrong_shape")) as model:
        for prompt in (PROMPT, PROMPT_B, list(range(40, 90))):
            greedy(model, torch.tensor([prompt]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"link_latency": "soon"}, "link latency"), ({"link_bandwidth": 0}, "link bandwidth")],
)
def test_link_options_are_validated_even_without_a_bandwidth(kwargs, message, ckpt):
    with pytest.raises(ExpertcacheError, match=message):
        load(ckpt("mixtral"), device="cpu", progress=False, **kwargs).close()


def test_the_link_may_be_given_as_a_config_but_not_twice(ckpt):
    """``load(link=LinkConfig(...))`` is the link the keywords would give; with them as well, one line."""
    from expertcache.config import LinkConfig

    link = LinkConfig("200MB/s", "0.5ms")
    with engine_load(ckpt("mixtral"), TOP_K, link=link) as model:
        assert model.link_config is link and model.stats["link"] == "0.2 GB/s, 500 us"
    for twice in ({"link_bandwidth": "1GB/s"}, {"link_latency": "20us"}):
        with pytest.raises(ExpertcacheError, match="link is given twice") as info:
            load(ckpt("mixtral"), device="cpu", progress=False, link=link, **twice)
        assert "\n" not in str(info.value)
    with pytest.raises(ExpertcacheError, match="link must be a LinkConfig \\(expertcache.config\\), not str"):
        load(ckpt("mixtral"), device="cpu", progress=False, link="200MB/s")


def test_loading_shows_progress_bars_when_asked(ckpt, capfd):
    """Long loads report progress on stderr: dense weights, then the experts filling host memory."""
    from expertcache.engine import load

    for progress in (True, False):
        with load(ckpt("mixtral"), device="cpu", slow_tier="host", progress=progress):
            pass
        err = capfd.readouterr().err
        assert ("dense weights" in err and "experts to host memory" in err) == progress


def test_router_outputs_are_found_in_either_order_transformers_uses():
    """transformers 5.23 routers return (logits, weights, index); 5.17's Granite-MoE (index, weights,
    logits): the gate-input predictors and routing replay find the index by type and shape."""
    from expertcache.engine.routing import router_parts

    logits, weights, index = torch.randn(3, 8), torch.rand(3, 2), torch.tensor([[1, 2], [0, 3], [4, 5]])
    module = torch.nn.Linear(2, 2)
    assert router_parts((logits, weights, index), module) == (0, 1, 2)
    assert router_parts((index, weights, logits), module) == (2, 1, 0)
    with pytest.raises(ExpertcacheError, match="did not return"):
        router_parts((logits, weights), module, 3)
    with pytest.raises(ExpertcacheError, match="no top-k weights"):
        router_parts((logits, torch.rand(3, 5), index), module)


def test_gate_input_routing_and_replay_with_a_router_in_the_older_order(ckpt):
    from expertcache.engine.routing import moe_routers, replay_routing, router_fns

    with engine_load(ckpt("mixtral"), 4) as model:
        model.generate_text("hello", 2)
        trace = model.trace()
        router = moe_routers(model.model)[0]
        x = torch.randn(trace.num_tokens, model.config.hidden_size, device=router.weight.device)
        logits, weights, index = router.forward(x)
        want = router_fns(model.model)[0](x)
        forward = router.forward
        router.forward = lambda h: tuple(reversed(forward(h)))  # transformers 5.17's Granite-MoE order
        assert torch.equal(router_fns(model.model)[0](x), want)
        replay = replay_routing(model.model, trace)
        try:
            got = replay._hook_for(0)(router, (x,), (index, weights, logits))
        finally:
            replay.remove()
    assert got[2] is logits and got[1].shape == weights.shape  # the same order back, logits untouched
    assert got[0].tolist() == trace.experts[:, 0].tolist()  # the trace's experts, in the index's place


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoint_tensors_are_views_of_one_map_equal_to_safe_open(make_ckpt, dtype):
    """The disk tier reads views of a memory map (safetensors' get_tensor keeps memory per call), and
    they hold exactly what safe_open reads, sharded checkpoints included."""
    from safetensors import safe_open

    from expertcache.engine.store import Checkpoint

    path = make_ckpt("qwen2_moe", dtype=dtype, max_shard_size="50KB")
    ckpt = Checkpoint(path)
    assert len(set(ckpt.files.values())) > 1  # sharded
    for key, file in ckpt.files.items():
        with safe_open(str(file), framework="pt") as f:
            want = f.get_tensor(key)
        got = ckpt.tensor(key)
        assert got.dtype == want.dtype and torch.equal(got, want), key
        assert ckpt.tensor(key).data_ptr() == got.data_ptr()  # the same view again, no new read
        if got.dim() > 1:
            last = got.shape[0] - 1
            assert torch.equal(ckpt.row(key, last), want[last])


def test_a_closed_model_frees_its_memory_without_waiting_for_the_garbage_collector(ckpt):
    """Loading one model after another in a process (a sweep) must not keep the closed ones' experts:
    close() breaks the engine's reference cycle, so the last reference going frees them at once."""
    import gc
    import weakref

    path = ckpt("mixtral")
    gc.collect()
    gc.disable()
    try:
        with engine_load(path, 8, slow_tier="host") as model:
            greedy(model, IDS)
            tier, pool = weakref.ref(model.tier), weakref.ref(model.pool)
        del model
        assert tier() is None and pool() is None
    finally:
        gc.enable()


class _OneSlowTier(_GateTier):
    """The first copy waits for ``gate``; every copy records the thread that made it. It copies on
    several threads at once (``concurrent``), so a waiting thread may take its transfers."""

    concurrent = True

    def copy_chunk(self, key, views, chunk, flat=None) -> None:
        if key == (0, 0):
            self.started.set()
            assert self.gate.wait(timeout=10)
        self.order.append((key, threading.current_thread().name))
        for name, start, stop, _ in chunk:
            views[name][start:stop].fill_(key[0] * 100 + key[1])


def test_a_waiting_thread_copies_a_transfer_the_worker_has_not_taken():
    """While the worker is inside a slow copy, a thread that waits for a queued transfer copies it
    itself rather than wait behind it; the worker then serves the rest, and nothing is copied twice."""
    tier, pool = _OneSlowTier(), _pool()
    worker = TransferWorker(tier, pool)
    assert worker.steal  # host slots, no link: the default
    try:
        slow = worker.submit((0, 0), 0, DEMAND)
        assert tier.started.wait(30)
        mine = worker.submit((0, 1), 1, SPECULATIVE)
        later = worker.submit((0, 2), 2, DEMAND)
        worker.wait(mine)  # returns while the worker still waits for the gate
        assert not slow.done.is_set()
        assert tier.order == [((0, 1), threading.current_thread().name)]
        assert worker.cancel(mine) is False and worker.stolen == 1
        tier.gate.set()
        worker.wait(slow)
        later.done.wait(30)
        worker.wait(later)
        assert [k for k, _ in tier.order] == [(0, 1), (0, 0), (0, 2)]
        for t in (slow, mine, later):
            assert (pool.buffer[t.slot] == t.key[1]).all()
        assert worker.bytes_moved == 3 * pool.layout.nbytes
    finally:
        tier.gate.set()
        worker.close()


def test_a_source_for_one_thread_is_never_copied_by_a_waiting_thread():
    """A source that keeps state for the worker's thread (a split expert's scratch slot) does not say
    ``concurrent``: its transfers stay with the worker."""
    tier, pool = _GateTier(), _pool()
    worker = TransferWorker(tier, pool)
    try:
        first = worker.submit((0, 0), 0, DEMAND)
        assert tier.started.wait(30)
        queued = worker.submit((0, 1), 1, DEMAND)
        threading.Timer(0.2, tier.gate.set).start()
        worker.wait(queued)
        worker.wait(first)
        assert worker.stolen == 0 and tier.order == [(0, 0), (0, 1)]
    finally:
        tier.gate.set()
        worker.close()


class _MemoryTier:
    """A fake tier that copies from memory (``concurrent``, not ``reads_device`` unless told):
    records the thread of every copy."""

    concurrent = True

    def __init__(self, reads_device: bool = False) -> None:
        self.reads_device = reads_device
        self.order: list[tuple[tuple[int, int], str]] = []

    def copy_chunk(self, key, views, chunk, flat=None) -> None:
        self.order.append((key, threading.current_thread().name))
        for name, start, stop, _ in chunk:
            views[name][start:stop].fill_(key[0] * 100 + key[1])


def test_a_demand_copy_from_memory_is_made_by_the_thread_that_submits_it():
    """A demand transfer from memory neither waits in the queue nor wakes the worker (the hand-off cost
    more than the copy): the submitting thread copies it there and then. A speculative one, or one from
    a tier that reads a device, goes to the worker at once."""
    tier, pool = _MemoryTier(), _pool()
    worker = TransferWorker(tier, pool)
    try:
        mine = worker.submit((0, 1), 1, DEMAND)
        assert mine.done.is_set() and not worker._heap
        assert tier.order == [((0, 1), threading.current_thread().name)] and worker.stolen == 1
        worker.wait(mine)
        assert (pool.buffer[1] == 1).all() and worker.bytes_moved == pool.layout.nbytes
        ahead = worker.submit((0, 2), 2, SPECULATIVE)
        assert ahead.done.wait(30)  # nobody waited: the worker took it
        assert tier.order[-1] == ((0, 2), "expertcache-transfer")
    finally:
        worker.close()
    tier, pool = _MemoryTier(reads_device=True), _pool()
    worker = TransferWorker(tier, pool)
    try:
        started = worker.submit((0, 3), 3, DEMAND)
        assert started.done.wait(30)
        assert tier.order == [((0, 3), "expertcache-transfer")] and worker.stolen == 0
    finally:
        worker.close()


def test_a_failed_copy_by_the_submitting_thread_is_reported_at_the_wait():
    """A demand copy made at submit that raises (after its retries) fails its transfer as the worker's
    would: the wait raises, naming the expert; the worker goes on."""
    tier, pool = _MemoryTier(), _pool()
    worker = TransferWorker(tier, pool, retries=1)
    tries = []
    worker.fault = lambda t, chunk, attempt: tries.append(attempt) or (_ for _ in ()).throw(OSError("bad"))
    try:
        bad = worker.submit((0, 1), 1, DEMAND)
        assert bad.done.is_set() and tries == [0, 1]
        with pytest.raises(ExpertcacheError, match=r"transfer of expert \(0, 1\) failed: bad"):
            worker.wait(bad)
        worker.fault = None
        worker.wait(worker.submit((0, 2), 2, DEMAND))
        assert (pool.buffer[2] == 2).all()

        def interrupt(t, chunk, attempt):
            raise KeyboardInterrupt

        worker.fault = interrupt  # Ctrl-C during the copy: the transfer fails, the wait re-raises it
        stopped = worker.submit((0, 3), 3, DEMAND)
        with pytest.raises(KeyboardInterrupt):
            worker.wait(stopped)
        with pytest.raises(KeyboardInterrupt):  # and again: the slot is never taken as filled
            worker.wait(stopped)
    finally:
        worker.close()


def test_a_large_demand_copy_goes_to_the_worker_only_when_a_processor_is_spare(monkeypatch):
    """A copy longer than a wake-up (a slot over ``LEAVE_BYTES``) is worth overlapping with the
    computation when the computation leaves the worker a processor (fewer torch threads than
    processors); with every processor computing the submitting thread copies it, as a small one."""
    from expertcache.engine import transfer

    rows = transfer.LEAVE_BYTES // (4 * 256) + 1  # float32 rows of 256: just over LEAVE_BYTES
    threads = torch.get_num_threads()
    for processors, by_worker in ((threads, False), (threads + 1, True)):
        monkeypatch.setattr(transfer, "_PROCESSORS", processors)
        tier, pool = _MemoryTier(), _pool(2, (rows, 256))
        worker = TransferWorker(tier, pool)
        try:
            t = worker.submit((0, 1), 1, DEMAND)
            assert t.done.wait(30)  # by the worker, unless the submit copied it
            worker.wait(t)
            assert (pool.buffer[1] == 1).all()
            assert worker.stolen == (0 if by_worker else 1)
            copier = "expertcache-transfer" if by_worker else threading.current_thread().name
            assert tier.order == [((0, 1), copier)]
        finally:
            worker.close()


def test_an_emulated_link_stays_serial():
    """With an emulated link no waiting thread copies (the link is one line, its time the worker's)."""
    tier, pool = _GateTier(), _pool()
    tier.gate.set()
    link = EmulatedLink(bandwidth=1e9)
    worker = TransferWorker(tier, pool, link)
    try:
        assert not worker.steal
        worker.wait(worker.submit((0, 1), 1, DEMAND))
        assert worker.stolen == 0
    finally:
        worker.close()
    with pytest.raises(ExpertcacheError, match="without a link"):
        TransferWorker(tier, pool, link, steal=True)


def test_the_worker_survives_a_transfer_whose_plan_raises():
    """A transfer for a part the worker has no target for fails alone; the worker goes on (before, the
    raise was outside the copy's guard and ended the thread: every later wait hung)."""
    tier, pool = _GateTier(), _pool()
    tier.gate.set()
    worker = TransferWorker(tier, pool, steal=False)
    try:
        bad = worker.submit((0, 1), 1, DEMAND, part="no such part")
        with pytest.raises(ExpertcacheError, match="failed"):
            worker.wait(bad)
        good = worker.submit((0, 2), 2, DEMAND)
        assert good.done.wait(30)
        worker.wait(good)
    finally:
        worker.close()


def test_a_profile_or_predictor_trace_of_another_checkpoint_is_said(make_ckpt, tmp_path):
    """A usage profile or a predictor's trace recorded on another checkpoint of the same shapes was taken
    in silence (a new user's trial): the trace records the checkpoint's fingerprint, and the engine says
    when it is not its own."""
    mine, other = make_ckpt("mixtral"), make_ckpt("mixtral", seed=1)
    with engine_load(other, expert_memory="50%") as model:
        model.generate_text("def read_config(path):", 4)
        model.save_trace(tmp_path / "other.npz")
    with engine_load(mine, expert_memory="50%") as model:
        model.generate_text("def read_config(path):", 4)
        model.save_trace(tmp_path / "mine.npz")
    for name, said in (("other", True), ("mine", False)):
        path = str(tmp_path / f"{name}.npz")
        for kwargs, what in (
            (dict(policy="static", profile=path), "the usage profile"),
            (dict(prefetch="token", predictor=path), "prefetch token's trace"),
        ):
            with engine_load(mine, expert_memory="50%", **kwargs) as model:
                notes = [n for n in model.notes if "recorded on another checkpoint" in n]
            assert bool(notes) == said, (name, kwargs)
            if said:
                assert notes[0].startswith(f"{what} {path} was recorded on another checkpoint ({other})")


def test_default_names_the_embedded_trace_for_a_profile_and_a_predictor_too(capsys):
    """``default`` is the embedded trace for sim, timing, doctor and trace info; ``--predictor default``
    and ``generate --profile default`` said "no such trace file" (a new user's trial)."""
    from expertcache.cli import main

    with load(None, expert_memory="30%", policy="static", profile="default", progress=False) as model:
        assert model.cache_config.policy == "static"
    with load(None, expert_memory="30%", prefetch="token", predictor="default", progress=False) as model:
        model.generate_text("def read_config(path):", 4)
        assert model.stats["prefetch_issued"] > 0
    argv = ["timing", "--capacity", "24", "--prefetch", "token", "--predictor", "default", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["prefetch_issued"] > 0
