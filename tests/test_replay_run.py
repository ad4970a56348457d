"""Design in the simulator, deploy in the engine, and back: what an engine run recorded replays to what it
counted, with the command the simulator suggests, and a plan runs as it was planned (a new user's trial
found each of these counted otherwise, at exit 0)."""

from __future__ import annotations

import json
import math
import re
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trace_fixtures import prefix

import expertcache as ec
from expertcache.cli import main
from expertcache.config import PrefetchConfig
from expertcache.costs import PROFILE_VERSION
from expertcache.errors import ExpertcacheError, ExpertcacheWarning

PROMPT = "def read_config(path):"


def _run(tmp_path, name, new_tokens=12, memory="30%", **kwargs):
    """An engine run of the embedded model (at 30 %), its stats and its trace's file."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExpertcacheWarning)
        with ec.load(expert_memory=memory, **kwargs) as model:
            model.generate_text(PROMPT, new_tokens)
            stats = model.stats
            path = tmp_path / f"{name}.npz"
            model.save_trace(path)
    return stats, path


@pytest.mark.parametrize("miss", ["split:theta=0.5", "hobbit:bits=8"])
def test_a_run_of_a_miss_path_with_parts_replays_at_its_own_parts_as_sim_says(tmp_path, capsys, miss):
    """The note named --capacity 57 (split: the parts' slots summed, half experts counted as experts) and
    70 (hobbit: int4 copies counted as experts); those replays missed 90 and 138 against the run's 133
    and 235. Now the run's own parts are replayed, and its expert memory in experts is recorded."""
    if miss.startswith("hobbit"):
        from expertcache.tools.quantize import quantize_model

        quantize_model(None, bits=(8,), progress=False)  # into the test session's own cache
    stats, path = _run(tmp_path, "parts", miss=miss, prefetch="none")
    trace = ec.load_trace(path)
    assert trace.meta["memory"] == stats["memory_experts"] == 28
    assert trace.meta["expert_bytes"] == stats["expert_bytes"]
    from expertcache.cli.generate import _held

    parts = " + ".join(f"{name} {n}" for name, n in json.loads(trace.meta["capacities"]).items())
    assert _held(stats) == f"28/96 experts' memory as {parts} slots"  # not "53/96 experts" of half experts
    assert main(["sim", str(path), "--policy", "lru", "--capacity", "28"]) == 0
    err = capsys.readouterr().err
    said = err.split("'expertcache timing ")[1].split("'")[0]
    assert "--capacity" not in said and "in an expert memory of 28 experts" in err
    assert main(["timing", *said.split(), "--json"]) == 0
    out, err = capsys.readouterr()
    assert "note: at the recorded run's own cache (" in err
    replayed = json.loads(out)
    assert (replayed["hits"], replayed["misses"]) == (stats["hits"], stats["misses"])
    result = ec.simulate_timing(trace, "recorded", miss=trace.meta["miss"])
    assert (result.hits, result.misses) == (stats["hits"], stats["misses"])
    # given no miss path, the run's own: the run replayed
    assert main(["timing", "--trace", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert f"note: under the recorded run's own miss path {trace.meta['miss']} (--miss sets another)" in err
    replayed = json.loads(out)
    assert (replayed["hits"], replayed["misses"]) == (stats["hits"], stats["misses"])
    # under another miss path, the run's expert memory, said
    assert main(["timing", "--trace", str(path), "--miss", "fetch", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "at the recorded run's expert memory, 28 whole experts" in err and "own miss path" not in err
    assert json.loads(out)["capacity"] == 28
    with pytest.raises(
        ExpertcacheError, match=r"served its misses by miss path .*give its expert memory in "
    ):
        ec.simulate_timing(trace, "recorded")


@pytest.mark.parametrize("miss", ["hybrid", "batch", "placement", "host"])
def test_timing_of_a_runs_trace_replays_its_own_miss_path_given_none(tmp_path, capsys, miss):
    """``timing --trace RUN.npz`` took the run's policy and cache parts but replayed ``fetch``: a hybrid
    run's 16 host-computed experts were 0 in it, a split run's 72 hits 41 (a new user's trial). Given no
    ``--miss``, the run's own path (on the costs it decided by) replays every count of the run."""
    stats, path = _run(tmp_path, "own", miss=miss, prefetch="none")
    assert main(["timing", "--trace", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert "note: under the recorded run's own miss path " in err
    replayed = json.loads(out)
    for key in ("hits", "misses", "host_computed", "misses_by_layer"):
        assert replayed[key] == stats[key], key


def test_recorded_capacities_need_an_engines_trace():
    with pytest.raises(ExpertcacheError, match="records no engine run's cache"):
        ec.simulate_timing(ec.default_trace(), "recorded")
    with pytest.raises(ExpertcacheError, match="leave out capacities"):
        ec.simulate_timing(ec.default_trace(), "recorded", capacities={"full": 8})


def test_a_runs_prefetch_limit_is_recorded_and_replayed(tmp_path, capsys):
    """--prefetch-limit was not in the trace: the replay the note suggested prefetched without it."""
    kw = dict(prefetch="learned", window=1, prefetch_limit=1, deterministic=True)
    stats, path = _run(tmp_path, "limit", **kw)
    trace = ec.load_trace(path)
    assert trace.meta["prefetch_limit"] == 1
    fast = {"link_bandwidth": "1000TB/s", "link_latency": "0us"}
    with pytest.warns(ExpertcacheWarning, match="prefetch limit 1 a layer: the recorded run's"):
        result = ec.simulate_timing(trace, "recorded", prefetch="recorded", cost=fast)
    assert (result.hits, result.misses) == (stats["hits"], stats["misses"])
    unlimited = ec.simulate_timing(trace, "recorded", prefetch=PrefetchConfig("recorded", limit=8), cost=fast)
    assert unlimited.misses != result.misses  # the limit was the difference


@pytest.mark.parametrize(("policy", "window"), [("lru", None), ("llru", 2)])
def test_an_adaptive_runs_predictions_replay_at_the_layers_it_made_them(tmp_path, policy, window):
    """HOBBIT's adaptive prefetch predicts a layer from each of the W before it and walks each batch over
    the cache; the trace kept one list a layer, replayed as a window predictor's: 253/185 against the
    run's 260/178 (lru), 497/127 against 481/143 (llru, window 2), at exit 0. The predictions are now
    recorded as made, by layer (``predicted_from``), and the replay walks them over its own cache."""
    kw = dict(policy=policy, prefetch="adaptive", window=window, deterministic=True)
    stats, path = _run(tmp_path, "adaptive", new_tokens=24, **kw)
    trace = ec.load_trace(path)
    assert trace.predicted_from is not None and trace.predicted_from.shape[2] == (window or 3)
    fast = {"link_bandwidth": "1000TB/s", "link_latency": "0us"}
    for prefetch in ("recorded", "adaptive"):
        result = ec.simulate_timing(trace, "recorded", cache=policy, prefetch=prefetch, cost=fast)
        assert (result.hits, result.misses) == (stats["hits"], stats["misses"])
        assert result.cache["prefetch_issued"] == stats["prefetch_issued"]
    if policy == "lru":  # the planner's per-layer replays take such a trace (layer_trace kept predicted_from)
        assert ec.make_plan(trace, 28).capacity == 28
        from dataclasses import replace

        older = replace(trace, predicted_from=None)  # a threaded run's, or an older version's: said
        with pytest.warns(ExpertcacheWarning, match="without the layers it made them at .* approximate"):
            ec.simulate_timing(older, "recorded", prefetch="recorded", cost=fast)


ONLINE_POLICIES = ["lru", "fifo", "lfu", "random", "marking", "llru", "lcp", "eam", "mrs", "tlfu", "hobbit",
                   "lru-dist", "tlfu-dist"]  # fmt: skip
MISS_PATHS = ["fetch", "split", "batch", "hybrid", "host", "placement", "hobbit:bits=8"]
COUNTS = ("hits", "misses", "prefetch_issued", "prefetch_used", "prefetch_cancelled", "host_computed",
          "low_precision", "misses_by_layer")  # fmt: skip


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(ONLINE_POLICIES),
    predictor=st.sampled_from(["none", "next-gate", "window", "adaptive", "learned"]),
    miss=st.sampled_from(MISS_PATHS),
    share=st.sampled_from(["20%", "30%", "60%"]),
    host=st.sampled_from([None, None, "40%", "70%"]),
    limit=st.sampled_from([None, None, 1]),
)
def test_property_a_deterministic_run_replays_to_its_own_counts(policy, predictor, miss, share, host, limit):
    """Design in the simulator, deploy in the engine: a deterministic run (every transfer landing before
    the cache's next decision) replays through ``timing --deterministic`` to every count the engine kept,
    whatever its policy, predictor, miss path, budget and host level, on the run's own costs. The replay
    advised before this (an instant link) changed a cost-based path's choices: hybrid computed 0 experts
    on the host in it, 9 in the run."""
    if miss == "hobbit:bits=8":
        from expertcache.tools.quantize import quantize_model

        quantize_model(None, bits=(8,), progress=False)  # into the test session's own cache
    host = host if miss == "fetch" else None  # a host level serves the fetch path
    limit = None if predictor == "none" else limit
    kw = dict(policy=policy, miss=miss, host_memory=host)
    pf = PrefetchConfig(predictor, limit=limit, deterministic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExpertcacheWarning)
        with ec.load(expert_memory=share, prefetch=pf, **kw) as model:
            model.generate_text(PROMPT, 12)
            stats, trace = model.stats, model.trace()
        replayed = PrefetchConfig("none" if predictor == "none" else "recorded", deterministic=True)
        result = ec.simulate_timing(trace, "recorded", cache=policy, prefetch=replayed, miss=miss, host=host)
    got = {"hits": result.hits, "misses": result.misses, **result.cache}
    assert stats["misses"] > 0
    for key in COUNTS:
        if key in stats:
            assert got[key] == stats[key], (key, policy, predictor, miss, share, host, limit)
    if host is not None:
        assert got["host_misses"] == stats["host_misses"]


def test_a_run_of_the_users_own_predictor_replays_where_it_predicted(tmp_path):
    """A predictor object of the user's own (a name the library does not know) was replayed as one of the
    model's gate inputs, after each router, dropping what it predicted at each step's start: 157/281
    against the run's 153/285. The run records where its predictor predicts."""
    from user_classes import LastStep

    from expertcache.predict.base import PredictContext

    mine = LastStep(PredictContext(num_layers=6, num_experts=16, top_k=2))
    stats, path = _run(tmp_path, "own", new_tokens=24, prefetch=PrefetchConfig(mine, deterministic=True))
    trace = ec.load_trace(path)
    assert trace.meta["predictor"] == "users-last-step" and trace.meta["predictor_needs_model"] is False
    assert stats["prefetch_issued"] > 0
    fast = {"link_bandwidth": "1000TB/s", "link_latency": "0us"}
    result = ec.simulate_timing(trace, "recorded", prefetch="recorded", cost=fast)
    assert (result.hits, result.misses) == (stats["hits"], stats["misses"])


def test_a_generations_json_holds_its_own_prediction_quality(tmp_path, capsys):
    """PREDICTORS.md says generate --json reports accuracy, fetchrate and goodpred; it held none of them.
    Each generation's are its own steps' (ratios of its counts), the model's stats its whole life's."""
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "8", "--expert-memory", "30%",
                 "--prefetch", "learned", "--deterministic", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert 0 < out["goodpred"] <= out["accuracy"] <= 1 and 0 < out["fetchrate"] <= 1
    assert len(out["accuracy_by_layer"]) == 6 and out["accuracy_by_layer"][0] is None  # layer 0 unpredicted
    with ec.load(expert_memory="30%", prefetch="learned", deterministic=True) as model:
        first = model.generate_text(PROMPT, 8)
        assert (
            {k: first.stats[k] for k in ("accuracy", "fetchrate", "goodpred")}
            == {k: model.stats[k] for k in ("accuracy", "fetchrate", "goodpred")}
            == {k: out[k] for k in ("accuracy", "fetchrate", "goodpred")}
        )
        counts = model.engine.driver.cache.stats.prediction_counts()
        second = model.generate_text("import numpy as np", 8)
        correct, actual, _ = (
            b - a for a, b in zip(counts, model.engine.driver.cache.stats.prediction_counts(), strict=True)
        )
        assert second.stats["accuracy"] == correct.sum() / actual.sum() != model.stats["accuracy"]


def test_a_random_policys_seed_is_recorded_and_a_replay_with_another_is_said(tmp_path, capsys):
    """A run of CacheConfig("random", seed=3) replayed by sim with seed 0 counted 107/235 against the
    run's 115/227 without a word."""
    from expertcache.config import CacheConfig

    stats, path = _run(
        tmp_path, "seeded", new_tokens=16, policy=CacheConfig("random", seed=3), prefetch="none"
    )
    assert ec.load_trace(path).meta["policy_seed"] == 3
    assert main(["sim", str(path), "--policy", "random", "--capacity", "28", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "this run's policy random drew at random with seed 3, these replays with seed 0: --seed 3" in err
    assert main(["sim", str(path), "--policy", "random", "--capacity", "28", "--seed", "3", "--json"]) == 0
    out, err = capsys.readouterr()
    (row,) = json.loads(out)
    assert (row["hits"], row["misses"]) == (stats["hits"], stats["misses"]) and "seed" not in err
    assert main(["timing", "--trace", str(path), "--policy", "random"]) == 0
    assert "its policy drew at random with seed 3 (--seed 3)" in capsys.readouterr().err
    assert main(["timing", "--trace", str(path), "--policy", "random", "--seed", "3", "--json"]) == 0
    out, err = capsys.readouterr()  # the note said seed 3 was another seed
    assert "seed" not in err and (json.loads(out)["hits"], json.loads(out)["misses"]) == (
        stats["hits"],
        stats["misses"],
    )
    with pytest.warns(ExpertcacheWarning, match="drew at random with seed 3, these replays with seed 0"):
        ec.simulate(path, ["random"], [28])
    result = ec.simulate_timing(path, "recorded", cache=CacheConfig("random", seed=3))
    assert (result.hits, result.misses) == (stats["hits"], stats["misses"])


def test_a_static_runs_profile_is_recorded_and_the_simulator_takes_one(tmp_path, capsys):
    """sim and timing ranked a static policy by the replayed trace itself (230/77 against the run's
    126/181), and had no --profile to say otherwise."""
    profile = tmp_path / "profile.npz"
    ec.load_trace(_run(tmp_path, "profiling", new_tokens=24, prefetch="none")[1]).save(profile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExpertcacheWarning)
        with ec.load(expert_memory="30%", policy="static", profile=str(profile), prefetch="none") as model:
            model.generate_text("import os", 12)
            stats, trace = model.stats, model.trace()
    assert trace.meta["profile"] == str(profile)
    with pytest.warns(ExpertcacheWarning, match=f"ranked experts by the use of {profile}"):
        (own,) = ec.simulate(trace, ["static"], [28])
    (given,) = ec.simulate(trace, ["static"], [28], profile=profile)
    assert (given.hits, given.misses) == (stats["hits"], stats["misses"]) != (own.hits, own.misses)
    path = tmp_path / "static.npz"
    trace.save(path)
    replay = ["timing", "--trace", str(path), "--policy", "static", "--profile", str(profile)]
    assert main([*replay, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["misses"] == stats["misses"]
    for argv, needle in (
        (["sim", str(path), "--policy", "lru", "--profile", str(profile)], "none of lru ranks by one"),
        (
            ["timing", "--trace", str(path), "--policy", "lru", "--profile", str(profile)],
            "policy lru uses none",
        ),
    ):
        assert main(argv) == 2
        assert needle in capsys.readouterr().err
    # timing takes the run's own policy (static) by default: its profile given, the run's counts
    assert main(["timing", "--trace", str(path), "--profile", str(profile), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["misses"] == stats["misses"]


def _token_plan(tmp_path, capsys, new_tokens: int):
    """A plan of 24 experts prefetching with ``token``, made on one run's trace and learning from
    another's: (the trace, the predictor's trace, the plan's file)."""
    _, made_on = _run(tmp_path, "made-on", new_tokens=new_tokens, prefetch="none")
    _, learned = _run(tmp_path, "learned", new_tokens=new_tokens, prefetch="none")
    plan_file = tmp_path / "plan.json"
    argv = ["plan", "--trace", str(made_on), "--capacity", "24", "--prefetch", "token", "--predictor"]
    assert main([*argv, str(learned), "--method", "uniform", "-o", str(plan_file)]) == 0
    capsys.readouterr()
    return made_on, learned, plan_file


def test_a_plan_runs_with_the_trace_its_predictor_learned_from_and_replays_on_its_own_trace(tmp_path, capsys):
    """A plan choosing prefetch token had predicted 451 misses; generate --plan ran 710 (the embedded
    trace's table), and timing --plan replayed the embedded trace, not the plan's."""
    made_on, learned, plan_file = _token_plan(tmp_path, capsys, 24)
    plan = ec.Plan.load(plan_file)
    assert plan.prefetch == "token" and plan.predictor_trace() == str(learned.resolve())
    assert plan.source["digest"] == ec.load_trace(made_on).digest()
    assert main(["timing", "--plan", str(plan_file), "--json"]) == 0
    out, err = capsys.readouterr()
    assert f"replaying the plan's trace {made_on.resolve()}" in err
    assert f"learns from {learned.resolve()}" in err
    assert json.loads(out)["misses"] == plan.predicted["misses"]
    said = f"prefetch token learns from {learned.resolve()}"
    with pytest.warns(ExpertcacheWarning, match=said), ec.load(plan=plan_file) as model:
        assert str(model.prefetch_config_.data) == str(learned.resolve())
    # the same number of tokens is not the same trace: the routing's digest says it
    other = ec.load_trace(made_on)
    shuffled = ec.Trace(np.roll(other.experts, 1, axis=2), other.num_experts, source="x")
    shuffled.save(tmp_path / "other.npz")
    assert main(["timing", "--plan", str(plan_file), "--trace", str(tmp_path / "other.npz")]) == 0
    assert "these figures are not the plan's prediction" in capsys.readouterr().err
    learned.unlink()
    with pytest.raises(ExpertcacheError, match="was planned learning from .*which is not there"):
        ec.load(plan=plan_file)


def test_a_plan_using_the_planned_trace_as_its_predictors_data_says_it_is_in_sample():
    short = prefix(256)
    with pytest.warns(ExpertcacheWarning, match="the predictor trace is the planned trace itself"):
        ec.make_plan(short, 24, prefetches=["token"], predictor_trace=short, methods=["uniform"])


def test_a_profile_of_other_experts_than_the_run_moved_is_said(tmp_path):
    _, path = _run(tmp_path, "run", prefetch="none")
    trace = ec.load_trace(path)
    profile = tmp_path / "profile.json"
    profile.write_text(
        json.dumps(
            {
                "format": "expertcache-profile", "version": PROFILE_VERSION,
                "model": {"name": "other", "layers": 6, "experts": 16, "top_k": 2},
                "cost": {"expert_bytes": trace.meta["expert_bytes"] * 4},
            }
        )
    )  # fmt: skip
    with pytest.warns(
        ExpertcacheWarning, match="prices experts of .*moved experts of .*another model or dtype"
    ):
        ec.simulate_timing(trace, 24, cost=str(profile))


def test_a_traces_digest_is_its_routing_whatever_its_file():
    trace = ec.default_trace()
    fields = dict(seq_id=trace.seq_id, is_prefill=trace.is_prefill, step_id=trace.step_id)
    again = ec.Trace(trace.experts.copy(), trace.num_experts, source="elsewhere", **fields)
    assert again.digest() == trace.digest()
    changed = trace.experts.copy()
    changed[0, 0, 0] = (changed[0, 0, 0] + 1) % trace.num_experts
    assert ec.Trace(changed, trace.num_experts, **fields).digest() != trace.digest()


def test_a_run_of_a_policy_the_replays_pass_for_is_named(capsys, tmp_path):
    """A plan's lru-dist:budgets=... run replayed by sim's defaults (whose lru-dist is uniform) gave no
    hint that none of the rows was the run's."""
    trace = prefix(256)
    run = ec.Trace(trace.experts, trace.num_experts, meta={"policy": "lru-dist:budgets=4/4/4/4/6/6"})
    with pytest.warns(ExpertcacheWarning, match=r"policy was lru-dist:budgets=4/4/4/4/6/6, which these"):
        ec.simulate(run, ["lru", "lru-dist"], [28])
    path = tmp_path / "dist.npz"
    run.save(path)
    assert main(["sim", str(path), "--capacity", "28"]) == 0  # the default policies
    assert "--policy lru-dist:budgets=4/4/4/4/6/6 replays it" in capsys.readouterr().err
    with warnings.catch_warnings():  # another policy asked for by name: the user compares, nothing said
        warnings.simplefilter("error", ExpertcacheWarning)
        ec.simulate(run, ["llru"], [28])
        ec.simulate(run, ["lru-dist:budgets=4/4/4/4/6/6"], [28])


@pytest.mark.parametrize("exclusive", [False, True])
def test_a_runs_host_level_is_named_with_the_flags_that_replay_it(tmp_path, capsys, exclusive):
    """timing on a three-tier run's trace replayed the expert memory alone, without a word of its host
    level; the flags it now names (an exclusive level's memory holds its reserve too) replay it."""
    kw = dict(prefetch="none", host_memory="30%", host_policy="lfu", host_exclusive=exclusive)
    stats, path = _run(tmp_path, "tiers", 12, "10%", **kw)
    assert main(["timing", "--trace", str(path)]) == 0
    err = capsys.readouterr().err
    said = err.split("which this replay leaves out: ")[1].split(" replays it")[0]
    assert ("--host-exclusive" in said) == exclusive
    assert main(["timing", "--trace", str(path), *said.split(), "--json"]) == 0
    replay = json.loads(capsys.readouterr().out)
    assert (replay["host_hits"], replay["host_misses"]) == (stats["host_hits"], stats["host_misses"])


def test_a_staging_runs_host_level_is_named_with_its_staging(tmp_path, capsys):
    """A run that staged predicted experts into its host level: the named flags left out --host-stage,
    and replayed 169/216 host hits/misses against the run's 173/212."""
    kw = dict(expert_memory="20%", host_memory="50%", host_stage=1, prefetch="next-gate", deterministic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExpertcacheWarning)
        with ec.load(**kw) as model:
            model.generate_text(PROMPT, 16)
            stats = model.stats
            path = tmp_path / "staged.npz"
            model.save_trace(path)
    assert stats["host_staged"] > 0
    assert main(["timing", "--trace", str(path)]) == 0  # the flags named run as they are
    said = capsys.readouterr().err.split("which this replay leaves out: ")[1].split(" replays it")[0]
    assert "--host-stage 1 --prefetch recorded" in said
    assert main(["timing", "--trace", str(path), *said.split()]) == 0
    capsys.readouterr()
    assert main(["timing", "--trace", str(path), "--prefetch", "recorded"]) == 0
    said = capsys.readouterr().err.split("which this replay leaves out: ")[1].split(" replays it")[0]
    assert "--host-stage 1" in said and "--prefetch" not in said
    instant = ["--link-bandwidth", "inf", "--link-latency", "0us"]
    assert (
        main(["timing", "--trace", str(path), "--prefetch", "recorded", *instant, *said.split(), "--json"])
        == 0
    )
    replay = json.loads(capsys.readouterr().out)
    assert (replay["host_hits"], replay["host_misses"]) == (stats["host_hits"], stats["host_misses"])


def test_quantize_out_into_the_engines_own_place_says_nothing_of_moving_them(capsys, tmp_path):
    """`quantize --out` into the user cache's folder for the model said "the engine looks for copies in
    X, not in X", the same folder twice."""
    from expertcache.engine.hub import DEFAULT_MODEL
    from expertcache.engine.quantized import candidates

    own = candidates(DEFAULT_MODEL)[1]
    own.parent.mkdir(parents=True, exist_ok=True)  # a user's cache made by an earlier run
    assert main(["quantize", "--bits", "8", "--out", str(own)]) == 0
    assert "the engine looks for copies" not in capsys.readouterr().err
    assert main(["quantize", "--bits", "8", "--out", str(tmp_path)]) == 0
    assert f"not in {tmp_path}: move the files there" in capsys.readouterr().err


def test_a_deterministic_prefetching_run_replays_settled_as_sim_says(tmp_path, capsys):
    """The engine settles each transfer as it is submitted, so it cancels nothing; the suggested replay
    on the default link cancelled queued prefetches, one hit off (155/78 against 154/79). The replay
    settles its transfers too (``--deterministic``), on any link."""
    kw = dict(prefetch="learned", prefetch_limit=3, deterministic=True)
    stats, path = _run(tmp_path, "det", new_tokens=16, **kw)
    assert ec.load_trace(path).meta["deterministic"] is True
    assert main(["sim", str(path), "--policy", "lru", "--capacity", "28"]) == 0
    said = capsys.readouterr().err.split("'expertcache timing ")[1].split("'")[0]
    assert said.endswith("--prefetch recorded --deterministic")
    for link in ([], ["--link-bandwidth", "2GB/s"]):
        assert main(["timing", *said.split(), *link, "--json"]) == 0
        replay = json.loads(capsys.readouterr().out)
        assert (replay["hits"], replay["misses"]) == (stats["hits"], stats["misses"])
        assert replay["prefetch_cancelled"] == 0 and replay["prefetch_issued"] == stats["prefetch_issued"]
    assert main(["timing", "--trace", str(path), "--prefetch", "recorded"]) == 0  # the default link: said
    assert "it was deterministic, every transfer landing before the next decision" in capsys.readouterr().err


@pytest.mark.parametrize("miss", ["host", "placement"])
def test_a_cost_based_or_all_host_run_replays_by_default_with_what_it_decided_by(tmp_path, capsys, miss):
    """A host run's replay needed --cost PROFILE.json, which no generate flag writes (0/233 against the
    run's 57/176 without it); a run with every layer on the host held 0 experts, and its replay was
    refused ("capacity must be at least 1")."""
    stats, path = _run(tmp_path, "run", new_tokens=16, miss=miss, prefetch="none")
    trace = ec.load_trace(path)
    assert ("costs" in trace.meta) == (miss == "host")
    assert main(["timing", "--trace", str(path), "--miss", trace.meta["miss"], "--json"]) == 0
    out, err = capsys.readouterr()
    assert ("priced by the costs the run decided by" in err) == (miss == "host")
    # costs measured at load are the path's (an expert, a transfer, the host), never the step's rest: said
    assert ("its dense and step times are not among them" in err) == (miss == "host")
    replay = json.loads(out)
    assert (replay["hits"], replay["misses"], replay["host_computed"]) == (
        stats["hits"], stats["misses"], stats["host_computed"]
    )  # fmt: skip
    assert main(["timing", "--trace", str(path), "--policy", "lfu", "--miss", trace.meta["miss"]]) == 0
    err = capsys.readouterr().err
    assert "this replay is not the recorded run's: its policy was lru (--policy lru)" in err
    assert main(["timing", "--trace", str(path), "--policy", "lru", "--miss", "fetch"]) == 0  # said
    err = capsys.readouterr().err
    assert f"it served its misses by miss path {trace.meta['miss']} (--miss {trace.meta['miss']})" in err
    assert main(["timing", "--trace", str(path), "--policy", "lru"]) == 0  # none given: the run's own
    err = capsys.readouterr().err
    assert f"under the recorded run's own miss path {trace.meta['miss']}" in err and "served its" not in err
    if miss == "host":  # its budget given (as SERVE.md writes the replay): still the run's own costs
        argv = ["timing", "--trace", str(path), "--miss", "host", "--expert-memory", "30%", "--json"]
        assert main(argv) == 0
        out, err = capsys.readouterr()
        assert "priced by the costs the run decided by" in err
        at = json.loads(out)
        assert (at["hits"], at["host_computed"]) == (stats["hits"], stats["host_computed"])
        assert ec.simulate_timing(trace, "30%", miss="host").cache["host_computed"] == stats["host_computed"]


def test_a_plan_whose_predictor_trace_changed_or_whose_trace_is_gone_says_so(tmp_path, capsys):
    made_on, learned, plan_file = _token_plan(tmp_path, capsys, 16)
    _, other = _run(tmp_path, "other", new_tokens=24, prefetch="none")
    learned.write_bytes(other.read_bytes())  # another recording written over it
    assert main(["timing", "--plan", str(plan_file)]) == 0
    assert "has changed since the plan was made" in capsys.readouterr().err
    with pytest.warns(ExpertcacheWarning, match="has changed since the plan was made"):
        ec.load(plan=plan_file).close()
    made_on.unlink()
    assert main(["timing", "--plan", str(plan_file)]) == 0
    assert f"the plan's trace {made_on.resolve()} is not there" in capsys.readouterr().err


def test_a_plan_priced_for_other_experts_than_the_model_s_says_so_when_run(tmp_path):
    trace = prefix(256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExpertcacheWarning)
        own = ec.load(expert_memory="30%", prefetch="none")
    size = own.layout.nbytes
    own.close()
    for expert_bytes, said in ((size, False), (4 * size, True)):
        plan = ec.make_plan(trace, 24, cost={"expert_bytes": expert_bytes, "link_bandwidth": "2GB/s"})
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always", ExpertcacheWarning)
            ec.load(plan=plan).close()
        notes = [str(w.message) for w in got]
        assert any(f"this plan was priced for experts of {4 * size} bytes" in n for n in notes) == said


def test_a_plan_runs_on_the_slow_tier_its_profile_measured(tmp_path, capsys):
    """A plan from a `profile --slow-tier host` chose `miss host` and ran on the disk tier, where the host
    path fetched instead: 367 hits, none on the host, against the plan's 0 and 407."""
    from expertcache.tools.profile import profile

    path = tmp_path / "host.json"
    path.write_text(json.dumps(profile(None, device="cpu", slow_tier="host", steps=2)))
    plan = ec.make_plan(prefix(256), 24, cost=str(path), misses=["host"])
    assert plan.source["slow_tier"] == "host"
    measured = r"slow tier host: the plan's \(its costs were measured on it"
    with pytest.warns(ExpertcacheWarning, match=measured), ec.load(plan=plan) as model:
        assert model.stats["slow_tier"] == "host"
    with pytest.warns(ExpertcacheWarning, match="priced on the host slow tier, and this runs on disk"):
        ec.load(plan=plan, slow_tier="disk").close()
    # a plan of the default cost model was measured on no tier: the tier it was planned for is only named
    plan = ec.make_plan(prefix(256), 24, slow_tier="mapped")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", ExpertcacheWarning)
        ec.load(plan=plan).close()
    notes = [str(w.message) for w in got]
    assert any(n.startswith("slow tier mapped: the plan's (it was planned for it;") for n in notes), notes
    assert not any("measured on it" in n for n in notes)


def test_a_plan_priced_with_submit_s_says_it_favours_computing_on_the_host():
    """A fitted submit_s prices each transfer and no host expert: a new user's host-tier plan chose
    `host` at 3.26 ms against `fetch` at 3.92, and measured 3.54-4.40 against 2.71-3.01 ms."""
    trace = prefix(256)
    with pytest.warns(ExpertcacheWarning, match=r"submit_s \(300 us.*host candidates are favoured"):
        plan = ec.make_plan(trace, 24, cost={"submit_s": "300us"}, misses=["fetch", "host"])
    assert any("host candidates are favoured" in n for n in plan.source["notes"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExpertcacheWarning)
        ec.make_plan(trace, 24, cost={"submit_s": "300us"}, misses=["fetch"])  # nothing on the host
        ec.make_plan(trace, 24, misses=["fetch", "host"])  # nothing charged to transfers
        # both priced (profile --fit-overheads fits host_submit_s beside submit_s): nothing favoured
        ec.make_plan(
            trace, 24, cost={"submit_s": "300us", "host_submit_s": "100us"}, misses=["fetch", "host"]
        )


def test_generate_decides_by_the_costs_given_and_its_run_replays_by_them(tmp_path, capsys):
    """A cost-based path's run repeats given its costs: the note said load(costs=...), which the command
    line had no flag for; --cost gives them (a cost model or a profile), and is refused where no miss
    path decides by costs."""
    cost = tmp_path / "c.json"
    cost.write_text(
        json.dumps({"link_bandwidth": "10GB/s", "host_expert_s": "30us", "expert_bytes": "180KiB"})
    )
    argv = ["generate", "--prompt", "def f(x):", "--max-new-tokens", "8", "--expert-memory", "30%", "--miss",
            "host", "--cost", str(cost), "--prefetch", "none", "--json", "--quiet"]  # fmt: skip
    runs = []
    for i in range(2):
        assert main([*argv, "--record-trace", str(tmp_path / f"r{i}.npz")]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["host_computed"] == runs[1]["host_computed"] > 0 and runs[0]["misses"] == runs[1]["misses"]
    recorded = json.loads(ec.load_trace(tmp_path / "r0.npz").meta["costs"])
    assert recorded["host_expert_s"] == pytest.approx(30e-6) and recorded["link_bandwidth"] == 10e9
    assert main(["generate", "--prompt", "x", "--max-new-tokens", "2", "--cost", str(cost)]) == 2
    assert "--cost changes nothing here: miss path fetch decides by no costs" in capsys.readouterr().err
    # an emulated link prices the transfers the path weighs, over the file's link, as timing takes the flag:
    # the host's 1 ms loses to a transfer at 10 GB/s and its computation (0.39 ms), and wins against one at
    # 10 MB/s (18 ms); the path weighed the file's link while each transfer took the emulated one's time
    cost.write_text(
        json.dumps({"link_bandwidth": "10GB/s", "host_expert_s": "1ms", "expert_bytes": "180KiB"})
    )
    got = {}
    for link in ([], ["--link-bandwidth", "10MB/s", "--link-latency", "5us"]):
        loud = [a for a in argv if a != "--quiet"]  # notes on stderr
        assert main([*loud, *link, "--record-trace", str(tmp_path / "link.npz")]) == 0
        out, err = capsys.readouterr()
        got[bool(link)] = json.loads(out)["host_computed"]
        said = "prices transfers at the emulated link (--link-bandwidth and --link-latency)" in err
        assert said == bool(link)
    assert got == {False: 0, True: got[True]} and got[True] > 0
    recorded = json.loads(ec.load_trace(tmp_path / "link.npz").meta["costs"])
    assert recorded["link_bandwidth"] == 10e6 and recorded["link_latency"] == pytest.approx(5e-6)
    assert recorded["host_expert_s"] == pytest.approx(1e-3)  # the rest is the file's


def test_generate_refuses_a_profile_of_another_model_and_names_one_of_another_tier(tmp_path, capsys):
    """timing, plan and doctor refused a profile of another model's shape, and generate and serve ran it
    in silence; a profile of another slow tier (no host read) sent every miss to the host, unsaid (a new
    user's trial)."""
    from expertcache.costs import PROFILE_FORMAT, PROFILE_VERSION

    def profile(path, layers, tier):
        shape = {"name": "embedded", "layers": layers, "experts": 16, "top_k": 2, "expert_bytes": 184320}
        cost = {"host_expert_s": "30us", "expert_bytes": 184320, "host_parallel": False}
        path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "model": shape,
                                    "cost": cost, "how": {"slow_tier": tier}}))  # fmt: skip
        return str(path)

    argv = ["generate", "--prompt", "def f(x):", "--max-new-tokens", "4", "--expert-memory", "30%", "--miss",
            "host", "--prefetch", "none", "--slow-tier", "disk"]  # fmt: skip
    assert main([*argv, "--cost", profile(tmp_path / "seven.json", 7, "disk")]) == 2
    err = capsys.readouterr().err
    assert "seven.json is for embedded (7 MoE layers x 16 experts, top-2); embedded has 6 x 16" in err
    assert len(err.strip().splitlines()) == 1
    assert main([*argv, "--cost", profile(tmp_path / "host.json", 6, "host")]) == 0
    err = capsys.readouterr().err
    assert "were measured on the host slow tier, and this runs on disk" in err and "--slow-tier host" in err
    assert main([*argv, "--cost", profile(tmp_path / "disk.json", 6, "disk")]) == 0
    assert "slow tier, and this runs on" not in capsys.readouterr().err


@pytest.mark.parametrize(("exclusive", "prefetch"), [(False, "next-gate"), (True, "none")])
def test_sim_names_the_host_level_in_the_replay_it_suggests(tmp_path, capsys, exclusive, prefetch):
    """sim's replay command left out a run's host level (timing then named it in a second note), and a
    run without prefetching got no word of it: the command sim prints now replays the host level's counts
    too, in the command line's flags and in Python's arguments alike."""
    kw = dict(
        host_memory="50%", host_exclusive=exclusive, prefetch=PrefetchConfig(prefetch, deterministic=True)
    )
    stats, path = _run(tmp_path, "run", 16, "20%", **kw)
    assert main(["sim", str(path), "--policy", "lru", "--capacity", "19"]) == 0
    said = capsys.readouterr().err.split("'expertcache timing ")[1].split("'")[0]
    assert "--host-capacity" in said and ("--host-exclusive" in said) == exclusive
    assert main(["timing", *said.split(), "--json"]) == 0
    out, err = capsys.readouterr()
    replay = json.loads(out)
    keys = ("hits", "misses", "host_hits", "host_misses")
    assert {k: replay[k] for k in keys} == {k: stats[k] for k in keys} and "leaves out" not in err
    with pytest.warns(ExpertcacheWarning) as told:
        ec.simulate(ec.load_trace(path), ["lru"], [19])
    python = next(str(w.message) for w in told if "simulate_timing(" in str(w.message))
    call = python.split("simulate_timing(trace, ")[1].rsplit(") replays", 1)[0]
    trace = ec.load_trace(path)
    got = eval(f"ec.simulate_timing(trace, {call})", {**vars(ec), "ec": ec, "trace": trace})  # noqa: S307
    assert (got.hits, got.misses, got.cache["host_misses"]) == (
        stats["hits"],
        stats["misses"],
        stats["host_misses"],
    )


def test_a_plan_of_a_cost_based_path_runs_by_the_costs_it_was_planned_with(tmp_path):
    """generate --plan of a plan made from a profile measured the costs again at load, so hybrid's host or
    fetch choices were not the planned ones and differed from run to run; the plan's costs now decide
    (said), unless --cost gives others."""
    cost = {"link_bandwidth": "1GB/s", "host_expert_s": "50us", "expert_bytes": 184320, "expert_s": "20us"}
    plan = ec.make_plan(prefix(400), "30%", cost=cost, misses=["hybrid"], methods=["shared"])
    assert plan.miss == "hybrid"
    plan_file = tmp_path / "plan.json"
    plan.save(plan_file)
    runs = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as told:
            warnings.simplefilter("always", ExpertcacheWarning)
            with ec.load(plan=plan_file) as model:
                model.generate_text(PROMPT, 8)
                runs.append((model.stats, model.trace()))
        assert any("decides by the costs the plan was made with" in str(w.message) for w in told)
    (stats, trace), (again, _) = runs
    assert stats["costs"] == ec.CostModel.from_dict(cost).to_dict()
    assert not any("measured" in v for v in stats["varies_by"])
    assert stats["host_computed"] == again["host_computed"] > 0 and stats["misses"] == again["misses"]
    replay = ec.simulate_timing(trace, "recorded", miss="hybrid")
    assert (replay.misses, replay.cache["host_computed"]) == (stats["misses"], stats["host_computed"])


def test_a_cost_based_runs_replay_counts_bytes_in_its_own_experts_and_says_where_its_costs_came_from(
    tmp_path, capsys
):
    """timing --expert-memory 1GB of a run with recorded costs counted 336 MiB experts (2 of them, the
    default cost model's) beside a cost line of 0.2 MiB; --chunk-size was checked against them too; and
    the note said the costs were measured at load when --cost had given them."""
    cost = tmp_path / "c.json"
    cost.write_text(json.dumps({"host_expert_s": "30us", "expert_bytes": 184320}))
    trace = tmp_path / "r.npz"
    argv = ["generate", "--prompt", "def f(x):", "--max-new-tokens", "4", "--expert-memory", "30%", "--miss",
            "hybrid", "--cost", str(cost), "--prefetch", "none", "--quiet",
            "--record-trace", str(trace)]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    assert (
        main(["timing", "--trace", str(trace), "--miss", "hybrid", "--expert-memory", "1GB", "--json"]) == 0
    )
    out, err = capsys.readouterr()
    assert json.loads(out)["capacity"] == 96 and "(given to it; --cost gives others)" in err
    assert main(["timing", "--trace", str(trace), "--miss", "hybrid", "--chunk-size", "60kB"]) == 0
    assert "expert 180.0 KiB in 1 chunk" in capsys.readouterr().out


def test_the_python_replay_of_a_run_with_a_host_level_says_it_leaves_it_out(tmp_path):
    stats, path = _run(tmp_path, "host", prefetch="none", host_memory="50%")
    with pytest.warns(
        ExpertcacheWarning, match=r"host level of \d+ experts, which this replay leaves out: host="
    ):
        ec.simulate_timing(path, "recorded")
    trace = ec.load_trace(path)
    got = ec.simulate_timing(
        trace, "recorded", host=ec.HostConfig(None, "lru"), host_capacity=trace.meta["host_capacity"]
    )
    assert got.cache["host_misses"] == stats["host_misses"]


def test_a_cost_based_runs_summary_names_what_repeats_it_and_a_cost_file_of_other_experts_is_said(
    tmp_path, capsys
):
    """A deterministic host run without --cost was told '--deterministic repeats the run' (given
    already: only --cost would); a cost file pricing the default 336 MiB experts decided for those, unsaid."""
    argv = ["generate", "--prompt", "def f(x):", "--max-new-tokens", "4", "--expert-memory", "30%", "--miss",
            "host", "--prefetch", "next-gate"]  # fmt: skip
    assert main([*argv, "--deterministic"]) == 0
    assert "(--cost PROFILE.json repeats the run)" in capsys.readouterr().err
    assert main(argv) == 0
    assert "(--deterministic and --cost PROFILE.json repeat the run)" in capsys.readouterr().err
    cost = tmp_path / "c.json"
    cost.write_text(json.dumps({"host_expert_s": "1ms"}))
    assert main([*argv, "--cost", str(cost)]) == 0
    assert (
        "the costs given price experts of 352321536 bytes; embedded's are 184320" in capsys.readouterr().err
    )


def test_a_recorded_run_batched_again_is_another_workload_without_the_runs_own_record(tmp_path, capsys):
    """trace batch of a served (prefetching) run kept the run's cache, policy and predictor in its meta
    and dropped its predictions: timing replayed the new steps at the run's cache and said the run 'did
    not prefetch'. The batched trace keeps the model's description and the routing alone."""
    stats, path = _run(tmp_path, "run", prefetch=PrefetchConfig("next-gate", deterministic=True))
    assert stats["prefetch_issued"] > 0
    out = tmp_path / "b.npz"
    assert main(["trace", "batch", str(path), "-c", "1", "--requests", "1", "-o", str(out)]) == 0
    assert "1 request, 1 at a time" in capsys.readouterr().err
    batched = ec.load_trace(out)
    assert "capacities" not in batched.meta and "predictor" not in batched.meta
    assert ec.load_trace(path).step_start_s is not None and batched.step_start_s is None  # the run's clock
    assert batched.meta["expert_bytes"] == stats["expert_bytes"]
    assert main(["timing", "--trace", str(out), "--prefetch", "recorded"]) == 2
    assert "a batched trace (trace batch) holds none" in capsys.readouterr().err
    assert main(["trace", "batch", str(path), "-c", "4", "--max-batch-tokens", "2", "-o", str(out)]) == 2
    assert "--batch-tokens 2 is below --concurrency 4" in capsys.readouterr().err


def test_a_deterministic_plan_runs_to_its_predicted_counts(tmp_path, capsys):
    """A plan with a predictor was timed on the cost model's link and run on the engine's, which lands
    transfers at other moments: 139 misses predicted, 141 run. ``plan --deterministic`` times every
    candidate settled, records it, and every run of the plan (generate, timing, the API) is settled too:
    the counts are the plan's."""
    _, made_on = _run(tmp_path, "made-on", new_tokens=24, prefetch="none")
    _, learned = _run(tmp_path, "learned", new_tokens=24, prefetch="none")
    plan_file = tmp_path / "plan.json"
    argv = ["plan", "--trace", str(made_on), "--capacity", "24", "--prefetch", "token", "--predictor",
            str(learned), "--method", "uniform", "--deterministic", "-o", str(plan_file)]  # fmt: skip
    assert main(argv) == 0
    assert "prefetch token, deterministic; exact" in capsys.readouterr().out
    plan = ec.Plan.load(plan_file)
    assert plan.deterministic is True and plan.candidates[0]["deterministic"] is True
    generate = ["generate", "--plan", str(plan_file), "--prompt", PROMPT, "--max-new-tokens", "24", "--json"]
    assert main(generate) == 0
    run = json.loads(capsys.readouterr().out)
    assert run["deterministic"] is True and run["misses"] == plan.predicted["misses"]
    assert run["hits"] + run["misses"] == plan.predicted["requests"]
    assert main(["timing", "--plan", str(plan_file), "--json"]) == 0
    timed = json.loads(capsys.readouterr().out)
    assert timed["misses"] == plan.predicted["misses"] and timed["deterministic"] is True
    assert main(["timing", "--plan", str(plan_file), "--prefetch-limit", "1"]) == 0  # a variant: said
    out, err = capsys.readouterr()
    assert "| deterministic (each transfer landed before the next decision)" in out
    assert "note: --prefetch-limit beside --plan: the plan was timed without it" in err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExpertcacheWarning)
        with ec.load(plan=plan_file) as model:  # the API runs it settled too, whatever it is given
            assert model.prefetch_config_.deterministic
            model.generate_text(PROMPT, 24)
            assert model.stats["misses"] == plan.predicted["misses"]
        with ec.load(plan=plan_file, prefetch=PrefetchConfig("token", data=learned)) as model:
            assert model.prefetch_config_.deterministic
    with pytest.raises(ExpertcacheError, match="plan: deterministic must be true or false"):
        ec.Plan.from_dict({**plan.to_dict(), "deterministic": "yes"})
    # settled, windows tie to the last bits of a sum: the first given is chosen, not the noise's pick
    windows = [PrefetchConfig("token", window=w, data=learned) for w in (1, 2, 3)]
    with warnings.catch_warnings():  # the two runs' routing is the same: an in-sample plan, said
        warnings.simplefilter("ignore", ExpertcacheWarning)
        tied = ec.make_plan(ec.load_trace(made_on), 24, prefetches=windows, methods=("uniform",),
                            predictor_trace=ec.load_trace(learned), deterministic=True)  # fmt: skip
    rows = {c["window"]: c for c in tied.candidates}
    assert len({(f"{c['tpot_s']:.9g}", c["misses"]) for c in rows.values()}) == 1  # settled, all alike
    assert tied.window == 1


def test_a_replay_under_the_runs_miss_path_with_other_parameters_says_so(tmp_path, capsys):
    """A run under ``batch:fill=0`` replayed under ``batch`` (fill=1, a parameter's default) was said to
    be the run's: only the name was compared. Every parameter is now, a default counting as given, and
    one left to the path's own rule (``buffer``) taken as the run's."""
    _, path = _run(tmp_path, "batch", new_tokens=8, memory="50%", policy="tlfu", miss="batch:fill=0",
                   prefetch="none")  # fmt: skip
    ran = ec.load_trace(path).meta["miss"]
    assert ran.startswith("batch:buffer=") and ran.endswith(",fill=0")
    for spec, said in (("batch", True), ("batch:fill=1", True), ("batch:fill=0", False), (ran, False),
                       ("batch:fill=0,buffer=1", True), ("batch:fill=0,split=makespan", True)):  # fmt: skip
        argv = ["timing", "--trace", str(path), "--policy", "tlfu", "--miss", spec, "--json"]
        assert main(argv) == 0, spec
        err = capsys.readouterr().err
        assert (f"it served its misses by miss path {ran} (--miss {ran})" in err) == said, spec


def test_a_replay_names_the_runs_miss_path_as_it_ran_and_refuses_a_bad_value_in_one_line(tmp_path, capsys):
    """From a new user's trial: ``placement:first=2`` ran as ``placement:layers=0/1``, and replays under
    ``first=3`` or the cost-based default were called the run's; a run with no layer on the host recorded
    ``placement:layers=``, which no replay could take; ``batch`` leaving its buffer to the rule at a memory
    that granted fewer slots replayed at the expert memory, not the run's cache; and a refused value
    (``batch:fill=2``) came after the replay's notes."""
    _, placed = _run(tmp_path, "placed", new_tokens=6, miss="placement:first=2", prefetch="none")
    _, none = _run(tmp_path, "none", new_tokens=6, miss="placement:first=0", prefetch="none")
    _, batch = _run(tmp_path, "batch", new_tokens=6, memory="12%", policy="tlfu", miss="batch:buffer=8",
                    prefetch="none")  # fmt: skip
    assert ec.load_trace(placed).meta["miss"] == "placement:layers=0/1"
    assert ec.load_trace(none).meta["miss"] == "placement:first=0"
    ran = ec.load_trace(batch).meta["miss"]
    assert ran.startswith("batch:buffer=") and ran != "batch:buffer=8"  # the slots the memory granted
    for path, spec, other in ((placed, "placement:first=3", True), (placed, "placement", True),
                              (placed, "placement:first=2", False), (placed, "placement:layers=0/1", False),
                              (none, "placement", True), (none, "placement:first=0", False),
                              (batch, "batch", False), (batch, ran, False)):  # fmt: skip
        policy = ["--policy", "tlfu"] if path == batch else []
        assert main(["timing", "--trace", str(path), "--miss", spec, *policy, "--json"]) == 0, spec
        err = capsys.readouterr().err
        assert ("it served its misses by miss path" in err) == other, spec
        assert ("at the recorded run's own cache" in err) == (not other), spec
    assert main(["timing", "--trace", str(batch), "--policy", "tlfu", "--miss", "batch:fill=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fill is 0 or 1" in err


def test_a_recorded_runs_clock_prices_what_the_model_leaves_out_of_its_steps(tmp_path, capsys):
    """A served run's decode steps took 9.2 ms on the 2-core CPU (the embedded model, 4 clients) where the
    timing model's replay of the run priced 3.8 ms from a profile: the server's own work around the forward
    and continuous batching's forward, which no profile measures. The engine records each step's wall
    clock with its routing; the replay states the run's times beside its own, and the difference is the
    step time (``step_s``) when asked (``--step-time recorded``), by default in doctor."""
    import dataclasses

    from expertcache.costs import CostModel
    from expertcache.sim.timing import RECORDED, run_timing

    recorded_step_s = ec.recorded_step_s  # the API's name

    _, path = _run(tmp_path, "clocked", new_tokens=16, prefetch="none")
    trace = ec.load_trace(path)
    cost = CostModel(link_bandwidth=math.inf, link_latency=0.0, expert_bytes=trace.meta["expert_bytes"])
    step, got = recorded_step_s(trace, cost)
    replay = run_timing(trace, RECORDED, miss="fetch", cost=dataclasses.replace(cost, step_s=0.0))
    assert got["replayed_decode_step_s"] == pytest.approx(replay.tpot_s) and got["decode_steps"] == 15
    assert step == pytest.approx(max(0.0, got["recorded_decode_step_s"] - replay.tpot_s), abs=1e-7)  # 0.1 us
    assert replay.recorded["decode_step_s"] == got["recorded_decode_step_s"] > 0
    if step > 0:  # with it, the replay's decode step is the run's (on a free link nothing overlaps it)
        timed = run_timing(trace, RECORDED, miss="fetch", cost=dataclasses.replace(cost, step_s=step))
        assert timed.tpot_s == pytest.approx(got["recorded_decode_step_s"], abs=1e-7)
    said = "from the recorded run's own clock: its decode steps took"
    cli = recorded_step_s(trace, CostModel(expert_bytes=trace.meta["expert_bytes"]))[0]  # the CLI's costs
    assert main(["timing", "--trace", str(path), "--step-time", "recorded", "--json"]) == 0
    out, err = capsys.readouterr()
    assert said in err and json.loads(out)["cost"]["step_s"] == pytest.approx(cli)
    assert json.loads(out)["recorded"]["requests_timed"]
    assert main(["doctor", "--trace", str(path), "--capacity", "28", "--json"]) == 0  # doctor's default
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert said in err and report["cost"]["step_s"] == pytest.approx(cli)
    assert report["step_time"]["step_s"] == report["cost"]["step_s"] and said in report["notes"][0]
    # a cost model that states its own step time keeps it (a profile's 0 is no such statement)
    stated = tmp_path / "stated.json"
    stated.write_text(json.dumps({"step_s": "3ms", "expert_bytes": trace.meta["expert_bytes"]}))
    assert main(["doctor", "--trace", str(path), "--capacity", "28", "--cost", str(stated), "--json"]) == 0
    out, err = capsys.readouterr()
    assert said not in err and json.loads(out)["cost"]["step_s"] == 0.003
    # costs far from the machine's (a GPU's expert over PCIe against a CPU's run): none, and said why
    slow, got = ec.recorded_step_s(trace, CostModel())
    assert slow == 0.0 and "slower than the run, so these costs are not the machine's" in got["note"]
    assert ec.recorded_step_s(str(path)) == (slow, got)  # a file and the default costs (a path failed)
    assert main(["doctor", "--trace", str(path), "--capacity", "28", "--step-time", "1ms", "--json"]) == 0
    out, err = capsys.readouterr()
    assert said not in err and json.loads(out)["cost"]["step_s"] == 0.001  # given: taken
    # a trace without a clock: the error where asked, nothing by default
    assert main(["timing", "--step-time", "recorded"]) == 2
    err = capsys.readouterr().err  # one line, before any note of the costs
    assert err.startswith("expertcache: error: the embedded trace has no clock of its run")
    assert err.count("\n") == 1
    assert main(["timing", "--step-time", "Recorded"]) == 2
    assert "or 'recorded' (a recorded run's clock)" in capsys.readouterr().err
    assert main(["doctor", "--capacity", "24", "--json"]) == 0
    assert "clock" not in capsys.readouterr().err
    # a run the replay cannot repeat: the error where asked, a note by default
    _, hosted = _run(tmp_path, "hosted", new_tokens=16, prefetch="none", host_memory="50%")
    assert main(["timing", "--trace", str(hosted), "--step-time", "recorded"]) == 2
    said_host = "its run had a host level, which the step time's replay does not repeat: give --step-time"
    assert said_host in capsys.readouterr().err
    assert main(["doctor", "--trace", str(hosted), "--capacity", "28", "--json"]) == 0
    assert "note: the trace's clock is not used (" in capsys.readouterr().err


def test_a_byte_budget_replays_the_runs_experts_where_no_costs_are_given():
    """``simulate_timing(engine_trace, "5MiB")`` sized the experts at the default cost model's 336 MiB: the
    run's 28 experts became none ("holds no expert"), where the command line takes the trace's expert size
    (a new user's trial). The API does as the command line, and says so."""
    with ec.load(expert_memory="5MiB", progress=False) as model:
        model.generate_text("def f(x):", 4)
        trace, held = model.trace(), model.stats["capacity_experts"]
    with pytest.warns(ExpertcacheWarning, match="with the run's experts of 180.0 KiB"):
        replayed = ec.simulate_timing(trace, "5MiB")
    assert replayed.capacity == held


def test_doctor_says_when_a_runs_clock_holds_misses_the_default_costs_price_as_a_gpus(tmp_path, capsys):
    """A new user's doctor on a CPU server's trace (25 %, no --cost) said 12.5 % of the experts brought TPOT
    within 1.25x of all resident, where 25 % had run 3.1x slower than 100 %: the default costs price a miss
    as a GPU's, so the run's own misses went into the recorded step time, charged to every budget alike.
    Where the run's steps are over twice its replay's under the default costs, doctor leaves the clock
    out by default and says why; asked for (--step-time recorded), it is taken, and the note says why not."""
    import dataclasses

    from expertcache.costs import CostModel

    _, path = _run(tmp_path, "clocked", new_tokens=16, prefetch="none")
    trace = ec.load_trace(path)
    slow = dataclasses.replace(
        trace, step_start_s=trace.step_start_s * 100, step_end_s=trace.step_end_s * 100
    )
    slow.save(tmp_path / "slow.npz")
    said = "its replay's under the default costs (a GPU's), so a step time from its clock would hold what"
    assert main(["doctor", "--trace", str(tmp_path / "slow.npz"), "--capacity", "28", "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)  # doctor's default: not taken, its figures the costs' own
    assert said in err and report["step_time"]["note"].startswith("the trace's clock is not used: the run's")
    assert report["cost"]["step_s"] == CostModel().step_s
    timing = ["timing", "--trace", str(tmp_path / "slow.npz"), "--step-time", "recorded", "--json"]
    assert main(timing) == 0  # asked for: taken, and said
    out, err = capsys.readouterr()
    assert said in err and json.loads(out)["cost"]["step_s"] > 0.1
    profile = tmp_path / "p.json"  # costs given: theirs are the machine's, as far as doctor can tell
    profile.write_text(json.dumps({"expert_bytes": trace.meta["expert_bytes"], "link_bandwidth": "1GB/s"}))
    assert (
        main(["doctor", "--trace", str(tmp_path / "slow.npz"), "--capacity", "28", "--cost", str(profile)])
        == 0
    )
    assert said not in capsys.readouterr().err


def test_a_replay_of_a_run_that_held_every_expert_from_its_load_says_it_starts_empty(tmp_path, capsys):
    """A new user's first `generate --record-trace` at the default 100 %, then `sim`: 914 hits and no miss
    in the run, 95 misses in the replay, and nothing said. The trace records the preload; sim, simulate
    and timing say what it changes."""
    stats, path = _run(tmp_path, "whole", memory="100%", prefetch="none")
    trace = ec.load_trace(path)
    assert stats["misses"] == 0 and trace.meta["preloaded"] == stats["preloaded_experts"] == 96
    said = "this run read all 96 experts at its load (its expert memory held them all) and missed none"
    with pytest.warns(ExpertcacheWarning, match=re.escape(said)):
        (row,) = ec.simulate(trace, ["lru"], [96])
    assert row.misses > 0  # the first uses, which the run had read at load
    for argv in (["sim", str(path), "--capacity", "96"], ["timing", "--trace", str(path)]):
        assert main(argv) == 0
        assert said in capsys.readouterr().err
    _, part = _run(tmp_path, "part", memory="30%", prefetch="none")  # a run that read nothing at load
    assert "preloaded" not in ec.load_trace(part).meta
    assert main(["sim", str(part), "--capacity", "28"]) == 0
    assert "at its load" not in capsys.readouterr().err


def test_a_split_runs_replay_moves_the_bytes_its_segments_moved(tmp_path):
    """A new user's split:theta=0.3 run moved 286,085,760 bytes and its replay 286,857,216, every count
    equal: the engine cuts a segment at whole neurons (29 of 96), the cost model took 0.3 of the expert's
    bytes. The trace records each part's transfer bytes, which the replay of the run's experts takes."""
    stats, path = _run(tmp_path, "split", miss="split:theta=0.3", prefetch="none", new_tokens=16)
    trace = ec.load_trace(path)
    assert set(json.loads(trace.meta["part_bytes"])) == set(stats["parts"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExpertcacheWarning)
        replayed = ec.simulate_timing(trace, "recorded", miss="split:theta=0.3")
    assert replayed.cache["part_misses"] == stats["part_misses"]
    assert replayed.to_dict()["bytes_moved"] == stats["bytes_transferred"]


def test_timing_of_an_engine_trace_takes_the_runs_own_policy_and_seed_as_its_cache(tmp_path, capsys):
    """A new user's `timing --trace run.npz` of a run under their own policy replayed LRU (with a note),
    where it takes the run's own cache: it now takes the run's policy too, with the seed it drew from."""
    stats, path = _run(tmp_path, "random", prefetch="none", policy="random", seed=3)
    assert stats["policy_seed"] == 3 == ec.load_trace(path).meta["policy_seed"]  # the stats say it too
    assert main(["timing", "--trace", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert "note: under the recorded run's own policy random (--policy sets another)" in err
    assert (got["policy"], got["hits"], got["misses"]) == ("random", stats["hits"], stats["misses"])
    assert "this replay is not the recorded run's" not in err
    assert main(["timing", "--trace", str(path), "--policy", "lru", "--json"]) == 0
    assert "its policy was random (--policy random)" in capsys.readouterr().err  # another, given: said


def test_doctor_and_plan_price_a_cost_based_runs_trace_by_its_own_costs_as_timing_does(tmp_path, capsys):
    """A new user's served trace: timing priced it by the costs the server decided by (13.3 ms a token),
    doctor and plan by the defaults (32.6 ms). All three take the run's costs where no --cost is given."""
    from expertcache.sim.timing import recorded_costs

    _, path = _run(tmp_path, "hosted", miss="host", prefetch="none", new_tokens=16)
    own = recorded_costs(ec.load_trace(path))
    assert own is not None
    said = "note: priced by the costs the run decided by (measured at its load"
    for argv in (["timing", "--trace", str(path)], ["doctor", "--trace", str(path), "--capacity", "28"],
                 ["plan", "--trace", str(path), "--capacity", "28"]):  # fmt: skip
        assert main([*argv, "--json"]) == 0
        out, err = capsys.readouterr()
        assert said in err, argv
        got = json.loads(out)
        cost = got.get("cost") or got["source"]["cost"]
        assert cost["link_bandwidth"] == own.link_bandwidth and cost["expert_s"] == own.expert_s, argv
    profile = tmp_path / "given.json"  # --cost given: its own
    profile.write_text(json.dumps({"expert_bytes": own.expert_bytes, "link_bandwidth": "1GB/s"}))
    assert main(["doctor", "--trace", str(path), "--capacity", "28", "--cost", str(profile)]) == 0
    assert said not in capsys.readouterr().err


def test_sim_of_an_engine_trace_holds_the_runs_own_capacity_among_its_rows(tmp_path, capsys):
    """A new user replayed a server's trace with `sim served.npz`, as SERVE.md says: the default rows (6,
    18, 30, ...) left out the server's 24 experts, to compare with its /stats."""
    stats, path = _run(tmp_path, "run", prefetch="none")
    assert main(["sim", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)
    lru = {r["capacity"]: r for r in rows if r["policy"] == "lru"}
    assert stats["capacity_experts"] == 28 and lru[28]["misses"] == stats["misses"]
    assert "note: with the recorded run's own capacity, 28 experts, among the rows" in err
    assert main(["sim", str(path), "--capacity", "30", "--json"]) == 0
    assert "own capacity" not in capsys.readouterr().err  # capacities given: only those


def test_a_run_on_an_emulated_link_records_it_and_its_replay_is_priced_over_it(tmp_path, capsys):
    """A new user's run over --link-bandwidth 500MB/s was replayed over the default PCIe link (25 GB/s):
    the trace did not say which link the run took. It does now, and a replay given no costs takes it."""
    _, path = _run(tmp_path, "linked", prefetch="none", link_bandwidth="500MB/s", link_latency="20us")
    trace = ec.load_trace(path)
    assert trace.meta["link_bandwidth"] == 5e8 and trace.meta["link_latency"] == pytest.approx(2e-5)
    said = "and its emulated link (0.5 GB/s + 20 us a transfer)"
    assert main(["timing", "--trace", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert said in err and json.loads(out)["cost"]["link_bandwidth"] == 5e8
    assert main(["timing", "--trace", str(path), "--link-bandwidth", "2GB/s", "--json"]) == 0  # given: it
    assert json.loads(capsys.readouterr().out)["cost"]["link_bandwidth"] == 2e9
    with pytest.warns(ExpertcacheWarning, match=re.escape(said)):
        assert ec.simulate_timing(trace, "recorded").cost.link_latency == pytest.approx(2e-5)
    _, plain = _run(tmp_path, "plain", prefetch="none")  # no emulated link: nothing recorded, nothing said
    assert "link_bandwidth" not in ec.load_trace(plain).meta
