"""Property tests of the simulator over random small traces, in all three orders.

- OPT is a lower bound on every online policy; OPT-Dist on every online -Dist policy.
- A cache that holds every distinct key misses only compulsorily, with every policy.
- LRU and OPT are stack algorithms: inclusion of resident sets, misses non-increasing in capacity,
  and run_policy's one-pass stack distances equal replay, per phase and layer.
- The adversarial traces of the LLRU paper: cyclic (Thm 3.3) and partition (Thm 3.1).
- Residency invariants under every policy, and the -Dist wrapper as independent per-layer caches.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertcache.cache import Residency
from expertcache.cache.schedule import Schedule
from expertcache.policy import POLICIES, Dist, is_offline, uniform_budgets
from expertcache.policy.base import Key, Policy
from expertcache.sim import ORDERS, build_schedule, replay, run_policy, simulate
from expertcache.sim.replay import policy_for
from expertcache.trace import Trace, synthesize

ONLINE = [n for n in POLICIES if not is_offline(n)]
ONLINE_FLAT = [n for n in ONLINE if not n.endswith("-dist")]
ONLINE_DIST = [n for n in ONLINE if n.endswith("-dist")]
STACK = ("lru", "opt")
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------------
# Strategies and helpers
# ------------------------------------------------------------------------------------------------
@st.composite
def traces(draw: st.DrawFn, max_tokens: int = 40) -> Trace:
    """T <= max_tokens tokens, L 1-4 layers, E 2-6 experts, top-k 1-3 distinct experts per row; maybe
    some unknown (-1) entries, maybe several sequences with prompt (prefill) runs."""
    t = draw(st.integers(1, max_tokens))
    layers = draw(st.integers(1, 4))
    experts = draw(st.integers(2, 6))
    k = draw(st.integers(1, min(3, experts)))
    hot = draw(st.integers(k, experts))  # rows drawn from the first `hot` experts: more reuse
    rows = draw(st.lists(st.permutations(range(hot)), min_size=t * layers, max_size=t * layers))
    ex = np.asarray([r[:k] for r in rows], dtype=np.int16).reshape(t, layers, k)
    unknown = draw(st.lists(st.integers(0, ex.size - 1), max_size=max(1, ex.size // 8)))
    flat = ex.reshape(-1)
    flat[unknown] = -1
    if (flat < 0).all():
        flat[0] = 0
    if not draw(st.booleans()):
        return Trace(ex, experts)
    cuts = sorted(draw(st.sets(st.integers(1, max(1, t - 1)), max_size=2)) - {t})
    seq_id = np.zeros(t, dtype=np.int32)
    for c in cuts:
        seq_id[c:] += 1
    is_prefill = np.zeros(t, dtype=np.int8)
    starts = [0, *cuts]
    for s, e in zip(starts, [*cuts, t], strict=True):
        is_prefill[s : s + draw(st.integers(0, e - s))] = 1
    return Trace(ex, experts, seq_id=seq_id, is_prefill=is_prefill)


def low_capacity(s: Schedule) -> int:
    """The smallest capacity the simulator accepts: top-k in layer order, 1 otherwise."""
    return s.top_k if s.order == "layer" else 1


def distinct_keys(s: Schedule) -> int:
    return len(np.unique(s.req_key))


def min_capacity(s: Schedule, name: str) -> int:
    """The smallest capacity a policy accepts: -Dist needs every layer's budget to be that low."""
    return low_capacity(s) * (s.num_layers if name.endswith("-dist") else 1)


def unsplit(s: Schedule, name: str, capacity: int) -> bool:
    """Whether every group is served whole (no layer's room is below the largest group)."""
    if not name.endswith("-dist"):
        return capacity >= s.max_group
    return min(uniform_budgets(capacity, s.num_layers)) >= s.max_group


class Served(NamedTuple):
    group: int
    phase: int  # 1 prefill, 0 decode
    layer: int
    keys: tuple[Key, ...]
    before: frozenset[Key]  # resident before the group was served
    misses: int
    residency: Residency  # after the group was served


