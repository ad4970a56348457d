"""Hand-traced access sequences for every policy, and the shared serving step (Residency).

Each policy is driven the way the simulator and the engine drive it: a request group (a tuple of
``(layer, expert)`` keys) is admitted through ``Residency`` with the whole chunk pinned, while the
test sets the policy's clock (round, layer, group) itself. Expected victims are derived by hand from
the algorithm's definition; the derivation is in the comment above each expectation.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Container, Sequence

import pytest

from expertcache.cache import Residency
from expertcache.errors import PolicyError
from expertcache.policy import Key, Policy, PolicyContext, make_policy, uniform_budgets

HIT = "hit"


def build(
    name: str,
    capacity: int,
    *,
    num_layers: int = 1,
    num_experts: int = 16,
    top_k: int = 1,
    seed: int = 0,
    future: dict[Key, list[int]] | None = None,
    profile: dict[Key, int] | None = None,
    **params: object,
) -> Policy:
    ctx = PolicyContext(
        capacity=capacity,
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=top_k,
        seed=seed,
        future=future,
        profile=profile,
    )
    return make_policy(name, ctx, **params)


class Driver:
    """Serves request groups through Residency; each call is one group with the clock set first."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.res = Residency(policy)
        self.group = 0

    def serve(self, keys: Sequence[Key], rnd: int, layer: int | None = None) -> list[tuple[Key, Key | None]]:
        clock = self.policy.clock
        clock.round = clock.token = rnd  # one token per round here
        clock.layer = keys[0][0] if layer is None else layer
        clock.group = self.group
        self.group += 1
        pairs: list[tuple[Key, Key | None]] = []
        for chunk in self.res.chunks(clock.layer, tuple(keys)):
            pairs += self.res.admit(chunk)
        return pairs

    def tick(self, rnd: int, layer: int) -> None:
        """An empty group: time passes, nothing is requested."""
        self.policy.clock.round, self.policy.clock.layer = rnd, layer
        self.policy.clock.token = rnd
        self.policy.clock.group = self.group
        self.group += 1


def run_flat(policy: Policy, experts: Sequence[int]) -> list[object]:
    """Single-expert requests of layer 0, one round each; per request: HIT, None (a miss into free
    room) or the expert id evicted."""
    drv, out = Driver(policy), []
    for rnd, e in enumerate(experts):
        pairs = drv.serve([(0, e)], rnd)
        if not pairs:
            out.append(HIT)
        else:
            (_, victim) = pairs[0]
            out.append(None if victim is None else victim[1])
    return out


# --------------------------------------------------------------------------------------- Residency


class TestResidency:
    def test_group_that_fits_is_one_chunk(self) -> None:
        res = Residency(build("lru", 3))
        keys = ((0, 5), (0, 1), (0, 2))
        assert res.chunks(0, keys) == [keys]

    def test_large_group_split_resident_first_then_missing(self) -> None:
        policy = build("lru", 3)
        res = Residency(policy)
        for e in (0, 1, 2):
            res.admit(((0, e),))
        group = ((0, 5), (0, 0), (0, 6), (0, 1), (0, 7))
        chunks = res.chunks(0, group)
        # resident 0 and 1 in group order, then missing 5, 6, 7 in group order, 3 (the room) at a time
        assert [list(c) for c in chunks] == [[(0, 0), (0, 1), (0, 5)], [(0, 6), (0, 7)]]
        # chunk 1: 0 and 1 are hits (LRU order becomes 2, 0, 1), 5 evicts 2.
        assert res.admit(chunks[0]) == [((0, 5), (0, 2))]
        # chunk 2: order 0, 1, 5: 6 evicts 0, 7 evicts 1.
        assert res.admit(chunks[1]) == [((0, 6), (0, 0)), ((0, 7), (0, 1))]
        assert res.resident == {(0, 5), (0, 6), (0, 7)}

    def test_serve_counts_misses_over_chunks(self) -> None:
        res = Residency(build("lru", 2))
        res.admit(((0, 0),))
        # group of 4 with room 2: chunks [0, 1], [2, 3]; 0 is a hit, 1, 2, 3 miss
        assert res.serve(0, ((0, 1), (0, 0), (0, 2), (0, 3))) == 3
        assert len(res) == 2

    def test_admit_returns_miss_and_evicted_pairs(self) -> None:
        res = Residency(build("lru", 2))
        assert res.admit(((0, 0), (0, 1))) == [((0, 0), None), ((0, 1), None)]
        assert res.admit(((0, 1),)) == []  # a hit is not a transfer
        assert res.admit(((0, 2),)) == [((0, 2), (0, 0))]

    def test_pinned_keys_never_evicted(self) -> None:
        res = Residency(build("lru", 2))
        res.admit(((0, 0),))
        res.admit(((0, 1),))
        # LRU order is 0, 1: (0, 0) would be the victim, but it is in the chunk being served
        assert res.admit(((0, 2), (0, 0))) == [((0, 2), (0, 1))]
        assert res.resident == {(0, 0), (0, 2)}

    def test_chunk_larger_than_capacity_is_an_error(self) -> None:
        res = Residency(build("lru", 2))
        with pytest.raises(PolicyError, match="all pinned"):
            res.admit(((0, 0), (0, 1), (0, 2)))

    def test_chunks_use_the_layer_room_of_dist(self) -> None:
        policy = build("lru-dist", 5, num_layers=2, budgets=[3, 2])
        res = Residency(policy)
        group = ((1, 0), (1, 1), (1, 2))
        assert [list(c) for c in res.chunks(1, group)] == [[(1, 0), (1, 1)], [(1, 2)]]
        assert res.chunks(0, ((0, 0), (0, 1), (0, 2))) == [((0, 0), (0, 1), (0, 2))]


