"""The timing simulator: the virtual link by hand, the cost model, whole runs against hand-computed
times and against the counting simulator (``replay``), switches, the CLI.

Times in the hand-traced cases are exact binary fractions, so equalities are exact.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from cli_fixtures import exit_code
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from trace_fixtures import prefix

from expertcache.cache.schedule import build_schedule
from expertcache.cache.transfers import DEMAND, FAILED, PENDING, READY, SPECULATIVE
from expertcache.cli import main
from expertcache.config import CacheConfig, PrefetchConfig
from expertcache.costs import CostModel, chunks_pay
from expertcache.errors import ExpertcacheError
from expertcache.miss.base import FULL
from expertcache.policy import POLICIES
from expertcache.predict.base import PredictContext, Predictor, PredictorError
from expertcache.sim.recorded import Recorded, make_sim_predictor
from expertcache.sim.replay import replay
from expertcache.sim.timing import format_timing, run_timing, shared_runs, simulate_timing
from expertcache.sim.vlink import VirtualLink
from expertcache.trace import Trace, synthesize

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FREE = dict(link_bandwidth=math.inf, link_latency=0.0)  # transfers take no time


def simulate(
    trace,
    policy="lru",
    *,
    capacity,
    predictor=None,
    window=None,
    preemption=True,
    reorder=True,
    prefetch_limit=None,
    **kw,
):
    """``simulate_timing`` with the prefetch options spelled out (a PrefetchConfig each time)."""
    prefetch = PrefetchConfig(
        predictor or "none", window=window, preemption=preemption, reorder=reorder, limit=prefetch_limit
    )
    return simulate_timing(trace, capacity, cache=policy, prefetch=prefetch, **kw)


def cost(**kw: object) -> CostModel:
    """A cost model of round numbers: nothing costs anything unless given."""
    base = dict(dense_s=0.0, expert_s=0.0, expert_token_s=0.0, step_s=0.0, expert_bytes=1, chunk_bytes=None)
    base.update(FREE)
    base.update(kw)
    return CostModel(**base)


def transfer(seconds: float, chunks: int = 1, **kw: object) -> CostModel:
    """Every chunk takes ``seconds`` (latency only), ``chunks`` chunks per expert."""
    return cost(link_latency=seconds, expert_bytes=chunks, chunk_bytes=1 if chunks > 1 else None, **kw)


def decode_trace(rows: list[list[list[int]]], experts: int = 4) -> Trace:
    """One decode step per token: rows [T][L][K]."""
    return Trace(np.asarray(rows, dtype=np.int16), experts)


class Fixed(Predictor):
    """Predicts the same experts for every target layer (for hand-traced cases)."""

    name = "fixed"

    def __init__(self, ctx: PredictContext, experts: list[int]) -> None:
        super().__init__(ctx)
        self.experts = experts

    def _predict(self, source: int, target: int, gate_input) -> list[int]:
        return list(self.experts)


class Wrong(Predictor):
    """Predicts, for each target layer, experts its step will not use (the worst predictor)."""

    name = "wrong"

    def _begin(self, token_ids, prefill, new_request, future) -> None:
        self.future = future

    def _predict(self, source: int, target: int, gate_input) -> list[int]:
        used = set(self.future[target])
        return [e for e in range(self.ctx.num_experts) if e not in used][: self.top_k]


def ctx_of(trace: Trace, window: int | None = None) -> PredictContext:
    return PredictContext(trace.num_layers, trace.num_experts, trace.top_k, window)


# ------------------------------------------------------------------------------------------------
# The virtual link, by hand
# ------------------------------------------------------------------------------------------------
class TestVirtualLink:
    def test_one_transfer_after_another_and_wait_is_stall(self):
        link = VirtualLink([1.0])
        a, b = link.submit((0, 0), None, DEMAND), link.submit((0, 1), None, DEMAND)
        assert link.started(a) and not link.started(b)
        link.wait(b)
        assert (a.done_at, b.done_at, link.now, link.stall_s, link.busy_s) == (1.0, 2.0, 2.0, 2.0, 2.0)
        assert link.poll(a) == READY and link.poll(b) == READY

    def test_the_link_works_while_compute_runs(self):
        link = VirtualLink([1.0])
        t = link.submit((0, 0), None, DEMAND)
        link.advance(0.5)
        assert link.poll(t) == PENDING
        link.advance(0.5)
        assert link.poll(t) == READY  # finished exactly now
        link.wait(t)
        assert link.stall_s == 0.0 and link.now == 1.0

    def test_a_chunk_starts_at_submit_time_when_the_link_is_idle(self):
        link = VirtualLink([1.0])
        link.advance(3.0)
        t = link.submit((0, 0), None, DEMAND)
        link.wait(t)
        assert t.done_at == 4.0 and link.stall_s == 1.0 and link.busy_s == 1.0

    def test_demand_before_speculative_fifo_within_a_priority(self):
        link = VirtualLink([1.0])
        s1 = link.submit((0, 1), None, SPECULATIVE)  # on the link at once
        s2 = link.submit((0, 2), None, SPECULATIVE)
        d1 = link.submit((0, 3), None, DEMAND)
        d2 = link.submit((0, 4), None, DEMAND)
        link.wait(s2)
        assert [t.done_at for t in (s1, d1, d2, s2)] == [1.0, 2.0, 3.0, 4.0]

    def test_demand_overtakes_speculative_between_chunks(self):
        link = VirtualLink([1.0, 1.0, 1.0])
        s = link.submit((0, 1), None, SPECULATIVE)
        link.advance(0.5)
        d = link.submit((0, 2), None, DEMAND)  # waits for s's chunk 0 only
        link.wait(d)
        assert d.done_at == 4.0 and link.now == 4.0 and link.stall_s == 3.5
        assert link.started(s) and link.poll(s) == PENDING
        link.wait(s)  # resumed where it stopped: chunks 1 and 2
        assert s.done_at == 6.0 and link.busy_s == 6.0

    def test_a_demand_transfer_moves_whole_a_speculative_one_in_chunks(self):
        """As the engine's worker: chunks only bound how long a demand waits behind a speculative
        transfer; a demand transfer itself moves whole, paying one latency, not one per chunk."""
        link = VirtualLink([1.0, 1.0, 1.0], [1, 1, 1], whole={FULL: ([1.5], [3])})
        s = link.submit((0, 1), None, SPECULATIVE)
        link.advance(0.5)
        d = link.submit((0, 2), None, DEMAND)  # after s's first chunk, in one piece
        link.wait(d)
        assert d.done_at == 2.5 and link.stall_s == 2.0
        link.wait(s)
        assert s.done_at == 4.5 and link.busy_s == 4.5 and link.bytes_moved == 6
        promoted = link.submit((0, 3), None, SPECULATIVE)
        link.promote(promoted)  # keeps the plan it was submitted with
        link.wait(promoted)
        assert promoted.done_at == 7.5

    def test_cancel(self):
        link = VirtualLink([1.0, 1.0])
        s = link.submit((0, 1), None, SPECULATIVE)
        q = link.submit((0, 2), None, SPECULATIVE)
        link.advance(0.5)
        assert not link.cancel(s)  # mid-chunk
        assert link.cancel(q) and link.poll(q) == FAILED  # queued, never started
        d = link.submit((0, 3), None, DEMAND)
        link.advance(1.0)  # t = 1.5: d's chunk 0 on the link, s moved one chunk of two
        assert link.started(s) and link.cancel(s)  # partly moved, not on the link now
        with pytest.raises(ExpertcacheError, match="cancelled"):
            link.wait(s)
        link.wait(d)
        assert d.done_at == 3.0 and link.busy_s == 3.0  # s's second chunk never moved
        assert not link.cancel(d)  # complete

    def test_a_transfer_whose_last_chunk_is_on_the_link_cannot_be_cancelled(self):
        link = VirtualLink([1.0])
        t = link.submit((0, 1), None, SPECULATIVE)
        link.advance(0.5)
        assert not link.cancel(t) and link.poll(t) == PENDING

    def test_promote_moves_a_speculative_transfer_ahead_of_earlier_ones(self):
        link = VirtualLink([1.0])
        s1, s2, s3 = (link.submit((0, e), None, SPECULATIVE) for e in range(3))
        link.promote(s3)
        d = link.submit((0, 3), None, DEMAND)  # after s3: FIFO by submit order within DEMAND
        link.wait(s2)
        assert [t.done_at for t in (s1, s3, d, s2)] == [1.0, 2.0, 3.0, 4.0]

    def test_promote_mid_transfer_keeps_its_place(self):
        link = VirtualLink([1.0, 1.0])
        s = link.submit((0, 1), None, SPECULATIVE)
        d = link.submit((0, 2), None, DEMAND)
        link.promote(s)  # now DEMAND too, and submitted before d
        link.wait(d)
        assert s.done_at == 2.0 and d.done_at == 4.0

    def test_free_transfers_are_ready_at_once(self):
        link = VirtualLink([0.0, 0.0])
        t = link.submit((0, 0), None, SPECULATIVE)
        assert link.poll(t) == READY and link.now == 0.0

    def test_chunk_bytes_are_counted(self):
        link = VirtualLink([1.0, 1.0], [3, 2])
        link.wait(link.submit((0, 0), None, DEMAND))
        assert link.bytes_moved == 5 and link.transfers == 1


# ------------------------------------------------------------------------------------------------
# The cost model
# ------------------------------------------------------------------------------------------------
class TestCostModel:
    def test_chunks(self):
        slow = dict(link_bandwidth=1.0, link_latency=0.0)  # 10 s of data, no latency: chunks pay
        assert CostModel(expert_bytes=10, chunk_bytes=4).chunk_sizes() == [4, 4, 2]
        assert CostModel(expert_bytes=10, **slow).chunk_sizes() == [4, 4, 2]  # auto: a third, rounded up
        assert CostModel(expert_bytes=9, **slow).chunk_sizes() == [3, 3, 3]
        assert CostModel(expert_bytes=10, chunk_bytes=None).chunk_sizes() == [10]
        # auto where the latency is most of a transfer (10 bytes over 25 GB/s + 20 us): one chunk
        assert CostModel(expert_bytes=10).chunk_sizes() == [10]

    def test_chunks_pay_when_the_data_takes_more_than_five_latencies(self):
        """Three chunks add two latencies to every speculative transfer and save at most a third of a
        transfer per demand that waits behind one: T / 3 > 2 lat, T = lat + data."""
        assert not chunks_pay(5.0, 1.0) and chunks_pay(5.01, 1.0)
        assert chunks_pay(1.0, 0.0) and not chunks_pay(0.0, 0.0)
        assert not chunks_pay(3.0, 1.0, chunks=2) and chunks_pay(3.01, 1.0, chunks=2)  # T > 4 lat
        mixtral = CostModel()  # 336 MiB over PCIe 4: 14 ms of data, 20 us latency
        assert len(mixtral.chunk_sizes()) == 3 and sum(mixtral.chunk_sizes()) == mixtral.expert_bytes

    def test_times(self):
        c = CostModel(dense_s=[1.0, 2.0], expert_s=0.5, expert_token_s=0.25)
        assert (c.dense(0), c.dense(1), c.expert(4)) == (1.0, 2.0, 1.5)
        assert CostModel(dense_s=3.0).dense(5) == 3.0

    @pytest.mark.parametrize(
        "kw, field",
        [
            (dict(expert_s=-1.0), "expert_s"),
            (dict(dense_s=[0.1, math.nan]), "dense_s"),
            (dict(link_bandwidth=0.0), "link_bandwidth"),
            (dict(expert_bytes=0), "expert_bytes"),
            (dict(chunk_bytes=0), "chunk_bytes"),
            (dict(dense_s=[]), "dense_s"),
        ],
    )
    def test_bad_values_name_the_field(self, kw, field):
        with pytest.raises(ExpertcacheError, match=field):
            CostModel(**kw)

    def test_save_load_round_trip(self, tmp_path: Path):
        for c in (CostModel(dense_s=[1e-3, 2e-3], chunk_bytes=None), CostModel(link_bandwidth=math.inf)):
            c.save(tmp_path / "c.json")
            assert CostModel.load(tmp_path / "c.json") == c

    def test_load_units_and_partial_files(self, tmp_path: Path):
        path = tmp_path / "c.json"
        path.write_text(
            json.dumps({"link_bandwidth": "16GB/s", "dense_s": ["1ms", 0.002], "expert_bytes": "3MiB"})
        )
        c = CostModel.load(path)
        assert c.link_bandwidth == 16e9 and c.dense_s == (1e-3, 2e-3) and c.expert_bytes == 3 * 2**20
        assert c.chunk_sizes() == [2**20] * 3  # auto follows the new expert size
        assert c.step_s == CostModel().step_s

    @pytest.mark.parametrize(
        "text, words",
        [
            ('{"link_bandwith": 1}', ["link_bandwith"]),
            ('{"link_latency": "soon"}', ["link_latency", "soon"]),
            ('{"expert_bytes": 1.5}', ["expert_bytes"]),
            ('{"step_s": true}', ["step_s"]),
            ("[1, 2]", ["JSON object"]),
            ("{", ["not JSON"]),
        ],
    )
    def test_load_errors_are_one_line(self, tmp_path: Path, text: str, words: list[str]):
        path = tmp_path / "c.json"
        path.write_text(text)
        with pytest.raises(ExpertcacheError) as e:
            CostModel.load(path)
        assert "\n" not in str(e.value) and str(path) in str(e.value)
        assert all(w in str(e.value) for w in words)

    def test_from_measurements_fits_a_line(self):
        c = CostModel.from_measurements(
            1e-3, [(1, 0.5), (3, 1.5), (5, 2.5)], 0.0, 1e9, 0.0, 1000, chunk_bytes=None
        )
        assert c.expert_s == pytest.approx(0.0, abs=1e-12) and c.expert_token_s == pytest.approx(0.5)
        assert CostModel.from_measurements(0, [(1, 2.0), (1, 4.0)], 0, 1e9, 0, 1).expert_s == 3.0

    def test_describe(self):
        text = CostModel().describe()
        assert "25 GB/s" in text and "3 chunks" in text and "\n" not in text


# ------------------------------------------------------------------------------------------------
# Whole runs, by hand
# ------------------------------------------------------------------------------------------------
class TestHandTraces:
    def test_free_link_gives_no_stall_and_tpot_is_compute(self):
        trace = synthesize("sticky", tokens=60, layers=3, experts=6, top_k=2, seed=2)
        c = cost(dense_s=[1.0, 2.0, 0.5], expert_s=0.25, expert_token_s=0.125, step_s=4.0)
        r = simulate(trace, "lru", capacity=2, cost=c, predictor="oracle")
        assert r.stall_s == 0.0 and r.ttft_s is None
        assert r.tpot_s == pytest.approx(4.0 + 3.5 + 3 * 2 * 0.375)  # each of 2 experts: 1 token

    def test_no_prefetch_stall_is_misses_times_transfer(self):
        # L=1, K=1: capacity 1 misses all four; capacity 2 hits the second 0
        trace = decode_trace([[[0]], [[1]], [[0]], [[2]]])
        c = transfer(2.0, dense_s=1.0, expert_s=1.0)
        for capacity, misses in ((1, 4), (2, 3)):
            r = simulate(trace, "lru", capacity=capacity, cost=c)
            assert (r.misses, r.stall_s) == (misses, 2.0 * misses)
            assert r.total_s == 4 * 2.0 + 2.0 * misses

    def test_prefill_and_decode_steps(self):
        trace = Trace(
            np.asarray([[[0]], [[1]], [[0]]], dtype=np.int16),
            4,
            seq_id=np.zeros(3, dtype=np.int32),
            is_prefill=np.asarray([1, 1, 0], dtype=np.int8),
        )
        c = cost(dense_s=1.0, expert_s=1.0, expert_token_s=0.5, step_s=2.0)
        r = simulate(trace, "lru", capacity=2, cost=c)
        assert (r.steps, r.ttft_s, r.tpot_s, r.total_s) == ([1, 1], 6.0, 4.5, 10.5)

    def test_expert_time_counts_the_tokens_routed_to_it(self):
        trace = Trace(
            np.asarray([[[0, 1]], [[0, 2]], [[0, 1]]], dtype=np.int16),
            4,
            is_prefill=np.ones(3, dtype=np.int8),
        )
        r = simulate(trace, "lru", capacity=3, cost=cost(expert_s=1.0, expert_token_s=1.0))
        assert r.ttft_s == (1 + 3) + (1 + 2) + (1 + 1)

    def test_reorder_computes_resident_experts_first(self):
        # step 1 misses 0 and 1; step 2 needs 2 (missing) then 1 (resident)
        trace = decode_trace([[[0, 1]], [[2, 1]]])
        c = transfer(1.0, expert_s=1.0)
        on = simulate(trace, "lru", capacity=3, cost=c)
        off = simulate(trace, "lru", capacity=3, cost=c, reorder=False)
        assert (on.total_s, on.stall_s) == (5.0, 1.0)
        assert (off.total_s, off.stall_s) == (6.0, 2.0)
        assert (on.misses, on.hits) == (off.misses, off.hits) == (3, 1)

    def test_early_preemption_drops_unchosen_queued_prefetches(self):
        # at the step's start experts 1 and 2 are predicted, 0 is routed: 1 is on the link and
        # finishes; 2 is still queued when the router chooses, and is dropped with preemption
        trace = decode_trace([[[0]]])
        c = transfer(1.0, dense_s=0.5)
        runs = {
            pre: simulate(
                trace,
                "lru",
                capacity=4,
                cost=c,
                predictor=Fixed(ctx_of(trace), [1, 2]),
                preemption=pre,
                prefetch_limit=2,
            )
            for pre in (True, False)
        }
        for r in runs.values():  # the demand waits for 1's chunk, then moves: 0.5 -> 2.0
            assert (r.total_s, r.stall_s, r.misses) == (2.0, 1.5, 1)
        assert runs[True].cache["prefetch_cancelled"] == 1 and runs[True].link_busy_s == 2.0
        assert runs[False].cache["prefetch_cancelled"] == 0 and runs[False].link_busy_s == 3.0

    def test_prefetch_hides_a_transfer_behind_compute(self):
        # two layers; layer 1's expert is predicted after layer 0's router and moves while layer 0
        # computes (2 s) and layer 1's dense part runs (1 s): the 2 s transfer is hidden
        trace = decode_trace([[[0], [3]]])
        c = transfer(2.0, dense_s=1.0, expert_s=2.0)
        none = simulate(trace, "lru", capacity=2, cost=c)
        oracle = simulate(trace, "lru", capacity=2, cost=c, predictor="oracle", window=1)
        assert (none.stall_s, none.total_s) == (4.0, 10.0)
        # layer 0 is prefetched at the step's start: 2 s transfer, 1 s dense -> 1 s stall
        assert (oracle.stall_s, oracle.total_s) == (1.0, 7.0)
        assert oracle.cache["prefetch_used"] == 2 and oracle.cache["prefetch_late"] >= 1

    def test_oracle_prefetch_reduces_stall_on_a_longer_trace(self):
        trace = synthesize(
            "sticky", tokens=400, layers=4, experts=8, top_k=2, seed=3, sequences=2, prompt_len=8
        )
        c = CostModel(expert_bytes=2**20, link_bandwidth=2**20 / 1e-3, link_latency=0.0, dense_s=0.5e-3)
        none = simulate(trace, "lru", capacity=16, cost=c)
        oracle = simulate(trace, "lru", capacity=16, cost=c, predictor="oracle", window=1)
        assert oracle.stall_s < 0.8 * none.stall_s and oracle.total_s < none.total_s
        assert oracle.cache["accuracy"] > 0.9


# ------------------------------------------------------------------------------------------------
# Agreement with the counting simulator, and robustness
# ------------------------------------------------------------------------------------------------
AGREE_TRACE = synthesize(
    "sticky", tokens=300, layers=4, experts=8, top_k=2, seed=5, sequences=3, prompt_len=12
)


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("capacity", [8, 13, 32])
def test_without_prefetch_hits_and_misses_equal_replay(name: str, capacity: int):
    r = simulate(AGREE_TRACE, name, capacity=capacity, cost=transfer(1.0, 3, dense_s=0.5))
    ref = replay(build_schedule(AGREE_TRACE, "layer"), name, capacity)
    assert (r.requests, r.misses, r.hits) == (ref.requests, ref.misses, ref.hits)
    # no expert compute to overlap with: every miss is waited for in full, one after another; a demand
    # transfer moves whole (one latency), not in the 3 chunks a speculative one would take
    assert r.stall_s == 1.0 * r.misses


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("window", [1, 2])
def test_no_deadlock_at_the_minimum_capacity_with_a_wrong_predictor(name: str, window: int):
    trace = AGREE_TRACE
    low = trace.top_k * (trace.num_layers if name.endswith("-dist") else 1)
    for capacity in (low, low + 1):
        pred = Wrong(ctx_of(trace, window))
        r = simulate(trace, name, capacity=capacity, cost=transfer(1.0, 3, dense_s=0.5), predictor=pred)
        assert (
            r.hits + r.misses == r.requests == replay(build_schedule(trace, "layer"), name, capacity).requests
        )
        assert r.stall_s >= 0 and r.cache["accuracy"] == 0.0


def test_shared_runs_give_one_result_to_the_same_arguments_only_within_them():
    """``shared_runs`` (the doctor's): a run asked again, its arguments spelled another way, is the first
    one's result; other arguments are other runs; outside it every call runs."""
    trace, cost = AGREE_TRACE, transfer(1.0, 3, dense_s=0.5)
    with shared_runs():
        first = run_timing(trace, 8, cost=cost)
        assert (
            run_timing(trace, 8, cache=CacheConfig("lru"), prefetch="none", miss="fetch", cost=cost) is first
        )
        other = run_timing(trace, 9, cost=cost)
        assert other is not first and other.capacity == 9
        assert run_timing(trace, 8, cache="lfu", cost=cost) is not first
        with shared_runs():  # nested: the outer one's runs
            assert run_timing(trace, 8, cost=cost) is first
    again = run_timing(trace, 8, cost=cost)
    assert again is not first and (again.misses, again.total_s) == (first.misses, first.total_s)


def test_preemption_cancels_wrong_prefetches_and_saves_link_time():
    c = transfer(1.0, 3, dense_s=0.5, expert_s=0.5)
    runs = {
        pre: simulate(AGREE_TRACE, "lru", capacity=16, cost=c, predictor=Wrong(ctx_of(AGREE_TRACE, 2)),
                             preemption=pre)
        for pre in (True, False)
    }  # fmt: skip
    assert runs[True].cache["prefetch_cancelled"] > 0 == runs[False].cache["prefetch_cancelled"]
    assert runs[True].link_busy_s < runs[False].link_busy_s
    assert runs[True].total_s <= runs[False].total_s


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    """Up to 24 tokens, 1-3 layers, 2-6 experts, top-k 1-3, maybe a prompt per sequence."""
    t, layers = draw(st.integers(1, 24)), draw(st.integers(1, 3))
    experts = draw(st.integers(2, 6))
    k = draw(st.integers(1, min(3, experts)))
    rows = draw(st.lists(st.permutations(range(experts)), min_size=t * layers, max_size=t * layers))
    ex = np.asarray([r[:k] for r in rows], dtype=np.int16).reshape(t, layers, k)
    tokens = np.asarray(draw(st.lists(st.integers(0, 5), min_size=t, max_size=t)), dtype=np.int32)
    if draw(st.booleans()):
        return Trace(ex, experts, token_id=tokens)
    prompt = draw(st.integers(0, t))
    prefill = (np.arange(t) < prompt).astype(np.int8)
    return Trace(ex, experts, seq_id=np.zeros(t, dtype=np.int32), is_prefill=prefill, token_id=tokens)


@SETTINGS
@given(
    trace=traces(),
    name=st.sampled_from(list(POLICIES)),
    extra=st.integers(0, 12),
    predictor=st.sampled_from([None, "oracle", "wrong", "token", "eam"]),
    window=st.integers(1, 3),
    chunks=st.integers(1, 3),
    latency=st.sampled_from([0.0, 0.25, 1.0, 4.0]),
    expert_s=st.sampled_from([0.0, 0.5]),
    switches=st.tuples(st.booleans(), st.booleans()),
)
def test_properties(trace, name, extra, predictor, window, chunks, latency, expert_s, switches):
    low = trace.top_k * (trace.num_layers if name.endswith("-dist") else 1)
    capacity = min(low + extra, trace.num_layers * trace.num_experts)
    if capacity < low:
        return
    c = transfer(latency, chunks, dense_s=0.25, expert_s=expert_s, step_s=0.5)
    pred = Wrong(ctx_of(trace, window)) if predictor == "wrong" else predictor
    r = simulate(
        trace, name, capacity=capacity, cost=c, predictor=pred, window=window if pred else None,
        preemption=switches[0] or not pred, reorder=switches[1],  # preemption is of prefetches
        predictor_trace=trace if pred == "token" else None,
    )  # fmt: skip
    ref = replay(build_schedule(trace, "layer"), name, capacity)
    steps = sum(r.steps)
    compute = steps * 0.5 + steps * trace.num_layers * 0.25 + expert_s * r.requests
    assert r.stall_s >= 0 and r.hits + r.misses == r.requests == ref.requests
    assert r.total_s == pytest.approx(compute + r.stall_s)
    assert r.transfers == r.misses + r.cache["prefetch_issued"]
    if predictor is None:
        assert r.misses == ref.misses
        if expert_s == 0.0:  # nothing overlaps a transfer: each miss is waited for in full, whole
            assert r.stall_s == pytest.approx(r.misses * latency)


# ------------------------------------------------------------------------------------------------
# Predictors in the simulator: recorded predictions
# ------------------------------------------------------------------------------------------------
def recorded_trace(predictor: str = "next-gate", window: int = 1) -> Trace:
    """Decode steps whose recorded predictions are the truth (a perfect gate predictor)."""
    base = synthesize("sticky", tokens=50, layers=3, experts=6, top_k=2, seed=4)
    return Trace(
        base.experts, 6, predicted=base.experts.copy(), meta={"predictor": predictor, "window": window}
    )


class TestRecorded:
    def test_reads_the_steps_rows_in_order(self):
        predicted = np.full((3, 2, 2), -1, dtype=np.int16)
        predicted[0, 1] = [3, -1]
        predicted[1, 1] = [1, 3]
        predicted[2, 1] = [5, 4]
        rec = Recorded(PredictContext(2, 6, 2, window=1), predicted)
        assert rec.begin_step(np.zeros(2), True, True) == {}  # gate-input predictors start at layer 0
        assert rec.after_router(0, np.zeros((2, 2), dtype=int)) == {1: [3, 1]}
        rec.begin_step(np.zeros(1), False, False)
        assert rec.after_router(0, np.zeros((1, 2), dtype=int)) == {1: [5, 4]}

    @pytest.mark.parametrize("name", ["next-gate", "recorded"])
    def test_gate_predictors_replay_the_recorded_predictions(self, name: str):
        trace = recorded_trace()
        r = simulate(trace, "lru", capacity=6, cost=transfer(1.0, dense_s=1.0), predictor=name)
        assert r.predictor == name and r.window == 1
        by_layer = r.cache["goodpred_by_layer"]
        assert by_layer[0] is None and r.cache["accuracy"] == 1.0  # layer 0 is never predicted

    def test_recorded_replays_other_predictors_where_they_predicted(self):
        trace = recorded_trace("token", 1)
        r = simulate(trace, "lru", capacity=6, cost=transfer(1.0, dense_s=1.0), predictor="recorded")
        assert r.cache["goodpred_by_layer"][0] is not None  # predicted at the step's start

    def test_missing_or_other_recordings_are_one_line_errors(self):
        plain = synthesize("sticky", tokens=10, layers=2, experts=4, top_k=2, seed=0)
        cases = [
            (plain, "next-gate", None, "has none"),
            (recorded_trace("window", 2), "next-gate", None, "'window'"),
            (recorded_trace(), "next-gate", 2, "window 1, not 2"),
            (plain, "recorded", None, "has none"),
        ]
        for trace, name, window, words in cases:
            with pytest.raises(PredictorError) as e:
                make_sim_predictor(name, trace, window)
            assert words in str(e.value) and "\n" not in str(e.value)

    def test_trace_predictors_learn_from_another_trace(self, tmp_path: Path):
        other = synthesize("sticky", tokens=200, layers=4, experts=8, top_k=2, seed=9)
        other = Trace(other.experts, 8, token_id=np.arange(200, dtype=np.int32) % 7)
        trace = Trace(AGREE_TRACE.experts, 8, token_id=np.arange(300, dtype=np.int32) % 5)
        with pytest.raises(PredictorError, match="needs a recorded trace to count from"):
            simulate(trace, "lru", capacity=8, predictor="token")  # never the simulated one, silently
        own = simulate(trace, "lru", capacity=8, predictor="token", predictor_trace=trace)
        learned = simulate(trace, "lru", capacity=8, predictor="token", predictor_trace=other)
        assert own.cache["accuracy"] != learned.cache["accuracy"]
        small = synthesize("sticky", tokens=10, layers=2, experts=8, top_k=2, seed=0)
        with pytest.raises(PredictorError, match="2 layers x 8 experts, the simulated one 4 x 8"):
            make_sim_predictor("token", trace, data=small)
        other.save(tmp_path / "o.npz")
        assert main(["timing", "--prefetch", "token", "--predictor", str(tmp_path / "o.npz")]) == 2

    def test_trace_predictors_by_name(self):
        trace = AGREE_TRACE
        assert make_sim_predictor("none", trace) is None
        assert make_sim_predictor("oracle", trace, 2).window == 2
        with pytest.raises(PredictorError, match="unknown predictor"):
            make_sim_predictor("psychic", trace)


# ------------------------------------------------------------------------------------------------
# API details and the CLI
# ------------------------------------------------------------------------------------------------
def test_api_errors():
    with pytest.raises(ExpertcacheError, match="below top-k"):
        simulate(AGREE_TRACE, "lru", capacity=1)
    with pytest.raises(ExpertcacheError, match="3 times for a model of 4 layers"):
        simulate(AGREE_TRACE, "lru", capacity=8, cost=CostModel(dense_s=[1.0, 1.0, 1.0]))
    with pytest.raises(ExpertcacheError, match="unknown policy"):
        simulate(AGREE_TRACE, "lur", capacity=8)


def test_policy_spec_and_result_text():
    r = simulate(AGREE_TRACE, "lcp:rho=0.5", capacity=8, predictor="oracle")
    assert r.params == {"rho": 0.5}
    text = format_timing(r)
    assert "lcp:rho=0.5" in text and "TPOT" in text and "goodpred" in text
    d = r.to_dict()
    assert d["hits"] + d["misses"] == d["requests"] and d["cost"]["chunk_bytes"] == "auto"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "t.npz"
    AGREE_TRACE.save(path)
    return path


def test_cli_json(capsys, trace_file):
    code, out, _ = run_cli(
        capsys, "timing", "--trace", str(trace_file), "--capacity", "10", "--prefetch", "oracle",
        "--window", "2",
        "--link-bandwidth", "8GB/s", "--link-latency", "20us", "--dense-time", "1ms", "--expert-time",
        "0.5ms,2us", "--step-time", "2ms", "--expert-bytes", "64MiB", "--json",
    )  # fmt: skip
    assert code == 0
    d = json.loads(out)
    assert (d["capacity"], d["predictor"], d["window"], d["chunks_per_expert"]) == (10, "oracle", 2, 3)
    assert d["cost"]["link_bandwidth"] == 8e9 and d["cost"]["expert_token_s"] == 2e-6
    assert d["tpot_s"] > 0 and d["stall_s"] >= 0


def test_cli_link_in_bits_is_an_eighth_of_bytes(capsys, trace_file):
    """--link-bandwidth 2Gb/s is 2 gigabits a second (it was read as 2 GB/s, 8x too fast)."""
    args = ("timing", "--trace", str(trace_file), "--link-bandwidth", "2Gb/s")
    code, out, _ = run_cli(capsys, *args)
    assert code == 0 and "link 0.25 GB/s" in out
    code, out, _ = run_cli(capsys, *args, "--json")
    assert json.loads(out)["cost"]["link_bandwidth"] == 0.25e9


def test_a_window_past_the_model_is_clipped_with_a_note(capsys, trace_file):
    """--window 99 on 4 layers was reported as 99 while every layer was predicted from the step's start."""
    code, out, err = run_cli(
        capsys, "timing", "--trace", str(trace_file), "--prefetch", "oracle", "--window", "99"
    )
    assert code == 0 and "prefetch oracle (window 4)" in out
    assert err == (
        "note: prefetch window 99 reaches past a model of 4 MoE layers: oracle predicts at most 4 layer(s) "
        "ahead, so its window is 4\n"
    )


def test_cli_switches_and_cost_file(capsys, trace_file, tmp_path):
    cost_file = tmp_path / "c.json"
    cost(link_latency=1e-3, dense_s=1e-3, expert_bytes=3).save(cost_file)
    args = (
        "timing",
        "--trace",
        str(trace_file),
        "--cost",
        str(cost_file),
        "--expert-memory",
        "25%",
        "--json",
    )
    d = json.loads(run_cli(capsys, *args)[1])
    assert d["capacity"] == 8 and d["cost"]["link_latency"] == 1e-3 and d["cost"]["chunk_bytes"] is None
    switches = ("--chunk-size", "1B", "--no-reorder", "--prefetch", "oracle", "--no-preemption")
    d = json.loads(run_cli(capsys, *args, *switches)[1])
    assert d["chunks_per_expert"] == 3 and not d["reorder"] and not d["preemption"]
    d = json.loads(run_cli(capsys, *args, "--no-chunking")[1])
    assert d["chunks_per_expert"] == 1
    code, _, err = run_cli(capsys, *args, "--chunk-size", "1B", "--no-chunking")  # never silently ignored
    assert code == 2 and "chunking off" in err


def test_cli_expert_memory_above_all_experts_is_capped_with_a_note(capsys, trace_file):
    argv = ("timing", "--trace", str(trace_file), "--expert-bytes", "1MiB", "--json")
    code, out, err = run_cli(capsys, *argv, "--expert-memory", "6GiB")
    assert code == 0 and json.loads(out)["capacity"] == 32  # 4 layers x 8 experts
    assert err == "note: --expert-memory 6GiB is more than all 32 experts take; capped at 32.0 MiB " \
        "(100%: no offloading)\n"  # fmt: skip
    code, out, err = run_cli(capsys, *argv, "--expert-memory", "16MiB")
    assert code == 0 and json.loads(out)["capacity"] == 16 and err == ""


def test_cli_budgets_that_fill_the_capacity_run(capsys, trace_file):
    argv = ("timing", "--trace", str(trace_file), "--policy", "lru-dist:budgets=2/2/2/4", "--json")
    code, out, err = run_cli(capsys, *argv, "--capacity", "10")
    assert code == 0, err
    assert json.loads(out)["capacity"] == 10


def test_cli_text_on_the_default_trace(capsys):
    code, out, _ = run_cli(capsys, "timing", "--capacity", "24")
    assert code == 0 and "TTFT" in out and "TPOT" in out and "stall" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--window", "2"], "needs a predictor (--prefetch NAME)"),
        (["--prefetch-limit", "2"], "--prefetch-limit is about prefetched experts"),
        (["--prefetch", "oracle", "--prefetch-limit", "9"], "prefetch limit 9 is more than the 8 experts"),
        (["--link-bandwidth", "fast"], "--link-bandwidth 'fast' is not a rate"),
        (["--expert-time", "1ms,2us,3us"], "TIME,PER_TOKEN"),
        (["--dense-time", "1ms,1ms"], "2 times for a model of 4 layers"),
        (["--prefetch", "next-gate"], "has none"),
        (["--capacity", "1"], "below top-k"),
        (["--cost", "/nonexistent.json"], "cannot read"),
        (["--capacity", "4", "--expert-memory", "50%"], "not allowed with"),
        (["--capacity", "0"], "capacity must be at least 1 expert, got 0"),  # not the default 50%
        (["--capacity", "-3"], "capacity must be at least 1 expert, got -3"),
        (["--expert-memory", "-5%"], "expert memory '-5%' must be a share in (0%, 100%]"),
        (["--expert-memory=-5%"], "expert memory '-5%' must be a share in (0%, 100%]"),
        (["--expert-memory", "1kB"], "--expert-memory 1kB holds no expert"),
        (["--expert-memory", "5m"], "unit 'm' is ambiguous; write 5MB (10^6 bytes) or 5MiB (2^20 bytes)"),
        (["--link-bandwidth", "2gb/s"], "unit 'gb' is ambiguous; write 2GB/s (10^9 bytes/s)"),
        (["--expert-memory", "6"], "expert memory '6' needs a unit: 6B, 6MB or 6GiB"),
        (["--link-latency", "20"], "--link-latency '20' needs a unit: 20us, 20ms or 20s"),
        (["--link-latency", "-1ms"], "--link-latency '-1ms' must be a non-negative duration"),
        (["--link-bandwidth", "16"], "--link-bandwidth '16' needs a unit: 16GB/s or 16MB/s"),
        (["--dense-time", "1ms,2"], "--dense-time '2' needs a unit: 2us, 2ms or 2s"),
        (["--expert-bytes", "1000"], "--expert-bytes '1000' needs a unit"),
        (["--chunk-size", "100"], "--chunk-size '100' needs a unit"),
        (["--chunk-size", "1B"], "into 352321536 chunks; at most 4096 (chunks of at least 86016 bytes)"),
        (["--policy", "static:profile=x.npz"], "give it as --policy static --profile TRACE.npz"),
        (
            ["--policy", "lru-dist:budgets=2/2/2/2", "--capacity", "10"],
            "holds 10 expert(s) but policy lru-dist's budgets sum to 8; give budgets that sum to 10",
        ),
        (
            ["--policy", "lru-dist:budgets=4/4/4/4", "--capacity", "10"],
            "needs at least 16 (its budgets sum to 16)",
        ),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(capsys, trace_file, argv, words):
    code = exit_code(["timing", "--trace", str(trace_file), *argv])
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1


@example(policy="lru", miss="fetch", predictor=None, share=0.3, seed=0)  # the shortcut with misses
@example(policy="tlfu", miss="batch", predictor=None, share=0.6, seed=1)  # a weighing policy's hits
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["lru", "fifo", "lfu", "llru", "mrs", "tlfu"]),
    miss=st.sampled_from(["fetch", "host", "hobbit", "split", "batch"]),
    predictor=st.sampled_from([None, "oracle", "eam"]),
    share=st.sampled_from([0.3, 0.6, 1.0]),
    seed=st.integers(0, 3),
)
def test_the_plain_layer_shortcut_takes_the_same_decisions(policy, miss, predictor, share, seed):
    """``ExpertCache._plain_layer`` (nothing moving or prefetched for the layer, one chunk, misses fetched
    whole) serves without routing and admission: every count, virtual time and byte equals the full
    path's, at budgets that hold every expert and at smaller ones, with and without prefetching, for
    every miss path."""
    from unittest import mock

    from expertcache.cache.expert_cache import ExpertCache

    trace = synthesize(
        "sticky", tokens=160, layers=3, experts=8, top_k=2, seed=seed, sequences=2, prompt_len=6
    )
    capacity = max(6, round(share * 3 * 8))
    kw = dict(cache=policy, miss=miss, prefetch=predictor)
    shortcut = simulate_timing(trace, capacity, **kw).to_dict()
    with mock.patch.object(ExpertCache, "_plain_layer", lambda self, layer, needs, keys: None):
        full = simulate_timing(trace, capacity, **kw).to_dict()
    assert shortcut == full
    if miss == "fetch" and predictor is None and policy != "mrs":  # mrs observes requests
        taken = []  # (served by the shortcut, with misses)
        real = ExpertCache._plain_layer

        def spy(self, layer, needs, keys):
            before = int(self.stats.misses.sum())
            got = real(self, layer, needs, keys)
            taken.append((got is not None, int(self.stats.misses.sum()) > before))
            return got

        with mock.patch.object(ExpertCache, "_plain_layer", spy):
            simulate_timing(trace, capacity, **kw)
        assert any(plain for plain, _ in taken)  # the shortcut is exercised here
        if share < 1.0:  # and serves layers with misses
            assert any(plain and missed for plain, missed in taken)