def drive(s: Schedule, policy: Policy) -> Iterator[Served]:
    """Serve every group through a Residency under ``policy``, setting the clock as replay() does
    (round, token, seq, layer, group), without replay's capacity check; yield each group once served."""
    residency, clock = Residency(policy), policy.clock
    g, tokens, seqs = 0, s.round_token.tolist(), s.round_seq.tolist()
    scores = s.group_scores if policy.observes else None  # routing scores, as replay gives them (mrs)
    for r, prefill in enumerate(s.round_prefill.tolist()):
        clock.round, clock.token, clock.seq, clock.prefill = r, tokens[r], seqs[r], prefill
        for layer in range(s.num_layers):
            for _ in range(s.per_layer):
                keys = s.groups[g]
                clock.layer, clock.group = layer, g
                before = frozenset(residency.resident)
                if keys and policy.weighs:  # tokens per key, as replay gives them (tlfu)
                    policy.on_use(keys, s.group_tokens[g])
                misses = residency.serve(layer, keys, scores and scores[g]) if keys else 0
                yield Served(g, int(prefill), layer, keys, before, misses, residency)
                g += 1
    assert g == len(s.groups)


def compulsory_by_cell(s: Schedule) -> np.ndarray:
    """First uses of each key per phase and layer. -> int64 [2, L]"""
    _, first = np.unique(s.req_key, return_index=True)
    layer = s.req_key[first] // s.num_experts
    phase = s.round_prefill[s.req_group[first] // (s.per_layer * s.num_layers)].astype(np.int64)
    return np.bincount(phase * s.num_layers + layer, minlength=2 * s.num_layers).reshape(2, -1)


orders = pytest.mark.parametrize("order", ORDERS)


# ------------------------------------------------------------------------------------------------
# OPT is a lower bound
# ------------------------------------------------------------------------------------------------
@orders
@SETTINGS
@given(trace=traces(), data=st.data())
def test_opt_is_a_lower_bound(order: str, trace: Trace, data: st.DataObject) -> None:
    """Where no group is split into chunks (always in flat and rounds order; in layer order where the
    room, the capacity or every -Dist budget, holds the largest group), OPT misses no more than any
    online policy, and OPT-Dist no more than any online -Dist policy. Split groups: the xfail tests."""
    s = build_schedule(trace, order)
    low = max(low_capacity(s), s.max_group)
    c = data.draw(st.integers(low, max(low, distinct_keys(s))), label="capacity")
    opt = replay(s, "opt", c).misses
    assert opt >= distinct_keys(s)  # compulsory misses bound every policy, OPT included
    for name in ONLINE_FLAT:
        assert replay(s, name, c).misses >= opt, name
    if c < min_capacity(s, "opt-dist") or not unsplit(s, "opt-dist", c):
        return
    opt_dist = replay(s, "opt-dist", c).misses
    assert opt_dist >= opt
    for name in ONLINE_DIST:
        assert replay(s, name, c).misses >= opt_dist, name


def _trace(rows: list[list[list[int]]], experts: int, **arrays: list[int]) -> Trace:
    return Trace(np.asarray(rows, dtype=np.int16), experts, **{k: np.asarray(v) for k, v in arrays.items()})


@pytest.mark.parametrize(
    ("trace", "capacity", "policy", "want"),
    [
        pytest.param(  # prefill steps {1, 2, 0} and {0, 2, 1} exceed capacity 2: FIFO 4 misses, OPT 5
            _trace(
                [[[0, 2]], [[1, 2]], [[0, 1]], [[0, 2]], [[1, 2]], [[1, 0]]],
                3,
                seq_id=[0, 1, 1, 2, 2, 2],
                is_prefill=[1, 1, 1, 1, 1, 0],
            ),
            2,
            "fifo",
            (4, 5),
            id="fifo-beats-opt-same-chunking",
        ),
        pytest.param(  # prefill group {1, 0} per layer: OPT (capacity 2) holds it whole, LRU-Dist
            # (budgets [1, 1] >= top-k 1) serves it one expert at a time: LRU-Dist 4 misses, OPT 5
            _trace([[[1], [1]], [[0], [0]], [[0], [0]]], 2, is_prefill=[1, 1, 0]),
            2,
            "lru-dist",
            (4, 5),
            id="lru-dist-beats-opt-chunked-prefill",
        ),
    ],
)
def test_split_groups_are_flagged_where_opt_is_no_bound(
    trace: Trace, capacity: int, policy: str, want: tuple[int, int]
) -> None:
    """In layer order a group larger than its room (a prefill group above the capacity or a -Dist
    budget) is served in chunks, resident members first. Belady under that rule is not optimal: FIFO
    can beat it, and -Dist may split a group that global OPT must hold whole. The simulator says so:
    such results carry opt_is_bound = False (and the CLI marks their ratio)."""
    s = build_schedule(trace, "layer")
    [result] = simulate(trace, [policy], [capacity], "layer")
    assert (result.misses, result.opt_misses) == want  # the policy makes fewer misses than OPT here
    assert result.ratio_to_opt < 1
    assert result.split_groups or replay(s, "opt", capacity).split_groups
    assert result.opt_is_bound is False
    assert result.to_dict()["opt_is_bound"] is False
    assert result.to_dict()["split_groups"] == result.split_groups  # sim --json says it, as DESIGN.md


@orders
@SETTINGS
@given(trace=traces(), data=st.data())
def test_opt_is_bound_exactly_when_nothing_is_split(order: str, trace: Trace, data: st.DataObject) -> None:
    """opt_is_bound is True iff neither the policy nor OPT split a group; when True, OPT is no worse."""
    s = build_schedule(trace, order)
    c = data.draw(st.integers(low_capacity(s), max(low_capacity(s), distinct_keys(s))), label="capacity")
    for r in simulate(trace, ["lru", "fifo", "llru"], [c], order):
        assert r.opt_is_bound == (c >= s.max_group)
        if r.opt_is_bound:
            assert r.misses >= r.opt_misses


# ------------------------------------------------------------------------------------------------
# A cache that holds everything misses only compulsorily
# ------------------------------------------------------------------------------------------------
@orders
@SETTINGS
@given(trace=traces(), extra=st.integers(0, 3))
def test_full_cache_misses_only_compulsorily(order: str, trace: Trace, extra: int) -> None:
    s = build_schedule(trace, order)
    want = compulsory_by_cell(s)
    assert int(want.sum()) == distinct_keys(s)
    full = max(low_capacity(s), distinct_keys(s)) + extra
    # -Dist splits the capacity evenly: every layer's budget must hold that layer's distinct keys.
    per_layer = np.bincount(np.unique(s.req_key) // s.num_experts, minlength=s.num_layers)
    full_dist = s.num_layers * max(low_capacity(s), int(per_layer.max())) + extra
    for name in POLICIES:
        c = full_dist if name.endswith("-dist") else full
        got = replay(s, name, c)
        np.testing.assert_array_equal(got.layer_misses, want, err_msg=f"{name} at capacity {c}")


# ------------------------------------------------------------------------------------------------
# LRU and OPT are stack algorithms
# ------------------------------------------------------------------------------------------------
@orders
@pytest.mark.parametrize("name", STACK)
@SETTINGS
@given(trace=traces(), data=st.data())
def test_inclusion_property(order: str, name: str, trace: Trace, data: st.DataObject) -> None:
    """After every group, the resident set at capacity c is a subset of the one at c + 1 (for every
    capacity that holds the largest group: below it groups are split, see stack.py)."""
    s = build_schedule(trace, order)
    low = max(low_capacity(s), s.max_group)
    c = data.draw(st.integers(low, max(low, distinct_keys(s))), label="capacity")
    small, large = drive(s, policy_for(s, name, c)), drive(s, policy_for(s, name, c + 1))
    for a, b in zip(small, large, strict=True):
        assert a.residency.resident <= b.residency.resident, f"group {a.group}"
        assert a.misses >= b.misses


@orders
@pytest.mark.parametrize("name", STACK)
@SETTINGS
@given(trace=traces())
def test_misses_non_increasing_in_capacity(order: str, name: str, trace: Trace) -> None:
    s = build_schedule(trace, order)
    low = max(low_capacity(s), s.max_group)
    caps = range(low, max(low, distinct_keys(s)) + 2)
    misses = [replay(s, name, c).misses for c in caps]
    assert all(a >= b for a, b in zip(misses, misses[1:], strict=False)), dict(zip(caps, misses, strict=True))
    assert misses[-1] == distinct_keys(s)


@orders
@pytest.mark.parametrize("name", STACK)
@SETTINGS
@given(trace=traces(), data=st.data())
def test_stack_distances_equal_replay(order: str, name: str, trace: Trace, data: st.DataObject) -> None:
    """run_policy (one stack pass for capacities >= max_group, replays below) equals replay at every
    capacity, per phase and layer, whatever the order of the capacities asked for (repeats included)."""
    s = build_schedule(trace, order)
    caps = list(range(low_capacity(s), max(low_capacity(s), distinct_keys(s)) + 2))
    caps = data.draw(st.permutations(caps), label="capacities") + [caps[0], caps[-1]]
    results = run_policy(s, name, caps)
    assert [r.capacity for r in results] == caps
    for r in results:
        want = replay(s, name, r.capacity)
        np.testing.assert_array_equal(r.layer_misses, want.layer_misses, err_msg=f"capacity {r.capacity}")
        np.testing.assert_array_equal(r.layer_requests, want.layer_requests)


# ------------------------------------------------------------------------------------------------
# Adversarial traces (the LLRU paper)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("layers", "experts"), [(1, 3), (2, 3), (3, 4), (4, 5), (6, 2)])
def test_cyclic_trace_lru_misses_everything_opt_once_per_capacity(layers: int, experts: int) -> None:
    """Thm 3.3: N = n*L pages cycled through a cache of k = N - 1: LRU misses every request, OPT once
    per k requests after the N compulsory misses, so LRU / OPT approaches k on long traces."""
    n_keys = layers * experts
    k = n_keys - 1
    tokens = math.ceil(12 * n_keys * k / layers)  # long enough for the ratio to come within 10% of k
    s = build_schedule(synthesize("cyclic", tokens=tokens, layers=layers, experts=experts), "flat")
    r = s.num_requests
    assert r == tokens * layers
    lru = replay(s, "lru", k).misses
    opt = replay(s, "opt", k).misses
    assert lru == r
    assert n_keys + (r - n_keys) // k <= opt <= n_keys + math.ceil(r / k) + 1
    assert 0.9 * k <= lru / opt <= k
    assert run_policy(s, "lru", [k, k + 1])[0].misses == lru  # two capacities: the stack pass
    assert run_policy(s, "opt", [k, k + 1])[0].misses == opt
    assert replay(s, "opt", k + 1).misses == n_keys  # one more slot: compulsory misses only


@pytest.mark.parametrize(("layers", "experts", "layer"), [(4, 4, 0), (3, 8, 2), (2, 6, 1), (6, 3, 5)])
@pytest.mark.parametrize("order", ["layer", "flat"])
def test_partition_trace_defeats_fixed_splits(layers: int, experts: int, layer: int, order: str) -> None:
    """Thm 3.1: one layer cycles through all E experts, the others use one expert each. OPT with room
    for the E + L - 1 keys misses only compulsorily; a per-layer split whose budget for the cycling
    layer is below E keeps missing there (LRU-Dist every request, even OPT-Dist a constant fraction)."""
    keys = experts + layers - 1
    for tokens in (150, 300):
        s = build_schedule(
            synthesize("partition", tokens=tokens, layers=layers, experts=experts, layer=layer), order
        )
        assert distinct_keys(s) == keys
        for c in (keys, keys + 1):
            budget = uniform_budgets(c, layers)[layer]
            assert budget < experts  # precondition of the theorem for these shapes
            assert replay(s, "opt", c).misses == keys
            for name in ("lru-dist", "fifo-dist", "llru-dist"):
                assert replay(s, name, c).misses == tokens + layers - 1, name
        # OPT on a cycle of E pages with b slots misses (E - b) / (E - 1) of the time.
        budget = uniform_budgets(keys, layers)[layer]
        bound = (tokens - experts) * (experts - budget) / (experts - 1)
        assert replay(s, "opt-dist", keys).misses >= bound


# ------------------------------------------------------------------------------------------------
# Residency invariants
# ------------------------------------------------------------------------------------------------
@orders
@SETTINGS
@given(trace=traces(), name=st.sampled_from(list(POLICIES)), seed=st.integers(0, 3), data=st.data())
def test_residency_invariants(order: str, trace: Trace, name: str, seed: int, data: st.DataObject) -> None:
    """Serving chunk by chunk: never more than capacity resident (per layer budget for -Dist), the
    pinned chunk never evicted, every key of a chunk resident after admit, an eviction only when full,
    the policy's view equal to the residency set; the totals equal replay()."""
    s = build_schedule(trace, order)
    low = min_capacity(s, name)
    c = data.draw(st.integers(low, max(low, distinct_keys(s) + 1)), label="capacity")
    policy = policy_for(s, name, c, seed)
    res, clock = Residency(policy), policy.clock
    rooms = [policy.room(layer) for layer in range(s.num_layers)]
    limits = policy.budgets if isinstance(policy, Dist) else None
    total, g, tokens, seqs = 0, 0, s.round_token.tolist(), s.round_seq.tolist()
    for r in range(s.num_rounds):
        clock.round, clock.token, clock.seq = r, tokens[r], seqs[r]
        clock.prefill = bool(s.round_prefill[r])
        for layer in range(s.num_layers):
            for _ in range(s.per_layer):
                keys = s.groups[g]
                clock.layer, clock.group = layer, g
                g += 1
                if not keys:
                    continue
                if policy.weighs:  # as replay tells it (tlfu)
                    policy.on_use(keys, s.group_tokens[g - 1])
                chunks = [keys] if len(keys) <= rooms[layer] else res.chunks(layer, keys)
                assert sorted(k for ch in chunks for k in ch) == sorted(keys)
                assert all(len(ch) <= rooms[layer] for ch in chunks)
                for chunk in chunks:
                    pre = set(res.resident)
                    pairs = res.admit(chunk, scores=s.group_scores[g - 1] if policy.observes else None)
                    assert [k for k, _ in pairs] == [k for k in chunk if k not in pre]
                    evicted = [v for _, v in pairs if v is not None]
                    assert all(v in pre and v not in chunk for v in evicted)  # pinned never evicted
                    assert set(chunk) <= res.resident
                    assert res.resident == (pre | set(chunk)) - set(evicted)
                    _check_fill(res.resident, pre, len(pairs), chunk, c, limits)
                    assert len(policy) == len(res.resident)
                    assert all(k in policy for k in res.resident)
                    assert not any(v in policy for v in evicted)
                    total += len(pairs)
    assert total == replay(s, name, c, seed).misses


def _check_fill(
    resident: set[Key], pre: set[Key], misses: int, chunk: tuple[Key, ...], cap: int, limits: list[int] | None
) -> None:
    """No more than the capacity (per layer: the budget) resident, and no eviction while there is room."""
    if limits is None:
        assert len(resident) <= cap
        assert len(resident) == min(cap, len(pre) + misses)
        return
    layer = chunk[0][0]
    now, was = Counter(k[0] for k in resident), Counter(k[0] for k in pre)
    assert all(now[layer_] <= b for layer_, b in enumerate(limits))
    assert now[layer] == min(limits[layer], was[layer] + misses)


@orders
@SETTINGS
@given(trace=traces(), name=st.sampled_from(list(POLICIES)), data=st.data())
def test_group_misses_are_the_keys_absent_before_it(
    order: str, trace: Trace, name: str, data: st.DataObject
) -> None:
    """Resident members are served first, so even a group split into chunks (capacities around the
    largest group) misses exactly its keys that were not resident before it; totals equal replay()."""
    s = build_schedule(trace, order)
    low = min_capacity(s, name)
    c = data.draw(st.integers(low, max(low, s.max_group + 1)), label="capacity")
    total = 0
    for x in drive(s, policy_for(s, name, c)):
        assert x.misses == len(set(x.keys) - x.before), f"group {x.group}"
        total += x.misses
    assert total == replay(s, name, c).misses


@pytest.mark.parametrize(("call", "name"), [("replay", "opt"), ("replay", "opt-dist"), ("run_policy", "opt")])
def test_opt_on_a_trace_without_known_entries(call: str, name: str) -> None:
    """Every other policy serves such a trace with 0 misses; OPT should too."""
    s = build_schedule(Trace(np.full((2, 2, 1), -1, dtype=np.int16), 2), "flat")
    assert s.num_requests == 0
    assert all(replay(s, n, 2).misses == 0 for n in ONLINE)
    misses = replay(s, name, 2).misses if call == "replay" else run_policy(s, name, [1, 2])[1].misses
    assert misses == 0


# ------------------------------------------------------------------------------------------------
# The -Dist wrapper is L independent caches
# ------------------------------------------------------------------------------------------------
INNER = [n.removesuffix("-dist") for n in POLICIES if n.endswith("-dist")]


@orders
@pytest.mark.parametrize("inner", INNER)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), data=st.data())
def test_dist_is_independent_per_layer_caches(
    order: str, inner: str, trace: Trace, data: st.DataObject
) -> None:
    """X-Dist at capacity c misses, layer by layer and phase by phase, as X alone on that layer's
    routing (the other layers unknown, so keys and clock are unchanged) with the layer's budget and
    seed + layer."""
    s = build_schedule(trace, order)
    low = min_capacity(s, "lru-dist")
    c = data.draw(st.integers(low, low + distinct_keys(s)), label="capacity")
    seed = data.draw(st.integers(0, 3), label="seed")
    whole = replay(s, f"{inner}-dist", c, seed).layer_misses
    for layer, budget in enumerate(uniform_budgets(c, s.num_layers)):
        ex = np.full_like(trace.experts, -1)  # only this layer's routing, keys and clock unchanged
        ex[:, layer] = trace.experts[:, layer]
        alone = Trace(ex, trace.num_experts, seq_id=trace.seq_id, is_prefill=trace.is_prefill)
        s1 = build_schedule(alone, order)
        if not s1.num_requests:  # the layer is all unknown (an empty schedule: see the xfail test)
            assert not whole[:, layer].any()
            continue
        alone_misses = replay(s1, inner, budget, seed + layer).layer_misses
        assert not np.delete(alone_misses, layer, axis=1).any()
        np.testing.assert_array_equal(
            whole[:, layer], alone_misses[:, layer], err_msg=f"layer {layer}, budget {budget}"
        )


