"""Batch-aware caching (issue "many users, one expert cache", parts 2 and 3): the ``tlfu`` policy
(token-weighted frequency with aging, TinyLFU's admission test) and the ``batch`` miss path (by token count:
host, cache, or a stream buffer that bypasses the cache), alone against hand-worked figures and a
brute-force model, and together in the simulator on batched traces against the per-step references of
``sim.bounds``; a layer's experts computed in groups as they land (streaming prefill), on a virtual link.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_fixtures import prefix, prefix_file

from expertcache.cache.schedule import build_schedule
from expertcache.cli import main
from expertcache.config import PrefetchConfig
from expertcache.costs import CostModel
from expertcache.errors import ExpertcacheWarning, PolicyError
from expertcache.miss import FETCH, FULL, ON_HOST, MissContext, MissPathError, Need, make_miss
from expertcache.miss.base import ON_HOST_FILL
from expertcache.miss.batch import STREAM, STREAMED
from expertcache.policy import Clock, PolicyContext, make_policy
from expertcache.sim.bounds import step_bounds
from expertcache.sim.replay import replay
from expertcache.sim.timing import simulate_timing
from expertcache.trace.batch import batch_requests
from expertcache.trace.default import default_trace


def tlfu(capacity: int, **params):
    ctx = PolicyContext(capacity=capacity, num_layers=2, num_experts=8, top_k=2, clock=Clock())
    return make_policy("tlfu", ctx, **params)


def use(policy, token: int, counts: dict, prefill: bool = False) -> None:
    policy.clock.token, policy.clock.prefill = token, prefill
    policy.on_use(list(counts), list(counts.values()))


# ------------------------------------------------------------------------------------------------
# tlfu alone
# ------------------------------------------------------------------------------------------------
class TestTLFU:
    def test_the_victim_has_the_fewest_tokens_aged(self):
        p = tlfu(2, half_life=100)
        use(p, 0, {(0, 0): 8, (0, 1): 3})
        p.on_insert((0, 0))
        p.on_insert((0, 1))
        assert p.victim((0, 2), ()) == (0, 1)  # 3 tokens < 8
        use(p, 200, {(0, 1): 2})  # two half-lives on: (0, 0) holds 8/4 = 2 tokens, (0, 1) 3/4 + 2
        p.on_hit((0, 1))
        assert p.victim((0, 2), ()) == (0, 0)
        assert p.victim((0, 2), {(0, 0)}) == (0, 1)  # never a pinned key

    def test_prompt_tokens_weigh_less(self):
        p = tlfu(2, half_life=1e9, prompt=0.25)
        use(p, 0, {(0, 0): 10}, prefill=True)  # 2.5
        use(p, 0, {(0, 1): 3})
        p.on_insert((0, 0))
        p.on_insert((0, 1))
        assert p.victim((0, 2), ()) == (0, 0)

    def test_admission_matches_the_best_candidates_against_the_victims_in_order(self):
        p = tlfu(3, half_life=1e9, margin=0.0)
        use(p, 0, {(0, 0): 1, (0, 1): 5, (0, 2): 9})
        for e in range(3):
            p.on_insert((0, e))
        use(p, 0, {(1, 0): 6, (1, 1): 2, (1, 2): 20})
        # best first: (1, 2) against (0, 0) yes, (1, 0) against (0, 1) yes, (1, 1) against (0, 2) no
        assert p.admits([(1, 0), (1, 1), (1, 2)], ()) == [True, False, True]
        # (0, 0) pinned: (1, 2) against (0, 1) yes, (1, 0) against (0, 2) no
        assert p.admits([(1, 0), (1, 1), (1, 2)], {(0, 0)}) == [False, False, True]

    def test_the_margin_keeps_what_is_nearly_as_good(self):
        p = tlfu(1, half_life=1e9, margin=1.0)  # admit above twice the victim's tokens
        use(p, 0, {(0, 0): 4})
        p.on_insert((0, 0))
        use(p, 0, {(1, 0): 7, (1, 1): 9})
        assert p.admits([(1, 0)], ()) == [False]
        assert p.admits([(1, 1)], ()) == [True]

    def test_room_left_admits_without_comparing(self):
        p = tlfu(4)
        assert p.admits([(0, 0), (0, 1)], ()) == [True, True]

    @pytest.mark.parametrize(
        "params, words",
        [({"half_life": 0}, "half_life"), ({"prompt": 2}, "prompt"), ({"margin": -1}, "margin")],
    )
    def test_bad_parameters(self, params, words):
        with pytest.raises(PolicyError, match=words):
            tlfu(2, **params)

    def test_bad_parameters_on_the_command_line_are_one_line_and_exit_2(self, capsys):
        code = main(["sim", "--policy", "tlfu:half_life=-3", "--capacity", "24"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "half_life" in err and len(err.splitlines()) == 1


@settings(max_examples=60, deadline=None)
@given(
    uses=st.lists(
        st.tuples(st.integers(0, 7), st.integers(1, 40), st.integers(0, 50), st.booleans()),
        min_size=1,
        max_size=40,
    ),
    half_life=st.sampled_from([10.0, 64.0, 1e6]),
)
def test_victim_is_the_least_aged_token_frequency(uses, half_life):
    """Against a brute-force model: each key's F = sum of w * tokens * 2^-(now - t)/h; every resident key is
    touched at its uses, and the victim is always a key of the least F (within rounding)."""
    p = tlfu(3, half_life=half_life, prompt=0.5, margin=0.0)
    history: dict = {}
    now = 0
    for expert, tokens, dt, prefill in uses:
        now += dt
        key = (0, expert)
        use(p, now, {key: tokens}, prefill)
        history.setdefault(key, []).append((now, tokens * (0.5 if prefill else 1.0)))
        if key in p:
            p.on_hit(key)
        else:
            victim = p.victim(key, ())
            if victim is not None:
                f = {k: sum(w * 2 ** (-(now - t) / half_life) for t, w in history[k]) for k in list(p._entry)}
                assert f[victim] <= min(f.values()) * (1 + 1e-9)
                p.on_evict(victim)
            p.on_insert(key)


def _admits_by_scan(p, incoming, pinned) -> list[bool]:
    """TinyLFU's test as ``admits`` documents it, with the victims found by sorting every resident key."""
    victims = iter(sorted(e for e in p._entry.values() if e[2] not in pinned))
    free, out = p.capacity - len(p._entry), [False] * len(incoming)
    for i in sorted(range(len(incoming)), key=lambda i: -p.score(incoming[i])):
        if free > 0:
            free, out[i] = free - 1, True
            continue
        victim = next(victims, None)
        if victim is None or p.score(incoming[i]) <= victim[0] + math.log1p(p.margin):
            break
        out[i] = True
    return out


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.lists(st.tuples(st.integers(0, 11), st.integers(1, 30)), min_size=1, max_size=5),
            st.sets(st.integers(0, 11), max_size=4),
        ),
        min_size=1,
        max_size=30,
    ),
    capacity=st.integers(1, 6),
    margin=st.sampled_from([0.0, 1.0]),
)
def test_admission_finds_the_victims_the_way_a_scan_of_every_key_does(steps, capacity, margin):
    """``admits`` takes the victims from the policy's heap (popping stale entries, putting live ones back)
    rather than scanning every resident key: the same answers as a scan, and the policy's own victims
    afterwards unchanged, whatever was pinned."""
    p = tlfu(capacity, half_life=16.0, margin=margin)
    for t, (used, pinned_experts) in enumerate(steps):
        counts = {(0, e): n for e, n in used}
        use(p, t, counts)
        keys, pinned = list(counts), {(0, e) for e in pinned_experts}
        missing = [k for k in keys if k not in p]
        assert p.admits(missing, pinned) == _admits_by_scan(p, missing, pinned)
        for key in keys:
            if key in p:
                p.on_hit(key)
                continue
            if len(p) >= capacity:
                expect = min((e for e in p._entry.values() if e[2] not in pinned), default=None)
                if expect is None:  # every resident key pinned: nothing may go
                    continue
                assert p.victim(key, pinned) == expect[2]
                p.on_evict(expect[2])
            p.on_insert(key)