def test_simulate_timing_names_itself_when_given_too_many_positions():
    from expertcache.trace.default import default_trace

    with pytest.raises(ExpertcacheError, match="simulate_timing takes the trace and the capacity by"):
        simulate_timing(default_trace(), 48, "lru")  # was run_timing's TypeError


def test_the_cache_line_spells_a_policy_as_policy_takes_it(capsys):
    """``cache lru-dist:budgets=[4, 4, ...]`` could not be pasted back into --policy."""
    from expertcache.cli import main

    assert main(["timing", "--policy", "lru-dist:budgets=4/4/4/4/4/4", "--capacity", "24"]) == 0
    assert "cache      lru-dist:budgets=4/4/4/4/4/4, 24 experts" in capsys.readouterr().out


@pytest.mark.parametrize("miss", ["host", "hybrid", "batch"])
def test_a_cost_based_path_prices_a_fetch_as_the_link_moves_it_whole(miss):
    """Fiddler's rule priced a fetch with every chunk's latency while the link moves a demand transfer
    whole: at 1 ms a chunk every miss went to the host, TPOT 194 ms against 51 ms with --no-chunking (a
    new user's audit). The decision, the cost line and the run are now the same however chunks are set."""
    cost = {"link_latency": "1ms", "host_expert_s": "16ms", "host_expert_token_s": 0}
    trace = prefix(1200)
    runs = [
        simulate_timing(trace, 24, miss=miss, cost=cost, prefetch=pf)
        for pf in (None, PrefetchConfig("none", chunking=False), PrefetchConfig("none", chunk_size="10MB"))
    ]
    assert len({(r.misses, r.cache["host_computed"], r.total_s) for r in runs}) == 1
    assert "in 1 chunk (nothing prefetched to pass)" in format_timing(runs[0])
    c = CostModel.from_dict(cost)
    assert c.demand_transfer_time() == pytest.approx(1e-3 + c.expert_bytes / c.link_bandwidth)
    assert c.transfer_time() > c.demand_transfer_time() and not c.host_pays(1)  # 16 ms > 15.1 + 0.35 ms
    if miss == "host":
        assert runs[0].cache["host_computed"] == 0
        filling = simulate_timing(trace, 24, miss="host:fill=1", cost=cost)  # fills move speculatively
        assert "in 3 chunks" in format_timing(filling)