# --------------------------------------------------------------------------------------- classic


class TestLRU:
    def test_hand_traced(self) -> None:
        # cap 2: 0, 1 fill; 0 hits (order 1, 0); 2 evicts 1 (order 0, 2); 1 evicts 0; 0 evicts 2;
        # 0 hits; 1 hits.
        assert run_flat(build("lru", 2), [0, 1, 0, 2, 1, 0, 0, 1]) == [None, None, HIT, 1, 0, 2, HIT, HIT]

    def test_cyclic_k_plus_one_pages_always_miss(self) -> None:
        # the LLRU paper Thm 3.3: k + 1 pages in a cycle; once full, LRU evicts exactly the page requested
        # next, i.e. request i evicts request i - 3 (the oldest of the 3 resident pages)
        requests = [0, 1, 2, 3] * 5
        out = run_flat(build("lru", 3), requests)
        assert HIT not in out
        assert out[3:] == requests[:-3]


class TestFIFO:
    def test_hits_do_not_refresh(self) -> None:
        # cap 2: 0, 1 fill; 0 hits (FIFO order stays 0, 1); 2 evicts 0 (LRU would evict 1);
        # 0 evicts 1; 1 evicts 2.
        assert run_flat(build("fifo", 2), [0, 1, 0, 2, 0, 1]) == [None, None, HIT, 0, 1, 2]
        assert run_flat(build("lru", 2), [0, 1, 0, 2]) == [None, None, HIT, 1]


class TestLFU:
    def test_counts_persist_and_ties_go_to_least_recent(self) -> None:
        # cap 2. counts after each request:
        # 0 (0:1)  1 (1:1)  0 hit (0:2)
        # 2: 0 has 2, 1 has 1 -> evict 1                       (2:1)
        # 1: 0 has 2, 2 has 1 -> evict 2; 1's count goes 1->2 (persisted across its eviction)
        # 2: 0 has 2, 1 has 2 -> tie, 0 touched longer ago -> evict 0; 2's count 1->2
        # 0: 1 has 2, 2 has 2 -> tie, 1 touched longer ago -> evict 1; 0's count 2->3
        # 1: 0 has 3, 2 has 2 -> evict 2
        out = run_flat(build("lfu", 2), [0, 1, 0, 2, 1, 2, 0, 1])
        assert out == [None, None, HIT, 1, 2, 0, 1, 2]

    def test_old_popularity_is_overtaken(self) -> None:
        # cap 2, requests 0 0 0 1 2 1 2 1 2 (count after the request in brackets):
        # 0 [1], 0 hit [2], 0 hit [3], 1 [1]
        # 2: 0 has 3, 1 has 1 -> evict 1; 2 [1]
        # 1: 0 has 3, 2 has 1 -> evict 2; 1 [2]  (its count survived its eviction)
        # 2: 0 has 3, 1 has 2 -> evict 1; 2 [2]
        # 1: 0 has 3, 2 has 2 -> evict 2; 1 [3]
        # 2: 0 has 3, 1 has 3 -> tie, 0 was touched longer ago -> evict 0
        # (with counts reset on eviction, 1 and 2 would stay at 1 and 0 would never leave)
        out = run_flat(build("lfu", 2), [0, 0, 0, 1, 2, 1, 2, 1, 2])
        assert out == [None, HIT, HIT, None, 1, 2, 1, 2, 0]