# ------------------------------------------------------------------------------------------------
# batch alone
# ------------------------------------------------------------------------------------------------
# a transfer of 3 ms; on the host 2 + n ms, on the device 1 + 0.1 n ms after the transfer
COSTS = CostModel(
    expert_s=1e-3, expert_token_s=1e-4, host_expert_s=2e-3, host_expert_token_s=1e-3,
    link_bandwidth=1e6, link_latency=0.0, expert_bytes=3000, chunk_bytes=None, dense_s=0.0, step_s=0.0,
)  # fmt: skip


class _View:
    def __init__(self, admitted=(), streaming=()):
        self.admitted, self.streaming = set(admitted), set(streaming)
        self.asked: list = []

    def present(self, part, key):
        return part == STREAM and key in self.streaming

    resident = present

    def admits(self, part, keys):
        assert part == FULL
        self.asked.append(list(keys))
        return [k in self.admitted for k in keys]


def need(expert: int, tokens: int) -> Need:
    return Need((0, expert), tokens, 1.0, 0.0, 0, 1.0)


class TestBatchPath:
    path = make_miss("batch", MissContext(2, 8, 2, costs=COSTS))

    def test_routes_by_token_count_and_admission(self):
        # 1 token: host 3 ms < 3 + 1.1 ms; 10 tokens: host 12 ms > 3 + 2 ms
        needs = [need(0, 1), need(1, 1), need(2, 10), need(3, 10), need(4, 10)]
        view = _View(admitted={(0, 0), (0, 2)}, streaming={(0, 4)})
        routes = self.path.decide(0, needs, view)
        assert routes == [ON_HOST_FILL, ON_HOST, FETCH, STREAMED, STREAMED]
        assert view.asked == [[(0, 0), (0, 1), (0, 2), (0, 3)]]  # one question, not for what is streaming

    def test_without_fill_admitted_host_experts_stay_on_the_host(self):
        path = make_miss("batch:fill=0", MissContext(2, 8, 2, costs=COSTS))
        assert path.decide(0, [need(0, 1)], _View(admitted={(0, 0)})) == [ON_HOST]

    def test_the_buffer_comes_out_of_the_budget(self):
        caps = self.path.capacities(100 * 3000, {FULL: 3000, STREAM: 3000})
        assert caps == {STREAM: 4, FULL: 96}  # 2 * top-k
        assert self.path.capacities(3 * 3000, {FULL: 3000, STREAM: 3000}) == {STREAM: 1, FULL: 2}
        assert self.path.capacities(8 * 3000, {FULL: 3000, STREAM: 3000}) == {STREAM: 2, FULL: 6}  # a quarter

    @pytest.mark.parametrize(
        "spec, words", [("batch:buffer=0", "buffer"), ("batch:fill=2", "fill"), ("batch:split=fast", "split")]
    )
    def test_bad_parameters(self, spec, words):
        with pytest.raises(MissPathError, match=words):
            make_miss(spec, MissContext(2, 8, 2, costs=COSTS))

    def test_no_costs_is_one_clear_error(self):
        path = make_miss("batch", MissContext(2, 8, 2))
        with pytest.raises(MissPathError, match="costs"):
            path.decide(0, [need(0, 1)], _View())


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.lists(st.integers(1, 60), min_size=1, max_size=12),
    cached=st.lists(st.integers(1, 60), max_size=6),
    parallel=st.booleans(),
)
def test_makespan_split_is_hybrimoes_where_everything_is_admitted(tokens, cached, parallel):
    """``split=makespan``: the host or the device by HybriMoE's schedule (the ``hybrid`` path's very
    routes when the policy admits every miss and nothing streams)."""
    c = replace(COSTS, host_parallel=parallel)
    ctx = MissContext(2, 64, 2, costs=c)
    needs = [need(e, n) for e, n in enumerate(tokens)]
    hits = [need(32 + e, n) for e, n in enumerate(cached)]
    view = _View(admitted={n.key for n in needs})
    got = make_miss("batch:split=makespan,fill=0", ctx).decide(0, needs, view, hits)
    assert got == make_miss("hybrid", ctx).decide(0, needs, view, hits)


