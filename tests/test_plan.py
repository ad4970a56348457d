"""The planner (``expertcache plan``): per-layer layouts (uniform, AdapMoE's knapsack, Fate's
shallow-favouring), their figures from the timing model, the plan file, and plans run by ``timing``, the
engine and ``generate`` (exact)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import engine_fixtures
import numpy as np
import pytest
import torch
from engine_fixtures import SPECS, TOP_K, assert_exact, engine_load, greedy, moe_layers
from hypothesis import given, settings
from hypothesis import strategies as st

from expertcache.cache.schedule import build_schedule
from expertcache.cli import main
from expertcache.errors import ExpertcacheError
from expertcache.plan import Plan
from expertcache.sim.planner import fate_budgets, knapsack, layer_curves, make_plan
from expertcache.sim.replay import replay
from expertcache.sim.timing import simulate_timing
from expertcache.trace import synthesize
from expertcache.trace.default import default_trace

_one_torch_thread = engine_fixtures._one_torch_thread
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
reference = engine_fixtures.reference
tokenizer_dir = engine_fixtures.tokenizer_dir

TRACE = synthesize("sticky", tokens=400, layers=4, experts=8, top_k=2, seed=1, sequences=3, prompt_len=10)


# ------------------------------------------------------------------------------------ layouts
@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 4),
    experts=st.integers(2, 6),
    low=st.integers(1, 2),
    data=st.data(),
)
def test_knapsack_equals_brute_force(layers, experts, low, data):
    """The dynamic programme finds the fewest misses of every layout, for any (non-increasing or not)
    per-layer curves."""
    low = min(low, experts)
    capacity = data.draw(st.integers(layers * low, layers * experts))
    curves = np.zeros((layers, experts + 1), dtype=np.int64)
    for layer in range(layers):
        curves[layer, low:] = data.draw(st.lists(st.integers(0, 50), min_size=experts - low + 1,
                                                 max_size=experts - low + 1))  # fmt: skip
    sizes = knapsack(curves, capacity, low)
    assert sum(sizes) == capacity and all(low <= s <= experts for s in sizes)
    best = min(
        sum(int(curves[layer, s]) for layer, s in enumerate(combo))
        for combo in itertools.product(range(low, experts + 1), repeat=layers)
        if sum(combo) == capacity
    )
    assert sum(int(curves[layer, s]) for layer, s in enumerate(sizes)) == best


def test_knapsack_refuses_a_budget_it_cannot_lay_out():
    with pytest.raises(ExpertcacheError, match="cannot give 4 layers 2 .. 8 each"):
        knapsack(np.zeros((4, 9), dtype=np.int64), 7, 2)


@pytest.mark.parametrize(
    "capacity, want",
    [
        (48, [8, 8, 8, 8, 8, 8]),  # 4 whole layers + 2 x 8 = 48: room for 4 whole, rest even
        (40, [8, 8, 8, 8, 4, 4]),
        (30, [8, 8, 8, 2, 2, 2]),  # a fourth whole layer would leave the last two below top-2
        (12, [2, 2, 2, 2, 2, 2]),  # no whole layer fits: uniform
    ],
)
def test_fate_favours_shallow_layers(capacity, want):
    assert fate_budgets(capacity, 6, 8, 2) == want


def test_layer_curves_equal_the_simulators_lru_dist():
    """Each layer's curve at its budget, summed, is what the simulator's lru-dist does with those budgets
    (the per-layer caches are independent): an oracle for the curves the knapsack optimises."""
    curves = layer_curves(TRACE, "lru")
    schedule = build_schedule(TRACE, "layer")
    for budgets in ([2, 2, 2, 2], [4, 3, 2, 5], [8, 8, 8, 8], [2, 8, 3, 2]):
        r = replay(schedule, "lru-dist", sum(budgets), budgets=budgets)
        want = [int(curves[:, layer, b].sum()) for layer, b in enumerate(budgets)]
        assert r.layer_misses.sum(axis=0).tolist() == want


# ------------------------------------------------------------------------------------ plans
@pytest.fixture(scope="module")
def embedded_plan() -> Plan:
    trace = default_trace()
    return make_plan(trace, trace.num_layers * trace.num_experts // 2)


def test_the_plan_is_the_best_candidate_and_above_opt(embedded_plan):
    plan = embedded_plan
    methods = {c["method"] for c in plan.candidates}
    assert methods == {"shared", "uniform", "knapsack", "fate"}  # moepic: only with a split miss path
    assert {c["miss"] for c in plan.candidates} == {"fetch"}
    assert plan.predicted["tpot_s"] == min(c["tpot_s"] for c in plan.candidates)
    by = {c["method"]: c for c in plan.candidates}
    assert by["knapsack"]["misses"] <= by["uniform"]["misses"]  # decode misses are what it minimises
    assert plan.lower_bound["misses"] <= plan.predicted["misses"]
    assert plan.budgets is None or sum(plan.budgets) == plan.capacity
    assert plan.lossy == []


def test_timing_of_a_plan_is_what_the_plan_predicted_with_the_plans_costs(embedded_plan, tmp_path, capsys):
    from expertcache.costs import CostModel

    path = tmp_path / "plan.json"
    embedded_plan.save(path)
    assert main(["timing", "--plan", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tpot_s"] == pytest.approx(embedded_plan.predicted["tpot_s"], rel=1e-12)
    assert got["misses"] == embedded_plan.predicted["misses"]
    # a plan made with other costs is timed with them, unless --cost says otherwise
    trace = default_trace()
    cheap = make_plan(trace, 48, CostModel(expert_bytes=1 << 20, link_bandwidth=1e9), methods=("uniform",))
    cheap.save(path)
    assert main(["timing", "--plan", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tpot_s"] == pytest.approx(
        cheap.predicted["tpot_s"], rel=1e-12
    )
    assert main(["timing", "--plan", str(path)]) == 0
    assert "costs: the plan's" in capsys.readouterr().out


def test_moepic_runs_with_a_split_miss_path_and_layouts_with_one_part_paths():
    plan = make_plan(TRACE, 16, misses=("fetch", "split:theta=0.5", "hobbit"))
    rows = {(c["method"], c["miss"].split(":")[0]) for c in plan.candidates}
    assert ("moepic", "split") in rows and ("shared", "hobbit") in rows
    assert ("uniform", "hobbit") not in rows and ("uniform", "split") not in rows  # several cache parts
    # a split given with its theta is compared as given, beside moepic's layout (it was dropped unread)
    assert ("shared", "split:theta=0.5") in {(c["method"], c["miss"]) for c in plan.candidates}
    assert any("hobbit with per-layer budgets" in line for line in plan.source["skipped"])
    bare = make_plan(TRACE, 16, misses=("split:buffer=2",))  # without theta: moepic's to lay out
    assert {c["method"] for c in bare.candidates if c["miss"].startswith("split")} == {"moepic"}
    with pytest.raises(ExpertcacheError, match="theta must be a fraction"):
        make_plan(TRACE, 16, misses=("split:theta=2",))
    small = make_plan(TRACE, 6)  # below top-2 in each of 4 layers: the shared cache alone, said so
    assert {c["method"] for c in small.candidates} == {"shared"}
    assert any("needs 8 experts" in line for line in small.source["skipped"])


def test_a_plan_file_round_trips_and_bad_ones_are_refused(embedded_plan, tmp_path):
    path = tmp_path / "plan.json"
    embedded_plan.save(path)
    again = Plan.load(path)
    assert again == embedded_plan and again.policy_spec == embedded_plan.policy_spec
    data = json.loads(path.read_text())
    cases = [
        ({"format": "other"}, "not an expertcache plan"),
        ({**data, "version": 9}, "plan version 9"),
        ({**data, "budgets": [1] * data["layers"], "capacity": data["layers"]}, "must be 2 .. 16"),
        ({**data, "budgets": [4] * data["layers"]}, f"not the plan's capacity of {data['capacity']}"),
        ({**data, "miss": "nope"}, "unknown miss path 'nope'"),
        ({**data, "polcy": "lfu"}, r"the plan has no field 'polcy' \(did you mean policy\?\)"),  # not ignored
        ({**data, "capacity": 1000}, r"capacity must be 2 \.\. 96 experts"),  # it failed only when run
        ({**data, "top_k": 20}, "top_k 20 is more than the 16 experts a layer has"),
        ({**data, "budgets": None, "policy": "opt"}, "policy opt needs the future"),
        ({**data, "candidates": "abc"}, "candidates is a list of the rows compared"),
    ]
    for body, words in cases:
        path.write_text(json.dumps(body))
        with pytest.raises(ExpertcacheError, match=words):
            Plan.load(path)
    path.write_text("{")
    with pytest.raises(ExpertcacheError, match="is not JSON"):
        Plan.load(path)
    from expertcache.costs import CostModel

    default_trace().save(tmp_path / "t.npz")  # a trace given as a plan, and as a cost model: said so
    with pytest.raises(ExpertcacheError, match="t.npz is a trace or another .npz archive, not a plan"):
        Plan.load(tmp_path / "t.npz")
    with pytest.raises(ExpertcacheError, match="t.npz is a trace or another .npz archive, not a cost model"):
        CostModel.load(tmp_path / "t.npz")
    with pytest.raises(
        ExpertcacheError, match=r"none.json: cannot read the plan \(no such file or directory\)"
    ):
        Plan.load(tmp_path / "none.json")
    path.write_text(json.dumps({k: v for k, v in data.items() if k != "layers"}))
    with pytest.raises(ExpertcacheError, match="the plan has no layers"):
        Plan.load(path)


def test_plan_cli_writes_the_plan_and_refuses_bad_input(tmp_path, capsys):
    trace = tmp_path / "t.npz"
    TRACE.save(trace)
    out = tmp_path / "plan.json"
    assert main(["plan", "--trace", str(trace), "--capacity", "16", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "chosen:" in printed and "a bound on fetching" in printed and printed.startswith("cost: ")
    plan = Plan.load(out)
    assert (plan.layers, plan.experts, plan.top_k, plan.capacity) == (4, 8, 2, 16)
    assert plan.file == str(out) and "file" not in plan.to_dict()  # named in its messages, never written
    plan_at = ["plan", "--trace", str(trace), "--capacity"]
    bad = [
        ([*plan_at, "6", "--method", "uniform"], "needs 8: top-2 in every layer"),
        ([*plan_at, "16", "--policy", "opt"], "needs the future"),
        ([*plan_at, "16", "--policy", "eam"], "-dist form and no parameters"),
        ([*plan_at, "16", "-o", str(tmp_path / "no" / "p.json")], "does not exist"),
        ([*plan_at, "16", "--dense-time", "1ms,2ms", "--miss", "split"], "dense_s) has 2 times for a"),
        ([*plan_at, "16", "--jobs", "-1"], "--jobs must be at least 1, got -1"),
        (["timing", "--plan", str(out), "--capacity", "8"], "leave out --capacity"),
        (["timing", "--plan", str(out), "--trace", "default"], f"the plan {out} is for a model of 4 MoE"),
    ]  # fmt: skip
    for argv, words in bad:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def test_a_known_answer_uniform_routing_gains_nothing_from_a_layout(tmp_path):
    """Every expert equally likely in every layer: no layout beats another by much, and knapsack never
    does worse than uniform on the misses it optimises."""
    trace = synthesize("uniform", tokens=600, layers=4, experts=8, top_k=2, seed=3)
    plan = make_plan(trace, 16, methods=("uniform", "knapsack"))
    by = {c["method"]: c for c in plan.candidates}
    assert by["knapsack"]["misses"] <= by["uniform"]["misses"] * 1.02


# ------------------------------------------------------------------------------------ the engine
def test_a_plan_recorded_on_the_model_runs_in_the_engine_exactly(ckpt, reference, tmp_path, capsys):
    path = ckpt("mixtral")
    L, E = moe_layers("mixtral"), SPECS["mixtral"]["experts"]
    ids = torch.tensor([[5, 9, 2, 7, 11, 3]])
    with engine_load(path) as model:
        greedy(model, ids)
        trace = model.trace()
    capacity = L * E // 2
    plan = make_plan(trace, capacity, methods=("uniform", "knapsack", "fate"))
    assert plan.budgets is not None and len(plan.budgets) == L
    file = tmp_path / "plan.json"
    plan.save(file)
    with _load_plan(path, str(file)) as model:
        assert model.capacity == capacity and model.cache_config.params["budgets"] == list(plan.budgets)
        assert_exact(greedy(model, ids), reference(path, ids))
        assert model.stats["plan"] == plan.describe()
    # the engine's counts equal the timing model's on the trace the engine records
    with _load_plan(path, file) as model:
        greedy(model, ids)
        again = model.trace()
        stats = model.stats
    predicted = simulate_timing(again, capacity, cache=plan.cache_config())
    assert stats["misses"] == predicted.misses
    # a plan for another shape, or with options it sets
    other = Plan(layers=L + 1, experts=E, top_k=TOP_K, capacity=capacity)
    with pytest.raises(ExpertcacheError, match=f"the plan is for a model of {L + 1} MoE layers"):
        _load_plan(path, other)
    with pytest.raises(ExpertcacheError, match="leave out policy"):
        _load_plan(path, file, policy="lfu")
    # a slow tier no engine has was kept in the plan, and its run took the disk, unsaid (a new user's trial)
    with pytest.raises(ExpertcacheError, match="slow_tier must be one of host, disk, mapped, got 'tape'"):
        make_plan(default_trace(), "25%", slow_tier="tape")
    # a value given that is also load's default was run as the plan's, silently (a new user's trial)
    given = (("miss", "fetch"), ("policy", "lru"), ("expert_memory", "100%"), ("prefetch", "auto"))
    for name, value in given:
        with pytest.raises(ExpertcacheError, match=f"leave out {name}"):
            _load_plan(path, file, **{name: value})


def _load_plan(path: Path, plan, **kwargs):
    from expertcache.engine import load

    return load(path, plan=plan, device="cpu", progress=False, **kwargs)


def test_generate_runs_a_plan_and_refuses_options_it_sets(tmp_path, capsys):
    trace = default_trace()
    plan = make_plan(trace, trace.num_layers * trace.num_experts // 4, methods=("uniform", "knapsack"))
    file = tmp_path / "plan.json"
    plan.save(file)
    argv = ["generate", "--prompt", "def add(", "--max-new-tokens", "6", "--device", "cpu", "--quiet"]
    assert main([*argv, "--plan", str(file)]) == 0
    planned = capsys.readouterr().out
    assert main(argv) == 0
    assert planned == capsys.readouterr().out  # exact: the plan changes the cost, not the text
    assert main([*argv, "--plan", str(file), "--expert-memory", "50%"]) == 2
    assert "leave out --expert-memory" in capsys.readouterr().err


def test_a_static_plan_runs_with_its_usage_profile(tmp_path, capsys):
    """A plan of ``--policy static`` could not run: generate asked for --profile, and refused it beside
    --plan with the same message; ``load(plan=..., profile=...)`` too."""
    import expertcache

    trace = tmp_path / "t.npz"
    default_trace().save(trace)
    file = tmp_path / "plan.json"
    assert (
        main(["plan", "--policy", "static", "--capacity", "24", "--method", "uniform", "-o", str(file)]) == 0
    )
    assert "note: a static plan runs with its usage profile: generate --plan PLAN --profile" in (
        capsys.readouterr().err
    )
    argv = [
        "generate",
        "--prompt",
        "def add(",
        "--max-new-tokens",
        "4",
        "--device",
        "cpu",
        "--plan",
        str(file),
    ]
    assert main(argv) == 2 and "pass --profile TRACE.npz" in capsys.readouterr().err
    assert main([*argv, "--profile", str(trace), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "static-dist:budgets=4/4/4/4/4/4" and out["capacity_experts"] == 24
    with expertcache.load(plan=file, profile=trace, device="cpu") as model:
        assert model.stats["policy"] == "static-dist:budgets=4/4/4/4/4/4"


# ------------------------------------------------------------------------------------ MoEpic
def test_expert_split_keeps_split_ratios_in_bounds_and_more_budget_never_exposes_more():
    from expertcache.costs import CostModel
    from expertcache.sim.planner import THETA, expert_split, moepic_stats

    hit, prob = moepic_stats(TRACE, "lru")
    assert hit.shape == (4, 9) and prob.shape == (4, 2) and not prob.any()  # no recorded predictions
    assert all(0 <= h <= 1 for h in hit[:, 2:].ravel()) and (np.diff(hit[:, 2:], axis=1) >= -1e-12).all()
    cost = CostModel(expert_bytes=8 << 20)
    prev = None
    for v in (1.0, 2.0, 4.0, 7.0):
        exposed, thetas, sizes = expert_split([v] * 4, hit, prob, cost, 2)
        assert all(THETA[0] <= t <= THETA[1] + 1e-9 for t in thetas) and all(2 <= c <= 8 for c in sizes)
        assert all(x >= 0 for x in exposed)
        if prev is not None:
            assert sum(exposed) <= sum(prev) + 1e-12
        prev = exposed


def test_moepic_allocation_only_lowers_its_exposed_latency_and_its_plan_runs():
    from expertcache.costs import CostModel
    from expertcache.sim.planner import expert_split, moepic_config, moepic_stats

    trace = synthesize("partition", tokens=600, layers=4, experts=8, layer=1)
    cost = CostModel(expert_bytes=8 << 20)
    budgets, thetas, total = moepic_config(trace, 12.0, cost)
    assert sum(budgets) == pytest.approx(12.0) and len(thetas) == 4
    hit, prob = moepic_stats(trace, "lru")
    even, _, _ = expert_split([3.0] * 4, hit, prob, cost, 1)
    assert total <= sum(even) + 1e-12
    plan = make_plan(trace, 12, cost, methods=("uniform", "moepic"))
    moepic = next(c for c in plan.candidates if c["method"] == "moepic")
    assert moepic["miss"].startswith("split:theta=") and moepic["tpot_s"] > 0
    assert "lossy" not in str(plan.lossy)  # split is exact


@pytest.mark.parametrize("policy", [p for p in engine_fixtures.ONLINE if p.endswith("-dist")])
def test_any_budget_vector_runs_every_dist_policy_in_the_engine_exactly(policy, ckpt, reference):
    """Uneven per-layer budgets (what a plan gives) for each online -dist policy: the engine holds no
    layer above its budget, and stays exact."""
    path = ckpt("mixtral")
    L, E = moe_layers("mixtral"), SPECS["mixtral"]["experts"]
    budgets = [E - 1 if layer % 2 == 0 else TOP_K for layer in range(L)]
    ids = torch.tensor([[5, 9, 2, 7, 11, 3]])
    spec = f"{policy}:budgets={'/'.join(map(str, budgets))}"
    kwargs = {"profile": engine_fixtures.profile_for(path)} if policy.startswith("static") else {}
    with engine_load(path, sum(budgets), spec, **kwargs) as model:
        assert_exact(greedy(model, ids), reference(path, ids))
        resident = model.cache.residency.resident
        for layer, b in enumerate(budgets):
            assert sum(1 for k in resident if k[0] == layer) <= b


def test_plan_compares_predictors_and_their_windows(tmp_path, capsys):
    trace = default_trace()
    argv = ["plan", "--capacity", "24", "--method", "uniform", "--prefetch", "none", "--prefetch", "eam"]
    assert main([*argv, "--window", "1", "--window", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["candidates"]
    assert {(r["prefetch"], r["window"]) for r in rows} == {("none", None), ("eam", 1), ("eam", 2)}
    assert trace.num_layers * trace.top_k <= 24
    # eam learns from --predictor, none beside it reads nothing: the pair was refused
    trace.save(tmp_path / "t.npz")
    assert main([*argv, "--predictor", str(tmp_path / "t.npz"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["candidates"]
    assert {r["prefetch"] for r in rows} == {"none", "eam"}


def test_doctor_records_a_trace_from_a_model_and_prompts(ckpt, tmp_path, capsys):
    path = ckpt("mixtral")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nimport os\n")
    L, E = moe_layers("mixtral"), SPECS["mixtral"]["experts"]
    argv = ["doctor", "--model", str(path), "--prompts", str(prompts), "--max-new-tokens", "20"]
    assert main([*argv, "--window-tokens", "8", "--capacity", str(L * TOP_K), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["shape"]["layers"], r["shape"]["experts"], r["shape"]["top_k"]) == (L, E, TOP_K)
    assert r["trace"] == f"{path} on {prompts}"  # the model and the prompts, not "<memory>"
    assert 0 <= r["consistency"]["srp"] <= 1 and r["verdict"]
    assert main([*argv, "--trace", "x.npz"]) == 2
    assert "give --trace or --prompts (recorded from --model), not both" in capsys.readouterr().err
    # sequences shorter than the window: said before the recording, in one line
    assert main([*argv, "--window-tokens", "500"]) == 2
    err = capsys.readouterr().err
    assert "and --max-new-tokens 20 make" in err and "fewer than --window-tokens 500" in err
    assert err.count("\n") == 1


def test_bare_placement_and_host_are_searched_per_layer_and_by_fill():
    from expertcache.sim.planner import expand_misses

    assert expand_misses(["fetch", "placement", "host"], 8) == [
        "fetch", "placement:first=1", "placement:first=2", "placement:first=4", "placement:first=6",
        "placement:first=7", "placement", "host", "host:fill=1",
    ]  # fmt: skip
    assert expand_misses(["placement:first=3", "host:fill=1"], 8) == ["placement:first=3", "host:fill=1"]
    plan = make_plan(default_trace(), 24, misses=("fetch", "placement"), methods=("shared",))
    assert {c["miss"] for c in plan.candidates} >= {"placement:first=1", "placement:first=5", "placement"}
    assert plan.predicted["tpot_s"] == min(c["tpot_s"] for c in plan.candidates)


def test_the_candidates_run_side_by_side_give_the_same_plan():
    """``jobs``: the candidates run first on worker processes (``warm_runs``); the plan, its candidates'
    figures and its skipped list are those of one process, with a host level (inclusive and exclusive
    under each host policy) and predictors among them."""
    from expertcache.costs import CostModel

    trace = synthesize("sticky", tokens=120, layers=4, experts=8, top_k=2, seed=3, sequences=2, prompt_len=10)
    kw = dict(host_capacity=9, prefetches=("none", "eam"))
    one = make_plan(trace, 8, CostModel(disk_read_s=5e-3), jobs=1, **kw)
    two = make_plan(trace, 8, CostModel(disk_read_s=5e-3), jobs=2, **kw)
    assert len(one.candidates) > 8 and one.source["skipped"]  # a -dist level that does not fit, said
    assert json.dumps(two.to_dict()) == json.dumps(one.to_dict())


def test_warm_runs_keep_what_ran_and_leave_a_refused_run_to_the_caller():
    from expertcache.sim.timing import run_timing, shared_runs, warm_runs

    trace = synthesize("sticky", tokens=200, layers=3, experts=6, top_k=2, seed=1)
    calls = [dict(trace=trace, capacity=c) for c in (4, 6, 6)] + [dict(trace=trace, capacity=1)]
    warm_runs(calls, 2)  # outside shared_runs: nothing to keep them in, nothing runs
    with shared_runs():
        warm_runs(calls, 2)
        from expertcache.sim import timing

        assert sorted(key[3] for key in timing._RUNS.get()) == [4, 6]  # the workers' runs; 1 refused
        first = run_timing(trace, 4, cache="lru")
        assert run_timing(trace, 4) is first and first.misses == run_timing(trace, 4).misses
        with pytest.raises(ExpertcacheError) as refused:  # capacity 1 < top-2: the caller's call says so
            run_timing(trace, 1)
        with pytest.raises(TypeError, match="not arguments of run_timing: colour"):
            warm_runs([dict(trace=trace, capacity=4, colour="red")], 2)
    with pytest.raises(ExpertcacheError) as alone:
        run_timing(trace, 1)
    assert str(refused.value) == str(alone.value)
    out = run_timing(trace, 6)
    with shared_runs():
        warm_runs(calls, 2)
        assert run_timing(trace, 6).misses == out.misses and run_timing(trace, 6).total_s == out.total_s


def test_warm_runs_that_fail_in_the_workers_leave_the_runs_to_the_caller(monkeypatch):
    """Best effort: where the workers cannot run them, nothing is kept and the caller's calls run them."""
    from expertcache.sim import timing

    def broken(args):
        raise RuntimeError("a worker's failure")

    trace = synthesize("sticky", tokens=200, layers=3, experts=6, top_k=2, seed=1)
    want = timing.run_timing(trace, 4)
    monkeypatch.setattr(timing, "_timing_or_none", broken)
    with timing.shared_runs():
        timing.warm_runs([dict(trace=trace, capacity=c) for c in (4, 5)], 2)
        got = timing.run_timing(trace, 4)
    assert (got.misses, got.total_s) == (want.misses, want.total_s)


