"""Batched traces: many requests served together (``trace batch``, a server's ``--record-trace``), their
steps as the simulator and the timing model replay them, and what ``trace info`` says of them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertcache.cache.schedule import build_schedule
from expertcache.cli import main
from expertcache.errors import ExpertcacheWarning, TraceError
from expertcache.sim.replay import replay
from expertcache.sim.timing import format_timing, simulate_timing
from expertcache.trace import Trace, load_trace
from expertcache.trace.batch import batch_requests, requests_of
from expertcache.trace.default import default_trace
from expertcache.trace.stats import step_shape
from expertcache.trace.synth import synthesize


def _requests(
    lengths: list[tuple[int, int]], layers: int = 2, experts: int = 6, top_k: int = 2, seed: int = 0
):
    """A single-stream trace of requests of (prompt, generated) tokens, random distinct top-k routing."""
    rng = np.random.default_rng(seed)
    rows = sum(p + g for p, g in lengths)
    ex = np.argsort(rng.random((rows, layers, experts)), axis=2)[:, :, :top_k].astype(np.int16)
    seq = np.concatenate([np.full(p + g, i) for i, (p, g) in enumerate(lengths)]).astype(np.int32)
    phase = np.concatenate([np.r_[np.ones(p), np.zeros(g)] for p, g in lengths]).astype(np.int8)
    return Trace(ex, experts, seq_id=seq, is_prefill=phase, token_id=np.arange(rows, dtype=np.int32))


def _check_batched(
    src: Trace, out: Trace, concurrency: int, batch_tokens: int | None, schedule: str = "fifo"
) -> None:
    """What any batching of ``src`` must satisfy: each request's tokens once and in order, its prompt
    before its generated tokens, one generated token of a request a step (under prompts-first, a step
    of prompts alone may come between two), at most ``concurrency`` requests in a step, and a step
    within ``batch_tokens``."""
    gap = 1 if schedule == "fifo" else 2
    pool = requests_of(src)
    steps = out.step_id
    assert (np.diff(steps) >= 0).all() and steps[0] == 0 and (np.diff(np.unique(steps)) == 1).all()
    for r in np.unique(out.seq_id).tolist():
        rows = np.flatnonzero(out.seq_id == r)
        want, prompt = pool[r % len(pool)]
        assert out.token_id[rows].tolist() == src.token_id[want].tolist()  # every token once, in order
        assert out.is_prefill[rows].tolist() == src.is_prefill[want].tolist()
        gen_steps = steps[rows[prompt:]]
        assert (np.diff(gen_steps) >= 1).all() and (np.diff(gen_steps) <= gap).all()  # one a step
        if len(gen_steps):  # from the step after its prompt's last (or the one after that)
            assert 1 <= gen_steps[0] - steps[rows[prompt - 1]] <= gap
    for s in np.unique(steps).tolist():
        in_step = steps == s
        assert len(np.unique(out.seq_id[in_step])) <= concurrency
        assert batch_tokens is None or in_step.sum() <= batch_tokens
        phase = out.is_prefill[in_step]  # generated tokens first, then prompts (transformers' layout)
        assert (np.diff(phase) >= 0).all()


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5)), min_size=1, max_size=6),
    concurrency=st.integers(1, 5),
    cap=st.one_of(st.none(), st.integers(0, 6)),
    stagger=st.integers(0, 3),
    extra=st.integers(0, 4),
    schedule=st.sampled_from(["fifo", "prompts-first"]),
)
def test_any_batching_keeps_every_request_whole_and_in_order(
    lengths, concurrency, cap, stagger, extra, schedule
):
    src = _requests(lengths)
    batch_tokens = None if cap is None else concurrency + cap
    total = len(lengths) + extra
    out = batch_requests(src, concurrency, total, batch_tokens, stagger, schedule)
    assert len(np.unique(out.seq_id)) == total
    assert out.num_tokens == sum(sum(lengths[r % len(lengths)]) for r in range(total))
    _check_batched(src, out, concurrency, batch_tokens, schedule)
    assert (out.meta["concurrency"], out.meta["batched_requests"]) == (concurrency, total)
    assert out.meta["schedule"] == schedule


def test_prompts_first_gives_prompts_a_step_of_their_own_but_never_two_in_a_row():
    """``trace batch --schedule prompts-first`` lays steps out as the server's scheduler does: a step
    with prompts to compute while others decode computes the prompts alone, unless the step before did."""
    src = _requests([(3, 6), (2, 5), (4, 4), (1, 7)] * 3, seed=1)
    fifo, first = (batch_requests(src, 4, schedule=s) for s in ("fifo", "prompts-first"))
    steps = {}
    for name, out in (("fifo", fifo), ("prompts-first", first)):
        kinds = []  # per step: (prompt tokens, decode tokens)
        for s in range(int(out.step_id.max()) + 1):
            phase = out.is_prefill[out.step_id == s]
            kinds.append((int(phase.sum()), int((phase == 0).sum())))
        steps[name] = kinds
    assert any(p and d for p, d in steps["fifo"])  # FIFO mixes a joining prompt with the decodes
    alone = [i for i, (p, d) in enumerate(steps["prompts-first"]) if p and not d]
    assert len(alone) > 1 and all(
        p == 0 or d == 0 or i - 1 in alone for i, (p, d) in enumerate(steps["prompts-first"])
    )
    with pytest.raises(TraceError, match="schedule must be one of fifo, prompts-first"):
        batch_requests(src, 4, schedule="sjf")


def test_one_at_a_time_is_the_trace_itself():
    """Concurrency 1: each request's prompt in one step, then a step a token: the schedule the simulator
    builds from the trace alone, group for group."""
    src = default_trace()
    out = batch_requests(src, 1)
    assert np.array_equal(out.experts, src.experts) and np.array_equal(out.weights, src.weights)
    a, b = build_schedule(src, "layer"), build_schedule(out, "layer")
    assert a.groups == b.groups and a.round_prefill.tolist() == b.round_prefill.tolist()
    assert replay(a, "lru", 24).layer_misses.tolist() == replay(b, "lru", 24).layer_misses.tolist()


def test_a_step_of_several_requests_is_one_group_per_layer_and_prompts_make_it_a_prefill_step():
    """4 requests of 3 prompt + 4 generated tokens, 2 at a time, at most 3 tokens a step: a step is
    the union of its tokens' experts per layer; a step holding any prompt token counts as prefill."""
    src = _requests([(3, 4)] * 4)
    out = batch_requests(src, 2, batch_tokens=3, stagger=0)
    _check_batched(src, out, 2, 3)
    schedule = build_schedule(out, "layer")
    starts = np.flatnonzero(np.r_[True, np.diff(out.step_id) != 0])
    ends = np.r_[starts[1:], out.num_tokens]
    assert schedule.num_rounds == len(starts)
    for r, (s, e) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        for layer in range(out.num_layers):
            group = schedule.groups[r * out.num_layers + layer]
            assert {k[1] for k in group} == set(out.experts[s:e, layer].reshape(-1).tolist())
        assert bool(schedule.round_prefill[r]) == bool((out.is_prefill[s:e] == 1).any())
    mixed = [bool(len(set(out.is_prefill[s:e].tolist())) == 2) for s, e in zip(starts, ends, strict=True)]
    assert any(mixed)  # a request's prompt chunk beside another's generated token
    res = replay(schedule, "lru", 6)
    assert res.layer_requests.sum() == sum(len(g) for g in schedule.groups)