def test_makespan_split_sends_what_is_already_streaming_to_the_device():
    """An expert in the stream buffer needs no transfer: the schedule counts none for it."""
    ctx = MissContext(2, 8, 2, costs=COSTS)
    path = make_miss("batch:split=makespan", ctx)
    assert path.decide(0, [need(0, 1)], _View()) == [ON_HOST]  # 3 ms on the host beats 3 + 1.1 ms
    assert path.decide(0, [need(0, 1)], _View(streaming={(0, 0)})) == [STREAMED]  # 1.1 ms: no transfer


# ------------------------------------------------------------------------------------------------
# Together, in the simulator, on batched traces
# ------------------------------------------------------------------------------------------------
def embedded_costs(host_factor: float = 1.0) -> CostModel:
    """The timing model's defaults scaled to the embedded model's 184 kB experts (bench/batched_sim.py)."""
    base = CostModel()
    f = 184_320 / base.expert_bytes
    return replace(
        base, expert_bytes=184_320, expert_s=base.expert_s * f, expert_token_s=base.expert_token_s * f,
        host_expert_s=base.host_expert_s * f * host_factor,
        host_expert_token_s=base.host_expert_token_s * f * host_factor,
    )  # fmt: skip


@pytest.fixture(scope="module")
def users16():
    return batch_requests(default_trace(), 16)


def test_tlfu_keeps_hits_where_lru_collapses(users16):
    s = build_schedule(users16, "layer")
    cap = users16.num_keys // 4
    hits = {p: replay(s, p, cap).hits / s.num_requests for p in ("lru", "tlfu", "opt")}
    assert hits["lru"] < 0.01  # a step of 16 requests needs most experts: recency keeps nothing
    assert hits["tlfu"] > 0.5 * hits["opt"]


@pytest.mark.parametrize("host_factor", [1.0, 16.0])
def test_batch_tlfu_moves_and_computes_within_the_target_of_the_better_reference(users16, host_factor):
    """Miss work (the link's busy time and the host's) within 1.2x the better per-step reference summed:
    with a fast host (the static split is better) and a slow one (streaming is)."""
    cost = embedded_costs(host_factor)
    cap = users16.num_keys // 4
    best = step_bounds(users16, cap, cost).best_s.sum()
    res = simulate_timing(users16, cap, cache="tlfu", miss="batch", cost=cost)
    assert res.link_busy_s + res.host_busy_s <= 1.2 * best
    lru = simulate_timing(users16, cap, cache="lru", miss="batch", cost=cost)
    assert res.link_busy_s + res.host_busy_s < lru.link_busy_s + lru.host_busy_s
    if host_factor > 1:  # a slow host: misses stream through the buffer, bypassing the cache
        assert res.cache["part_misses"][STREAM] > 0 and res.cache["host_computed"] == 0
    else:  # a fast host: the cold experts are computed there, the popular ones cached
        assert res.cache["host_computed"] > 0 and res.cache["filled"] > 0
    assert math.isclose(res.requests, res.hits + res.misses)