# MRS decays once per visit of a layer (the clock's round), and rounds order visits each layer K times per
# token: its time is not the token's, so the two orders legitimately differ for it.
TOKEN_TIMED = [name for name in INNER if name != "mrs"]


@pytest.mark.parametrize("inner", TOKEN_TIMED)
@SETTINGS
@given(trace=traces(), data=st.data())
def test_dist_flat_equals_rounds(inner: str, trace: Trace, data: st.DataObject) -> None:
    """Flat and rounds orders give every layer the same request sequence at the same token times
    (the K rounds of a token share its time), so every -Dist policy whose time is the token's misses
    alike in both."""
    c = data.draw(st.integers(trace.num_layers, trace.num_layers + trace.num_keys), label="capacity")
    flat = replay(build_schedule(trace, "flat"), f"{inner}-dist", c)
    rounds = replay(build_schedule(trace, "rounds"), f"{inner}-dist", c)
    np.testing.assert_array_equal(flat.layer_misses, rounds.layer_misses)


@orders
@SETTINGS
@given(trace=traces(), data=st.data())
def test_llru_within_one_layer_is_lru(order: str, trace: Trace, data: st.DataObject) -> None:
    """LLRU ranks by whole rounds since last use; inside one layer that is recency, so LLRU-Dist is
    LRU-Dist."""
    s = build_schedule(trace, order)
    low = min_capacity(s, "lru-dist")
    c = data.draw(st.integers(low, low + distinct_keys(s)), label="capacity")
    lru = replay(s, "lru-dist", c)
    np.testing.assert_array_equal(replay(s, "llru-dist", c).layer_misses, lru.layer_misses)