def test_the_timing_model_counts_a_batched_trace_as_the_replay_does():
    """The timing model drives the engine's step logic over the batched steps: its hits and misses, per
    phase and layer, equal the replay's (the rule the engine's counts follow, tested under serve)."""
    out = batch_requests(_requests([(4, 6), (2, 8), (5, 3)] * 3, layers=3, experts=8), 3, batch_tokens=5)
    res = simulate_timing(out, capacity=9)
    ref = replay(build_schedule(out, "layer"), "lru", 9)
    assert res.cache["phases"]["decode"]["misses"] == int(ref.layer_misses[0].sum())
    assert res.cache["phases"]["prefill"]["misses"] == int(ref.layer_misses[1].sum())
    assert res.misses == ref.misses and res.requests == ref.requests


def test_a_requests_time_to_first_token_spans_its_steps_up_to_its_last_prompt_token():
    """A prompt chunked over steps, or waiting behind others', counts whole: the mean prefill step time
    understated it (13.1 s against 1.3 s on the embedded trace at 16 users, chunks of 32 tokens)."""
    from expertcache.sim.timing import request_ttfts

    # steps: [r0 prompt], [r0 prompt, r1 prompt], [r0 decode, r1 prompt], [r1 decode]; they take 1, 2, 3, 4 s
    seq, prompt, step = [0, 0, 1, 0, 1, 1], [1, 1, 1, 0, 1, 0], [0, 1, 1, 2, 2, 3]
    trace = Trace(
        np.zeros((6, 1, 1), np.int16), 2, seq_id=np.array(seq, np.int32),
        is_prefill=np.array(prompt, np.int8), step_id=np.array(step, np.int32),
    )  # fmt: skip
    got = request_ttfts(trace, np.array([0, 1, 3, 5]), np.array([0.0, 1, 3, 6, 10]))
    assert got.tolist() == [3.0, 5.0]  # r0: steps 0-1; r1: steps 1-2
    one = simulate_timing(batch_requests(default_trace(), 1), capacity=24)  # a prompt a step, alone
    assert math.isclose(one.request_ttfts["mean_s"], one.ttft_s) and one.request_ttfts["requests"] == 16
    chunked = simulate_timing(batch_requests(default_trace(), 16, batch_tokens=32), capacity=24)
    q = chunked.request_ttfts
    assert q["mean_s"] > 3 * chunked.ttft_s and q["p99_s"] >= q["p50_s"] and q["requests"] == 32
    assert chunked.to_dict()["ttft_requests"] == q


