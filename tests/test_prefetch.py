"""Proactive caching in the engine: prefetch, chunking, preemption and reordering never change outputs.

- ``ExpertCache`` alone with a scripted transport: what is prefetched, evicted, dropped, promoted.
- The engine against transformers' eager reference: identical tokens and logits for every predictor
  and switch, at random budgets and windows (hypothesis), under injected transfer faults and delays,
  and with predictions that are always wrong at the minimum budget (no deadlock).
- The chunked, preemptible transfer worker on its own.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time

import engine_fixtures
import numpy as np
import pytest
import torch
from engine_fixtures import (
    TOP_K,
    assert_exact,
    engine_load,
    greedy,
    moe_layers,
    total_experts,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertcache.cache.expert_cache import ExpertCache
from expertcache.cache.residency import Residency
from expertcache.cache.transfers import DEMAND, FAILED, PENDING, READY, SPECULATIVE
from expertcache.cli import main
from expertcache.config import PrefetchConfig
from expertcache.engine.memory import SlotLayout, SlotPool
from expertcache.engine.transfer import TransferWorker
from expertcache.errors import ExpertcacheError
from expertcache.miss.base import FULL, MissContext, MissPath
from expertcache.policy.base import PolicyContext
from expertcache.policy.registry import make_policy
from expertcache.predict.base import Predictor

IDS = torch.tensor([engine_fixtures.PROMPT])
_one_torch_thread = engine_fixtures._one_torch_thread
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
reference = engine_fixtures.reference
tokenizer_dir = engine_fixtures.tokenizer_dir
PREDICTORS = ("next-gate", "window", "token", "eam")


# ------------------------------------------------------------------------ ExpertCache, scripted
class _Handle:
    def __init__(self, key, victim, priority, seq):
        self.key, self.victim, self.priority, self.seq = key, victim, priority, seq
        self.state, self.started, self.cancelled = PENDING, False, False


class _Script:
    """A transport whose transfers finish only when the test says (or at ``wait``)."""

    def __init__(self):
        self.handles: list[_Handle] = []
        self.released: list = []

    def submit(self, key, victim, priority, part=FULL):
        h = _Handle(key, victim, priority, len(self.handles))
        self.handles.append(h)
        return h

    def cancel(self, h):
        if h.state != PENDING or h.started:
            return False
        h.cancelled, h.state = True, FAILED
        return True

    def promote(self, h):
        h.priority = DEMAND

    def poll(self, h):
        return h.state

    def started(self, h):
        return h.started

    def wait(self, h):
        assert not h.cancelled
        h.state = READY

    def release(self, key, part=FULL):
        self.released.append(key)


def _proactive(capacity=4, layers=3, experts=4, limit=2, **kw):
    ctx = PolicyContext(capacity=capacity, num_layers=layers, num_experts=experts, top_k=1)
    res = Residency(make_policy("lru", ctx))
    tr = _Script()
    miss = MissPath(MissContext(layers, experts, 1))
    return ExpertCache({FULL: res}, tr, miss, layers, limit=limit, **kw), tr, res


def test_a_split_expert_whose_bottom_was_prefetched_is_served_before_one_whose_bottom_is_missing():
    """Split experts (a top and a bottom part) where the bottoms have room for one a layer: the expert whose
    bottom is already resident (prefetched, now the layer's demand) goes first, so that its bottom is
    computed, and becomes evictable, before the other's bottom needs the room (the other way round, the
    first chunk found every bottom pinned: a PolicyError that the self-test met with Aria and ``eam``)."""
    ctx = PolicyContext(capacity=8, num_layers=2, num_experts=4, top_k=2)
    top = Residency(make_policy("lru", ctx))
    bottom = Residency(
        make_policy("lru-dist", PolicyContext(capacity=2, num_layers=2, num_experts=4, top_k=1))
    )
    tr = _Script()
    cache = ExpertCache({"top": top, "bottom": bottom}, tr, MissPath(MissContext(2, 4, 2)), 2, limit=2)
    top.admit([(0, 0)])  # expert 0's top cached
    bottom.admit([(0, 3)])  # expert 3's bottom prefetched
    items = [((0, 0), ("top", "bottom")), ((0, 3), ("top", "bottom"))]
    assert cache.chunks(0, items) == [[items[1]], [items[0]]]
    for chunk in cache.chunks(0, items):  # each admitted once the one before is served
        cache.admit(0, chunk)
        for key, part in cache.order(chunk):
            cache.wait(key, part)
    assert (0, 0) in bottom and (0, 3) not in bottom and {(0, 0), (0, 3)} <= top.resident


def test_prefetch_admits_through_the_policy_as_speculative_transfers():
    pro, tr, res = _proactive()
    assert pro.prefetch({1: [2, 3, 0]}) == 2  # limit 2 per layer
    assert [(h.key, h.priority) for h in tr.handles] == [((1, 2), SPECULATIVE), ((1, 3), SPECULATIVE)]
    assert (1, 2) in res and (1, 3) in res
    assert pro.prefetch({1: [2]}) == 0  # resident (in flight) already: nothing queued


def test_preemption_drops_unchosen_queued_prefetches_and_promotes_chosen_ones():
    pro, tr, res = _proactive()
    pro.prefetch({1: [2, 3]})
    order = list(pro.serve(1, [3, 1]))
    a, b = tr.handles[:2]
    assert a.cancelled and (1, 2) not in res and tr.released == [(1, 2)]
    assert b.priority == DEMAND and not b.cancelled
    assert tr.handles[2].key == (1, 1) and tr.handles[2].priority == DEMAND
    assert order == [(1, 3), (1, 1)]
    assert pro.stats.cancelled[1] == 1 and pro.stats.used[1] == 1 and pro.stats.misses[0, 1] == 1
    # counted by part too: the part's prefetches as queued, and of them the one that never moved
    got = pro.stats.to_dict()
    assert got["part_prefetches"] == {"full": 2} and got["part_cancelled"] == {"full": 1}


def test_without_preemption_stale_prefetches_stay_queued():
    pro, tr, res = _proactive(preemption=False)
    pro.prefetch({1: [2, 3]})
    list(pro.serve(1, [3, 1]))
    assert not tr.handles[0].cancelled and (1, 2) in res
    assert tr.handles[1].priority == SPECULATIVE


def test_prefetch_never_evicts_the_current_layer_in_flight_or_awaited_keys():
    pro, tr, res = _proactive(capacity=3, limit=3)
    list(pro.serve(0, [0, 1]))  # resident: (0,0), (0,1)
    pro.prefetch({1: [0, 1, 2]}, current=[(0, 0), (0, 1)])
    # one free slot: (1,0) is queued; (1,1) would need to evict (0,x) (current) or (1,0) (in flight)
    assert [h.key for h in tr.handles[2:]] == [(1, 0)]
    assert pro.stats.skipped_prefetches[1] == 2
    assert (0, 0) in res and (0, 1) in res


def test_reordering_computes_resident_then_moving_then_queued():
    pro, tr, res = _proactive(capacity=4, limit=4)
    list(pro.serve(0, [0]))  # (0,0) resident
    pro.prefetch({0: [1, 2]})
    tr.handles[-2].started = True  # (0,1) is being copied, (0,2) queued
    assert list(pro.serve(0, [3, 2, 1, 0])) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    pro2, tr2, _ = _proactive(capacity=4, limit=4, reorder=False)
    list(pro2.serve(0, [0]))
    pro2.prefetch({0: [1, 2]})
    assert list(pro2.serve(0, [3, 2, 1, 0])) == [(0, 3), (0, 2), (0, 1), (0, 0)]


def test_a_demand_miss_with_every_slot_in_flight_drains_speculation_instead_of_failing():
    pro, tr, res = _proactive(capacity=2, limit=2)
    pro.prefetch({1: [0, 1]})  # both slots now hold in-flight prefetches for layer 1
    tr.handles[0].started = True  # one is mid-copy: it must be waited for, not cancelled
    assert list(pro.serve(0, [3])) == [(0, 3)]
    assert tr.handles[1].cancelled and tr.handles[0].state == READY
    assert (0, 3) in res and len(res) <= 2


def test_accuracy_fetchrate_goodpred_counts():
    pro, tr, res = _proactive(capacity=4, limit=2)
    pro.prefetch({1: [0, 1]})
    tr.handles[0].state = READY  # (1,0) arrived in time; (1,1) was wrong
    list(pro.serve(1, [0, 2]))
    s = pro.stats.to_dict()
    assert pro.stats.actual[1] == 2 and pro.stats.correct[1] == 1 and pro.stats.in_time[1] == 1
    assert s["accuracy"] == 0.5 and s["fetchrate"] == 1.0 and s["goodpred"] == 0.5
    # nothing predicted: nothing measured, overall as per layer (a new user read 0.0 as "always wrong")
    from expertcache.cache.stats import prediction_quality

    zero = np.zeros(3, dtype=np.int64)
    quality = prediction_quality(zero, zero, zero)
    assert quality["accuracy"] is quality["fetchrate"] is quality["goodpred"] is None
    assert quality["accuracy_by_layer"] == [None, None, None]


# ------------------------------------------------------------------------- engine exactness
# (every family with next-gate at the minimum budget: tests/test_families.py)
_TRACES: dict = {}


def _trace_for(path):
    """A recorded trace of the model (another prompt): token's table and eam's warm start."""
    if path not in _TRACES:
        with engine_load(path) as model:
            greedy(model, torch.tensor([engine_fixtures.PROMPT_B]))
            _TRACES[path] = model.trace()
    return _TRACES[path]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_any_predictor_window_budget_and_switches_give_the_reference(data, ckpt, reference):
    family = data.draw(st.sampled_from(("mixtral", "gpt_oss", "qwen2_moe", "deepseek_v3")), label="family")
    predictor = data.draw(st.sampled_from(PREDICTORS), label="predictor")
    window = data.draw(st.integers(1, 3), label="window")
    policy = data.draw(st.sampled_from(("lru", "lfu", "llru", "lru-dist", "eam")), label="policy")
    low, high = moe_layers(family) * TOP_K, total_experts(family)
    cap = data.draw(st.integers(low, high), label="capacity")
    switches = {
        "chunking": data.draw(st.booleans(), label="chunking"),
        "preemption": data.draw(st.booleans(), label="preemption"),
        "reorder": data.draw(st.booleans(), label="reorder"),
    }
    path = ckpt(family)
    extra = {"predictor": _trace_for(path)} if predictor in ("token", "eam") else {}
    want = reference(path, IDS)
    with engine_load(
        path, cap, policy, prefetch=predictor, window=window, link_latency="30us", **switches, **extra
    ) as model:
        got = greedy(model, IDS)
    assert_exact(got, want)


def test_injected_delays_and_failures_are_retried_and_change_nothing(ckpt, reference):
    path = ckpt("mixtral")
    want = reference(path, IDS)
    rng = random.Random(7)
    failed: set = set()

    def fault(transfer, chunk, attempt):
        time.sleep(rng.random() * 2e-4)
        key = (transfer.key, transfer.seq, chunk)
        if attempt == 0 and rng.random() < 0.3 and key not in failed:
            failed.add(key)
            raise OSError("injected read error")

    with engine_load(path, moe_layers("mixtral") * TOP_K + 3, "lru", prefetch="window", window=2) as model:
        worker = model.worker
        worker.fault = fault
        got = greedy(model, IDS)
        reported = model.stats["retried_chunks"]
    # counted once the worker has stopped: a prefetch may still be failing and retrying after generate
    assert_exact(got, want)
    assert reported <= worker.retried == len(failed) > 0


def test_a_transfer_that_keeps_failing_is_one_clear_error(ckpt):
    path = ckpt("mixtral")

    def fault(transfer, chunk, attempt):
        raise OSError("disk gone")

    with engine_load(path, moe_layers("mixtral") * TOP_K) as model:
        model.worker.fault = fault
        with pytest.raises(Exception, match="failed: disk gone"):
            greedy(model, IDS)


class _AlwaysWrong(Predictor):
    """Predicts, for every layer, every expert the step will NOT use there (read from a recording)."""

    name = "always-wrong"

    def __init__(self, ctx, steps):
        super().__init__(ctx)
        self.steps, self.step = steps, -1
        self.num_experts = ctx.num_experts

    def _begin(self, token_ids, prefill, new_request, future):
        self.step += 1

    def _predict(self, source, target, gate_input):
        used = self.steps[self.step][target]
        return [e for e in range(self.num_experts) if e not in used]


def _recorded_groups(trace):
    out = []
    for step in np.unique(trace.step_id):
        rows = trace.experts[trace.step_id == step]
        out.append([set(rows[:, layer].reshape(-1).tolist()) for layer in range(trace.num_layers)])
    return out


@pytest.mark.parametrize("policy", ["lru", "lru-dist"])
def test_every_prediction_wrong_at_the_minimum_budget_neither_deadlocks_nor_changes_output(
    policy, ckpt, reference
):
    from expertcache.predict.base import PredictContext

    path = ckpt("mixtral")
    want = reference(path, IDS)
    low = moe_layers("mixtral") * TOP_K
    with engine_load(path, low, policy) as model:
        greedy(model, IDS)
        steps = _recorded_groups(model.trace())
    ctx = PredictContext(moe_layers("mixtral"), engine_fixtures.SPECS["mixtral"]["experts"], TOP_K, window=1)
    wrong = PrefetchConfig(_AlwaysWrong(ctx, steps))  # a predictor object, through the API
    with engine_load(path, low, policy, link_latency="50us", prefetch=wrong) as model:
        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(out=greedy(model, IDS)), daemon=True)
        worker.start()
        worker.join(timeout=120)
        assert not worker.is_alive(), "generation deadlocked"
        stats = model.stats
    assert_exact(result["out"], want)
    assert stats["prefetch_issued"] > 0 and stats["prefetch_used"] == 0
    assert stats["accuracy"] == 0.0


def test_the_trace_records_what_the_predictor_predicted(ckpt, tmp_path):
    path = ckpt("mixtral")
    with engine_load(path, moe_layers("mixtral") * TOP_K + 2, prefetch="next-gate") as model:
        greedy(model, IDS)
        trace = model.trace()
    assert trace.predicted is not None and trace.predicted.shape == trace.experts.shape
    assert trace.meta["predictor"] == "next-gate" and trace.meta["window"] == 1
    decode = trace.is_prefill == 0
    # next-gate predicts layers 1.. (layer 0 has nothing before it); every decode step predicts them all
    assert (trace.predicted[decode][:, 0] == -1).all()
    assert (trace.predicted[decode][:, 1:] >= 0).all()
    trace.save(tmp_path / "t.npz")
    from expertcache.trace.trace import load_trace

    assert np.array_equal(load_trace(tmp_path / "t.npz").predicted, trace.predicted)


def test_without_prefetch_the_engine_still_matches_the_simulator_with_chunking(ckpt):
    from expertcache.cache.schedule import build_schedule
    from expertcache.sim.replay import replay

    path = ckpt("mixtral")
    cap = moe_layers("mixtral") * TOP_K + 1
    with engine_load(path, cap, "lru", link_latency="20us") as model:
        greedy(model, IDS)
        stats, trace = model.stats, model.trace()
    sim = replay(build_schedule(trace, "layer"), "lru", cap)
    assert sim.misses == stats["misses"] and sim.requests == stats["requests"]


# --------------------------------------------------------------------------- transfer worker
class _SlowTier:
    name = "slow"

    def __init__(self):
        self.log: list = []
        self.gate = threading.Event()
        self.entered = threading.Event()  # set when the worker is inside a chunk: waited on, not slept for

    def copy_chunk(self, key, views, chunk, flat=None):
        self.entered.set()
        self.gate.wait(30)
        for name, start, stop, _ in chunk:
            views[name][start:stop].fill_(key[0] * 100 + key[1])
        self.log.append((key, chunk[0][1]))


def test_a_demand_transfer_overtakes_a_speculative_one_between_chunks():
    layout = SlotLayout.of({"w": (6, 4)}, torch.float32)
    pool = SlotPool(layout, 4, torch.device("cpu"))
    tier = _SlowTier()
    worker = TransferWorker(tier, pool, chunk_bytes=2 * 4 * 4, steal=False)  # 3 chunks of 2 rows
    try:
        spec = worker.submit((0, 1), 0, SPECULATIVE)
        assert tier.entered.wait(30)  # the worker is inside spec's first chunk
        demand = worker.submit((0, 2), 1, DEMAND)
        tier.gate.set()
        worker.wait(demand)
        worker.wait(spec)
    finally:
        worker.close()
    keys = [k for k, _ in tier.log]
    assert keys == [(0, 1), (0, 2), (0, 1), (0, 1)]  # the demand transfer moves whole: one copy
    assert torch.all(pool.buffer[0][: layout.numel] == 1) and torch.all(pool.buffer[1][: layout.numel] == 2)


def test_a_partly_moved_speculative_transfer_can_be_cancelled_and_one_can_be_promoted():
    layout = SlotLayout.of({"w": (6, 4)}, torch.float32)
    pool = SlotPool(layout, 4, torch.device("cpu"))
    tier = _SlowTier()
    worker = TransferWorker(tier, pool, chunk_bytes=2 * 4 * 4, steal=False)
    try:
        a = worker.submit((0, 1), 0, SPECULATIVE)
        assert tier.entered.wait(30)  # the worker is inside a's first chunk
        b = worker.submit((0, 2), 1, SPECULATIVE)
        c = worker.submit((0, 3), 2, SPECULATIVE)
        worker.promote(c)
        assert worker.cancel(b)
        tier.gate.set()
        worker.wait(c)
        worker.wait(a)
        b.done.wait(30)
    finally:
        worker.close()
    keys = [k for k, _ in tier.log]
    assert (0, 2) not in keys and keys.index((0, 3)) < keys.index((0, 1), 1)
    assert b.cancelled and a.started and c.moved == layout.nbytes


def test_chunks_cover_each_tensor_once():
    layout = SlotLayout.of({"gate_up_proj": (8, 5), "down_proj": (5, 4), "bias": (3,)}, torch.float32)
    for chunk_bytes in (None, 1, 20, 64, 10_000):
        covered: dict[str, list[int]] = {n: [] for n in layout.names}
        for chunk in layout.chunks(chunk_bytes):
            if chunk_bytes:
                assert len(chunk) == 1
            for name, start, stop, nbytes in chunk:
                covered[name] += range(start, stop)
                assert nbytes == (stop - start) * (nbytes // (stop - start))
        for name, shape in zip(layout.names, layout.shapes, strict=True):
            assert covered[name] == list(range(shape[0]))
    assert len(layout.chunks(None)) == 1


# ------------------------------------------------------------------------------------- CLI
def test_cli_generate_with_prefetch_reports_it(ckpt, capsys):
    path = ckpt("mixtral")
    rc = main(
        [
            "generate", "--model", str(path), "--prompt", "a b c", "--max-new-tokens", "4",
            "--expert-memory", "50%", "--device", "cpu", "--prefetch", "window", "--window", "1",
            "--no-preemption", "--chunk-size", "1kB", "--json",
        ]
    )  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["prefetch"] == "window" and out["window"] == 1 and out["preemption"] is False
    assert out["chunk_bytes"] == 1000 and out["reorder"] is True
    assert out["prefetch_limit"] == TOP_K  # ProMoE's default: top-k per predicted layer
    assert out["prefetch_issued"] >= out["prefetch_used"] >= 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prefetch", "oracle"], "simulator only"),
        (["--prefetch", "nope"], "unknown predictor 'nope'"),
        (["--prefetch", "window", "--window", "0"], "at least 1 layer"),
        (["--chunk-size", "0"], "chunk size must be a positive"),
        (["--prefetch", "window", "--prefetch-limit", "0"], "prefetch limit must be at least 1"),
        (["--chunk-size", "lots"], "chunk size"),
        (["--prefetch", "token", "--predictor", "/no/such/file.npz"], "predictor data"),
        (
            ["--prefetch", "none", "--prefetch-when", "pays"],
            "prefetch when 'pays' needs a predictor: --prefetch NAME",
        ),
        # options about prefetched experts without a predictor: refused, not ignored (a new user's)
        (["--prefetch", "none", "--prefetch-limit", "3"], "--prefetch-limit is about prefetched experts"),
        (["--prefetch", "none", "--no-preemption"], "--no-preemption is about prefetched experts"),
        (
            ["--prefetch", "window", "--prefetch-limit", "99"],
            "prefetch limit 99 is more than the 8 experts of a layer",
        ),
    ],
)
def test_cli_prefetch_errors_are_one_line_and_exit_2(ckpt, capsys, args, message):
    path = ckpt("mixtral")
    rc = main(["generate", "--model", str(path), "--prompt", "a", "--device", "cpu", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and "\n" not in err


def test_cli_lists_every_predictor(capsys):
    from expertcache.predict.registry import PREDICTORS

    assert main(["predictors"]) == 0
    out = capsys.readouterr().out
    for name in PREDICTORS:
        assert f"\n{name} " in "\n" + out
    assert "oracle     sim" in out


def test_cli_predictor_accuracy_reports_per_layer_accuracy(ckpt, tmp_path, capsys):
    path = ckpt("mixtral")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a b c d\ne f g\n")
    args = [
        "--model",
        str(path),
        "--prompts",
        str(prompts),
        "--predictors",
        "next-gate",
        "--window",
        "1",
        "2",
    ]
    rc = main(["predictor-accuracy", *args, "--max-new-tokens", "4", "--json"])
    out, err = capsys.readouterr()
    rows = json.loads(out)  # 2 MoE layers: window 2 predicts no further than window 1 (and says so)
    assert rc == 0 and [(r["name"], r["window"]) for r in rows] == [("next-gate", 1), ("next-gate", 1)]
    assert "note: prefetch window 2 reaches past a model of 2 MoE layers: next-gate predicts at most 1" in err
    layers = moe_layers("mixtral")
    for r in rows:
        assert len(r["per_layer"]) == layers and r["per_layer"][0] is None  # layer 0 is never predicted
        assert all(a is None or 0.0 <= a <= 1.0 for a in r["per_layer"]) and 0.0 <= r["accuracy"] <= 1.0
    assert err.count("reaches past a model of 2 MoE layers") == 1  # each predictor built once (said twice)
    assert main(["predictor-accuracy", "--model", str(path), "--predictors", "oracle"]) == 2
    assert "exact by definition" in capsys.readouterr().err
    for flags, needle in (  # one message an option, naming the flag; one new token has no decode step
        (["--max-new-tokens", "1"], "--max-new-tokens must be at least 2 (accuracy is counted over decode"),
        (["--window", "0"], "--window must be at least 1, got 0"),
    ):
        assert main(["predictor-accuracy", "--model", str(path), *flags]) == 2
        assert needle in capsys.readouterr().err


def test_evaluate_model_takes_one_prompt_name_or_window_as_one(ckpt):
    """evaluate_model(prompts="def f", names="next-gate") ran five one-letter prompts, and asked for
    predictor 'n'."""
    from expertcache.tools.predictor_accuracy import evaluate_model

    rows = evaluate_model(ckpt("mixtral"), "a b c d", "next-gate", 1, max_new_tokens=3)
    assert [(r["name"], r["window"], r["steps"]) for r in rows] == [("next-gate", 1, 2)]
    for kwargs, needle in (
        ({"prompts": ["a", 5]}, "prompts holds int 5; it takes text"),
        ({"windows": [1, "2"]}, "windows holds str '2'; it takes whole numbers"),
        ({"max_new_tokens": 1}, "max_new_tokens must be at least 2"),
    ):
        with pytest.raises(ExpertcacheError, match=re.escape(needle)):
            evaluate_model(ckpt("mixtral"), **{"prompts": "a b", **kwargs})


@pytest.mark.parametrize("name", ["next-gate", "window", "eam"])
def test_a_predictor_on_its_own_thread_changes_nothing_but_timing(name, ckpt, reference):
    path = ckpt("mixtral")
    want = reference(path, IDS)
    extra = {"predictor": _trace_for(path)} if name == "eam" else {}
    low = moe_layers("mixtral") * TOP_K
    with engine_load(path, low + 1, "lru", prefetch=name, predictor_thread=True, **extra) as model:
        got = greedy(model, IDS)
        thread, stats = model.driver.predictor, model.stats
        assert stats["predictor_thread"] is True
        for _, future in list(thread._pending):  # what is still out, finished (the thread may have been slow)
            future.result(timeout=60)
        thread.ready()
        calls, returned = thread.calls, thread.collected + thread.stale
    assert_exact(got, want)
    steps = engine_fixtures.NEW  # one prefill step and NEW - 1 decode steps
    assert calls == steps * (1 + moe_layers("mixtral"))  # begin_step + one call per layer, every step
    # every result comes back, without the compute thread waiting for it; whether in time to prefetch is
    # timing's (on a tiny model a window-1 prediction often lands after its layer): see
    # test_predictor_thread_...
    assert returned == calls


class _Slow:
    """A predictor whose calls take a while and record their order."""

    window = 1

    def __init__(self):
        self.seen = []
        self.gate = threading.Event()

    def begin_step(self, *args):
        self.gate.wait(30)
        self.seen.append("begin")
        return {0: [1]}

    def after_router(self, layer, *args):
        self.seen.append(layer)
        if layer == 9:
            raise ValueError("predictor broke")
        return {layer + 1: [layer]}


def test_predictor_thread_never_waits_keeps_order_drops_stale_and_surfaces_errors():
    from expertcache.engine.runtime import PredictorThread

    slow = _Slow()
    pt = PredictorThread(slow)
    try:
        pt.begin_step()
        pt.after_router(0)
        assert pt.ready() == []  # nothing finished yet: no waiting
        slow.gate.set()
        deadline = time.time() + 30
        got = []
        while len(got) < 2 and time.time() < deadline:
            got += pt.ready()
        assert got == [{0: [1]}, {1: [0]}] and slow.seen == ["begin", 0]
        pt.after_router(3)
        pt.begin_step()  # a new step: layer 3's prediction belongs to the old one
        deadline = time.time() + 30
        while pt._pending and time.time() < deadline:
            got = pt.ready()
        assert pt.stale == 1 and got == [{0: [1]}]
        pt.after_router(9)
        time.sleep(0.05)
        with pytest.raises(ValueError, match="predictor broke"):
            while time.time() < deadline + 5:
                pt.ready()
    finally:
        pt.close()


def test_transfers_move_in_chunks_only_where_something_speculative_can_be_waited_behind(ckpt):
    """Chunks bound a demand transfer's wait behind a prefetch; without a prefetcher or a miss path's
    background fills an expert moves in one piece per tensor, unless a chunk size is given. The timing
    simulator applies the same rule."""
    from expertcache.sim.timing import simulate_timing
    from expertcache.trace.default import default_trace

    assert not PrefetchConfig("none").chunked() and PrefetchConfig("none").chunked(background=True)
    assert PrefetchConfig("next-gate").chunked() and PrefetchConfig("none", chunk_size="4KiB").chunked()
    assert not PrefetchConfig("next-gate", chunking=False).chunked()
    path = ckpt("mixtral")
    with engine_load(path, 4) as model:
        assert model.chunk_bytes is None and model.stats["chunking"] is None
    with engine_load(path, 4, miss="host:fill=1") as model:  # background fills: chunking is decided
        assert "measured" in model.stats["chunking"]
    for miss in ("hybrid", "split:theta=0.5"):  # every transfer a demand one: whole
        with engine_load(path, 4, miss=miss) as model:
            assert model.chunk_bytes is None and model.stats["chunking"] is None
    with engine_load(path, 4, miss="split:theta=0.5", prefetch="next-gate") as model:  # no whole-expert slot
        assert model.chunk_bytes == -(-model.layout.nbytes // 3) and "thirds" in model.stats["chunking"]
    # where chunks pay: an expert's data takes more than 5 chunk latencies (here the emulated link's)
    with engine_load(path, 4, prefetch="next-gate", link_bandwidth="1MB/s", link_latency="1us") as model:
        assert model.chunk_bytes == -(-model.layout.nbytes // 3)
        assert "link" in model.stats["chunking"] and "thirds" in model.stats["chunking"]
    with engine_load(path, 4, prefetch="next-gate", link_bandwidth="100GB/s", link_latency="50us") as model:
        assert model.chunk_bytes is None and "chunks do not pay" in model.stats["chunking"]
    with engine_load(path, 4, prefetch="next-gate", chunk_size="1KiB") as model:
        assert model.chunk_bytes == 1024 and "given" in model.stats["chunking"]
    with engine_load(path, 4, prefetch="next-gate") as model:  # no link: measured through the worker
        assert "measured" in model.stats["chunking"] and model.stats["bytes_transferred"] == 0
    tr = default_trace()
    plain = simulate_timing(tr, 24).to_dict()
    prefetched = simulate_timing(tr, 24, prefetch="oracle").to_dict()  # a predictor a trace can replay
    assert plain["chunks_per_expert"] == 1 and prefetched["chunks_per_expert"] == 3


# --------------------------------------------------------------------------- the default: auto, while it pays
def test_the_default_is_the_models_predictor_used_only_while_it_pays(ckpt, tmp_path):
    from expertcache.engine import load

    path = ckpt("mixtral")
    kw = {"expert_memory": 4 * engine_fixtures._slot_bytes(path), "device": engine_fixtures.DEVICE}
    with load(path, progress=False, **kw) as model:  # no prefetch given
        stats = model.stats
        assert model.prefetch == "next-gate" and model.governor is not None  # every family has routers
        assert stats["prefetch"] == "next-gate" and stats["prefetch_when"] == "pays"
        assert stats["prefetch_governor"]["state"] == "warm" and not stats["prefetch_governor"]["prefetching"]
    with load(path, device=engine_fixtures.DEVICE, progress=False) as model:  # 100 %: nothing to fetch
        assert model.predictor is None and model.governor is None and model.chunk_bytes is None
        assert model.stats["prefetch_governor"]["state"] == "idle"
    with load(path, progress=False, prefetch="next-gate", **kw) as model:  # named: always on
        assert model.governor is None and model.stats["prefetch_governor"] is None
    trace_file = tmp_path / "other.npz"
    with engine_load(path, 4) as model:
        greedy(model, torch.tensor([engine_fixtures.PROMPT_B]))
        model.save_trace(trace_file)
    with load(path, progress=False, predictor=str(trace_file), **kw) as model:
        assert model.prefetch == "eam" and model.governor is not None  # auto learning from a recorded trace


def test_a_named_predictor_may_be_governed_and_auto_always_on(ckpt):
    path = ckpt("mixtral")
    with engine_load(path, 4, prefetch="next-gate", prefetch_when="pays") as model:
        assert model.governor is not None and model.stats["prefetch_when"] == "pays"
    with engine_load(path, 4, prefetch="auto", prefetch_when="always") as model:
        assert model.governor is None and model.prefetch == "next-gate"
    with pytest.raises(ExpertcacheError, match="needs a predictor"):
        PrefetchConfig("none", when="pays")
    with pytest.raises(ExpertcacheError, match="^prefetch_limit is about prefetched experts.*prefetch=NAME"):
        PrefetchConfig("none", limit=2)
    with pytest.raises(ExpertcacheError, match="^preemption=False is about prefetched experts"):
        PrefetchConfig("none", preemption=False)
    with pytest.raises(ExpertcacheError, match="prefetch when 'sometimes'"):
        PrefetchConfig("auto", when="sometimes")


class _Alternate:
    """A governor that predicts in every other step (deterministic, unlike the wall clock's)."""

    clock = staticmethod(time.perf_counter)

    def __init__(self) -> None:
        self.step = 0

    def begin_step(self, *args) -> bool:
        self.step += 1
        return self.step % 2 == 0


def test_steps_switched_off_predict_nothing_record_nothing_and_stay_exact(ckpt, reference):
    path = ckpt("mixtral")
    with engine_load(
        path, moe_layers("mixtral") * TOP_K + 2, prefetch="next-gate", prefetch_when="pays"
    ) as m:
        m.driver.governor = _Alternate()
        got = greedy(m, IDS)
        trace, stats = m.trace(), m.stats
    assert_exact(got, reference(path, IDS))
    steps = np.unique(trace.step_id)
    predicted = [bool((trace.predicted[trace.step_id == s] >= 0).any()) for s in steps]
    assert predicted == [s % 2 == 1 for s in range(len(steps))]  # steps 2, 4, ... (0-based 1, 3, ...)
    assert stats["prefetch_issued"] > 0


def test_cli_the_default_reports_what_the_governor_decided(ckpt, capsys):
    from expertcache.cli.generate import PREFETCH_WHEN
    from expertcache.config import WHEN

    assert PREFETCH_WHEN == WHEN  # the CLI's choices, kept without importing the config at start-up
    path = ckpt("mixtral")
    base = ["generate", "--model", str(path), "--prompt", "a b c", "--max-new-tokens", "4", "--device", "cpu"]
    assert main([*base, "--expert-memory", "50%", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prefetch"] == "next-gate" and out["prefetch_when"] == "pays"
    gov = out["prefetch_governor"]
    assert gov["state"] == "warm" and gov["steps_on"] == 0 and gov["steps_off"] >= 4
    assert main([*base, "--expert-memory", "50%"]) == 0
    err = capsys.readouterr().err
    assert (
        "prefetch next-gate, window 1 | while it pays: not yet decided, measuring on-demand first; 0 of"
        in err
    )
    assert main([*base, "--json"]) == 0  # 100 %: nothing to prefetch, and no prefetch line
    out = json.loads(capsys.readouterr().out)
    assert out["prefetch_governor"]["state"] == "idle" and out["window"] is None
    assert main(base) == 0
    assert "prefetch" not in capsys.readouterr().err


def test_cli_timing_governs_a_named_predictor_and_refuses_auto(capsys):
    assert main(["timing", "--prefetch", "oracle", "--prefetch-when", "pays", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prefetch_governor"]["steps_on"] + out["prefetch_governor"]["steps_off"] > 0
    assert main(["timing", "--prefetch", "oracle", "--prefetch-when", "pays"]) == 0
    side = "on" if out["prefetch_governor"]["prefetching"] else "off"
    assert f"prefetch oracle (window 1), while it pays: {side}, " in capsys.readouterr().out
    assert main(["timing", "--prefetch", "oracle", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prefetch_governor"] is None
    assert main(["timing", "--prefetch", "auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert "engine's choice" in err and "\n" not in err


def test_cli_sim_says_when_the_replayed_run_prefetched(ckpt, capsys, tmp_path):
    path = ckpt("mixtral")
    trace = tmp_path / "run.npz"
    args = ["generate", "--model", str(path), "--prompt", "a b c", "--max-new-tokens", "4", "--device", "cpu"]
    assert (
        main([*args, "--expert-memory", "50%", "--prefetch", "next-gate", "--record-trace", str(trace)]) == 0
    )
    capsys.readouterr()
    assert main(["sim", str(trace), "--policy", "lru", "--capacity", "8"]) == 0
    err = capsys.readouterr().err
    assert "this run prefetched (next-gate, in 4 of 4 steps)" in err and "--prefetch recorded" in err
    assert "--policy" not in err  # LRU, timing's own default
    assert main(["sim", str(trace), "--policy", "reuse:weights=/nonexistent.json", "--capacity", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "/nonexistent.json" in err and "\n" not in err  # the error alone, not the note before it
    run = [*args, "--expert-memory", "50%", "--prefetch", "next-gate", "--record-trace", str(trace)]
    assert main([*run, "--policy", "llru"]) == 0
    capsys.readouterr()
    assert main(["sim", str(trace), "--policy", "llru", "--capacity", "8"]) == 0
    err = capsys.readouterr().err  # the command replays the run's own policy (it said LRU's)
    assert f"'expertcache timing --trace {trace} --policy llru --prefetch recorded' replays it" in err
    assert main([*args, "--expert-memory", "50%", "--prefetch", "none", "--record-trace", str(trace)]) == 0
    capsys.readouterr()
    assert main(["sim", str(trace), "--policy", "lru", "--capacity", "8"]) == 0
    assert "prefetched" not in capsys.readouterr().err


@pytest.mark.parametrize("miss", ["fetch", "hobbit:bits=8"])
def test_a_deterministic_run_repeats_whatever_the_transfers_take(ckpt, tmp_path, miss):
    """deterministic=True: every transfer lands before the cache's next decision, so hits, misses,
    prefetches and what the miss path did (HOBBIT's low-precision uses) are the same however long each
    transfer takes (random delays injected here), and the outputs equal each other; the run says it
    repeats (``varies_by`` empty). Without it the same run names what it follows."""
    path = ckpt("mixtral")
    if miss.startswith("hobbit"):
        from expertcache.tools.quantize import quantize_model

        quantize_model(path, bits=(8,), progress=False)  # int8: one file whatever the group
    capacity = moe_layers("mixtral") * TOP_K + 3
    keys = ("hits", "misses", "prefetch_issued", "prefetch_used", "prefetch_cancelled", "low_precision",
            "misses_by_layer", "bytes_transferred")  # fmt: skip
    runs = []
    for seed in (1, 2, 3):
        rng = random.Random(seed)
        kw = dict(prefetch="window", window=1, miss=miss, deterministic=True)
        with engine_load(path, capacity, "lru", **kw) as m:
            m.worker.fault = lambda transfer, chunk, attempt, rng=rng: time.sleep(rng.random() * 1e-3)
            out = greedy(m, IDS)
            stats = m.stats
        assert stats["deterministic"] and stats["varies_by"] == [] and stats["prefetch_when"] == "always"
        runs.append((out, {k: stats[k] for k in keys}))
    assert runs[0][1]["prefetch_issued"] > 0 and runs[0][1]["misses"] > 0
    for out, stats in runs[1:]:
        assert stats == runs[0][1]
        assert_exact(out, runs[0][0])
    with engine_load(path, capacity, "lru", prefetch="window", window=1, miss=miss) as m:
        assert m.stats["varies_by"] == ["when transfers in flight land"]
    with engine_load(path, None, "lru", prefetch="window", window=1, miss=miss) as m:  # all resident
        assert m.stats["varies_by"] == ([] if miss == "fetch" else ["when transfers in flight land"])


def test_deterministic_refuses_what_follows_measured_times():
    assert PrefetchConfig("auto", deterministic=True).when == "always"
    assert PrefetchConfig("auto").when == "pays"
    with pytest.raises(ExpertcacheError, match="prefetch when 'pays' follows measured times"):
        PrefetchConfig("auto", when="pays", deterministic=True)
    with pytest.raises(ExpertcacheError, match="a predictor thread races"):
        PrefetchConfig("window", thread=True, deterministic=True)


def test_a_deterministic_run_s_prefetches_replay_exactly_given_its_link(ckpt, capsys, tmp_path):
    """The README's claim: a run with a predictor always on (``--deterministic``) replays through
    ``timing --prefetch recorded --deterministic`` to its own hits, misses and prefetches on any link, as
    it does given the run's link (a CPU's copies land at once: an instant link); the default cost model's
    PCIe link without ``--deterministic`` leaves some in flight."""
    path = ckpt("mixtral")
    trace = tmp_path / "run.npz"
    argv = ["generate", "--model", str(path), "--prompt", "a b c d e f", "--max-new-tokens", "12", "--device",
            "cpu", "--expert-memory", "50%", "--prefetch", "next-gate", "--deterministic",
            "--record-trace", str(trace), "--json", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    run = json.loads(capsys.readouterr().out)
    assert run["prefetch_issued"] > 0 and run["misses"] > 0
    replay = ["timing", "--trace", str(trace), "--prefetch", "recorded", "--policy", "lru",
              "--capacity", str(run["capacity_experts"]), "--json"]  # fmt: skip
    keys = ("hits", "misses", "prefetch_issued", "prefetch_used", "prefetch_cancelled")
    for link in (["--link-bandwidth", "1000TB/s", "--link-latency", "0us"], ["--deterministic"]):
        assert main([*replay, *link]) == 0
        got = json.loads(capsys.readouterr().out)
        assert {k: got[k] for k in keys} == {k: run[k] for k in keys}


def test_predictor_accuracy_refuses_a_predictor_file_nothing_reads(capsys, tmp_path):
    """PREDICTORS.md: a --predictor no named predictor reads is refused in one line, not ignored."""
    from expertcache.trace.default import default_trace

    trace = tmp_path / "t.npz"
    default_trace().save(trace)
    for path, why in ((str(trace), "reads no recorded trace"), (str(tmp_path), "a trained predictor")):
        assert main(["predictor-accuracy", "--predictors", "next-gate", "--predictor", path]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err


def test_a_trace_predictor_on_the_embedded_model_says_what_it_learns_from():
    """A new user's trial: `generate --prefetch token` on the embedded model learned from its own
    recorded trace without a word, where `predictor-accuracy --predictors token` asks for a trace."""
    from expertcache.engine import load
    from expertcache.engine.hub import DEFAULT_MODEL

    for name in ("token", "eam"):
        with load(DEFAULT_MODEL, "50%", device="cpu", prefetch=name, progress=False) as model:
            said = f"prefetch {name} learns from the embedded model's own"
            assert any(n.startswith(said) for n in model.notes)
    with load(DEFAULT_MODEL, "50%", device="cpu", prefetch="next-gate", progress=False) as model:
        assert not any("learns from" in n for n in model.notes)


@pytest.mark.parametrize("predictor", ["oracle", "eam"])
def test_every_prefetch_is_used_cancelled_or_unused(predictor):
    """``prefetch_unused``: the prefetches that landed and were not chosen by their layer (a trial asked
    what became of the rest of them): issued = used + cancelled + unused, in the timing model's counts."""
    from expertcache.sim.timing import simulate_timing
    from expertcache.trace.default import default_trace

    trace = default_trace()
    r = simulate_timing(trace.select(range(600)), 24, prefetch=predictor).cache
    assert r["prefetch_issued"] > 0 and r["prefetch_unused"] >= 0
    assert r["prefetch_issued"] == r["prefetch_used"] + r["prefetch_cancelled"] + r["prefetch_unused"]
    assert (r["prefetch_unused"] > 0) == (predictor != "oracle")  # the oracle names the chosen experts


def test_a_prefetch_evicted_before_its_layer_is_counted_evicted_not_used_or_late():
    """A new user's trial: on a settled link (nothing moving at any decision) 113 of the oracle's
    prefetches were counted used and late; a demand transfer of a layer in between had evicted them, and
    they were fetched again. Now: evicted, neither used nor late, and among the unused."""
    from expertcache.config import PrefetchConfig
    from expertcache.sim.timing import simulate_timing
    from expertcache.trace.default import default_trace

    settled = PrefetchConfig("oracle", window=3, deterministic=True)
    r = simulate_timing(default_trace(), 24, prefetch=settled).cache
    assert r["prefetch_late"] == 0  # nothing was moving when any layer asked
    assert r["prefetch_evicted"] > 0 and r["prefetch_unused"] == r["prefetch_evicted"]  # the oracle's own
    assert r["prefetch_issued"] == r["prefetch_used"] + r["prefetch_cancelled"] + r["prefetch_unused"]
    # the engine counts them alike (the cache's accounting is shared): its own stats, and its replay
    import expertcache as ec

    engine_settled = PrefetchConfig("next-gate", window=1, deterministic=True)  # an engine's predictor
    with ec.load(expert_memory="25%", prefetch=engine_settled, device="cpu") as model:
        model.generate_text("def read_config(path):", max_new_tokens=24)
        stats = model.stats
    assert stats["prefetch_late"] == 0 and stats["prefetch_evicted"] >= 0
    assert (
        stats["prefetch_issued"]
        == stats["prefetch_used"] + stats["prefetch_cancelled"] + stats["prefetch_unused"]
    )


def test_each_generations_bytes_are_what_its_own_transfers_moved():
    """A new user's `generate --prompts` with prefetching on a slow link: a batch's bytes were 593.33
    experts' where its transfers that landed were 594, the rest counted in the next batch. A generation
    now waits for its last transfers to land (cancelling none) before its counts are taken."""
    import warnings

    import expertcache as ec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ec.load(expert_memory="25%", prefetch="next-gate", link_bandwidth="20MB/s", progress=False) as m:
            size, total = m.stats["expert_bytes"], 0
            for prompt in ("def read_config(path):", "import os\n", "class Stack:"):
                s = m.generate_text(prompt, 6).stats
                landed = s["misses"] + s["prefetch_issued"] - s["prefetch_cancelled"]
                assert s["bytes_transferred"] == landed * size, prompt
                total += s["bytes_transferred"]
            assert total == m.stats["bytes_transferred"]