@pytest.mark.parametrize("parallel", [False, True])
def test_each_host_expert_costs_the_compute_thread_host_submit_s(parallel, capsys):
    """The engine's own work an expert computed on the host (its tokens handed over, its output placed) was
    priced nowhere: a profile's host path came out 4x too cheap on a 2-core CPU, and the doctor's budget
    ladder named 12.5 % of the experts enough for a server that ran 1.7x slower there."""
    trace = prefix(300)
    base = {"host_parallel": parallel, "host_expert_s": "20us", "host_expert_token_s": 0}
    plain = simulate_timing(trace, 24, miss="placement", cost=base)
    charged = simulate_timing(trace, 24, miss="placement", cost={**base, "host_submit_s": "100us"})
    computed = plain.cache["host_computed"]
    assert computed == charged.cache["host_computed"] > trace.num_tokens  # every expert of every step
    assert charged.total_s - plain.total_s == pytest.approx(computed * 100e-6)
    assert main(["timing", "--miss", "placement", "--capacity", "24", "--host-issue-time", "100us"]) == 0
    out = capsys.readouterr().out
    assert "+ issue 100 us" in out
    # every layer on the host allocates no slot: the header said "24 experts" (a new user's trial)
    assert "lru, no slot (the expert memory of 24 experts goes unused: miss placement:layers=all" in out
    assert exit_code(["timing", "--host-issue-time", "abc"]) == 2
    assert "--host-issue-time" in capsys.readouterr().err