def test_a_requests_time_per_token_spans_its_steps_after_its_first_token():
    """TPOT is the mean pure-decode step; on a batched trace most tokens come in steps that also prefill
    others' prompts (a new user's trial: 8.6 ms of TPOT against 13.1 ms between a request's own tokens),
    so each request's own time per token is given beside it."""
    from expertcache.sim.timing import request_tpots

    # the steps of the TTFT test above: r0's first token ends step 1 (3 s), its decode token step 2 (6 s);
    # r1's first token ends step 2 (6 s), its decode token step 3 (10 s)
    seq, prompt, step = [0, 0, 1, 0, 1, 1], [1, 1, 1, 0, 1, 0], [0, 1, 1, 2, 2, 3]
    trace = Trace(
        np.zeros((6, 1, 1), np.int16), 2, seq_id=np.array(seq, np.int32),
        is_prefill=np.array(prompt, np.int8), step_id=np.array(step, np.int32),
    )  # fmt: skip
    assert request_tpots(trace, np.array([0, 1, 3, 5]), np.array([0.0, 1, 3, 6, 10])).tolist() == [3.0, 4.0]
    alone = batch_requests(default_trace(), 1)  # one request at a time: its tokens are its decode steps
    one = simulate_timing(alone, capacity=24)
    first = [int(np.flatnonzero(alone.seq_id == r)[0]) for r in np.unique(alone.seq_id)]
    order = np.unique(alone.seq_id)[np.argsort(first)]  # the requests in the order they began
    decode = [int(np.count_nonzero(alone.is_prefill[alone.seq_id == r] == 0)) for r in order]
    assert math.isclose(float(np.dot(one.request_tpot_s, decode)), one.step_time_s[0], rel_tol=1e-9)
    chunked = simulate_timing(batch_requests(default_trace(), 16, batch_tokens=32), capacity=24)
    q = chunked.request_tpots
    assert (
        q["mean_s"] > 1.3 * chunked.tpot_s and q["requests"] == 32 and chunked.to_dict()["tpot_requests"] == q
    )
    assert "a request's, between its tokens: mean" in format_timing(chunked)
    assert f"p99 {1e3 * one.request_tpots['p99_s']:.3f} ms over 16 requests" in format_timing(one)  # the tail
    single = simulate_timing(batch_requests(default_trace(), 1, requests=1), capacity=24)  # one request:
    assert "between its tokens" not in format_timing(single)  # its decode steps are its tokens


def test_more_users_need_more_distinct_experts_a_step_and_lru_loses_its_hits():
    """The issue this answers, on the embedded trace: a step of many users needs most of a layer's experts,
    and LRU at a quarter of them keeps almost nothing from one step to the next."""
    src = default_trace()
    shapes, hits = [], []
    for n in (1, 4, 16):
        out = batch_requests(src, n)
        shapes.append(step_shape(out)["mean_step_experts"])
        hits.append(replay(build_schedule(out, "layer"), "lru", src.num_keys // 4).hits)
    assert shapes[0] < shapes[1] < shapes[2] <= src.num_experts
    assert hits[0] > hits[1] > hits[2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"concurrency": 0}, "concurrency must be at least 1"),
        ({"concurrency": 4, "batch_tokens": 3}, "batch_tokens 3 is below concurrency 4"),
        ({"concurrency": 2, "stagger": -1}, "stagger must be at least 0"),
        ({"concurrency": 2, "requests": 0}, "requests must be at least 1"),
        ({"concurrency": 10**9}, "would make a trace of about 8,000,000,000 tokens, more than 20,000,000"),
    ],
)
def test_bad_batching_parameters_are_one_line(kwargs, message):
    with pytest.raises(TraceError, match=message):
        batch_requests(_requests([(2, 2)]), **kwargs)


