"""The trace-based predictors (token, eam, oracle), the EAM model they share with the eam policy,
and the simulator's request boundaries (clock.seq).

Expected rankings and victims are derived by hand in the comment above each expectation; the EAM
model is also checked against a direct (non-incremental) reference implementation of the paper's
matching and EAMC replacement.
"""

from __future__ import annotations

import numpy as np
import pytest

from expertcache.cache import Residency
from expertcache.errors import ExpertcacheError, PolicyError
from expertcache.policy import POLICIES, Clock, PolicyContext, make_policy, parse_policy
from expertcache.policy.eam import EAM
from expertcache.policy.eam_model import EamModel, request_eams
from expertcache.predict import PREDICTORS, PredictContext, PredictorError, make_predictor
from expertcache.predict.eam_matching import Eam
from expertcache.sim import build_schedule, replay
from expertcache.trace import Trace
from expertcache.trace.default import default_trace

EPS = 1e-3  # the eam policy's default epsilon


def ctx_for(
    trace: Trace | None = None, *, layers: int = 2, experts: int = 4, top_k: int = 1, **kw
) -> PredictContext:
    if trace is not None:
        layers, experts, top_k = trace.num_layers, trace.num_experts, trace.top_k
    return PredictContext(num_layers=layers, num_experts=experts, top_k=top_k, trace=trace, **kw)


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------------- token


def token_trace() -> Trace:
    """L=2, E=4, K=1. Token 5 twice: layer 0 -> 1, 1; layer 1 -> 2, 3. Token 7 once: 0 / 3.
    Token 9 once: 1 / 3."""
    experts = [[[1], [2]], [[1], [3]], [[0], [3]], [[1], [3]]]
    return Trace(np.asarray(experts, dtype=np.int16), 4, token_id=np.asarray([5, 5, 7, 9]))


class TestToken:
    def test_known_token_ranking(self) -> None:
        pred = make_predictor("token", ctx_for(token_trace(), window=1))
        # token 5, layer 0: expert 1 twice -> [1]; known at the step's start (window 1: layer 0 only)
        assert pred.begin_step(np.asarray([5]), False, True) == {0: [1]}
        # layer 1 (predicted after layer 0's router): experts 2 and 3 once each, ties by id
        assert pred.after_router(0, np.asarray([[1]])) == {1: [2, 3]}
        assert pred.after_router(1, np.asarray([[2]])) == {}  # no layer after the last

    def test_window_covers_layers_at_the_start(self) -> None:
        pred = make_predictor("token", ctx_for(token_trace(), window=2))
        assert pred.begin_step(np.asarray([7]), False, True) == {0: [0], 1: [3]}

    def test_several_tokens_sum_expected_use(self) -> None:
        pred = make_predictor("token", ctx_for(token_trace(), window=2))
        # layer 0: token 5 uses expert 1 once per occurrence (2/2), token 7 expert 0 (1/1) -> tie, by id
        # layer 1: token 5 -> 2: 0.5, 3: 0.5; token 7 -> 3: 1 => 3 (1.5) before 2 (0.5)
        assert pred.begin_step(np.asarray([5, 7]), True, True) == {0: [0, 1], 1: [3, 2]}

    def test_unknown_token_falls_back_to_overall_use(self) -> None:
        pred = make_predictor("token", ctx_for(token_trace(), window=2))
        # overall: layer 0 -> 1 three times, 0 once; layer 1 -> 3 three times, 2 once
        assert pred.begin_step(np.asarray([123]), False, True) == {0: [1, 0], 1: [3, 2]}
        assert pred.begin_step(np.asarray([-1]), False, False) == {0: [1, 0], 1: [3, 2]}

    def test_needs_a_trace_with_token_ids(self) -> None:
        with pytest.raises(PredictorError) as exc:
            make_predictor("token", ctx_for(None))
        assert "needs a recorded trace" in one_line(exc)
        bare = Trace(token_trace().experts, 4)
        with pytest.raises(PredictorError) as exc:
            make_predictor("token", ctx_for(bare))
        assert "no token ids" in one_line(exc)

    @pytest.mark.parametrize(("layers", "experts"), [(3, 4), (2, 8)])
    def test_shape_mismatch(self, layers: int, experts: int) -> None:
        ctx = PredictContext(num_layers=layers, num_experts=experts, top_k=1, trace=token_trace())
        with pytest.raises(PredictorError) as exc:
            make_predictor("token", ctx)
        assert "2 layers x 4 experts" in one_line(exc)


