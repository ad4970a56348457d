"""The compiled simulator (numba) equals the Python reference request for request.

- Replays of LRU, FIFO, LFU, LCP, LLRU, OPT and their -dist forms (uniform and given budgets), and of
  ``reuse`` (its parameters and routing scores included), on every
  order, at many capacities (from the smallest feasible, where prefill groups are split into chunks, to
  all experts), on synthetic traces, the embedded one's first 1600 tokens and the shared real one when
  present, and on
  random traces (hypothesis): the same misses per phase and layer.
- LRU's and OPT's stack depths, and the curves ``run_policy`` builds with them.
- ``run_policy`` and ``simulate`` pick the compiled path by themselves on large schedules, and the
  planner's per-layer curves where their replays together are large.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_fixtures import prefix

from expertcache.cache.residency import Residency
from expertcache.cache.schedule import ORDERS, build_schedule
from expertcache.errors import ExpertcacheError, PolicyError
from expertcache.sim import fast, simulate, stack
from expertcache.sim.curves import misses_by_layer, run_policy
from expertcache.sim.replay import policy_for, replay
from expertcache.trace import Trace, load_trace, synthesize

QWEN = Path(__file__).resolve().parents[2] / "shared" / "traces" / "qwen15_moe_a27b_chat.npz"
COMPILED = ["lru", "fifo", "lfu", "lcp", "llru", "opt"]
COMPILED += [f"{n}-dist" for n in COMPILED] + ["reuse"]

pytestmark = pytest.mark.skipif(not fast.available(), reason="numba is not installed")

TRACES = {
    "sticky": lambda: synthesize(
        "sticky", tokens=1500, layers=4, experts=8, top_k=2, seed=2, sequences=3, prompt_len=40
    ),
    "zipf": lambda: synthesize("zipf", tokens=1000, layers=3, experts=16, top_k=4, seed=5),
    "embedded": lambda: prefix(1600),  # its first requests (a third of it: the same code paths, sooner)
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", list(TRACES))
def test_compiled_depths_equal_the_reference(name, order):
    s = build_schedule(TRACES[name](), order)
    assert np.array_equal(fast.lru_depths(s), stack.lru_depths(s))
    assert np.array_equal(fast.opt_depths(s), stack.opt_depths(s))


def test_compiled_curves_equal_replays():
    s = build_schedule(TRACES["sticky"](), "layer")
    caps = [s.max_group, s.max_group + 3, 20, 32]
    for name, depths in (("lru", fast.lru_depths(s)), ("opt", fast.opt_depths(s))):
        curve = misses_by_layer(s, depths, caps)
        for c, per in zip(caps, curve, strict=True):
            assert per.tolist() == replay(s, name, c).layer_misses.tolist()


def _capacities(s) -> list[int]:
    """From the smallest feasible capacity (groups split) to all experts."""
    K, low = s.num_layers * s.num_experts, s.min_room
    return sorted(c for c in {low, low + 1, s.max_group, K // 4, K // 2, K - 1, K} if low <= c <= K)


def reference_hits(s, name: str, capacity: int, **params) -> np.ndarray:
    """Whether each request hits, by the Python policy object and ``Residency``: the replay loop of
    ``sim/replay.py`` with each chunk's misses kept. uint8 [R]"""
    policy = policy_for(s, name, capacity, 0, **params)
    residency, clock = Residency(policy), policy.clock
    hits = np.zeros(s.num_requests, dtype=np.uint8)
    L, per_layer, r = s.num_layers, s.per_layer, 0
    for g, keys in enumerate(s.groups):
        rnd, layer = g // (per_layer * L), (g // per_layer) % L
        clock.round, clock.layer, clock.group = rnd, layer, g
        clock.token, clock.seq = int(s.round_token[rnd]), int(s.round_seq[rnd])
        if not keys:  # an empty group is no event (replay's rule: a round without one is not seen)
            continue
        scores = s.group_scores[g] if policy.observes and s.group_scores is not None else None
        chunks = residency.chunks(layer, keys)
        missed = {key for chunk in chunks for key, _ in residency.admit(chunk, scores=scores)}
        for key in keys:  # a group's requests are its keys, in order
            assert s.key(s.req_key[r]) == key
            hits[r] = key not in missed
            r += 1
    assert r == s.num_requests
    return hits