class TestRandom:
    def _full(self, seed: int, keys: int = 6) -> tuple[Policy, Residency]:
        policy = build("random", keys, seed=seed)
        res = Residency(policy)
        for e in range(keys):
            res.admit(((0, e),))
        return policy, res

    def test_deterministic_for_a_seed(self) -> None:
        def victims(seed: int) -> list[Key]:
            policy, _ = self._full(seed)
            return [policy.victim((0, 99), ()) for _ in range(50)]

        assert victims(3) == victims(3)
        assert victims(3) != victims(4)
        assert run_flat(build("random", 3, seed=7), list(range(8)) * 4) == run_flat(
            build("random", 3, seed=7), list(range(8)) * 4
        )

    def test_never_evicts_pinned(self) -> None:
        policy, _ = self._full(0)
        pinned = {(0, e) for e in range(5)}
        assert {policy.victim((0, 99), pinned) for _ in range(200)} == {(0, 5)}
        with pytest.raises(PolicyError):
            policy.victim((0, 99), {(0, e) for e in range(6)})

    def test_uniform_over_unpinned(self) -> None:
        policy, _ = self._full(1)
        pinned = ((0, 0), (0, 3))
        counts = Counter(policy.victim((0, 99), pinned) for _ in range(4000))
        assert set(counts) == {(0, 1), (0, 2), (0, 4), (0, 5)}
        # 1000 expected each; the standard deviation is ~27, so 150 is > 5 sigma
        assert all(850 <= c <= 1150 for c in counts.values())

    def test_no_victim_while_room(self) -> None:
        policy, _ = self._full(0, keys=3)
        assert build("random", 4).victim((0, 0), ()) is None
        assert policy.victim((0, 9), ()) in {(0, 0), (0, 1), (0, 2)}


class TestMarking:
    def test_phases_hand_traced(self) -> None:
        policy = build("marking", 3, seed=5)
        drv = Driver(policy)
        for rnd, e in enumerate((0, 1, 2)):  # phase 1: 0, 1, 2 all marked
            drv.serve([(0, e)], rnd)
        # request 3: every resident page is marked -> new phase, all unmarked, victim any of 0, 1, 2
        [(_, v1)] = drv.serve([(0, 3)], 3)
        assert v1 in {(0, 0), (0, 1), (0, 2)}
        survivors = sorted({(0, 0), (0, 1), (0, 2)} - {v1})
        assert drv.serve([survivors[0]], 4) == []  # a hit marks survivors[0]
        # the evicted page comes back: the only unmarked page is survivors[1], so it must go
        assert drv.serve([v1], 5) == [(v1, survivors[1])]
        # now 3, survivors[0], v1 are all marked: the next miss starts a new phase again
        [(_, v2)] = drv.serve([(0, 7)], 6)
        assert v2 in {(0, 3), survivors[0], v1}

    @pytest.mark.parametrize("seed", range(6))
    def test_only_unmarked_pages_are_evicted(self, seed: int) -> None:
        """Model check over random chunked groups: the victim is unmarked (phase rule of the docstring)."""
        rng = random.Random(seed)
        policy = build("marking", 5, seed=seed)
        drv = Driver(policy)
        res = drv.res
        marked: set[Key] = set()
        inner_hit, inner_insert, inner_evict, inner_victim = (
            policy.on_hit,
            policy.on_insert,
            policy.on_evict,
            policy.victim,
        )

        def on_hit(key: Key) -> None:
            marked.add(key)
            inner_hit(key)

        def on_insert(key: Key) -> None:
            marked.add(key)
            inner_insert(key)

        def on_evict(key: Key) -> None:
            marked.discard(key)
            inner_evict(key)

        def victim(incoming: Key, pinned: Container[Key]) -> Key | None:
            v = inner_victim(incoming, pinned)
            if v is None:
                assert len(res) < 5
                return v
            free = [k for k in res.resident if k not in marked and k not in pinned]
            if not free:  # a new phase: every mark is cleared except the pinned group's
                marked.intersection_update(k for k in res.resident if k in pinned)
                free = [k for k in res.resident if k not in marked and k not in pinned]
            assert v in free
            return v

        policy.on_hit, policy.on_insert, policy.on_evict, policy.victim = on_hit, on_insert, on_evict, victim
        misses = 0
        for rnd in range(150):
            group = rng.sample(range(9), rng.randint(1, 3))
            misses += len(drv.serve([(0, e) for e in group], rnd))
        assert len(policy) == len(res) == 5
        assert misses > 50

    def test_seeded(self) -> None:
        seq = [0, 1, 2, 3, 4, 5, 0, 2, 4, 6, 1, 3, 5, 7] * 3
        assert run_flat(build("marking", 3, seed=2), seq) == run_flat(build("marking", 3, seed=2), seq)


