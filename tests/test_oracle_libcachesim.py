"""libCacheSim as an independent oracle for plain paging (flat and rounds orders).

In ``flat`` and ``rounds`` order every request group holds one request, so the simulator does classic
demand paging over ``Schedule.req_key``. Fed to libCacheSim as objects of size 1 (``obj_id`` = key id,
cache size = capacity in objects), its LRU, FIFO and Belady must miss exactly as our lru, fifo and opt
do, request for request. We compare the misses per phase and layer at many capacities, through
``replay`` and through ``run_policy`` (one-pass stack distances for lru and opt), and on the synthetic
traces every request's hit or miss, from the cache driven as replay drives it and from the stack depths.

libCacheSim's Belady reads the next access of each request from ``Request.next_access_vtime``; we set
it to the index of the next request to the same object, or INT64_MAX when there is none (libCacheSim
aborts on -1).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest

from expertcache.cache import Residency
from expertcache.cache.schedule import Schedule
from expertcache.sim import build_schedule, replay, run_policy
from expertcache.sim.replay import policy_for
from expertcache.sim.stack import lru_depths, opt_depths
from expertcache.trace import Trace, load_trace, synthesize

lcs = pytest.importorskip(
    "libcachesim", reason="libcachesim, the independent oracle, is not installed (pip install -e '.[dev]')"
)

REAL_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "qwen15_moe_a27b_chat.npz"
NEVER = 2**63 - 1  # libCacheSim's "no next access"
ORACLES = {"lru": lcs.LRU, "fifo": lcs.FIFO, "opt": lcs.Belady}
PAGING_ORDERS = ("flat", "rounds")


def _masked_zipf() -> Trace:
    """A Zipf trace with 15% unknown (-1) entries, which the schedule must skip."""
    base = synthesize("zipf", tokens=240, layers=5, experts=12, top_k=3, a=0.8, seed=11)
    ex = base.experts.copy()
    ex[np.random.default_rng(5).random(ex.shape) < 0.15] = -1
    return Trace(ex, base.num_experts, seq_id=base.seq_id, is_prefill=base.is_prefill)


SYNTHETIC = {
    "zipf-L6E8K2": lambda: synthesize("zipf", tokens=300, layers=6, experts=8, top_k=2, seed=1),
    "zipf-L4E16K4-a1.2": lambda: synthesize(
        "zipf", tokens=200, layers=4, experts=16, top_k=4, a=1.2, seed=2, sequences=3, prompt_len=20
    ),
    "sticky-L8E8K2": lambda: synthesize(
        "sticky", tokens=300, layers=8, experts=8, top_k=2, stickiness=0.6, seed=3
    ),
    "sticky-L2E32K6": lambda: synthesize(
        "sticky", tokens=150, layers=2, experts=32, top_k=6, stickiness=0.3, seed=7
    ),
    "uniform-L3E10K3": lambda: synthesize("uniform", tokens=250, layers=3, experts=10, top_k=3, seed=4),
    "uniform-L1E20K1": lambda: synthesize("uniform", tokens=400, layers=1, experts=20, top_k=1, seed=9),
    "zipf-masked": _masked_zipf,
}


@cache
def _trace(name: str) -> Trace:
    if name == "qwen":
        if not REAL_TRACE.is_file():
            pytest.skip(f"real trace not found at {REAL_TRACE} (the shared/ directory beside the repository)")
        return load_trace(REAL_TRACE)
    return SYNTHETIC[name]()


@cache
def _schedule(name: str, order: str) -> Schedule:
    return build_schedule(_trace(name), order)


def _capacities(distinct: int, n: int) -> list[int]:
    """At least n capacities spread over 1..distinct (dense at the small end), plus distinct + 1."""
    geo = np.geomspace(1, distinct, n)
    lin = np.linspace(1, distinct, n // 2)
    caps = np.unique(np.round(np.concatenate([geo, lin, [1, 2, 3, distinct, distinct + 1]])).astype(int))
    return caps.tolist()


def _next_access(keys: list[int]) -> list[int]:
    """Index of the next request to the same key, NEVER when there is none."""
    nxt, last = [NEVER] * len(keys), {}
    for i in range(len(keys) - 1, -1, -1):
        nxt[i] = last.get(keys[i], NEVER)
        last[keys[i]] = i
    return nxt


@cache
def _oracle_hits(name: str, order: str, policy: str, capacity: int) -> np.ndarray:
    """libCacheSim's hit (True) or miss of every request of the schedule. -> bool [R]"""
    keys = _schedule(name, order).req_key.tolist()
    cache_ = ORACLES[policy](capacity, hashpower=16)
    req = lcs.Request()  # one request object, refilled for every access
    req.obj_size = 1
    get = cache_.get

    def access(key: int, next_access: int) -> bool:
        req.obj_id = key
        req.next_access_vtime = next_access
        return get(req)

    return np.fromiter(map(access, keys, _next_access(keys)), dtype=bool, count=len(keys))