# --------------------------------------------------------------------------------------- EAM model


def reference_aggregate(stored: list[np.ndarray], current: np.ndarray, matches: int) -> np.ndarray:
    """The paper's matching, directly: cosine of the flattened EAMs, the best ``matches`` summed
    (ties: lower slot); all of them while the current EAM is empty; the current one when none."""
    if not stored:
        return current.copy()
    cur = current.reshape(-1)
    if not cur.any():
        return np.sum(stored, axis=0)
    sims = [float(s.reshape(-1) @ cur) / (np.linalg.norm(s) * np.linalg.norm(cur)) for s in stored]
    best = sorted(range(len(stored)), key=lambda i: (-sims[i], i))[:matches]
    return np.sum([stored[i] for i in best], axis=0)


def reference_store(stored: list[np.ndarray], eam: np.ndarray, capacity: int) -> None:
    if not eam.any():
        return
    if len(stored) < capacity:
        stored.append(eam.copy())
        return
    v = eam.reshape(-1)
    sims = [float(s.reshape(-1) @ v) / (np.linalg.norm(s) * np.linalg.norm(v)) for s in stored]
    stored[int(np.argmax(sims))] = eam.copy()


class TestEamModel:
    def test_matching_picks_the_most_similar(self) -> None:
        model = EamModel(2, 3, capacity=8, matches=1)
        a = np.asarray([[4, 0, 0], [0, 4, 0]])
        b = np.asarray([[0, 4, 0], [0, 0, 4]])
        c = np.asarray([[0, 0, 4], [4, 0, 0]])
        for eam in (a, b, c):
            model.store(eam)
        model.observe(0, np.asarray([[1]]))  # current: layer 0 expert 1, layer 1 expert 2 -> b
        model.observe(1, np.asarray([[2]]))
        assert model.matched() == (1,)
        assert np.array_equal(model.aggregate(), b)

    def test_matches_are_summed(self) -> None:
        model = EamModel(1, 4, capacity=8, matches=2)
        for eam in ([[3, 1, 0, 0]], [[0, 0, 5, 0]], [[1, 3, 0, 0]]):
            model.store(np.asarray(eam))
        model.observe(0, np.asarray([[0], [1]]))  # (1, 1, 0, 0): slots 0 and 2 equally close
        assert model.matched() == (0, 2)
        assert np.array_equal(model.aggregate(), [[4, 4, 0, 0]])

    def test_full_eamc_replaces_the_most_similar(self) -> None:
        model = EamModel(1, 3, capacity=2)
        model.store(np.asarray([[5, 0, 0]]))
        model.store(np.asarray([[0, 5, 1]]))
        # (0, 4, 0) is closest to slot 1 (cosine 0.98 against 0): slot 1 is replaced
        assert model.store(np.asarray([[0, 4, 0]])) == 1
        assert np.array_equal(model.eams()[:, 0], [[5, 0, 0], [0, 4, 0]])
        assert model.store(np.zeros((1, 3))) == -1  # an empty EAM is not stored

    def test_end_request_stores_the_request_eam(self) -> None:
        model = EamModel(2, 2, capacity=4)
        model.end_request()  # nothing observed: nothing stored
        assert model.size == 0
        model.observe(0, np.asarray([[0, 1], [0, -1]]))  # -1 unknown: skipped
        model.observe(1, np.asarray([[1, 1]]))
        model.end_request()
        assert model.size == 1
        assert np.array_equal(model.eams()[0], [[2, 1], [0, 2]])
        assert not model.current.any()

    def test_fallbacks(self) -> None:
        model = EamModel(2, 4)
        # nothing known: uniform likelihood
        assert np.allclose(model.likelihood(), 0.25)
        # empty EAMC: the current EAM; a row still unseen stays uniform
        model.observe(0, np.asarray([[1], [1], [3]]))
        assert np.array_equal(model.aggregate(), [[0, 2, 0, 1], [0, 0, 0, 0]])
        assert np.allclose(model.likelihood(), [[0, 2 / 3, 0, 1 / 3], [0.25] * 4])

    def test_layer_proximity(self) -> None:
        model = EamModel(4, 2)
        for layer in range(4):
            model.observe(layer, np.asarray([[0], [1], [1], [1]]))  # every row: 1/4, 3/4
        peam = model.peam(1)
        # layers 0 and 1 already routed: 0; layer i > 1: 1 - (i - 1)/4 -> 0.75, 0.5
        assert np.allclose(peam.sum(axis=1), [0, 0, 0.75, 0.5])
        assert np.allclose(peam[2], [0.75 / 4, 0.75 * 3 / 4])
        # at the step's start (-1) every layer is ahead: 1 - (i + 1)/4
        assert np.allclose(model.peam(-1).sum(axis=1), [0.75, 0.5, 0.25, 0.0])

    @pytest.mark.parametrize("seed", range(5))
    def test_incremental_state_equals_reference(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        L, E, cap, m = 3, 5, 4, 2
        model, stored = EamModel(L, E, capacity=cap, matches=m), []
        current = np.zeros((L, E))
        for _ in range(60):
            if rng.random() < 0.15:
                reference_store(stored, current, cap)
                model.end_request()
                current[:] = 0
            layer = int(rng.integers(L))
            ex = rng.integers(-1, E, size=(int(rng.integers(1, 4)), 2))
            model.observe(layer, ex)
            np.add.at(current[layer], ex[ex >= 0], 1)
            assert np.array_equal(model.current.reshape(L, E), current)
            assert np.array_equal(model.eams(), np.asarray(stored).reshape(-1, L, E))
            assert np.array_equal(model.aggregate(), reference_aggregate(stored, current, m))

    def test_bad_parameters(self) -> None:
        with pytest.raises(ExpertcacheError, match="capacity"):
            EamModel(2, 2, capacity=0)
        with pytest.raises(ExpertcacheError, match="matches"):
            EamModel(2, 2, matches=0)


# ----------------------------------------------------------------------------------- eam predictor


class TestEamPredictor:
    def test_predicts_from_the_matched_request(self) -> None:
        # two recorded requests: seq 0 uses experts 0 then 1; seq 1 uses 2 then 3 (L=2, E=4, K=1)
        experts = np.asarray([[[0], [1]], [[0], [1]], [[2], [3]], [[2], [3]]], dtype=np.int16)
        trace = Trace(experts, 4, seq_id=np.asarray([0, 0, 1, 1]))
        pred = Eam(ctx_for(trace, window=1), matches=1)
        assert pred.model.size == 2  # warm start: one EAM per request
        # an empty request matches every stored EAM: layer 0 -> experts 0 and 2 (2 each), by id
        assert pred.begin_step(np.asarray([1]), False, True) == {0: [0, 2]}
        # layer 0 chose expert 2: the closest request is seq 1, whose layer 1 used expert 3
        assert pred.after_router(0, np.asarray([[2]])) == {1: [3]}

    def test_nothing_known_predicts_nothing(self) -> None:
        pred = make_predictor("eam", ctx_for(None, window=1))
        assert pred.begin_step(np.asarray([1]), False, True) == {}
        # empty EAMC: the current request's own EAM, where layer 1 is still unseen
        assert pred.after_router(0, np.asarray([[3]])) == {}
        assert pred.after_router(1, np.asarray([[2]])) == {}  # no layer after the last
        # the next step of the same request: its EAM so far
        assert pred.begin_step(np.asarray([1]), False, False) == {0: [3]}
        assert pred.after_router(0, np.asarray([[3]])) == {1: [2]}

    def test_warm_start_needs_a_matching_trace(self) -> None:
        trace = Trace(np.zeros((2, 3, 1), dtype=np.int16), 4)
        with pytest.raises(PredictorError) as exc:
            make_predictor("eam", PredictContext(num_layers=2, num_experts=4, top_k=1, trace=trace))
        assert "3 layers x 4 experts" in one_line(exc)

    def test_request_eams(self) -> None:
        trace = Trace(np.asarray([[[0, 1]], [[1, -1]], [[1, 0]]], dtype=np.int16), 2, seq_id=[4, 2, 4])
        # by first appearance: seq 4 (tokens 0, 2), then seq 2 (token 1)
        assert [e.tolist() for e in request_eams(trace)] == [[[2, 2]], [[0, 1]]]


# -------------------------------------------------------------------------------------- eam policy


def eam_policy(capacity: int, layers: int = 2, experts: int = 4, **params: object):
    ctx = PolicyContext(capacity=capacity, num_layers=layers, num_experts=experts, clock=Clock())
    return make_policy("eam", ctx, **params)


def serve(res: Residency, keys: list[tuple[int, int]], seq: int = 0) -> list:
    res.policy.clock.seq = seq
    res.policy.clock.layer = keys[0][0]
    return [victim for _, victim in res.admit(tuple(keys))]


class TestEamPolicy:
    def test_hand_traced(self) -> None:
        res = Residency(eam_policy(2, matches=1))
        assert serve(res, [(0, 0)]) == [None]
        assert serve(res, [(1, 0)]) == [None]
        # (1, 1) misses: p(0,0) = (1+eps)/1 * 1, p(1,0) = (1+eps)/2 * 1/2 -> evict (1, 0)
        assert serve(res, [(1, 1)]) == [(1, 0)]
        # (1, 0) again, row 1 = (2, 1): p(1,1) = (1+eps)/3 * 1/2 < p(0,0) -> evict (1, 1)
        assert serve(res, [(1, 0)]) == [(1, 1)]
        # a new request: the first one's EAM {(0,0): 1, (1,0): 2, (1,1): 1} is the only match;
        # p(0,0) = (1+eps)/1 * 1 > p(1,0) = (2+eps)/3 * 1/2 -> evict (1, 0)
        assert serve(res, [(0, 1)], seq=1) == [(1, 0)]
        assert res.policy.model.size == 1

    def test_ties_go_to_least_recently_used(self) -> None:
        res = Residency(eam_policy(2, layers=1))
        serve(res, [(0, 0)])
        serve(res, [(0, 1)])
        assert serve(res, [(0, 2)]) == [(0, 0)]  # counts 1, 1: equal p, (0, 0) touched first
        assert serve(res, [(0, 1)]) == []  # hit: count 2
        assert serve(res, [(0, 3)]) == [(0, 2)]  # (0, 2) has count 1 < 2

    def test_no_victim_while_room_and_never_pinned(self) -> None:
        policy = eam_policy(3, layers=1)
        res = Residency(policy)
        serve(res, [(0, 0), (0, 1)])
        assert policy.victim((0, 2), pinned=()) is None
        serve(res, [(0, 2), (0, 0)])  # (0, 0) count 2; (0, 1) lowest
        assert policy.victim((0, 3), pinned=()) == (0, 1)
        assert policy.victim((0, 3), pinned=((0, 1),)) == (0, 2)
        assert policy.victim((0, 3), pinned={(0, 1), (0, 2)}) == (0, 0)
        assert policy.victim((0, 3), pinned=_Only({(0, 1), (0, 2)})) == (0, 0)
        with pytest.raises(PolicyError):
            policy.victim((0, 3), pinned={(0, 0), (0, 1), (0, 2)})
        assert policy.victim((0, 3), pinned=()) == (0, 1)  # the masks are undone

    @pytest.mark.parametrize("seed", range(4))
    def test_victim_is_argmin_of_algorithm_1(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        L, E, cap = 3, 4, 5
        policy = eam_policy(cap, layers=L, experts=E, eamc=2, matches=1)
        res, last = Residency(policy), {}
        for t in range(80):
            seq = t // 20
            layer = int(rng.integers(L))
            keys = [(layer, int(e)) for e in rng.choice(E, size=int(rng.integers(1, 3)), replace=False)]
            policy.clock.seq = seq
            policy.on_request(keys)
            peam = policy.model.aggregate()
            for key in keys:
                if key in res:
                    policy.on_hit(key)
                else:
                    victim = policy.victim(key, keys)
                    live = [k for k in res.resident if k not in keys]
                    if len(res) < cap:
                        assert victim is None
                    else:
                        p = {k: _algorithm_1(peam, k) for k in live}
                        assert victim == min(live, key=lambda k: (p[k], last[k]))
                        res.resident.remove(victim)
                        policy.on_evict(victim)
                    res.resident.add(key)
                    policy.on_insert(key)
                last[key] = t + 0.001 * keys.index(key)

    def test_parameters_through_the_registry(self) -> None:
        name, params = parse_policy("eam:eamc=8,matches=2,eps=0.5")
        policy = eam_policy(4, **params)
        assert (name, policy.model.capacity, policy.model.matches, policy.eps) == ("eam", 8, 2, 0.5)
        for bad in ({"eamc": 0}, {"matches": 0}, {"eps": 0.0}, {"window": 2}):
            with pytest.raises(PolicyError):
                eam_policy(4, **bad)


class _Only:
    """A container that can only answer ``in`` (like the prefetcher's pins)."""

    def __init__(self, keys: set) -> None:
        self.keys = keys

    def __contains__(self, key: object) -> bool:
        return key in self.keys


def _algorithm_1(peam: np.ndarray, key: tuple[int, int]) -> float:
    layer, expert = key
    L, E = peam.shape
    ntoken = peam[layer].sum()
    count = peam[layer, expert] if ntoken else 1.0
    return (count + EPS) * (1 - layer / L) / (ntoken if ntoken else E)


class TestSharedModel:
    def test_predictor_and_policy_build_the_same_eams(self) -> None:
        """Decode steps (one token, distinct experts per layer): the predictor counts tokens, the
        policy counts group members; both feed the same EamModel state."""
        rng = np.random.default_rng(0)
        L, E, K = 3, 6, 2
        pred = make_predictor("eam", ctx_for(None, layers=L, experts=E, top_k=K))
        policy = eam_policy(L * E, layers=L, experts=E)
        res = Residency(policy)
        for step in range(30):
            seq = step // 7
            pred.begin_step(np.asarray([step]), False, new_request=step % 7 == 0)
            for layer in range(L):
                experts = rng.choice(E, size=K, replace=False)
                pred.after_router(layer, experts[None, :])
                serve(res, [(layer, int(e)) for e in experts], seq=seq)
                assert np.array_equal(pred.model.aggregate(), policy.model.aggregate())
                assert np.array_equal(pred.model.peam(layer), policy.model.peam(layer))
        assert pred.model.size == policy.model.size == 4


# ------------------------------------------------------------------------------------------ oracle


class TestOracle:
    def test_exact(self) -> None:
        pred = make_predictor("oracle", ctx_for(None, layers=3, experts=8, window=2))
        future = [[3, 1], [7], [0, 2, 5]]
        assert pred.begin_step(np.asarray([1]), False, True, future) == {0: [3, 1], 1: [7]}
        assert pred.after_router(0, np.asarray([[3, 1]])) == {2: [0, 2, 5]}
        assert pred.after_router(1, np.asarray([[7, 0]])) == {}

    def test_simulator_only(self) -> None:
        pred = make_predictor("oracle", ctx_for(None))
        assert pred.sim_only
        with pytest.raises(PredictorError) as exc:
            pred.begin_step(np.asarray([1]), False, True)
        assert one_line(exc).startswith("oracle is simulator-only")


def test_registries_list_them() -> None:
    assert {"token", "eam", "oracle"} <= set(PREDICTORS)
    assert "eam" in POLICIES


# --------------------------------------------------------------------------------------- simulator


class TestSimulator:
    @pytest.mark.parametrize("order", ["layer", "flat"])
    def test_eam_replays_the_default_trace(self, order: str) -> None:
        schedule = build_schedule(default_trace(), order)
        distinct = len(np.unique(schedule.req_key))
        for capacity in (16, 48):
            eam, lru = replay(schedule, "eam", capacity), replay(schedule, "lru", capacity)
            assert eam.requests == lru.requests == schedule.num_requests
            assert distinct <= eam.misses <= eam.requests
            assert eam.hits + eam.misses == eam.requests
            assert (eam.layer_misses <= eam.layer_requests).all()
        assert replay(schedule, "eam", 16).misses > replay(schedule, "eam", 48).misses

    def test_round_seq(self) -> None:
        experts = np.zeros((5, 2, 1), dtype=np.int16)
        trace = Trace(experts, 2, seq_id=[3, 3, 3, 8, 8], is_prefill=[1, 1, 0, 1, 0])
        assert build_schedule(trace, "layer").round_seq.tolist() == [3, 3, 8, 8]  # prompt: one step
        assert build_schedule(trace, "flat").round_seq.tolist() == [3, 3, 3, 8, 8]
        assert build_schedule(Trace(experts, 2), "rounds").round_seq.tolist() == [0] * 5

    def test_clock_seq_changes_at_request_boundaries(self, monkeypatch: pytest.MonkeyPatch) -> None:
        trace = default_trace()
        schedule = build_schedule(trace, "layer")
        seen: list[tuple[int, int]] = []
        original = EAM.on_request

        def spy(self, keys, scores=None):
            seen.append((self.clock.round, self.clock.seq))
            original(self, keys)

        monkeypatch.setattr(EAM, "on_request", spy)
        replay(schedule, "eam", 24)
        rounds = np.asarray([r for r, _ in seen])
        assert np.array_equal([s for _, s in seen], schedule.round_seq[rounds])
        # every request boundary of the trace is seen: one seq per request, in order
        assert list(dict.fromkeys(s for _, s in seen)) == list(dict.fromkeys(trace.seq_id.tolist()))


@pytest.mark.parametrize(("name", "most"), [("next-gate", 5), ("window", 5), ("oracle", 6), ("token", 6)])
def test_a_window_past_the_last_layer_is_clipped_with_a_note(name, most):
    """A window reaches at most the last layer (from layer 0 for gate predictors, from the step's start
    for the others); --window 99 on 6 layers was reported as 99 while predicting from layer 0."""
    trace = default_trace()
    fits = make_predictor(name, ctx_for(trace, window=most, routers=[None] * 6))
    assert fits.window == most and fits.note is None
    past = make_predictor(name, ctx_for(trace, window=99, routers=[None] * 6))
    assert past.window == most
    assert past.note == (
        f"prefetch window 99 reaches past a model of 6 MoE layers: {name} predicts at most {most} layer(s) "
        f"ahead, so its window is {most}"
    )


def test_a_default_window_past_the_last_layer_is_the_window_it_runs():
    """adaptive's default window 3 on a model of 3 MoE layers predicts 2 ahead at most: it was reported
    (and recorded) as 3, and the replay of the recorded window cut it with a note the run never gave (a new
    user's trial). A default is cut to the model silently: nothing was asked."""
    three = make_predictor("adaptive", ctx_for(layers=3, routers=[None] * 3))
    assert three.window == 2 and three.note is None
    six = make_predictor("adaptive", ctx_for(layers=6, routers=[None] * 6))
    assert six.window == 3 and six.note is None