# --------------------------------------------------------------------------------------- LLRU


def llru_rank(t: int, tau: int, num_layers: int) -> tuple[int, int]:
    """The LLRU paper Def. 2: R = floor((t - tau) / L), D = (tau - t) mod L."""
    return (t - tau) // num_layers, (tau - t) % num_layers


class TestLLRU:
    def test_differs_from_lru(self) -> None:
        # L = 3, cap 2. Round 0: layer 0 uses (0,0) at t=0, layer 1 uses (1,0) at t=1.
        # Round 1, layer 2 (t = 1*3 + 2 = 5) requests (2,0):
        #   (0,0): R = (5-0)//3 = 1, D = (0-5) mod 3 = 1   (its layer comes in 1 step)
        #   (1,0): R = (5-1)//3 = 1, D = (1-5) mod 3 = 2   (its layer comes in 2 steps)
        # LLRU evicts (1,0) (R tie, larger D); LRU evicts the older (0,0).
        # Round 2, layer 0 requests (0,0): a hit for LLRU, a miss for LRU (evicting (1,0), t=1).
        outcomes = {}
        for name in ("llru", "lru"):
            drv = Driver(build(name, 2, num_layers=3))
            first = drv.serve([(0, 0)], 0) + drv.serve([(1, 0)], 0)
            assert first == [((0, 0), None), ((1, 0), None)]
            outcomes[name] = (drv.serve([(2, 0)], 1), drv.serve([(0, 0)], 2))
        assert outcomes["llru"] == ([((2, 0), (1, 0))], [])
        assert outcomes["lru"] == ([((2, 0), (0, 0))], [((0, 0), (1, 0))])

    def test_larger_r_wins_over_larger_d(self) -> None:
        # L = 2, cap 2. (0,0) at t=0 (round 0, layer 0); (1,0) at t=3 (round 1, layer 1).
        # At t = 4 (round 2, layer 0): (0,0) has R = 2, D = 0; (1,0) has R = 0, D = 1 -> evict (0,0).
        drv = Driver(build("llru", 2, num_layers=2))
        drv.serve([(0, 0)], 0)
        drv.serve([(1, 0)], 1)
        assert drv.serve([(0, 1)], 2) == [((0, 1), (0, 0))]

    def _window_state(self) -> tuple[Policy, dict[str, Key]]:
        # L = 3, cap 5. Round 0: A=(0,0) t=0, B=(1,0) t=1, C=(2,0) t=2. Round 1: D=(0,1) t=3,
        # E=(1,1) t=4. At t = 5 (round 1, layer 2):
        #   A: R=1 D=1   B: R=1 D=2   C: R=1 D=0   D: R=0 D=1   E: R=0 D=2
        # eviction order: B, A, C (the R=1 window, C at its edge with D=0), then E, D.
        policy = build("llru", 5, num_layers=3)
        drv = Driver(policy)
        named = {"A": (0, 0), "B": (1, 0), "C": (2, 0), "D": (0, 1), "E": (1, 1)}
        for rnd, layer, name in ((0, 0, "A"), (0, 1, "B"), (0, 2, "C"), (1, 0, "D"), (1, 1, "E")):
            drv.serve([named[name]], rnd, layer)
        policy.clock.round, policy.clock.layer = 1, 2
        return policy, named

    def test_pinned_candidates_and_fallback_scan(self, monkeypatch: pytest.MonkeyPatch) -> None:
        policy, n = self._window_state()
        scans: list[Key] = []
        scan = policy._victim_by_scan

        def spy(incoming: Key, pinned: object) -> Key:
            scans.append(incoming)
            return scan(incoming, pinned)

        monkeypatch.setattr(policy, "_victim_by_scan", spy)
        incoming = (2, 1)
        assert policy.victim(incoming, ()) == n["B"]
        assert policy.victim(incoming, (n["B"],)) == n["A"]  # fast path: next in the window
        assert policy.victim(incoming, (n["A"], n["B"])) == n["C"]  # the window's edge (D = 0)
        assert scans == []
        # the whole R = 1 window is pinned: the fallback scan finds the best R = 0 page
        assert policy.victim(incoming, (n["A"], n["B"], n["C"])) == n["E"]
        assert policy.victim(incoming, (n["A"], n["B"], n["C"], n["E"])) == n["D"]
        assert len(scans) == 2
        with pytest.raises(PolicyError):
            policy.victim(incoming, tuple(n.values()))

    def test_rank_matches_definition(self) -> None:
        policy, n = self._window_state()
        expected = {"A": (1, 1), "B": (1, 2), "C": (1, 0), "D": (0, 1), "E": (0, 2)}
        assert {name: policy.rank(key) for name, key in n.items()} == expected

    def test_fallback_through_residency(self) -> None:
        # L = 2, cap 2. (0,0) at t=0, (1,0) at t=1; at t=2 (round 1, layer 0) the group
        # ((0,1), (0,0)) arrives: (0,1) misses while (0,0), the oldest page and the window's only
        # one, is pinned (served later in the same group) -> the scan evicts (1,0).
        drv = Driver(build("llru", 2, num_layers=2))
        drv.serve([(0, 0)], 0)
        drv.serve([(1, 0)], 0)
        assert drv.serve([(0, 1), (0, 0)], 1) == [((0, 1), (1, 0))]

    @pytest.mark.parametrize("num_layers", [1, 2, 3, 5])
    @pytest.mark.parametrize("seed", range(6))
    def test_victim_is_brute_force_argmax_of_rank(self, num_layers: int, seed: int) -> None:
        """Random states: victim == argmax over unpinned keys of (rank, earliest touch among equal tau)."""
        rng = random.Random(seed * 31 + num_layers)
        cap = rng.randint(2, min(7, 5 * num_layers - 1))
        policy = build("llru", cap, num_layers=num_layers, num_experts=6)
        drv = Driver(policy)
        tau: dict[Key, int] = {}
        touch: dict[Key, int] = {}
        stamps = itertools.count()
        checked = 0

        def probe(t: int, layer: int) -> int:
            resident = sorted(drv.res.resident)
            if len(resident) < cap or rng.random() < 0.3:
                return 0
            pinned = set(rng.sample(resident, rng.randint(0, len(resident) - 1)))
            free = [k for k in resident if k not in pinned]
            for k in free:
                assert policy.rank(k) == llru_rank(t, tau[k], num_layers)
            best = max(free, key=lambda k: (policy.rank(k), -touch[k]))
            assert policy.victim((layer, 5), pinned) == best
            return 1

        for rnd in range(40):
            for layer in range(num_layers):
                t = rnd * num_layers + layer
                policy.clock.round, policy.clock.layer = rnd, layer
                checked += probe(t, layer)
                if rng.random() < 0.25:
                    drv.tick(rnd, layer)
                    continue
                group = [(layer, e) for e in rng.sample(range(5), rng.randint(1, min(cap, 3)))]
                drv.serve(group, rnd, layer)
                for k in group:
                    tau[k] = t
                    touch[k] = next(stamps)
                checked += probe(t, layer)  # keys just used now have R = 0, D = 0
        assert checked > 5