def _check_replays(s, names=COMPILED, caps=None) -> int:
    """Each policy at each capacity: the compiled replay's misses per layer are ``replay``'s; request for
    request its hits are ``reference_hits``' at a policy's smallest and middle capacities (the slow
    oracle: at every capacity it was half of this module's time)."""
    checked = 0
    for name in names:
        feasible = [
            c for c in caps or _capacities(s) if not name.endswith("-dist") or c >= s.num_layers * s.min_room
        ]
        for c in feasible:
            ref = replay(s, name, c)
            got, rooms, hits = fast.replay(s, name, c, record=True)
            assert got.tolist() == ref.layer_misses.tolist(), (name, c, s.order)
            if c in (feasible[0], feasible[len(feasible) // 2]):  # request for request
                assert np.array_equal(hits, reference_hits(s, name, c)), (name, c, s.order)
            assert bool((rooms < s.max_group_by_layer).any()) == ref.split_groups
            checked += 1
    return checked


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", list(TRACES))
def test_compiled_replays_equal_the_reference(name, order):
    s = build_schedule(TRACES[name](), order)
    caps = _capacities(s)
    if name == "embedded":  # the largest: the smallest feasible capacity, the largest group, a quarter, all
        caps = sorted({caps[0], s.max_group, s.num_layers * s.num_experts // 4, caps[-1]})
    assert _check_replays(s, caps=caps) >= 6 * len(caps)  # the -dist forms need one slot per layer


@pytest.mark.parametrize("order", ORDERS)
def test_opt_heap_and_scan_kernels_both_equal_the_reference(order, monkeypatch):
    """OPT runs on a scan kernel up to ``SCAN_MAX`` slots and on ``replay``'s heap above: both exact."""
    for make in TRACES.values():
        s = build_schedule(make(), order)
        for scan_max in (0, 10**9):
            monkeypatch.setattr(fast, "SCAN_MAX", scan_max)
            assert _check_replays(s, names=["opt"]) >= 4
    assert fast._scans(s, 16) and not fast._scans(s, fast.SCAN_MAX + 1)


@pytest.mark.skipif(not QWEN.exists(), reason="the shared real trace is not here")
@pytest.mark.parametrize("order", ["layer", "flat"])
def test_compiled_replays_equal_the_reference_on_the_real_trace(order):
    tr = load_trace(QWEN)
    tr = Trace(tr.experts[:300], tr.num_experts)
    s = build_schedule(tr, order)
    K = s.num_layers * s.num_experts
    assert _check_replays(s, caps=[s.num_layers * s.min_room, K // 4, K // 2]) >= 30


def test_given_budgets_and_parameters_run_compiled():
    s = build_schedule(TRACES["sticky"](), "layer")
    budgets = [2, 3, 5, 6]
    cases = [("lru-dist", {"budgets": budgets}), ("lcp-dist", {"budgets": budgets, "rho": 0.5}),
             ("lcp", {"rho": 0.1, "omega": 16.0}), ("opt-dist", {"budgets": budgets})]  # fmt: skip
    for name, params in cases:
        got, rooms = fast.replay(s, name, 16, params)
        assert rooms.tolist() == (budgets if "budgets" in params else [16] * 4)
        assert got.tolist() == replay(s, name, 16, **params).layer_misses.tolist(), name
    with pytest.raises(PolicyError, match="budgets sum"):
        fast.replay(s, "lru-dist", 10, {"budgets": budgets})
    assert not fast.supports("marking") and not fast.supports("lru", {"budgets": [1]})
    assert not fast.supports("reuse-dist") and not fast.supports("reuse", {"rho": 1})


def test_reuse_parameters_and_scores_run_compiled(tmp_path):
    """``reuse``'s weights, learning rate and horizon reach the kernel; routing scores (the trace's gate
    weights) and their absence (a schedule without its trace: 1 per request) both match the object."""
    from expertcache.tools.train_policy import train_policy, write_weights

    tr = synthesize("sticky", tokens=500, layers=4, experts=8, top_k=2, seed=2, sequences=3, prompt_len=40)
    weights = tmp_path / "w.json"
    write_weights(train_policy([TRACES["zipf"]()], ["zipf"], orders=("flat",)), weights)
    ex = tr.experts
    scored = Trace(ex, tr.num_experts, weights=np.random.default_rng(0).random(ex.shape).astype(np.float32),
                   seq_id=tr.seq_id, is_prefill=tr.is_prefill)  # fmt: skip
    for order in ORDERS:
        s = build_schedule(scored, order)
        for params in ({"weights": str(weights)}, {"lr": 0.0}, {"lr": 3.0, "horizon": 1}, {"horizon": 40}):
            for c in (s.min_room + 1, 12):
                got, _, hits = fast.replay(s, "reuse", c, params, record=True)
                assert got.tolist() == replay(s, "reuse", c, **params).layer_misses.tolist(), (params, c)
                assert np.array_equal(hits, reference_hits(s, "reuse", c, **params))
        bare = dataclasses.replace(s, trace=None)
        assert bare.req_score.tolist() == [1.0] * bare.num_requests and s.req_score.min() < 1
        for c in (s.min_room + 1, 12):
            assert fast.replay(bare, "reuse", c)[0].tolist() == replay(bare, "reuse", c).layer_misses.tolist()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    layers=st.integers(1, 4),
    experts=st.integers(2, 9),
    top_k=st.integers(1, 3),
    order=st.sampled_from(ORDERS),
    gaps=st.booleans(),
)
def test_compiled_replays_equal_the_reference_on_random_traces(seed, layers, experts, top_k, order, gaps):
    top_k = min(top_k, experts)
    rng = np.random.default_rng(seed)
    tr = synthesize("sticky", tokens=60, layers=layers, experts=experts, top_k=top_k, seed=seed,
                    sequences=2, prompt_len=int(rng.integers(0, 12)))  # fmt: skip
    if gaps:  # unknown entries (-1) leave holes and empty groups
        ex = tr.experts.copy()
        ex[rng.random(ex.shape) < 0.2] = -1
        tr = Trace(ex, tr.num_experts, seq_id=tr.seq_id, is_prefill=tr.is_prefill)
    s = build_schedule(tr, order)
    _check_replays(s)
    # requests per phase and layer (counted from the trace in token orders) match the request arrays
    rnd = s.req_group // (s.per_layer * s.num_layers)
    phase = s.round_prefill[rnd].astype(np.int64)
    want = np.bincount(phase * s.num_layers + s.req_key // s.num_experts, minlength=2 * s.num_layers)
    assert s.layer_requests.tolist() == want.reshape(2, s.num_layers).tolist()


def test_run_policy_and_simulate_use_the_compiled_replay(monkeypatch):
    tr = TRACES["sticky"]()
    s = build_schedule(tr, "layer")
    caps = [8, 13, 32]
    reference = {n: [r.layer_misses.tolist() for r in run_policy(s, n, caps)] for n in ("fifo", "lcp-dist")}
    expected = simulate(tr, ["opt", "fifo", "lru"], caps, "layer")
    calls = []
    real = fast.replay
    monkeypatch.setattr(fast, "MIN_REQUESTS", 0)
    monkeypatch.setattr(fast, "replay", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    for name, want in reference.items():
        got = run_policy(s, name, caps, jobs=2)
        assert [r.layer_misses.tolist() for r in got] == want
    assert calls.count("fifo") == 3 and calls.count("lcp-dist") == 3
    got = simulate(tr, ["opt", "fifo", "lru"], caps, "layer")  # the opt row: the bound, computed once
    assert [r.to_dict() for r in got] == [r.to_dict() for r in expected]
    assert calls.count("lru") == 3  # three capacities: compiled replays beat the stack pass


def test_the_planners_layer_curves_run_compiled_when_all_their_replays_pay_for_it(monkeypatch):
    """Each layer's schedule is small, but the curves replay every layer at every size: compiled when that
    work together reaches ``MIN_REQUESTS`` (the same misses as the reference's replays)."""
    from expertcache.sim.planner import layer_curves

    tr = TRACES["zipf"]()
    calls = []
    real = fast.replay
    monkeypatch.setattr(fast, "replay", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    monkeypatch.setattr(fast, "MIN_REQUESTS", 10**12)
    reference = layer_curves(tr, "fifo")
    assert not calls
    work = tr.num_tokens * tr.top_k * tr.num_layers * (tr.num_experts - tr.top_k + 1)
    monkeypatch.setattr(fast, "MIN_REQUESTS", work)  # each layer's schedule alone is far below it
    assert layer_curves(tr, "fifo").tolist() == reference.tolist()
    assert calls and set(calls) == {"fifo"}


def test_compiled_flat_schedule_needs_no_group_objects():
    s = build_schedule(synthesize("zipf", tokens=2000, layers=4, experts=8, top_k=2, seed=1), "flat")
    fast.replay(s, "lru", 8)
    run_policy(s, "opt", [8, 9, 10, 11])
    assert "groups" not in s.__dict__  # the per-group tuples are built only for the Python reference
    assert s.groups[0] == (s.key(s.req_key[0]),) and "groups" in s.__dict__


def test_compiled_replay_refuses_what_the_reference_refuses(monkeypatch):
    s = build_schedule(synthesize("zipf", tokens=300, layers=32, experts=8, top_k=2, seed=1), "layer")
    budgets = {"budgets": [1] * 31 + [33]}  # 64 slots, but layer 0 holds one expert: below top-k
    with pytest.raises(ExpertcacheError, match="layer 0 gets 1 slot") as ref:
        replay(s, "lru-dist", 64, **budgets)
    with pytest.raises(ExpertcacheError) as got:
        fast.replay(s, "lru-dist", 64, budgets)
    assert str(got.value) == str(ref.value)
    monkeypatch.setattr(fast, "MIN_REQUESTS", 0)  # and run_policy, compiled
    with pytest.raises(ExpertcacheError, match="layer 0 gets 1 slot"):
        run_policy(s, "lru-dist", [64], params=budgets)
    with pytest.raises(
        ExpertcacheError, match="lru-dist at capacity 40: each layer needs 2 slot.s. in layer order"
    ):
        run_policy(s, "lru-dist", [40])