def test_a_cpus_costs_that_leave_the_engines_own_work_unpriced_are_said_to(tmp_path, capsys):
    """A new user's trial: only the doctor said that a plain CPU profile (no fitted overheads) predicts
    misses too cheaply; `timing` on the same profile said nothing. It names what the run paid for and left
    unpriced, and nothing where the costs price it or are a GPU's."""
    trace = prefix(300)
    cpu = {"host_parallel": False, "host_expert_s": "20us"}
    said = {
        "fetch": "(submit_s 0)",
        "placement": "(host_submit_s 0)",  # every expert computed on the host, none moved
    }
    for miss, what in said.items():
        with pytest.warns(UserWarning, match="own work") as record:
            result = simulate_timing(trace, 24, miss=miss, cost=cpu)
        assert [n for n in result.notes if "own work" in n] == [str(w.message) for w in record if "own" in
                                                              str(w.message)]  # fmt: skip
        assert any(what in n and "optimistic" in n for n in result.notes), (miss, result.notes)
    for priced in ({"submit_s": "50us"}, {"host_parallel": True}):
        assert not any("own work" in n for n in simulate_timing(trace, 24, cost={**cpu, **priced}).notes)
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(cpu))
    assert main(["timing", "--capacity", "24", "--cost", str(path)]) == 0
    err = capsys.readouterr().err
    assert err.count("own work") == 1 and "--issue-time declares it" in err