def test_doctor_and_plan_serve_the_trace_n_at_a_time(tmp_path, capsys):
    """``--concurrency N``: the trace's requests served N at a time first; the doctor then says what a
    step asks of the cache and what ``batch`` with ``tlfu`` does for it."""
    assert main(["doctor", "--concurrency", "16", "--json"]) == 0  # the whole trace: issue 31's target
    out, err = capsys.readouterr()

    batch = json.loads(out)["batch"]
    assert "16 at a time" in err
    assert batch["mean_step_experts"] > 10 and batch["tlfu_miss_ratio"] < batch["lru_miss_ratio"]
    assert batch["batch_vs_best"] <= 1.2
    # the advice and the options' effects, on the trace's first 256 tokens, 4 at a time
    short = ["--trace", prefix_file(tmp_path, 256)]
    assert main(["doctor", *short, "--concurrency", "4"]) == 0  # the advice names the paths to weigh
    advice = capsys.readouterr().out  # under the policy it quoted (it named the paths alone: lru weighed)
    assert "--policy tlfu --miss fetch --miss batch --miss host" in advice
    argv = ["doctor", *short, "--concurrency", "4", "--miss", "fetch", "--miss", "batch", "--miss", "host"]
    assert main(argv) == 0
    out = capsys.readouterr().out  # given them, the plan weighed them: no advice to give them
    assert "a step serves" in out and "--miss fetch --miss batch" not in out
    assert main(["doctor", *short]) == 0
    assert "a step serves" not in capsys.readouterr().out  # one request a step: no batch to speak of
    assert main(["plan", *short, "--concurrency", "4", "--policy", "tlfu", "--miss", "batch", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["miss"].startswith("batch")
    # the steps laid out as serve --schedule prompts-first runs them: other steps, other figures
    assert main(["doctor", *short, "--concurrency", "4", "--json"]) == 0
    fifo = json.loads(capsys.readouterr().out)["batch"]
    assert main(["doctor", *short, "--concurrency", "4", "--schedule", "prompts-first", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "4 at a time (prompts-first)" in err and json.loads(out)["batch"] != fifo


@pytest.mark.parametrize("command", ["doctor", "plan"])
def test_a_bad_budget_is_refused_before_the_requests_are_batched(command, capsys):
    assert main([command, "--concurrency", "16", "--expert-memory", "64MiB"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("expertcache: error: --expert-memory 64MiB holds no expert")
        and len(err.splitlines()) == 1
    )


def test_timing_of_a_batched_plan_on_another_trace_says_so(tmp_path, capsys):
    short = prefix_file(tmp_path, 256)
    plan = tmp_path / "p4.json"
    assert (
        main(["plan", "--trace", short, "--concurrency", "4", "--expert-memory", "25%", "-o", str(plan)]) == 0
    )
    capsys.readouterr()
    assert main(["timing", "--trace", short, "--plan", str(plan)]) == 0
    said = capsys.readouterr().err  # the command that serves the requests as the plan did, whole
    assert f"as `expertcache trace batch {Path(short).resolve()} --concurrency 4 --requests " in said
    assert "--batch-tokens 512` serves them: replay that (-o F, then --trace F), or leave out --trace" in said
    # without --trace: the plan's trace made again as it was (the plan's file said "not there", circularly)
    assert main(["timing", "--plan", str(plan), "--json"]) == 0
    out, err = capsys.readouterr()
    assert "note: replaying the plan's trace: " in err and "requests served 4 at a time (fifo" in err
    assert "not there" not in err and "the plan was made on" not in err
    assert json.loads(out)["tpot_s"] == pytest.approx(json.loads(plan.read_text())["predicted"]["tpot_s"])
    served = tmp_path / "u4.npz"
    assert main(["trace", "batch", short, "--concurrency", "4", "-o", str(served)]) == 0
    capsys.readouterr()
    assert main(["timing", "--plan", str(plan), "--trace", str(served)]) == 0
    assert "note: the plan was made on" not in capsys.readouterr().err
    single = tmp_path / "p1.json"  # a plan of the trace as it is, replayed on it: nothing to say
    assert main(["plan", "--trace", short, "--expert-memory", "25%", "-o", str(single)]) == 0
    capsys.readouterr()
    assert main(["timing", "--trace", short, "--plan", str(single)]) == 0
    assert "note: the plan was made on" not in capsys.readouterr().err


def test_plan_refuses_to_write_over_its_own_trace(tmp_path, capsys):
    import shutil

    from expertcache.trace.default import DEFAULT_TRACE

    trace = tmp_path / "t.npz"
    shutil.copyfile(DEFAULT_TRACE, trace)
    before = trace.read_bytes()
    assert main(["plan", "--trace", str(trace), "--capacity", "24", "-o", str(trace)]) == 2
    assert "is the input itself" in capsys.readouterr().err and trace.read_bytes() == before


def test_doctor_of_a_batched_trace_with_every_expert_cached_has_a_verdict(tmp_path, capsys):
    """At 100 % nothing misses, so batch has no reference to compare with: said, not a crash."""
    short = prefix_file(tmp_path, 256)
    assert main(["doctor", "--trace", short, "--concurrency", "4", "--expert-memory", "100%"]) == 0
    out = capsys.readouterr().out
    assert "at this budget every expert stays in the cache after its first use" in out


@pytest.mark.parametrize("command", ["doctor", "plan"])
@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--max-batch-tokens", "64"], "--max-batch-tokens lays out the steps of --concurrency N"),
        (
            ["--concurrency", "16", "--max-batch-tokens", "8"],
            "--max-batch-tokens 8 is below --concurrency 16",
        ),
    ],
)
def test_bad_concurrency_is_one_line_and_exit_2(command, argv, words, capsys):
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def test_the_served_steps_are_capped_as_the_servers_are(tmp_path, capsys):
    """``--max-batch-tokens``: the steps of at most that many tokens a server with that cap computes, by
    default serve's 512; a smaller cap chunks the prompts into more steps."""
    from expertcache.trace.batch import batch_requests

    short = ["--trace", prefix_file(tmp_path, 256)]
    assert main(["doctor", *short, "--concurrency", "4", "--max-batch-tokens", "16", "--json"]) == 0
    out, err = capsys.readouterr()
    capped = batch_requests(prefix(256), 4, batch_tokens=16)
    assert (
        f"steps of at most 16 tokens: {capped.num_tokens} tokens in {len(set(capped.step_id.tolist()))} steps"
        in err
    )
    assert main(["doctor", *short, "--concurrency", "4"]) == 0
    assert "steps of at most 512 tokens" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Streaming prefill (part 3): a layer computed as its experts land; the decode set kept from a prompt
# ------------------------------------------------------------------------------------------------
def _streaming_driver(capacity: int = 8):
    """A one-layer fetch cache over a virtual link moving an expert a second."""
    from expertcache.cache.build import build_parts, part_capacities
    from expertcache.cache.expert_cache import ExpertCache
    from expertcache.cache.step import StepDriver
    from expertcache.miss.registry import miss_class
    from expertcache.sim.vlink import VirtualLink

    L, E, K = 1, 8, 4
    path = miss_class("fetch")(MissContext(L, E, K))
    ctx = PolicyContext(capacity=capacity, num_layers=L, num_experts=E, top_k=K, clock=Clock())
    parts = build_parts(path, part_capacities(path, capacity, {FULL: 1}, K), "lru", ctx)
    link = VirtualLink([1.0])
    return StepDriver(ExpertCache(parts, link, path, L, K), L), link


@pytest.mark.parametrize(
    "compute_s, groups, end_s",
    [
        (2.5, [[0], [1, 2], [3]], 8.5),  # landing at 1, 2, 3, 4 s: a group takes what landed meanwhile
        (0.5, [[0], [1], [2], [3]], 4.5),  # compute faster than the link: each as it lands
        (10.0, [[0], [1, 2, 3]], 21.0),  # slower: the rest has landed by the time the first is computed
    ],
)
def test_a_layers_misses_are_computed_in_groups_as_they_land(compute_s, groups, end_s):
    import numpy as np

    driver, link = _streaming_driver()
    driver.begin_step(np.array([1]), True, 0)
    work = driver.layer(0, np.array([[0, 1, 2, 3]]), None)
    got = []
    for group in work.batches():
        got.append([key[1] for key, _ in group])
        link.advance(compute_s)
    driver.end_layer(0)
    assert got == groups and link.now == end_s
    driver.begin_step(np.array([2]), False, 1)  # every one resident now: one group
    work = driver.layer(0, np.array([[3, 2, 1, 0]]), None)
    assert [[key[1] for key, _ in group] for group in work.batches()] == [[3, 2, 1, 0]]
    driver.end_layer(0)


def test_a_prompts_one_time_experts_do_not_push_out_the_decode_working_set():
    """One sequence decodes on experts 0 and 1; a 16-token prompt of another, over experts 2-7, comes in
    between. Under ``batch`` TLFU (a prompt token weighs a quarter, admission by count) computes the
    prompt's experts without caching them: the decoding sequence misses only its two cold experts. LRU
    admits the prompt's and misses 0 and 1 again after it."""
    import numpy as np

    from expertcache.trace.trace import Trace

    rng = np.random.default_rng(0)
    prompt = [[sorted(rng.choice(np.arange(2, 8), 2, replace=False).tolist())] for _ in range(16)]
    rows = [[[0, 1]]] * 20 + prompt + [[[0, 1]]] * 20
    steps = list(range(20)) + [20] * 16 + list(range(21, 41))
    trace = Trace(
        experts=np.array(rows, dtype=np.int16), num_experts=8,
        seq_id=np.array([0] * 20 + [1] * 16 + [0] * 20, dtype=np.int32),
        is_prefill=np.array([0] * 20 + [1] * 16 + [0] * 20, dtype=np.int8),
        step_id=np.array(steps, dtype=np.int32),
    )  # fmt: skip
    tlfu_run = simulate_timing(trace, 8, cache="tlfu", miss="batch").to_dict()
    lru_run = simulate_timing(trace, 8, cache="lru", miss="batch").to_dict()
    assert tlfu_run["decode_misses"] == 2 and lru_run["decode_misses"] == 4
    assert tlfu_run["prefill_misses"] == lru_run["prefill_misses"] == 6


def test_serve_lays_out_its_steps_as_a_batched_plan_was_made(tmp_path, capsys):
    """serve --plan of a plan made with --concurrency 4 --max-batch-tokens 64 --schedule prompts-first
    served steps of 512 tokens, fifo, without a word."""
    from argparse import Namespace

    from expertcache.cli.serve import _layout

    plan = tmp_path / "pf.json"
    argv = ["plan", "--trace", prefix_file(tmp_path, 256), "--concurrency", "4", "--max-batch-tokens", "64",
            "--schedule", "prompts-first", "--expert-memory", "25%", "-o", str(plan)]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    taken = _layout(Namespace(plan=str(plan), max_batch_tokens=None, schedule=None))
    assert taken[:2] == (64, "prompts-first") and taken[2].startswith("note: serving as the plan was made: ")
    other = _layout(Namespace(plan=str(plan), max_batch_tokens=None, schedule="fifo"))
    assert other[:2] == (64, "fifo") and "this server's steps differ (at most 64 tokens, fifo)" in other[2]
    plain = tmp_path / "plain.json"  # a plan of one request at a time: the defaults, nothing to say
    assert (
        main(["plan", "--trace", prefix_file(tmp_path, 256), "--expert-memory", "25%", "-o", str(plain)]) == 0
    )
    assert _layout(Namespace(plan=str(plain), max_batch_tokens=None, schedule=None)) == (512, "fifo", None)
    assert _layout(Namespace(plan=None, max_batch_tokens=0, schedule=None))[0] == 0  # refused by ServeConfig


def test_serve_lays_out_its_steps_as_the_server_whose_trace_a_plan_was_made_on(tmp_path, capsys):
    """A plan made on a served run's trace (``serve --record-trace``, which records the server's
    --max-batch-tokens and --schedule) serves so again; ``trace batch`` of such a trace, another
    workload, does not keep them."""
    from argparse import Namespace

    from expertcache.cli.serve import _layout
    from expertcache.trace import load_trace
    from expertcache.trace.batch import RUN_META

    made = batch_requests(prefix(256), 4, batch_tokens=64, schedule="prompts-first")
    layout = {"served_batch_tokens": 64, "served_schedule": "prompts-first"}  # as serve writes them
    made_so = ("batched_from", "concurrency", "batched_requests")  # what trace batch writes, not serve
    meta = {k: v for k, v in made.meta.items() if k not in made_so}
    recorded = tmp_path / "served.npz"
    replace(made, meta={**meta, **layout}, source="served").save(recorded)
    plan = tmp_path / "p.json"
    assert main(["plan", "--trace", str(recorded), "--expert-memory", "25%", "-o", str(plan)]) == 0
    capsys.readouterr()
    served = json.loads(plan.read_text())["source"]["served"]
    assert served == {"batch_tokens": 64, "schedule": "prompts-first"}
    tokens, schedule, note = _layout(Namespace(plan=str(plan), max_batch_tokens=None, schedule=None))
    assert (tokens, schedule) == (64, "prompts-first")
    assert note == (
        "note: serving as the plan was made: steps of at most 64 tokens, prompts-first, as the server whose "
        "trace it was made on (--max-batch-tokens and --schedule give others)"
    )
    assert set(layout) <= RUN_META
    again = tmp_path / "again.npz"
    assert main(["trace", "batch", str(recorded), "--concurrency", "2", "-o", str(again)]) == 0
    assert not set(layout) & set(load_trace(again).meta)


def test_a_plan_made_on_a_batched_file_replays_it_without_a_word(tmp_path, capsys):
    """A plan made on `trace batch`'s output (the README's workflow) was re-served from the trace it came
    from, then said to be another workload; on its own file too, which holds the same routing."""
    served = tmp_path / "u4.npz"
    assert main(["trace", "batch", prefix_file(tmp_path, 256), "--concurrency", "4", "-o", str(served)]) == 0
    plan = tmp_path / "pu.json"
    assert main(["plan", "--trace", str(served), "--expert-memory", "25%", "-o", str(plan)]) == 0
    capsys.readouterr()
    want = json.loads(plan.read_text())["predicted"]["tpot_s"]
    for extra in ([], ["--trace", str(served)]):
        assert main(["timing", "--plan", str(plan), *extra, "--json"]) == 0
        out, err = capsys.readouterr()
        assert "not the plan's prediction" not in err and json.loads(out)["tpot_s"] == pytest.approx(want)


def test_plan_on_a_batched_trace_chooses_by_what_a_request_sees():
    """On a batched trace the planner ranks by a request's own figures (its time between its tokens,
    to its first token, their tails) or by tokens a second, not by the mean pure-decode step: here
    knapsack's decode steps are the shorter, yet its requests wait longer between their tokens (they
    come in steps that also prefill others), and the plan takes uniform."""
    from expertcache.plan import OBJECTIVES
    from expertcache.sim.planner import format_plan, is_batched, make_plan, objective_key

    served = batch_requests(default_trace(), 16, batch_tokens=32)
    assert is_batched(served) and not is_batched(default_trace())
    by_objective = {
        o: make_plan(served, 24, misses=("hybrid",), methods=("uniform", "knapsack"), objective=o)
        for o in OBJECTIVES
    }
    plan = by_objective["tpot"]
    rows = {c["method"]: c for c in plan.candidates}
    assert rows["knapsack"]["tpot_s"] < rows["uniform"]["tpot_s"]  # the steps alone would take knapsack
    assert rows["uniform"]["request_tpot_s"] < rows["knapsack"]["request_tpot_s"]
    assert plan.method == "uniform" and plan.source["batched_steps"] is True
    for objective, plan in by_objective.items():
        key = objective_key(objective, True)
        figures = [c[key] for c in plan.candidates]
        assert None not in figures
        assert plan.predicted[key] == (max if objective == "throughput" else min)(figures), objective
        text = format_plan(plan)
        assert "TPOT, TTFT: a request's own" in text
        assert ("chosen: " if objective == "tpot" else f"chosen by {objective}: ") in text
        if objective in ("tpot-p99", "ttft-p99", "throughput"):  # its figure has a column of its own
            head = {"tpot-p99": "TPOT p99 ms", "ttft-p99": "TTFT p99 ms", "throughput": "tok/s"}[objective]
            assert head in text
            chosen = next(line for line in text.splitlines() if line.startswith("* "))
            value = plan.predicted[key]
            assert (f"{value:.1f}" if objective == "throughput" else f"{value * 1e3:.3f}") in chosen
    uniform = {c["method"]: c for c in by_objective["tpot"].candidates}["uniform"]
    run = simulate_timing(served, 24, cache="lru-dist:budgets=4/4/4/4/4/4", miss="hybrid")
    assert uniform["request_tpot_s"] == run.request_tpots["mean_s"] <= run.request_tpots["p99_s"]
    assert uniform["tokens_per_s"] == pytest.approx(served.num_tokens / run.total_s, rel=1e-12)


def test_plan_objectives_one_request_at_a_time_and_a_trace_that_cannot_say(tmp_path, capsys):
    """One request at a time TPOT and TTFT are the steps' (which are its tokens); the tails are the
    requests' own on any trace; an objective the trace has nothing to measure on is one line, exit 2."""
    from expertcache.errors import ExpertcacheError
    from expertcache.sim.planner import make_plan
    from expertcache.trace import Trace

    trace = prefix(600)
    tail = make_plan(trace, 24, methods=("uniform", "shared"), objective="ttft-p99")
    assert "batched_steps" not in tail.source
    assert tail.predicted["request_ttft_p99_s"] == min(c["request_ttft_p99_s"] for c in tail.candidates)
    plain = make_plan(trace, 24, methods=("uniform", "shared"), objective="ttft")
    assert plain.predicted["ttft_s"] == min(c["ttft_s"] for c in plain.candidates)
    decode_only = Trace(experts=trace.experts, num_experts=trace.num_experts, source="decode-only")

    for objective, words in (("ttft", "no prefill step"), ("tpot-p99", "no request with a prompt token")):
        with pytest.raises(ExpertcacheError, match=f"objective {objective} ranks by .*{words}"):
            make_plan(decode_only, 24, methods=("uniform",), objective=objective)
    path = prefix_file(tmp_path, 200)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--trace", path, "--expert-memory", "25%", "--objective", "fastest"])
    assert exit_.value.code == 2 and "argument --objective: invalid choice" in capsys.readouterr().err


def test_a_new_users_trial_of_the_serving_planner(tmp_path, capsys, monkeypatch):
    """Trial 26: a plan chose prefetch oracle, which generate then refused; a chunked prompt's TTFT was
    one step's; trace batch kept a relative source (a plan made elsewhere replayed another file); two
    windows' rows were both marked chosen; timing hid the per-request figures a plan was chosen by; a
    hand-edited plan's layout was refused naming options never given; a window past the model went
    without the note timing gives."""
    import dataclasses

    from expertcache.errors import ExpertcacheError
    from expertcache.plan import Plan
    from expertcache.sim.planner import format_plan, make_plan

    short = prefix(256)
    # a predictor no engine runs: compared, not chosen; alone: refused
    plan = make_plan(short, 48, prefetches=("none", "oracle"), methods=("shared",))
    assert plan.prefetch == "none" and any(c.get("sim_only") for c in plan.candidates)
    assert "prefetch oracle: compared, not chosen" in format_plan(plan)
    with pytest.raises(ExpertcacheError, match="no candidate an engine can run: prefetch oracle"):
        make_plan(short, 48, prefetches=("oracle",), methods=("shared",))
    # recorded predictions of an engine's predictor: the plan names that predictor
    recorded = dataclasses.replace(
        short, predicted=short.experts.copy(), meta={**short.meta, "predictor": "next-gate", "window": 1}
    )
    named = make_plan(recorded, 48, prefetches=("recorded",), methods=("shared",))
    assert (named.prefetch, named.window) == ("next-gate", 1)
    # one request at a time, prompts chunked: TTFT is a request's own, not one step's
    chunked = batch_requests(short, 1, batch_tokens=4)
    plan = make_plan(chunked, 24, methods=("shared", "uniform"), objective="ttft")
    assert plan.predicted["request_ttft_s"] > 3 * plan.predicted["ttft_s"]
    assert plan.predicted["request_ttft_s"] == min(c["request_ttft_s"] for c in plan.candidates)
    row = next(line for line in format_plan(plan).splitlines() if line.startswith("* "))
    assert f"{plan.predicted['request_ttft_s'] * 1e3:.3f}" in row
    # trace batch of a file named relative to the folder it ran in keeps its whole path
    monkeypatch.chdir(tmp_path)
    prefix_file(tmp_path, 256)
    assert main(["trace", "batch", "prefix256.npz", "--concurrency", "4", "-o", "b.npz"]) == 0
    capsys.readouterr()
    from expertcache.trace import load_trace

    assert load_trace(tmp_path / "b.npz").meta["batched_from"] == str((tmp_path / "prefix256.npz").resolve())
    # windows: a row each, one chosen, named in the last line; a window past the model is noted
    windows = [PrefetchConfig("eam", window=w) for w in (1, 2)]
    plan = make_plan(short, 48, prefetches=windows, methods=("shared",))
    text = format_plan(plan)
    assert sum(line.startswith("* ") for line in text.splitlines()) == 1
    assert "eam w1" in text and "eam w2" in text and f"prefetch eam (window {plan.window})" in text
    with pytest.warns(ExpertcacheWarning, match="window 9 reaches past a model of 6 MoE layers"):
        far = make_plan(short, 48, prefetches=[PrefetchConfig("eam", window=9)], methods=("shared",))
    assert any("window 9 reaches past" in n for n in far.source["notes"])
    # timing prints a request's figures wherever a trace holds several requests
    assert main(["timing", "--trace", str(tmp_path / "b.npz"), "--expert-memory", "25%"]) == 0
    out = capsys.readouterr().out
    assert "a request's, between its tokens: mean" in out and "a request's, from its first step" in out
    # a hand-edited plan's layout: named in the plan's terms
    made = make_plan(batch_requests(short, 4), 24, methods=("shared",)).to_dict()
    for where, value, words in (
        ("batched", {**made["source"]["batched"], "concurrency": 0}, "source.batched.concurrency must be"),
        ("batched", {**made["source"]["batched"], "batch_tokens": 2}, "batched.batch_tokens 2 is below"),
        ("served", {"batch_tokens": 64, "schedule": "lifo"}, "source.served.schedule must be one of"),
    ):
        bad = {**made, "source": {**made["source"], where: value}}
        with pytest.raises(ExpertcacheError, match=words):
            Plan.from_dict(bad)
    assert main(["plan", "--trace", str(tmp_path / "prefix256.npz"), "--concurrency", "4", "--schedule",
                 "lifo", "--capacity", "24"]) == 2  # fmt: skip
    assert "--schedule must be one of fifo, prompts-first" in capsys.readouterr().err


@pytest.mark.parametrize("users,host_factor,share", [(16, 1.0, 0.25), (16, 16.0, 0.25), (4, 16.0, 0.9)])
def test_batchs_misses_and_bytes_add_up_by_part(users16, users, host_factor, share):
    """Every miss of ``batch`` is a transfer into the cache or the stream buffer, a host computation, or an
    expert found in the stream buffer already (``part_reused``: no transfer); the bytes moved are the
    demand transfers' and the fills' (``part_fills``), each a whole expert (a trial found the re-uses and
    the fills counted nowhere)."""
    cost = embedded_costs(host_factor)
    trace = users16 if users == 16 else batch_requests(default_trace(), users)
    res = simulate_timing(trace, int(trace.num_keys * share), cache="tlfu", miss="batch", cost=cost)
    c = res.cache
    moved = sum(c["part_misses"].values())
    assert c["misses"] == moved + sum(c["part_reused"].values()) + c["host_computed"]
    assert sum(c["part_fills"].values()) == c["filled"] and not c["part_prefetches"]
    assert res.bytes_moved == (moved + c["filled"]) * cost.expert_bytes
    if share > 0.5:  # misses stream, and at a large budget some are in the buffer from an earlier step
        assert c["part_reused"].get(STREAM, 0) > 0
    elif host_factor == 1:  # a fast host: the cold experts computed there, the popular ones filled
        assert c["host_computed"] > 0 and c["filled"] > 0


def test_batch_under_a_policy_that_admits_everything_says_its_buffer_goes_unused(users16, capsys):
    """Under ``lru`` nothing bypasses the cache, so the stream buffer's slots were held and never used, in
    silence (a trial: 16 of Granite's 115 slots at 90 %): a note says so, in the timing model as at load;
    under ``tlfu`` (which may refuse an expert) none."""
    cap = users16.num_keys // 2
    lru = simulate_timing(users16, cap, cache="lru", miss="batch", cost=embedded_costs(1.0))
    assert any("policy lru admits every expert" in n and "go unused" in n for n in lru.notes)
    assert lru.cache["part_misses"].get(STREAM, 0) == 0 and not lru.cache["part_reused"]
    tlfu = simulate_timing(users16, cap, cache="tlfu", miss="batch", cost=embedded_costs(1.0))
    assert not any("admits every expert" in n for n in tlfu.notes)