@pytest.mark.parametrize("empty", [{"methods": []}, {"prefetches": []}, {"misses": ()}])
def test_an_empty_list_is_said_to_be_empty(empty):
    """``methods=[]`` was "unknown planning method ''", ``prefetches=[]`` "no method could lay out"."""
    (what,) = empty
    with pytest.raises(ExpertcacheError, match=f"{what} is empty"):
        make_plan(default_trace(), 24, **empty)


def test_a_plan_on_a_cpus_costs_says_what_of_the_engines_own_work_they_leave_unpriced():
    """Each transfer priced and no host expert favours the host's paths, said as such; none of it priced
    (a plain CPU profile) makes every candidate optimistic, said once, not once a run of the search."""
    trace = synthesize("zipf", tokens=64, layers=2, experts=8, top_k=2, seed=1)
    cpu = {"host_parallel": False, "expert_bytes": "180KiB", "host_expert_s": "30us"}
    with pytest.warns(UserWarning) as record:
        plan = make_plan(
            trace, 6, {**cpu, "submit_s": "50us"}, misses=("fetch", "host"), methods=("uniform",)
        )
    assert any("favoured against fetch" in n for n in plan.source["notes"])
    assert not any("price none" in str(w.message) for w in record)
    with pytest.warns(UserWarning) as record:
        plan = make_plan(trace, 6, cpu, misses=("fetch", "host"), methods=("uniform",))
    said = [n for n in plan.source["notes"] if "price none of the engine's own work" in n]
    assert len(said) == 1 and "(submit_s, host_submit_s 0)" in said[0]
    assert sum("price none" in str(w.message) for w in record) == 1
    fetch_only = make_plan(trace, 6, cpu, misses=("fetch",), methods=("uniform",)).source["notes"]
    assert [n for n in fetch_only if "own work" in n] == [
        said[0]
        .replace(" or an expert computed on the host (submit_s, host_submit_s 0)", " (submit_s 0)")
        .replace(
            "fits both; --issue-time and --host-issue-time declare them", "fits it; --issue-time declares it"
        )
    ]