def test_a_recorded_runs_expert_size_counts_a_byte_budget_without_a_profile(tmp_path, capsys):
    """A new user's trial: `timing --trace RUN.npz --expert-memory 144MiB` on a run of 3 MiB experts was
    refused ("holds no expert of 336.0 MiB"), the default cost model's Mixtral expert, and its TTFT came out
    13x the run's. The run's own expert size now counts the budget, said in a note."""
    import dataclasses

    from expertcache.trace import synthesize

    trace = synthesize("zipf", tokens=48, layers=2, experts=8, top_k=2, seed=1)
    path = tmp_path / "run.npz"
    dataclasses.replace(trace, meta={**trace.meta, "expert_bytes": 184320}).save(path)
    for command in (["timing"], ["plan"], ["doctor"]):
        assert main([*command, "--trace", str(path), "--expert-memory", "1MiB", "--json"]) == 0, command
        err = capsys.readouterr().err
        assert "with the run's experts of 180.0 KiB (the trace's expert_bytes)" in err, command
    assert main(["timing", "--trace", str(path), "--expert-memory", "1MiB"]) == 0
    assert "lru, 5 experts" in capsys.readouterr().out  # 1 MiB of 180 KiB experts
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"expert_bytes": "100KiB"}))
    assert main(["timing", "--trace", str(path), "--expert-memory", "1MiB", "--cost", str(cost)]) == 0
    out, err = capsys.readouterr()
    assert "lru, 10 experts" in out and "expert_bytes" not in err  # a cost file given: its size