# --------------------------------------------------------------------------------------- LCP


class TestLCP:
    def test_hand_traced_parameters_change_the_victim(self) -> None:
        # cap 2. a = (0,0) requested in rounds 0, 1, 2 (mu 3, last round 2); b = (0,1) in round 3
        # (mu 1, last 3). At round 4, c = (0,2) misses: nu_a = 2, nu_b = 1.
        # default rho .25, omega 128: P_a = 3 * .25^(2/128) = 2.873, P_b = .25^(1/128) = 0.989 -> b
        # rho .25, omega 1:           P_a = 3 * .25^2 = 0.1875,    P_b = .25^1 = 0.25        -> a
        def victim(**params: object) -> Key | None:
            drv = Driver(build("lcp", 2, **params))
            for rnd, e in enumerate((0, 0, 0, 1)):
                drv.serve([(0, e)], rnd)
            [(_, v)] = drv.serve([(0, 2)], 4)
            return v

        assert victim() == (0, 1)
        assert victim(rho=0.25, omega=1.0) == (0, 0)

    def test_bad_parameters(self) -> None:
        for params in ({"rho": 0.0}, {"rho": 1.0}, {"rho": 1.5}, {"omega": 0}, {"omega": -2.0}):
            with pytest.raises(PolicyError):
                build("lcp", 2, **params)

    @pytest.mark.parametrize("params", [{}, {"rho": 0.5, "omega": 3.0}, {"rho": 0.1, "omega": 20.0}])
    @pytest.mark.parametrize("seed", range(4))
    def test_victim_is_argmin_of_priority(self, params: dict[str, float], seed: int) -> None:
        """P = mu * rho^(nu / omega), mu = requests so far, nu = tokens since the last one."""
        rho, omega = params.get("rho", 0.25), params.get("omega", 128.0)
        rng = random.Random(seed)
        cap, num_layers = 4, 2
        policy = build("lcp", cap, num_layers=num_layers, num_experts=8, **params)
        drv = Driver(policy)
        res = drv.res
        mu: Counter[Key] = Counter()
        last: dict[Key, int] = {}
        inner_victim = policy.victim
        checked: list[Key] = []

        def victim(incoming: Key, pinned: Container[Key]) -> Key | None:
            v = inner_victim(incoming, pinned)
            if v is not None:
                now = policy.clock.token
                prio = {k: mu[k] * rho ** ((now - last[k]) / omega) for k in res.resident if k not in pinned}
                assert v in prio
                assert prio[v] <= min(prio.values()) * (1 + 1e-9)
                checked.append(v)
            return v

        policy.victim = victim
        weights = [8, 4, 2, 1, 1, 1, 1, 1]  # skewed popularity: frequency and recency both matter
        for rnd in range(120):
            for layer in range(num_layers):
                keys = [(layer, e) for e in sorted(set(rng.choices(range(8), weights, k=rng.randint(1, 2))))]
                drv.serve(keys, rnd, layer)
                for k in keys:
                    mu[k] += 1
                    last[k] = rnd
        assert len(checked) > 20