def test_a_trace_without_requests_and_phases_cannot_be_batched():
    with pytest.raises(TraceError, match="needs each token's request and phase"):
        batch_requests(Trace(synthesize("zipf", tokens=20, layers=2, experts=4, top_k=2).experts, 4), 2)
    src = _requests([(2, 2)])
    bad = Trace(src.experts, src.num_experts, seq_id=src.seq_id, is_prefill=np.array([1, 0, 1, 0], np.int8))
    with pytest.raises(TraceError, match="request 0 is not a prompt followed by generated tokens"):
        batch_requests(bad, 2)


def test_the_cli_writes_a_batched_trace_and_info_describes_its_steps(tmp_path: Path, capsys):
    out = tmp_path / "batched.npz"
    assert main(["trace", "batch", "-c", "4", "--batch-tokens", "64", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "wrote" in err and "requests, 4 at a time (achieved: " in err and "experts a layer a step" in err
    trace = load_trace(out)
    per_step = [len(set(trace.seq_id[trace.step_id == s].tolist())) for s in np.unique(trace.step_id)]
    shape = step_shape(trace)  # the concurrency achieved: ramp-up and drain run fewer than 4
    assert shape["max_step_requests"] == max(per_step) <= 4 and shape["mean_step_requests"] == np.mean(
        per_step
    )
    assert f"{shape['mean_step_requests']:.1f} a step on average, {max(per_step)} at most" in err
    assert trace.meta["concurrency"] == 4 and trace.step_id is not None
    _check_batched(default_trace(), trace, 4, 64)
    assert main(["trace", "info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step_shape"] == step_shape(trace) and info["step_shape"]["max_step_tokens"] <= 64
    assert main(["trace", "info", str(out)]) == 0
    assert "forward steps of" in capsys.readouterr().out
    assert main(["trace", "batch", "-c", "4", "--batch-tokens", "2", "-o", str(out)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_requests_reuse_does_not_depend_on_what_ran_beside_it():
    """``trace info``'s reuse follows each request's own tokens, however a batch interleaves them."""
    from expertcache.trace.stats import reuse_between_tokens

    src = default_trace()
    out = batch_requests(src, 4, requests=len(requests_of(src)))
    assert np.allclose(reuse_between_tokens(out), reuse_between_tokens(src))


def test_the_two_per_step_references_by_hand():
    """Two steps (a prompt of 2 tokens, then 1 token) through 1 layer of 4 experts, top-2: streaming moves
    each needed expert once a step; the static split keeps the most used experts (by tokens) and computes
    the others on the host at their token counts."""
    from expertcache.costs import CostModel
    from expertcache.sim.bounds import step_bounds

    ex = np.array([[[0, 1]], [[0, 2]], [[0, 3]]], dtype=np.int16)  # expert 0: 3 tokens; 1, 2, 3: one each
    trace = Trace(ex, 4, seq_id=np.zeros(3, np.int32), is_prefill=np.array([1, 1, 0], np.int8))
    cost = CostModel(expert_bytes=1000, link_bandwidth=1e6, link_latency=0.0, chunk_bytes=None,
                     host_expert_s=0.01, host_expert_token_s=0.001)  # fmt: skip
    b = step_bounds(trace, 1, cost)  # room 1: expert 0 resident
    assert np.allclose(b.stream_s, [3 * 1e-3, 2 * 1e-3])  # {0, 1, 2}, then {0, 3}
    assert np.allclose(b.static_s, [2 * 0.011, 0.011])  # 1 and 2 (a token each), then 3
    assert np.allclose(b.best_s, [3e-3, 2e-3]) and b.prefill.tolist() == [True, False]
    assert step_bounds(trace, 4, cost).static_s.sum() == 0  # every expert resident
    assert np.allclose(step_bounds(trace, 0, cost).static_s, [0.012 + 0.011 + 0.011, 0.011 + 0.011])
    assert b.to_dict()["stream_better_steps"] == 2
    # a capacity beyond every expert is capped, and said as the simulator says it (it was not: a trial)
    with pytest.warns(ExpertcacheWarning, match="a cache of 1000000 experts is more than all 4; capped at 4"):
        assert step_bounds(trace, 10**6, cost).static_s.sum() == 0


def test_the_timing_model_counts_the_hosts_work_on_misses():
    """``host_busy_s``: each expert computed on the host at its step's token count, waited for or not."""
    from expertcache.costs import CostModel

    src = _requests([(1, 6)] * 3, layers=2, experts=8)  # one token a step: one token an expert
    cost = CostModel()
    res = simulate_timing(src, capacity=4, miss="host", cost=cost)
    assert res.cache["host_computed"] > 0
    assert res.host_busy_s == pytest.approx(res.cache["host_computed"] * cost.host_expert(1))
    assert simulate_timing(src, capacity=4, cost=cost).host_busy_s == 0


def test_the_python_api_names_them():
    import expertcache
    from expertcache.sim.bounds import step_bounds

    assert expertcache.batch_requests is batch_requests and expertcache.step_bounds is step_bounds
    assert "batch_requests" in expertcache.__all__ and "step_bounds" in expertcache.__all__


def test_step_bounds_takes_its_arguments_as_simulate_timing_does():
    """A trace file, a share of the experts, a cost as None or a dict; a bad one is one clear error (they
    were AttributeErrors)."""
    from expertcache.costs import CostModel
    from expertcache.errors import ExpertcacheError
    from expertcache.sim.bounds import step_bounds
    from expertcache.trace.default import default_trace

    trace = default_trace()
    want = step_bounds(trace, 24, CostModel()).best_s.sum()
    assert step_bounds(trace, "25%", None).best_s.sum() == want  # 25 % of 96 experts
    assert step_bounds(trace, 24, {}).best_s.sum() == want
    for bad, message in ((-1, "at least 0"), ("lots", "lots")):
        with pytest.raises(ExpertcacheError, match=message):
            step_bounds(trace, bad)


def test_a_trace_served_already_is_said_to_be_laid_out_again():
    """A new user's trial: `doctor --concurrency 4` on a trace the server recorded replaced the served
    steps with its own without a word."""
    from expertcache.trace.batch import is_batched

    trace = synthesize("zipf", tokens=64, layers=2, experts=8, top_k=2, seed=1, sequences=4, prompt_len=4)
    served = batch_requests(trace, 2)
    assert is_batched(served) and not is_batched(trace)
    with pytest.warns(UserWarning, match="is served already .* laid out again here, 3 at a time"):
        again = batch_requests(served, 3)
    assert is_batched(again)


def test_sim_compares_tlfu_by_default_on_steps_of_several_requests(tmp_path, capsys):
    """A new user's idea: `sim` on a served trace left out tlfu, the policy made for such steps."""
    trace = synthesize("zipf", tokens=64, layers=2, experts=8, top_k=2, seed=1, sequences=4, prompt_len=4)
    served, plain = tmp_path / "served.npz", tmp_path / "plain.npz"
    batch_requests(trace, 2).save(served)
    trace.save(plain)
    assert main(["sim", str(served), "--capacity", "6", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "tlfu" in [r["policy"] for r in json.loads(out)] and "the default policies and tlfu" in err
    assert main(["sim", str(plain), "--capacity", "6", "--json"]) == 0
    assert "tlfu" not in [r["policy"] for r in json.loads(capsys.readouterr().out)]


def test_a_padded_batchs_left_padding_is_no_requests_and_batching_leaves_it_out():
    """``generate --prompts`` records a padded batch's left padding (``padding``) among the shorter prompt's
    rows; a server computes none, so a request laid out by ``trace batch`` is its own tokens only."""
    ex = np.arange(7 * 2, dtype=np.int16).reshape(7, 1, 2) % 8
    seq, prefill = np.array([0, 0, 0, 1, 1, 0, 1]), np.array([1, 1, 1, 1, 1, 0, 0])
    pad = np.array([0, 0, 0, 1, 0, 0, 0])  # request 1: one row of padding, then one prompt token
    trace = Trace(ex, 8, seq_id=seq, is_prefill=prefill, padding=pad)
    pool = requests_of(trace)
    assert [(rows.tolist(), prompt) for rows, prompt in pool] == [([0, 1, 2, 5], 3), ([4, 6], 1)]
    batched = batch_requests(trace, 2)
    assert batched.num_tokens == 2 * (4 + 2) and batched.padding is None
    assert not (batched.experts == ex[3]).all(axis=(1, 2)).any()  # the padding row's routing is not there