def test_a_plan_on_a_trace_recorded_with_a_host_level_does_not_call_its_own_candidates_a_replay():
    """A new user's trial: plan, which weighs inclusive and exclusive host levels both, said "the trace was
    recorded with an inclusive host level; this replay's is exclusive" of its own exclusive candidates."""
    import dataclasses

    from expertcache.config import HostConfig

    trace = synthesize("zipf", tokens=64, layers=2, experts=8, top_k=2, seed=1)
    trace = dataclasses.replace(trace, meta={**trace.meta, "host_exclusive": False, "host_capacity": 10})
    plan = make_plan(trace, 6, {"disk_read_s": "1ms"}, methods=("uniform",), host=HostConfig(None, "lru"),
                     host_capacity=12)  # fmt: skip
    kinds = {c["host_exclusive"] for c in plan.candidates}
    assert kinds == {False, True}
    assert not any("recorded with" in n for n in plan.source["notes"])


def test_a_plans_cold_eam_runs_cold_in_the_engine_as_it_was_priced(tmp_path, capsys):
    """A new user's trial: `plan --prefetch eam` priced eam learning from nothing, and `generate --plan`
    ran it warm from the embedded model's own trace (the engine's default there), so the run did not
    replay to the plan's prediction. It runs as planned now, said in a note."""
    plan, run = tmp_path / "plan.json", tmp_path / "run.npz"
    argv = ["plan", "--expert-memory", "25%", "--prefetch", "eam", "--deterministic", "--method", "uniform"]
    assert main([*argv, "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["generate", "--plan", str(plan), "--prompt", "def add(", "--max-new-tokens", "12",
                 "--record-trace", str(run), "--json"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    ran = json.loads(out)
    assert "prefetch eam starts with nothing learned, as the plan priced it" in err
    assert main(["timing", "--plan", str(plan), "--trace", str(run), "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    for key in ("hits", "misses", "prefetch_issued", "prefetch_used"):
        assert ran[key] == replayed[key], key
    assert ran["prefetch_issued"] > 0


def test_plan_timing_is_timing_dash_dash_plan_in_one_call(tmp_path, capsys):
    """The Python of `timing --plan` (a new user found none): the plan's trace (a file, or its requests
    served N at a time made again), configuration, predictor's trace, host level and costs, as the
    command replays them; another workload is said not to be the plan's prediction."""
    import warnings

    from trace_fixtures import prefix_file

    import expertcache as ec
    from expertcache.trace.default import DEFAULT_TRACE

    short = prefix_file(tmp_path, 256)
    plans = {
        "plain": ["--expert-memory", "25%"],
        "served 4 at a time": ["--concurrency", "4", "--expert-memory", "25%"],
        "host level": ["--capacity", "24", "--host-capacity", "60", "--disk-time", "2ms"],
        "eam learning": ["--capacity", "24", "--method", "uniform", "--prefetch", "eam", "--predictor", "T"],
    }
    for name, argv in plans.items():
        argv = [short if a == "T" else a for a in argv]  # the predictor's trace: the plan's own
        path = tmp_path / f"{name.replace(' ', '_')}.json"
        assert main(["plan", "--trace", short, *argv, "-o", str(path)]) == 0, name
        capsys.readouterr()
        assert main(["timing", "--plan", str(path), "--json"]) == 0, name
        want = json.loads(capsys.readouterr().out)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = ec.plan_timing(path)  # its file, or the Plan itself
            again = ec.plan_timing(Plan.load(path))
        del want["trace"], want["step_time"]  # the command's own: what it replayed, a --step-time said
        assert json.loads(json.dumps(got.to_dict())) == want, name  # every figure, the host level's too
        assert again.to_dict()["tpot_s"] == want["tpot_s"]
        assert want["tpot_s"] == pytest.approx(json.loads(path.read_text())["predicted"]["tpot_s"])
    # a static plan ranks by the usage profile given, as `timing --plan P --profile T` does
    static = tmp_path / "static.json"
    assert main(["plan", "--trace", short, "--policy", "static", "--capacity", "24", "-o", str(static)]) == 0
    capsys.readouterr()
    assert main(["timing", "--plan", str(static), "--profile", str(DEFAULT_TRACE), "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ec.plan_timing(static, profile=str(DEFAULT_TRACE)).to_dict()
        own = ec.plan_timing(static).to_dict()  # ranked by the replayed trace's own use
    assert got["misses"] == want["misses"] and got["tpot_s"] == want["tpot_s"]
    assert own["misses"] != got["misses"]
    # on another trace than the plan's: said so, as the command says it
    with pytest.warns(Warning, match="so these figures are not the plan's prediction"):
        ec.plan_timing(tmp_path / "plain.json", "default")
    with pytest.raises(ExpertcacheError, match="plan_timing takes a plan"):
        ec.plan_timing({"capacity": 3})