# --------------------------------------------------------------------------------------- MRS


class TestMRS:
    def test_hand_traced_scores_decay_per_step_and_pick_the_victim(self) -> None:
        # cap 2, alpha 0.5, one layer; each request carries its routing score (the gate weight).
        # round 0: a = (0,0) routed with s 0.9 -> S_a = 0.45
        # round 1: b = (0,1) routed with s 0.2 -> S_b = 0.1; S_a decays to 0.225
        # round 2: c = (0,2) misses: S_a = 0.1125, S_b = 0.05 -> b (lowest) is evicted
        # LRU would evict a (least recent); MRS keeps the expert routed with the larger weight
        policy = build("mrs", 2)
        res = Residency(policy)

        def request(rnd: int, expert: int, score: float) -> list[tuple[Key, Key | None]]:
            policy.clock.round = policy.clock.token = rnd
            return res.admit([(0, expert)], scores={(0, expert): score})

        request(0, 0, 0.9)
        request(1, 1, 0.2)
        assert policy.current((0, 0)) == pytest.approx(0.225) and policy.current((0, 1)) == pytest.approx(0.1)
        [(_, victim)] = request(2, 2, 0.3)
        assert victim == (0, 1)
        assert policy.current((0, 2)) == pytest.approx(0.15)

    def test_without_scores_every_routed_expert_scores_one_over_k(self) -> None:
        policy = build("mrs", 2, top_k=2)
        drv = Driver(policy)
        drv.serve([(0, 0), (0, 1)], 0)  # Residency calls on_request without scores
        assert policy.current((0, 0)) == pytest.approx(0.25)

    def test_bad_alpha(self) -> None:
        for alpha in (0.0, 1.0, -0.5, 2.0):
            with pytest.raises(PolicyError, match="alpha"):
                build("mrs", 2, alpha=alpha)


# --------------------------------------------------------------------------------------- Static


class TestStatic:
    PROFILE = {(0, 0): 10, (0, 1): 8, (0, 2): 5, (0, 3): 1, (0, 4): 0, (0, 5): 8}

    def test_favoured_are_top_capacity_minus_top_k(self) -> None:
        # capacity 4, top_k 1: 3 favoured; counts 10 (0,0), 8 (0,1) and 8 (0,5) (tie by key), then 5
        assert build("static", 4, profile=self.PROFILE).favoured == {(0, 0), (0, 1), (0, 5)}
        # top_k 2 leaves 2 favoured; capacity <= top_k leaves none
        assert build("static", 4, top_k=2, profile=self.PROFILE).favoured == {(0, 0), (0, 1)}
        assert build("static", 2, top_k=2, profile=self.PROFILE).favoured == frozenset()
        # zero-count keys are never favoured
        assert (0, 4) not in build("static", 10, profile=self.PROFILE).favoured

    def test_needs_profile(self) -> None:
        with pytest.raises(PolicyError, match="profile"):
            build("static", 3)

    def test_hand_traced(self) -> None:
        # capacity 3, top_k 1 -> favoured {(0,0), (0,1)}; (0,2)..(0,4) stream through one LRU slot
        drv = Driver(build("static", 3, profile=self.PROFILE))
        for rnd, e in enumerate((0, 1, 2)):
            drv.serve([(0, e)], rnd)
        # 3 misses: unfavoured residents are [(0,2)] -> evict it, though (0,0) is the LRU page
        assert drv.serve([(0, 3)], 3) == [((0, 3), (0, 2))]
        assert drv.serve([(0, 4)], 4) == [((0, 4), (0, 3))]
        assert drv.serve([(0, 1)], 5) == []  # favoured LRU order becomes (0,0), (0,1)
        # a group of two misses: 2 evicts the unfavoured (0,4); 3 finds only the pinned (0,2)
        # unfavoured, so it falls back to favoured LRU order -> (0,0)
        assert drv.serve([(0, 2), (0, 3)], 6) == [((0, 2), (0, 4)), ((0, 3), (0, 0))]

    def test_unfavoured_lru_order(self) -> None:
        # capacity 4, top_k 2 -> favoured {(0,0), (0,1)}; unfavoured slots follow LRU
        drv = Driver(build("static", 4, top_k=2, profile=self.PROFILE))
        for rnd, e in enumerate((0, 1, 2, 3)):
            drv.serve([(0, e)], rnd)
        drv.serve([(0, 2)], 4)  # unfavoured LRU order: 3, 2
        assert drv.serve([(0, 4)], 5) == [((0, 4), (0, 3))]