def _oracle_layer_misses(name: str, order: str, policy: str, capacity: int) -> np.ndarray:
    """The oracle's misses per phase (row 0 decode, row 1 prefill) and layer. -> int64 [2, L]"""
    s = _schedule(name, order)
    miss = ~_oracle_hits(name, order, policy, capacity)
    layer = s.req_key // s.num_experts
    phase = s.round_prefill[s.req_group // (s.per_layer * s.num_layers)].astype(np.int64)
    cells = np.bincount((phase * s.num_layers + layer)[miss], minlength=2 * s.num_layers)
    return cells.reshape(2, s.num_layers)


def _cases(policies: tuple[str, ...]) -> list[object]:
    return [
        pytest.param(name, order, policy, id=f"{name}-{order}-{policy}")
        for name in ("qwen", *SYNTHETIC)
        for order in PAGING_ORDERS
        for policy in policies
    ]


def _caps_for(name: str, order: str, few: bool = False) -> list[int]:
    """About 20 capacities over 1..distinct keys + 1 (15 on the real trace; 6 of those where `few`)."""
    distinct = len(np.unique(_schedule(name, order).req_key))
    if name != "qwen":
        return _capacities(distinct, 16)
    caps = _capacities(distinct, 10)
    return sorted({*caps[1::3], distinct}) if few else caps


def test_oracle_is_demand_paging() -> None:
    """The oracle itself: textbook miss counts (Belady without bypass, FIFO's anomaly sequence)."""
    seq = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]

    def misses(policy: str, keys: list[int], cap: int) -> int:
        c = ORACLES[policy](cap, hashpower=8)
        nxt = _next_access(keys)
        return sum(
            not c.get(lcs.Request(obj_id=k, obj_size=1, next_access_vtime=n))
            for k, n in zip(keys, nxt, strict=True)
        )

    assert misses("fifo", seq, 3) == 9
    assert misses("fifo", seq, 4) == 10  # Belady's anomaly
    assert misses("lru", seq, 3) == 10
    assert misses("opt", seq, 3) == 7
    assert misses("opt", seq, 4) == 6
    assert misses("opt", [1, 2, 1], 1) == 3  # demand paging: a never-reused object is still inserted


@pytest.mark.parametrize(("name", "order", "policy"), _cases(("lru", "fifo", "opt")))
def test_replay_matches_libcachesim(name: str, order: str, policy: str) -> None:
    s = _schedule(name, order)
    assert s.max_group == 1  # plain paging: one request per group
    # On the real trace replays are slow: the full sweep for fifo in flat order (fifo has no stack
    # path, so this is its only sweep), a few capacities elsewhere (lru and opt sweep through run_policy).
    few = name == "qwen" and (order, policy) != ("flat", "fifo")
    for c in _caps_for(name, order, few):
        got = replay(s, policy, c)
        want = _oracle_layer_misses(name, order, policy, c)
        assert got.requests == s.num_requests
        np.testing.assert_array_equal(got.layer_misses, want, err_msg=f"{policy} at capacity {c}")


@pytest.mark.parametrize(("name", "order", "policy"), _cases(("lru", "opt")))
def test_run_policy_matches_libcachesim(name: str, order: str, policy: str) -> None:
    """run_policy takes one stack-distance pass for lru and opt (every capacity >= max_group = 1)."""
    s = _schedule(name, order)
    few = name == "qwen" and order == "rounds"  # time: the rounds order is swept on synthetic traces
    caps = _caps_for(name, order, few)
    assert len(caps) >= (5 if few else 15)
    results = run_policy(s, policy, caps)
    assert [r.capacity for r in results] == caps
    for r in results:
        want = _oracle_layer_misses(name, order, policy, r.capacity)
        np.testing.assert_array_equal(r.layer_misses, want, err_msg=f"{policy} at capacity {r.capacity}")


def _our_hits(s: Schedule, policy: str, capacity: int) -> np.ndarray:
    """Our hit (True) or miss of every request: a Residency driven as replay() drives it. -> bool [R]"""
    p = policy_for(s, policy, capacity)
    residency, clock = Residency(p), p.clock
    per_round, tokens = s.per_layer * s.num_layers, s.round_token.tolist()
    hits = []
    for g in s.req_group.tolist():  # the non-empty groups, one request each
        clock.round, within = divmod(g, per_round)
        clock.token, clock.layer, clock.group = tokens[clock.round], within // s.per_layer, g
        clock.seq = int(s.round_seq[clock.round])
        hits.append(not residency.admit(s.groups[g]))
    return np.asarray(hits, dtype=bool)


@pytest.mark.parametrize("order", PAGING_ORDERS)
@pytest.mark.parametrize("name", list(SYNTHETIC))
def test_request_by_request(name: str, order: str) -> None:
    """Every request hits or misses as in libCacheSim: replayed (lru, fifo, opt) and by stack depth (a
    request misses at capacity c iff it is a first use, depth 0, or its depth exceeds c)."""
    s = _schedule(name, order)
    depths = {"lru": lru_depths(s), "opt": opt_depths(s)}
    for c in _caps_for(name, order):
        for policy in ORACLES:
            want = _oracle_hits(name, order, policy, c)
            np.testing.assert_array_equal(_our_hits(s, policy, c), want, err_msg=f"{policy} at {c}")
            if policy in depths:
                d = depths[policy]
                np.testing.assert_array_equal((d > 0) & (d <= c), want, err_msg=f"{policy} depths at {c}")


@pytest.mark.parametrize("name", ["qwen", *SYNTHETIC])
def test_oracle_extremes(name: str) -> None:
    """Capacity 1 hits only on immediate repeats; capacity >= distinct keys misses only compulsorily."""
    for order in PAGING_ORDERS:
        s = _schedule(name, order)
        keys = s.req_key
        distinct = len(np.unique(keys))
        repeats = int((keys[1:] == keys[:-1]).sum())
        for policy in ORACLES:
            assert int((~_oracle_hits(name, order, policy, 1)).sum()) == len(keys) - repeats
            assert int((~_oracle_hits(name, order, policy, distinct)).sum()) == distinct
            assert replay(s, policy, distinct).misses == distinct