def test_a_step_without_tokens_needs_nothing() -> None:
    from unittest import mock

    from expertcache.cache import needs
    from expertcache.cache.needs import LayerNeeds, needs_of

    for small in (0, 10**6):  # numpy's arrays and plain Python alike
        with mock.patch.object(needs, "SMALL", small):
            empty = np.zeros((0, 2), dtype=np.int64)
            assert needs_of(1, empty) == [] and list(LayerNeeds(1, empty)) == []


def _needs_by_loop(layer: int, index: np.ndarray, weights: np.ndarray | None) -> list:
    """``needs_of`` one routing entry at a time, as first written (importance now summed in rank order,
    as a single token sums it): the oracle of the vectorised one."""
    from expertcache.cache.needs import _renormalised
    from expertcache.cache.residency import group_experts
    from expertcache.miss.base import Need

    w = _renormalised(index, weights)
    order = np.argsort(-w, axis=1, kind="stable")
    ranked_w = np.take_along_axis(w, order, axis=1)
    above = np.zeros_like(ranked_w)  # [T, K] weight of the experts ranked above: summed in rank order,
    np.cumsum(ranked_w[:, :-1], axis=1, out=above[:, 1:])  # as a token alone sums it
    stats: dict[int, list] = {}
    for t, (row, cols) in enumerate(zip(index.tolist(), order.tolist(), strict=True)):
        for rank, col in enumerate(cols):
            e = row[col]
            if e < 0:
                continue
            s = stats.get(e)
            weight, imp = float(w[t, col]), float(above[t, rank])
            if s is None:
                stats[e] = [1, weight, imp, rank, weight]
            else:
                s[0] += 1
                s[1], s[2], s[3] = max(s[1], weight), min(s[2], imp), min(s[3], rank)
                s[4] += weight
    return [Need((layer, e), *stats[e]) for e in group_experts(index.tolist())]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.integers(1, 40),
    top_k=st.integers(1, 4),
    experts=st.integers(1, 12),
    data=st.data(),
)
def test_needs_of_equals_its_entry_by_entry_definition(tokens: int, top_k: int, experts: int, data) -> None:
    """Every expert's tokens, largest weight, least importance, best rank and summed weight (added in
    the same order: the same float), in first-use order; unknown entries (-1), repeated experts in a
    row, tied weights and no weights at all included."""
    from unittest import mock

    from expertcache.cache import needs
    from expertcache.cache.needs import LayerNeeds, needs_of

    index = np.array(
        data.draw(
            st.lists(
                st.lists(st.integers(-1, experts - 1), min_size=top_k, max_size=top_k),
                min_size=tokens,
                max_size=tokens,
            )
        )  # fmt: skip
    )
    weights = None
    if data.draw(st.booleans()):
        values = st.sampled_from([0.0, 0.125, 0.25, 0.3, 0.5, 1.0])  # ties and zeros
        weights = np.array(
            data.draw(
                st.lists(st.lists(values, min_size=top_k, max_size=top_k), min_size=tokens, max_size=tokens)
            ),
            dtype=np.float32,
        )
    want = _needs_by_loop(3, index, weights)
    for small in (0, 10**6):  # numpy's arrays (a large step) and plain Python (a small one): the same floats
        with mock.patch.object(needs, "SMALL", small):
            got = needs_of(3, index, weights)
            assert got == want
            lazy = LayerNeeds(3, index, weights)
            assert lazy.keys_in_order == [n.key for n in got] and len(lazy) == len(got)  # before computing
            assert lazy.tokens == [n.tokens for n in got]  # counted alone, before the needs
            assert list(lazy) == got and lazy[0:1] == got[0:1]