# --------------------------------------------------------------------------------------- OPT


def future_of(groups: Sequence[Sequence[Key]]) -> dict[Key, list[int]]:
    fut: dict[Key, list[int]] = {}
    for g, keys in enumerate(groups):
        for k in keys:
            fut.setdefault(k, []).append(g)
    return fut


def run_groups(policy: Policy, groups: Sequence[Sequence[Key]]) -> list[list[tuple[Key, Key | None]]]:
    drv = Driver(policy)
    return [drv.serve(keys, g) for g, keys in enumerate(groups)]


def belady_misses(requests: Sequence[int], capacity: int) -> int:
    """Reference Belady on a flat sequence: evict the page whose next use is furthest (never first)."""
    cache: set[int] = set()
    misses = 0
    for i, x in enumerate(requests):
        if x in cache:
            continue
        misses += 1
        if len(cache) == capacity:

            def next_use(p: int, i: int = i) -> float:
                rest = requests[i + 1 :]
                return rest.index(p) if p in rest else math.inf

            cache.remove(max(cache, key=next_use))
        cache.add(x)
    return misses


class TestOPT:
    def test_hand_traced_furthest_next_use(self) -> None:
        # cap 2, groups a b c a b c: at c (g2) a is next used at g3, b at g4 -> evict b;
        # a hits at g3; at b (g4): a is never used again, c is used at g5 -> evict a; c hits.
        a, b, c = (0, 0), (0, 1), (0, 2)
        groups = [[a], [b], [c], [a], [b], [c]]
        out = run_groups(build("opt", 2, future=future_of(groups)), groups)
        assert out == [[(a, None)], [(b, None)], [(c, b)], [], [(b, a)], []]

    def test_never_used_again_first_least_recent_among_them(self) -> None:
        # cap 3: a b c d a. At d (g3): a is used at g4, b and c never again -> one of those;
        # they tie at infinity and b was touched first -> evict b.
        a, b, c, d = ((0, e) for e in range(4))
        groups = [[a], [b], [c], [d], [a]]
        out = run_groups(build("opt", 3, future=future_of(groups)), groups)
        assert out[3] == [(d, b)]
        assert out[4] == []

    def test_needs_future(self) -> None:
        with pytest.raises(PolicyError, match="future"):
            build("opt", 2)

    def test_matches_reference_belady_count(self) -> None:
        for seed in range(10):
            rng = random.Random(seed)
            requests = [rng.choice([0, 0, 1, 1, 2, 3, 4, 5, 6]) for _ in range(80)]
            groups = [[(0, e)] for e in requests]
            for cap in (1, 2, 3, 5):
                out = run_groups(build("opt", cap, num_experts=7, future=future_of(groups)), groups)
                assert sum(len(o) for o in out) == belady_misses(requests, cap)

    def test_key_needed_by_the_current_group_is_kept(self) -> None:
        # cap 3. g0 serves a, b, c. In g1, which requests a again, a victim for d is asked with
        # nothing pinned: a's next use is g1 (now), b and c are never used again -> b (touched first).
        a, b, c, d = ((0, e) for e in range(4))
        groups = [[a, b, c], [d, a]]
        policy = build("opt", 3, future=future_of(groups))
        run_groups(policy, groups[:1])
        policy.clock.group = 1
        assert policy.victim(d, ()) == b
        assert policy.victim(d, (b,)) == c
        assert policy.victim(d, (b, c)) == a


# --------------------------------------------------------------------------------------- Dist