def test_a_configs_field_given_to_simulate_timing_names_its_config():
    """A new user's trial: simulate_timing(..., deterministic=True) said only "unknown argument"."""
    trace = prefix(50)
    with pytest.raises(ExpertcacheError, match=r"deterministic is PrefetchConfig's: prefetch=PrefetchConfig"):
        simulate_timing(trace, 24, deterministic=True)
    with pytest.raises(
        ExpertcacheError, match=r"seed is CacheConfig's: cache=CacheConfig\(\.\.\., seed=\.\.\.\)"
    ):
        simulate_timing(trace, 24, seed=3)


def test_a_predictor_replayed_by_name_from_a_run_that_predicted_in_some_steps_says_so():
    """A new user's trial: `timing --prefetch learned` on a run the governor held off in 108 of 120 steps
    replayed its 12 steps' predictions as if learned had run always on, without a word."""
    import dataclasses

    from expertcache.trace import synthesize

    trace = synthesize("zipf", tokens=40, layers=3, experts=8, top_k=2, seed=1)
    predicted = trace.experts.astype(np.int16)  # [T, L, K]: every guess right
    some = predicted.copy()
    some[10:] = -1  # predicted in the first 10 steps alone
    meta = {**trace.meta, "predictor": "next-gate", "window": 1}
    for held, said in ((some, True), (predicted, False)):
        run = dataclasses.replace(trace, predicted=held, meta=meta)
        notes = simulate_timing(run, 8, prefetch="next-gate").notes
        assert any("predictions for 10 of 40 steps" in n for n in notes) == said, notes


def test_timings_header_gives_a_cache_of_several_parts_by_its_parts(capsys):
    """A new user's batch trace: the header said 'tlfu, 20 experts' without --expert-memory and '24
    experts' with --expert-memory 25 %, for the same cache of 20 + 4 slots."""
    from expertcache.cli import main

    assert main(["timing", "--miss", "batch", "--policy", "tlfu", "--capacity", "24"]) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert header.startswith("cache      tlfu, slots: ") and "full 20" in header and "stream 4" in header
    assert main(["timing", "--capacity", "24"]) == 0  # one part: its experts
    assert capsys.readouterr().out.splitlines()[1].startswith("cache      lru, 24 experts | miss fetch")