class TestDist:
    def test_uniform_budgets(self) -> None:
        assert uniform_budgets(10, 3) == [4, 3, 3]
        assert uniform_budgets(9, 3) == [3, 3, 3]
        assert uniform_budgets(5, 4) == [2, 1, 1, 1]
        policy = build("lru-dist", 10, num_layers=3)
        assert policy.budgets == [4, 3, 3]
        assert [policy.room(layer) for layer in range(3)] == [4, 3, 3]
        assert policy.name == "lru-dist"

    def test_given_budgets(self) -> None:
        policy = build("fifo-dist", 6, num_layers=3, budgets=[1, 2, 3])
        assert [policy.room(layer) for layer in range(3)] == [1, 2, 3]
        assert [p.capacity for p in policy.layers] == [1, 2, 3]

    @pytest.mark.parametrize(
        ("capacity", "budgets", "match"),
        [
            (6, [1, 2], "2 budgets given for 3 layers"),
            (6, [2, 2, 3], "sum to 7 > capacity 6"),
            (6, [0, 3, 3], "at least one slot"),
            (2, None, "at least one slot"),  # uniform budgets of 2 over 3 layers: 1, 1, 0
        ],
    )
    def test_bad_budgets(self, capacity: int, budgets: list[int] | None, match: str) -> None:
        params = {} if budgets is None else {"budgets": budgets}
        with pytest.raises(PolicyError, match=match):
            build("lru-dist", capacity, num_layers=3, **params)

    def test_miss_evicts_only_from_its_layer(self) -> None:
        # budgets [2, 3] of capacity 5. Layer 0 holds 2 (full), layer 1 one: the cache has room
        # overall, yet a layer-0 miss must evict the layer-0 LRU page, never a layer-1 page.
        policy = build("lru-dist", 5, num_layers=2, budgets=[2, 3])
        drv = Driver(policy)
        drv.serve([(1, 0)], 0)
        drv.serve([(0, 0)], 1)
        drv.serve([(0, 1)], 2)
        assert policy.victim((1, 5), ()) is None  # layer 1 has room
        assert drv.serve([(0, 2)], 3) == [((0, 2), (0, 0))]
        assert len(policy) == 3
        assert (1, 0) in policy

    def test_inner_policies_see_only_their_layer(self) -> None:
        policy = build("lfu-dist", 4, num_layers=2)
        drv = Driver(policy)
        for rnd, key in enumerate([(0, 0), (1, 0), (0, 1), (1, 1), (0, 0)]):
            drv.serve([key], rnd)
        assert len(policy.layers[0]) == 2 and len(policy.layers[1]) == 2
        assert (0, 0) in policy.layers[0] and (0, 0) not in policy.layers[1]
        # layer 0 LFU: (0,0) twice, (0,1) once -> (0,1) goes
        assert drv.serve([(0, 2)], 5) == [((0, 2), (0, 1))]

    def test_static_dist_favours_each_layers_own_top_experts(self) -> None:
        # budgets [3, 3], top_k 1: each layer's Static favours its own 2 most used experts (ranking the
        # whole profile would favour (0,0), (0,1) in both layers and leave layer 1 plain LRU).
        profile = {(0, 0): 100, (0, 1): 90, (0, 2): 80, (1, 0): 5, (1, 1): 4, (1, 2): 1, (1, 3): 1}
        policy = build("static-dist", 6, num_layers=2, num_experts=4, profile=profile)
        assert [p.favoured for p in policy.layers] == [{(0, 0), (0, 1)}, {(1, 0), (1, 1)}]
        drv = Driver(policy)
        for rnd, e in enumerate((0, 1, 2)):
            drv.serve([(1, e)], rnd)
        # layer 1 favours (1,0), (1,1): the miss of (1,3) should evict the unfavoured (1,2)
        assert drv.serve([(1, 3)], 3) == [((1, 3), (1, 2))]


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("eam", {"eps": math.nan}, "eps must be a positive finite number"),  # was an IndexError
        ("eam", {"eps": math.inf}, "eps must be a positive finite number"),
        ("eam", {"eamc": 1.5}, "eamc must be a whole number"),  # was taken as 1
        ("eam", {"matches": 2.7}, "matches must be a whole number"),
        ("lcp", {"omega": math.nan}, "omega must be a positive finite number"),  # was accepted
        ("lcp", {"omega": math.inf}, "omega must be a positive finite number"),
    ],
)
def test_parameters_that_are_not_numbers_of_their_kind_are_refused(name, params, message):
    with pytest.raises(PolicyError, match=message):
        build(name, 8, num_layers=2, **params)
    build(name, 8, num_layers=2, **{k: 2 for k in params})  # a whole, finite value of each is taken


def test_make_policy_without_a_context_says_what_it_needs():
    with pytest.raises(PolicyError, match="make_policy needs a PolicyContext"):
        make_policy("lru", None)  # was an AttributeError
