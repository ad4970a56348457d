"""The planner: per-layer cache budgets, miss path and predictor chosen on the timing model.

For a routing trace, a cache of ``capacity`` experts and a cost model, the planner lays the budget out
over the layers in several ways, runs each layout with each miss path and predictor asked for through
the timing model (``simulate_timing``: the engine's own step logic in virtual time), and keeps the one
with the lowest predicted TPOT (or TTFT). The layouts:

- ``shared``: one cache for all layers under the policy (no per-layer budget);
- ``uniform``: the policy's ``-dist`` form, the budget split evenly (Mixtral-offloading's per-layer LRU);
- ``knapsack`` (AdapMoE): per-layer sizes by dynamic programming over the layers' own miss curves
  (each layer's policy replayed on that layer's requests at every size, one stack pass for LRU), the
  sizes summing to the budget with the fewest misses of the objective's phase (decode for TPOT);
- ``fate`` (Fate's shallow-favouring cache): the first four layers hold all their experts, the rest
  share what is left evenly; with room for fewer than four whole layers, as many as fit;
- ``moepic`` (MoEpic's cache configurator, its Sec. 3.4 and Algorithm 1): per-layer budgets V_i and
  split ratios theta_i together, for the ``split`` miss path. ``ExpertSplit`` solves each layer's
  sub-problem (Eq. 11: the cache size C_i = V_i / theta_i that maximises the activated experts already
  in memory, cached top segments plus what the prefetch window moves) from the layer's hit-rate curve
  H_i(C), the predictor's accuracy P_i(y) and predicted-hit curve PH_i(y, C), layer after layer as each
  one's window follows from the one before (Eqs. 5-7); ``VramAllocation`` moves a grain zeta of the
  budget from the layer that loses least to the layer that gains most while the exposed loading latency
  falls (a fixed point). P_i(y) comes from the trace's recorded predictions (``generate --prefetch NAME
  --record-trace``; none: no prefetching assumed), and PH_i(y, C) is approximated by P_i(y) H_i(C).

Beside them it reports OPT (Belady, one shared cache, on demand) as the lower bound of on-demand
fetching. Every layout is scored by the timing model, whatever the method's own model predicted.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from expertcache.cache.schedule import build_schedule
from expertcache.cache.tiers import level_experts
from expertcache.config import SLOW_TIERS, CacheConfig, HostConfig, MissConfig, PrefetchConfig
from expertcache.costs import CostModel, as_cost, check_dense_layers, profile_tier
from expertcache.errors import ExpertcacheError, arguments_checked, option, warn_notes
from expertcache.miss.registry import miss_class, parse_miss
from expertcache.plan import METHODS, OBJECTIVES, Plan
from expertcache.policy.dist import uniform_budgets
from expertcache.policy.registry import POLICIES, is_offline, min_capacity, parse_policy
from expertcache.predict.registry import PREDICTORS, predictor_class, trace_readers
from expertcache.sim.curves import run_policy
from expertcache.sim.timing import RECORDED_LEVEL, host_level_of, run_timing, shared_runs, warm_runs
from expertcache.trace.batch import is_batched
from expertcache.trace.trace import Trace, as_trace
from expertcache.units import capped_capacity, one_capacity, whole_number

LAYOUT_METHODS = METHODS[:4]  # those that lay out a -dist policy's budgets (moepic: a split miss path)
# the host level's policies the planner tries by default: those that decide by hits and insertions alone
# a host level sees only the device's misses: frequency often beats recency there, and which one wins
# depends on the trace (``bench/host_policies_sim.py``); -dist forms where the level holds top-k a layer
HOST_POLICIES = ("lru", "lfu", "fifo", "lcp", "lfu-dist", "lru-dist")
FATE_FULL_LAYERS = 4  # Fate caches its first four layers whole


def layer_trace(trace: Trace, layer: int) -> Trace:
    """The trace of one MoE layer alone (its requests, in the same steps)."""

    def one(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[:, layer : layer + 1]

    return replace(
        trace, experts=one(trace.experts), weights=one(trace.weights), predicted=one(trace.predicted),
        predicted_from=None,  # predictions of one layer from others: nothing within one layer
        source=f"{trace.source} layer {layer}",
    )  # fmt: skip


def layer_curves(trace: Trace, policy: str = "lru") -> np.ndarray:
    """Misses of each layer's own cache at every size: int64 [2, L, E + 1], row 0 decode, row 1
    prefill, column c a cache of c experts for that layer (sizes below top-k are not run: -1)."""
    from expertcache.sim import fast

    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    out = np.full((2, L, E + 1), -1, dtype=np.int64)
    sizes = list(range(K, E + 1))
    # compiled where the replays of every layer at every size, together, pay for loading the kernels
    compiled = trace.num_tokens * K * L * len(sizes) >= fast.MIN_REQUESTS or None
    for layer in range(L):
        schedule = build_schedule(layer_trace(trace, layer), "layer")
        for r in run_policy(schedule, policy, sizes, compiled=compiled):
            out[:, layer, r.capacity] = r.layer_misses[:, 0]
    return out


def knapsack(curves: np.ndarray, capacity: int, low: int) -> list[int]:
    """Per-layer sizes in ``low`` .. E summing to ``capacity`` with the fewest misses, where
    ``curves[l, c]`` is layer l's misses at size c [L, E + 1]. Exact dynamic programming over layers;
    ties go to the layout with more room in shallower layers."""
    L, E = curves.shape[0], curves.shape[1] - 1
    if not L * low <= capacity <= L * E:
        raise ExpertcacheError(f"a budget of {capacity} experts cannot give {L} layers {low} .. {E} each")
    inf = np.iinfo(np.int64).max // 4
    best = np.full(capacity + 1, inf, dtype=np.int64)  # best[c]: fewest misses of the layers so far in c
    best[0] = 0
    choice = np.zeros((L, capacity + 1), dtype=np.int64)
    for layer in range(L):
        nxt = np.full(capacity + 1, inf, dtype=np.int64)
        for size in range(min(E, capacity), low - 1, -1):  # larger first: ties keep the larger size
            cand = np.full(capacity + 1, inf, dtype=np.int64)
            cand[size:] = best[: capacity + 1 - size] + curves[layer, size]
            better = cand < nxt
            nxt[better], choice[layer, better] = cand[better], size
        best = nxt
    sizes, left = [], capacity
    for layer in range(L - 1, -1, -1):
        size = int(choice[layer, left])
        sizes.append(size)
        left -= size
    return sizes[::-1]


def fate_budgets(capacity: int, layers: int, experts: int, low: int) -> list[int]:
    """Fate's shallow-favouring layout: the first layers whole (four, or as many as fit while every
    other layer keeps ``low``), the rest of the budget even over the deeper layers."""
    full = 0
    while (
        full < min(FATE_FULL_LAYERS, layers - 1)
        and (full + 1) * experts + (layers - full - 1) * low <= capacity
    ):
        full += 1
    rest = uniform_budgets(capacity - full * experts, layers - full)
    return [experts] * full + [min(b, experts) for b in rest]


def layouts(
    trace: Trace,
    capacity: int,
    policy: str,
    methods: Sequence[str],
    objective: str,
    curves: np.ndarray | None = None,
) -> dict[str, list[int] | None]:
    """Each method's budgets (None: a shared cache); methods that cannot lay this budget out are left
    out (a per-layer layout needs top-k experts in every layer). ``curves``: ``layer_curves(trace,
    policy)`` when the caller has them."""
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    fits = L * K <= capacity <= L * E
    out: dict[str, list[int] | None] = {}
    for method in (m for m in methods if m in LAYOUT_METHODS):
        if method == "shared":
            out[method] = None
        elif not fits:
            continue
        elif method == "uniform":
            out[method] = uniform_budgets(capacity, L)
        elif method == "knapsack":
            both = layer_curves(trace, policy) if curves is None else curves
            weighed = objective_phase(objective)
            phase = both.sum(axis=0) if weighed is None else both[weighed]
            if not phase[:, K:].any():  # the phase has no request: all phases
                phase = both.sum(axis=0)
            out[method] = knapsack(phase, capacity, K)
        elif method == "fate":
            out[method] = fate_budgets(capacity, L, E, K)
    return out


THETA = (0.05, 0.95)  # the split ratios the configurator considers


def moepic_stats(
    trace: Trace, policy: str, phase: int = 0, curves: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """MoEpic's per-layer statistics from a trace: H [L, E + 1], the hit rate of a layer's cache of C
    experts (the layer's own policy, ``phase`` 0 decode, 1 prefill), and P [L, K], the share of tokens
    whose y-th predicted expert was activated (the trace's recorded predictions; zeros without them)."""
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    curves = (layer_curves(trace, policy) if curves is None else curves)[phase].astype(np.float64)
    requests = build_schedule(trace, "layer").layer_requests[phase].astype(np.float64)  # [L]
    hit = np.zeros((L, E + 1))
    hit[:, K:] = 1 - curves[:, K:] / np.maximum(requests, 1)[:, None]
    prob = np.zeros((L, K))
    if trace.predicted is not None:
        rows = np.ones(trace.num_tokens, dtype=bool)
        if trace.is_prefill is not None:
            rows = trace.is_prefill == (1 if phase else 0)
        ex, pred = trace.experts[rows], trace.predicted[rows]  # [T, L, K]
        if len(ex):
            for y in range(K):
                p = pred[:, :, y : y + 1]
                prob[:, y] = ((ex == p) & (p >= 0)).any(axis=2).mean(axis=0)
    return hit, prob


def expert_split(
    budgets: Sequence[float], hit: np.ndarray, prob: np.ndarray, cost: CostModel, top_k: int
) -> tuple[list[float], list[float], list[int]]:
    """MoEpic's ``ExpertSplit``: for per-layer budgets V_i (in whole experts), each layer's best cache
    size and split ratio (Eq. 11), taken layer by layer with its prefetch window (Eqs. 5-7).
    -> (exposed loading latency per layer, theta per layer, cache size per layer)."""
    L, E = hit.shape[0], hit.shape[1] - 1
    t_exp, t_load = cost.expert(1), cost.transfer_s
    t_moe = top_k * t_exp
    window = cost.step_s + cost.dense(0)
    exposed, thetas, sizes = [], [], []
    for i, v in enumerate(budgets):
        best = (-1.0, 0.5, top_k)
        low = max(top_k, int(np.ceil(v / THETA[1])))
        for c in range(low, E + 1):
            theta = v / c
            if theta < THETA[0]:
                break
            m = top_k * hit[i, c] * theta
            spent = 0.0
            for y in range(prob.shape[1]):
                ph = prob[i, y] * hit[i, c]  # PH_i(y, C) ~ P_i(y) H_i(C)
                t = (1 - ph * theta) * t_load
                if spent + t > window:
                    break
                spent += t
                m += (1 - ph * theta) * prob[i, y]
            m = min(float(top_k), m)
            if m > best[0]:
                best = (m, theta, c)
        m, theta, c = best
        hide, miss = m * t_exp, (top_k - m) * t_load
        exposed.append(max(0.0, miss - hide))
        thetas.append(theta)
        sizes.append(c)
        window = (t_moe - min(hide, miss)) + cost.dense(min(i + 1, L - 1))
    return exposed, thetas, sizes


def moepic_config(
    trace: Trace,
    capacity: float,
    cost: CostModel,
    policy: str = "lru",
    zeta: float = 0.02,
    curves: np.ndarray | None = None,
) -> tuple[list[float], list[float], float]:
    """MoEpic's ``VramAllocation`` (Algorithm 1): start even, then move ``zeta`` of the budget from the
    layer whose exposed latency grows least when it has less to the one whose exposed latency falls
    most when it has more, while the total falls. -> (V_i, theta_i, total exposed seconds per step)."""
    L, K = trace.num_layers, trace.top_k
    hit, prob = moepic_stats(trace, policy, curves=curves)
    grain = zeta * capacity
    floor = 2 * K * THETA[0]  # the least budget a layer can split into top-k segments, with a margin
    v = [capacity / L] * L
    t1, thetas, _ = expert_split(v, hit, prob, cost, K)
    for _ in range(int(4 * L / max(zeta, 1e-6))):  # a bound; the fixed point comes long before
        t2, _, _ = expert_split([x + grain for x in v], hit, prob, cost, K)
        t3, _, _ = expert_split([max(floor, x - grain) for x in v], hit, prob, cost, K)
        gain = [a - b for a, b in zip(t1, t2, strict=True)]
        i1 = int(np.argmax(gain))
        loss = [
            (b - a) if i != i1 and v[i] - grain >= floor else np.inf
            for i, (a, b) in enumerate(zip(t1, t3, strict=True))
        ]
        i2 = int(np.argmin(loss))
        if not np.isfinite(loss[i2]):
            break
        trial = list(v)
        trial[i1] += grain
        trial[i2] -= grain
        t4, th4, _ = expert_split(trial, hit, prob, cost, K)
        if sum(t4) - sum(t1) >= 0:
            break
        v, t1, thetas = trial, t4, th4
    return v, thetas, sum(t1)


def moepic_miss(
    trace: Trace,
    capacity: int,
    cost: CostModel,
    policy: str = "lru",
    curves: np.ndarray | None = None,
    buffer: int | None = None,
) -> str:
    """The split miss path MoEpic's configurator chooses: per-layer theta and budget weights; ``buffer``
    (bottom segments, the split path's parameter, where the user gave one) is kept as given."""
    budgets, thetas, _ = moepic_config(trace, capacity - trace.top_k, cost, policy, curves=curves)  # buffer
    theta = "/".join(f"{min(max(t, THETA[0]), THETA[1]):.2f}" for t in thetas)
    weights = "/".join(f"{max(b, 1e-3):.3f}" for b in budgets)
    even = len(set(f"{b:.3f}" for b in budgets)) == 1
    kept = "" if buffer is None else f",buffer={buffer}"
    return f"split:theta={theta}" + ("" if even else f",weights={weights}") + kept


def _host_room(policy: str, num_layers: int, top_k: int) -> int:
    """The fewest experts a host level under ``policy`` can hold: a layer's top-k (a -dist policy: a
    layer's top-k in every layer), as the engine and the timing model build it."""
    name, params = parse_policy(policy)
    return min_capacity(name, num_layers, params, min_room=top_k)


def check_layout_policy(policy: str, who: str) -> str:
    """A policy the planner can lay out over the layers (one with a -dist form, no parameters, online);
    ``who`` begins the message (``"the planner lays out"``). -> its name"""
    name, params = parse_policy(policy)
    if params or name.endswith("-dist") or f"{name}-dist" not in POLICIES:
        raise ExpertcacheError(
            f"{who} a policy with a -dist form and no parameters, not {policy!r} (e.g. lru, lfu, llru)"
        )
    if is_offline(name):
        raise ExpertcacheError(f"policy {name} needs the future: it cannot run in an engine")
    return name


@arguments_checked
def make_plan(
    trace: Trace | str,
    capacity: int | str,
    cost: CostModel | dict | str | None = None,
    *,
    policy: str = "lru",
    misses: Sequence[str] = ("fetch",),
    prefetches: Sequence[PrefetchConfig | str] = ("none",),
    methods: Sequence[str] | None = None,
    objective: str = "tpot",
    seed: int = 0,
    predictor_trace: Trace | None = None,
    host: HostConfig | str | None = None,
    host_capacity: int | None = None,
    host_policies: Sequence[str] = HOST_POLICIES,
    jobs: int = 1,
    slow_tier: str | None = None,
    deterministic: bool = False,
) -> Plan:
    """Lay ``capacity`` experts out by every method, run each with each miss path and predictor through
    the timing model, and return the best as a ``Plan`` (every candidate's figures inside). ``methods``
    None: every layout of a -dist policy, and MoEpic's when a ``split`` miss path is among ``misses``
    (its layout is that path's: it replaces the split spec given). ``host`` (a ``HostConfig``, or its
    memory) or ``host_capacity`` (experts): a host level between the cache and the disk (``cache.tiers``;
    its misses read ``cost.disk_read_s``), under each of ``host_policies`` in turn; the plan then says
    which, and whether it is inclusive or exclusive of the expert memory (an exclusive one holds its
    memory less ``cache.tiers.exclusive_reserve`` experts). Staging is not planned. The engine's host
    level serves the ``fetch`` miss path, so other miss paths are left out. ``trace`` is a ``Trace`` or
    its file, ``capacity`` experts or a share of all ("25%"); a list argument may be one name. ``jobs``:
    worker processes that run the candidates side by side first (``sim.timing.warm_runs``; the same
    plan). ``slow_tier``: the tier the costs were measured on (a profile's own, read from its file when
    ``cost`` is one), recorded in the plan: a run of it takes that tier. ``deterministic``: every
    candidate runs on a settled link (``PrefetchConfig(deterministic=True)``: each transfer lands before
    the next decision), and so does every run of the plan, whose counts are then the predicted ones."""
    if slow_tier is None and isinstance(cost, str | os.PathLike | dict):
        slow_tier = profile_tier(cost)
    if slow_tier is not None and slow_tier not in SLOW_TIERS:  # a run of the plan takes it (tape ran as disk)
        raise ExpertcacheError(f"slow_tier must be one of {', '.join(SLOW_TIERS)}, got {slow_tier!r}")
    trace = as_trace(trace, replay=True)
    predictor_trace = None if predictor_trace is None else as_trace(predictor_trace, "predictor trace")
    capacity, capped = capped_capacity(
        one_capacity(capacity, trace.num_layers * trace.num_experts), trace.num_layers * trace.num_experts
    )
    misses, prefetches, host_policies = (
        [v] if isinstance(v, str | PrefetchConfig) else v for v in (misses, prefetches, host_policies)
    )
    if isinstance(methods, str):
        methods = [methods]
    for given, what in ((methods, "methods"), (misses, "misses"), (prefetches, "prefetches")):
        if given is not None and not len(given):
            raise ExpertcacheError(f"{what} is empty: name one at least (or leave it out for the default)")
    cost = as_cost(cost, trace)
    seed = whole_number(seed, option("--seed", "seed"), 0)  # -1 would draw as 1 does
    jobs = whole_number(jobs, option("--jobs", "jobs"))
    if host is None and host_capacity is None and host_policies is not HOST_POLICIES:  # not in silence
        raise ExpertcacheError(
            f"{option('--host-policy', 'host_policies')} rules a host level: give "
            f"{option('--host-memory', 'host')} or {option('--host-capacity', 'host_capacity')} too"
        )
    named = [p.predictor if isinstance(p, PrefetchConfig) else str(p) for p in prefetches or ["none"]]
    if predictor_trace is not None and not trace_readers(named):
        raise ExpertcacheError(
            f"predictor_trace: prefetch {', '.join(dict.fromkeys(named))} reads no recorded trace (token and "
            "eam do)"
        )
    if predictor_trace is not None and _same_routing(predictor_trace, trace):  # as timing's token says
        level_notes_extra = [
            f"the predictor trace is the planned trace itself ({trace.source}): its predictors learn the "
            "future they predict, an in-sample bound, not what a run will see"
        ]
    else:
        level_notes_extra = []
    host_cfgs: list[HostConfig | None] = [None]
    host_caps: dict[bool, int] = {}  # the host level's capacity, inclusive and exclusive
    skipped: list[str] = []
    host_level = host_level_of(
        host, host_capacity, trace.num_layers * trace.num_experts, cost.expert_bytes, capacity=capacity
    )
    level_notes = capped + level_notes_extra + ([] if host_level is None else host_level[2])
    warn_notes(level_notes)  # also in the plan's search; the command line prints them
    if host_level is not None and capacity >= trace.num_layers * trace.num_experts:  # as the engine does
        skipped.append("the host level: every expert fits the expert memory, so it is not used")
        host_level = None
    if host_level is not None:
        cfg, memory, _ = host_level
        if cfg.exclusive:
            raise ExpertcacheError(
                "the planner compares an inclusive and an exclusive host level itself: give the host level "
                "without exclusive"
            )
        if cfg.stage:  # a plan does not keep it, and the engine would run the plan without it
            raise ExpertcacheError(
                "the planner does not plan staging (a host stage): give the host level without it"
            )
        host_caps = {False: memory, True: level_experts(memory, True, trace.top_k)}
        room = {hp: _host_room(hp, trace.num_layers, trace.top_k) for hp in dict.fromkeys(host_policies)}
        fit = {(hp, x) for hp in room for x in (False, True) if room[hp] <= host_caps[x]}
        host_cfgs = [
            HostConfig(None, hp, exclusive=x) for hp in room for x in (False, True) if (hp, x) in fit
        ]
        kind = {False: "inclusive", True: "exclusive (its memory less the reserve for hits in flight)"}
        skipped += [
            f"host policy {hp}, {kind[x]}: needs {room[hp]} host experts, the level holds {host_caps[x]}"
            for hp in room
            for x in (False, True)
            if (hp, x) not in fit
        ]
        if not room:
            raise ExpertcacheError("a host level needs at least one policy to plan with")
        if not host_cfgs:
            raise ExpertcacheError(
                f"a host level of {host_caps[False]} expert{'s' if host_caps[False] != 1 else ''} is too "
                "small for every host policy given "
                f"({', '.join(room)}): the least needs {min(room.values())} (a layer's top-{trace.top_k}, "
                "in every layer for a -dist policy)"
            )
        others = [m for m in misses if parse_miss(m)[0] != "fetch"]
        if others and len(others) == len(misses):
            raise ExpertcacheError(
                f"the engine's host level serves the fetch miss path, not {others[0]}: plan with --miss fetch"
            )
        skipped += [f"{m}: the engine's host level serves the fetch miss path" for m in others]
        misses = [m for m in misses if parse_miss(m)[0] == "fetch"]
    misses = expand_misses(misses, trace.num_layers)
    on_host = sorted({parse_miss(m)[0] for m in misses if _computes_on_host(parse_miss(m)[0])})
    if cost.submit_s > 0 and not cost.host_submit_s and on_host:  # a transfer's own work priced, a host's not
        favoured = [
            f"the cost model charges each transfer submit_s ({cost.submit_s * 1e6:.0f} us of the engine's "
            f"own work) and an expert computed on the host nothing of the kind (host_submit_s 0): "
            f"{', '.join(on_host)} candidates are favoured against fetch by up to that much a miss "
            "(profile --fit-overheads fits both)"
        ]
        warn_notes(favoured)
        level_notes += favoured
    elif unpriced := cost.unpriced_work(host=bool(on_host)):  # none of it priced (a plain CPU profile)
        warn_notes([unpriced])
        level_notes.append(unpriced)
    split_asked = any(parse_miss(m)[0] == "split" for m in misses)
    if methods is None:
        methods = [*LAYOUT_METHODS, *(["moepic"] if split_asked else [])]
    check_dense_layers(cost, trace.num_layers)
    if objective not in OBJECTIVES:
        raise ExpertcacheError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ExpertcacheError(f"unknown planning method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    name = check_layout_policy(policy, "the planner lays out")
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    if capacity < K:
        raise ExpertcacheError(f"a cache of {capacity} experts: the planner needs top-k ({K}) at least")
    if not isinstance(deterministic, bool):
        raise ExpertcacheError(f"deterministic: true or false, got {deterministic!r}")
    prefetch_cfgs = [p if isinstance(p, PrefetchConfig) else PrefetchConfig(p) for p in prefetches]
    prefetch_cfgs = list(dict.fromkeys(_as_recorded(p, trace) for p in prefetch_cfgs))
    if deterministic:  # each settled (a config given with its own `when` keeps it: "pays" is refused)
        prefetch_cfgs = [p if p.deterministic else _settled(p) for p in prefetch_cfgs]
    fits = L * K <= capacity <= L * E
    need = ("knapsack" in methods and fits) or ("moepic" in methods and L > 1 and capacity > K)
    curves = layer_curves(trace, name) if need else None  # one replay of each layer, shared
    laid = layouts(trace, capacity, name, methods, objective, curves)
    skipped += [
        f"{m}: a per-layer layout needs {L * K} experts (top-{K} in each of {L} layers), not {capacity}"
        for m in methods if m in LAYOUT_METHODS and m not in laid
    ]  # fmt: skip
    # moepic lays out a split path's thetas itself: a split given without them is its; one given with them is
    # compared as given (its theta was dropped unread: split:theta=2 was planned without a word)
    laid_out = [m for m in misses if parse_miss(m)[0] == "split" and "theta" not in parse_miss(m)[1]]
    plain = [m for m in misses if m not in laid_out] if "moepic" in methods else list(misses)
    one_part = [m for m in plain if _parts(m, L, E, K, cost) == 1]  # what -dist budgets can hold
    for m in plain:
        if m not in one_part and len(laid) > ("shared" in laid):
            skipped.append(f"{m} with per-layer budgets: it has several cache parts (shared cache only)")
    cells = [(m, b, plain if b is None else one_part) for m, b in laid.items()]
    if "moepic" in methods:  # its layout is a split miss path's, with the buffer of the split path given
        buffers = [parse_miss(m)[1].get("buffer") for m in laid_out]
        if L > 1 and capacity > K:
            cells += [
                ("moepic", None, [moepic_miss(trace, capacity, cost, name, curves, buffer)])
                for buffer in dict.fromkeys(buffers or [None])
            ]
        else:
            skipped.append(f"moepic: needs more than one layer and more than top-{K} experts")

    def spec_of(budgets) -> str:
        return name if budgets is None else f"{name}-dist:budgets={'/'.join(map(str, budgets))}"

    def run_of(spec: str, miss: str, pf: PrefetchConfig, host: HostConfig | None) -> dict[str, object]:
        return dict(
            trace=trace, capacity=capacity, cache=CacheConfig(spec, seed=seed), prefetch=pf,
            miss=MissConfig(miss), cost=cost, host=host,
            predictor_trace=predictor_trace if trace_readers([pf.predictor]) else None,  # its readers only
            host_capacity=host_caps.get(host is not None and host.exclusive),
        )  # fmt: skip

    with shared_runs():  # the candidates run side by side first, on ``jobs`` processes
        cells_run = [
            run_of(spec_of(budgets), miss, pf, host)
            for _, budgets, cell_misses in cells
            for miss, pf, host in itertools.product(cell_misses, prefetch_cfgs, host_cfgs)
        ]
        warm_runs(cells_run, jobs)
        candidates, seen, run_notes = [], {}, []
        for method, budgets, cell_misses in cells:
            spec = spec_of(budgets)
            for miss, pf, host in itertools.product(cell_misses, prefetch_cfgs, host_cfgs):
                hp = None if host is None else host.policy
                hx = host is not None and host.exclusive
                cell = (spec, miss, pf.predictor, pf.window, pf.deterministic, hp, hx)
                if cell in seen:  # another method laid the budget out the same way
                    figures = {**seen[cell], "same_as": seen[cell]["method"]}
                else:
                    try:
                        r = run_timing(**run_of(spec, miss, pf, host))
                    except ExpertcacheError as exc:
                        if hx:  # an exclusive level the memory cannot hold for this policy: the other kind
                            skipped.append(f"an exclusive host level under {hp}: {exc}")
                            continue
                        if method != "moepic":  # a layout of ours that does not run: a bug, not a skip
                            raise
                        skipped.append(f"{method} ({miss}): {exc}")  # its rounded budgets did not fit
                        continue
                    figures = seen[cell] = {"method": method, **_figures(r)}
                    # what a run adjusted (a window cut to the model), once each; the costs' own, once
                    run_notes += [n for n in r.notes if not n.startswith(RECORDED_LEVEL)]
                candidates.append(
                    {**figures, "method": method, "budgets": budgets, "miss": miss, "prefetch": pf.predictor,
                     "window": pf.window, "host_policy": hp, "host_exclusive": hx,
                     **({"deterministic": True} if pf.deterministic else {}),
                     **({"sim_only": True} if _sim_only(pf.predictor) else {})}
                )  # fmt: skip
    skipped = list(dict.fromkeys(skipped))  # once each: some are found once a method
    run_notes = [n for n in dict.fromkeys(run_notes) if n not in level_notes]
    warn_notes(run_notes)
    level_notes = level_notes + run_notes
    if not candidates:
        raise ExpertcacheError(
            f"no method could lay out {capacity} experts over {L} layers (a per-layer layout needs "
            f"{L * K}: top-{K} in every layer); add 'shared'"
            if all(m in LAYOUT_METHODS for m in methods) else
            f"nothing to compare: {'; '.join(skipped) or 'no method and miss path left'}"
        )  # fmt: skip
    key = objective_key(objective, is_batched(trace))
    if key == "request_ttft_s" and all(c[key] is None for c in candidates):  # no request: the steps'
        key = "ttft_s"
    runnable = [c for c in candidates if not c.get("sim_only")]
    if not runnable:
        raise ExpertcacheError(
            "no candidate an engine can run: prefetch "
            + ", ".join(dict.fromkeys(c["prefetch"] for c in candidates))
            + " needs the future or the trace's own recording (simulator only); add --prefetch none or "
            "a predictor of the engine's"
        )
    if all(c[key] is None for c in candidates):
        raise ExpertcacheError(
            f"objective {objective} ranks by {OBJECTIVE_WORDS[objective]}, and this trace has no "
            + ("decode step" if key == "tpot_s" else "prefill step" if key == "ttft_s" else
               "request with a prompt token" + (" and a generated one" if "tpot" in key else ""))
            + " to measure it on (its tokens' is_prefill and seq_id say which)"
        )  # fmt: skip
    sign = -1 if objective == "throughput" else 1
    # the first of equals: fewer misses, then fewer host-level misses (which cost nothing without a
    # disk read time)
    # the first of equals (by 9 digits: a sum's last bits are not a difference), in the order given
    best = min(runnable, key=lambda c: (_value(c[key], sign), c["misses"], c.get("host_misses") or 0))
    if len(runnable) < len(candidates):  # as OPT's row: a bound to compare, not a plan to run
        skipped.append(
            "prefetch "
            + ", ".join(dict.fromkeys(c["prefetch"] for c in candidates if c.get("sim_only")))
            + ": compared, not chosen: the engine cannot run it (simulator only)"
        )
    hx = bool(best["host_exclusive"])
    best_host = None if best["host_policy"] is None else HostConfig(None, best["host_policy"], exclusive=hx)
    host_capacity = host_caps.get(hx)
    bound = run_timing(
        trace, capacity, cache="opt", miss="fetch", cost=cost, host=best_host, host_capacity=host_capacity
    )
    return Plan(
        layers=L, experts=E, top_k=K, capacity=capacity, policy=name,
        budgets=None if best["budgets"] is None else tuple(best["budgets"]), miss=best["miss"],
        prefetch=best["prefetch"], window=best["window"], method=best["method"], objective=objective,
        predicted={k: best[k] for k in _FIGURES if k in best}, candidates=tuple(candidates),
        lower_bound={"method": "opt (shared, on demand)", **_figures(bound)},
        host_capacity=host_capacity, host_policy=best["host_policy"], host_exclusive=hx,
        deterministic=bool(best.get("deterministic")),
        source={
            "trace": _path_of(trace), "tokens": trace.num_tokens, "digest": trace.digest(),
            **({"batched_steps": True} if is_batched(trace) else {}),
            **({"batched": batched} if (batched := _batched_from(trace)) is not None else {}),
            **({"served": served} if (served := _served_from(trace)) is not None else {}),
            "cost": cost.to_dict(), "skipped": skipped, "notes": level_notes,
            **({"slow_tier": slow_tier} if slow_tier is not None else {}),
            **(
                {"predictor_trace": _path_of(predictor_trace), "predictor_digest": predictor_trace.digest()}
                if predictor_trace is not None and trace_readers([best["prefetch"]])
                else {}
            ),
        },
    )  # fmt: skip


def _sim_only(predictor: str) -> bool:
    """A predictor no engine runs: one that reads the future (``oracle``), or ``recorded`` (a trace's
    own predictions, of a predictor not known here)."""
    return predictor == "recorded" or (predictor in PREDICTORS and predictor_class(predictor).sim_only)


def _as_recorded(pf: PrefetchConfig, trace: Trace) -> PrefetchConfig:
    """``recorded`` as the predictor that recorded the trace's predictions, where the engine has it: the
    simulator replays those predictions by its name too, and a plan names what an engine runs."""
    made_by = trace.meta.get("predictor")
    if pf.predictor != "recorded" or not isinstance(made_by, str) or made_by not in PREDICTORS:
        return pf
    if predictor_class(made_by).sim_only:
        return pf
    window = pf.window if pf.window is not None else trace.meta.get("window")
    return replace(pf, predictor=made_by, window=None if window is None else int(window))


def _settled(pf: PrefetchConfig) -> PrefetchConfig:
    """``pf`` as a deterministic run takes it (``PrefetchConfig(deterministic=True)``; its ``when``
    derived again, where "always": "pays" is refused in one line, as a deterministic run refuses it)."""
    return replace(pf, deterministic=True, when=None if pf.when == "always" else pf.when)


def _computes_on_host(name: str) -> bool:
    """A miss path that computes some experts on the host: a cost-based one (host, hybrid, batch) or
    placement."""
    return name == "placement" or miss_class(name).needs_costs


def _same_routing(a: Trace, b: Trace) -> bool:
    return a is b or (a.experts.shape == b.experts.shape and bool(np.array_equal(a.experts, b.experts)))


def _batched_from(trace: Trace) -> dict | None:
    """How a trace of requests served N at a time (``trace.batch.batch_requests``) was made: the trace it
    was made from (its whole path where it is a file) and the arguments, to make it again; None for
    another trace."""
    meta = trace.meta
    if "batched_from" not in meta:
        return None
    source = Path(str(meta["batched_from"]))
    return {
        "trace": str(source.resolve()) if source.is_file() else str(meta["batched_from"]),
        "concurrency": int(meta["concurrency"]), "requests": int(meta["batched_requests"]),
        "stagger": int(meta.get("stagger", 1)), "schedule": str(meta.get("schedule", "fifo")),
        "batch_tokens": None if meta.get("batch_tokens") is None else int(meta["batch_tokens"]),
    }  # fmt: skip


def _served_from(trace: Trace) -> dict | None:
    """How a server laid out the steps of a trace it recorded (``serve --record-trace``): its
    ``--max-batch-tokens`` and ``--schedule``; None for another trace."""
    meta = trace.meta
    if "served_schedule" not in meta or trace.step_id is None:
        return None
    return {"batch_tokens": int(meta["served_batch_tokens"]), "schedule": str(meta["served_schedule"])}


def _path_of(trace: Trace) -> str:
    """Where a trace was read from, whole (a plan run elsewhere finds it), or its source as it is."""
    source = Path(trace.source)
    return str(source.resolve()) if source.is_file() else trace.source


def expand_misses(misses: Sequence[str], layers: int) -> list[str]:
    """The miss paths to compare: as given, but a bare ``placement`` becomes a choice per layer (the first
    N layers' experts on the host, for a spread of N, and all of them) and a bare ``host`` both of its
    fills; a path with parameters is taken as it is."""
    out: list[str] = []
    for miss in misses:
        name, params = parse_miss(miss)
        if name == "placement" and not params and layers > 1:
            firsts = sorted({1, layers // 4, layers // 2, (3 * layers) // 4, layers - 1} - {0})
            out += [f"placement:first={n}" for n in firsts] + ["placement"]
        elif name == "host" and not params:
            out += ["host", "host:fill=1"]
        else:
            out.append(miss)
    return list(dict.fromkeys(out))


def _parts(miss: str, layers: int, experts: int, top_k: int, cost: CostModel) -> int:
    from expertcache.miss.base import MissContext
    from expertcache.miss.registry import make_miss

    return len(make_miss(miss, MissContext(layers, experts, top_k, costs=cost)).parts())


_FIGURES = (
    "tpot_s", "ttft_s", "stall_s", "misses", "requests", "host_misses", "disk_read_s", "tokens_per_s",
    "request_tpot_s", "request_tpot_p99_s", "request_ttft_s", "request_ttft_p99_s",
)  # fmt: skip


def _figures(r) -> dict[str, object]:
    """A candidate's figures: the mean decode and prefill steps (``tpot_s``, ``ttft_s``), the requests'
    own times (``request_...``: the mean and p99 over the trace's requests of each one's time between its
    tokens and to its first token; None where the trace has no such request), tokens a second over the
    whole trace, and the counts."""
    tpots, ttfts = r.request_tpots or {}, r.request_ttfts or {}
    out = {
        "tpot_s": r.tpot_s,
        "ttft_s": r.ttft_s,
        "stall_s": r.stall_s,
        "misses": r.misses,
        "requests": r.requests,
        "tokens_per_s": r.tokens_per_s,
        "request_tpot_s": tpots.get("mean_s"),
        "request_tpot_p99_s": tpots.get("p99_s"),
        "request_ttft_s": ttfts.get("mean_s"),
        "request_ttft_p99_s": ttfts.get("p99_s"),
    }
    if "host_misses" in r.cache:  # with a host level: its misses, and the disk's time reading them
        out.update(host_misses=r.cache["host_misses"], disk_read_s=r.cache["disk_read_s"])
    return out


def objective_key(objective: str, batched: bool) -> str:
    """The candidates' figure an objective ranks by (the lowest wins; ``throughput`` ranks by
    ``tokens_per_s``, the highest). On a batched trace (steps that serve several requests) ``tpot`` and
    ``ttft`` are a request's own, its mean time between its tokens and to its first token over the
    trace's requests (a pure decode step is not what a request sees between its tokens there, where most
    of its tokens come in steps that also prefill others); one request at a time, ``tpot`` is the mean
    decode step (each is a token of the request) and ``ttft`` still a request's own (its prefill step,
    or its steps where a prompt is chunked). The ``-p99`` objectives are the requests' 99th percentile
    on any trace."""
    if objective == "throughput":
        return "tokens_per_s"
    if objective.endswith("-p99"):
        return f"request_{objective.removesuffix('-p99')}_p99_s"
    return f"request_{objective}_s" if batched or objective == "ttft" else f"{objective}_s"


def objective_phase(objective: str) -> int | None:
    """The phase whose misses an objective weighs most (0 decode, 1 prefill; None: both), as the
    knapsack layout minimises them."""
    return None if objective == "throughput" else 0 if objective.startswith("tpot") else 1


OBJECTIVE_WORDS = {
    "tpot": "a request's time between its tokens",
    "ttft": "a request's time to its first token",
    "tpot-p99": "the 99th percentile over the requests of the time between a request's tokens",
    "ttft-p99": "the 99th percentile over the requests of the time to a request's first token",
    "throughput": "tokens a second over the whole trace",
}


def _value(x: float | None, sign: int = 1) -> float:
    return float("inf") if x is None else sign * float(f"{x:.9g}")


def _prefetch(c: dict) -> str:
    """A candidate's predictor, with its window where one was given (``--window`` repeated compares
    several)."""
    return c["prefetch"] if c.get("window") is None else f"{c['prefetch']} w{c['window']}"


def format_plan(plan: Plan) -> str:
    """The candidates side by side, the chosen one marked, and the lower bound (what ``plan`` prints)."""

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.3f}"

    batched = bool(plan.source.get("batched_steps"))
    tpot = "request_tpot_s" if batched else "tpot_s"
    extra = {"tpot-p99": "TPOT p99", "ttft-p99": "TTFT p99", "throughput": "tok/s"}.get(plan.objective)
    extra_key = objective_key(plan.objective, batched)

    def cols(c: dict) -> str:  # the times, and the objective's own figure where it has a column
        first = c.get("request_ttft_s")  # a request's own (the prefill step where a prompt takes one)
        out = f"{ms(c.get(tpot)):>10}{ms(c.get('ttft_s') if first is None else first):>10}"
        if extra is not None:
            v = c.get(extra_key)
            out += f"{'-' if v is None else f'{v:.1f}' if extra == 'tok/s' else ms(v):>12}"
        return out

    cost = plan.source.get("cost")
    rows = [] if cost is None else [f"cost: {CostModel.from_dict(cost).describe()}"]
    if batched:  # what the columns are, where steps are not a request's own times
        rows.append(
            "TPOT, TTFT: a request's own, the mean over the trace's requests of its time between its tokens "
            "and to its first token (timing --plan gives the steps' too)"
        )
    rows += [
        f"{'':2}{'method':10}{'miss':20}{'prefetch':14}{'TPOT ms':>10}{'TTFT ms':>10}"
        + ("" if extra is None else f"{extra + (' ms' if extra != 'tok/s' else ''):>12}")
        + f"{'misses':>9}  budgets"
    ]
    notes = []
    for c in plan.candidates:
        chosen = (
            c["method"] == plan.method and c["miss"] == plan.miss and c["prefetch"] == plan.prefetch
            and (c["budgets"] is None) == (plan.budgets is None) and c.get("host_policy") == plan.host_policy
            and bool(c.get("host_exclusive")) == bool(plan.host_exclusive) and c.get("window") == plan.window
            and bool(c.get("deterministic")) == plan.deterministic
        )  # fmt: skip
        budgets = "shared" if c["budgets"] is None else "/".join(map(str, c["budgets"]))
        miss = c["miss"]
        if len(miss) > 19:  # a per-layer miss path (moepic's split): in full below the table
            notes.append(f"[{len(notes) + 1}] {miss}")
            miss, budgets = f"{miss.split(':')[0]} [{len(notes)}]", "per layer, see [" + f"{len(notes)}]"
        if "same_as" in c:
            budgets += f" (as {c['same_as']})"
        if c.get("host_policy") is not None:
            kind = " exclusive" if c.get("host_exclusive") else ""
            reads = f"{c['host_misses']} misses, {c['disk_read_s']:.3f} s of reads"
            budgets += f"; host {c['host_policy']}{kind}: {reads}"
        rows.append(
            f"{'* ' if chosen else '  '}{c['method']:10}{miss:20}{_prefetch(c):14}{cols(c)}"
            f"{c['misses']:>9}  {budgets}"
        )
    b = plan.lower_bound
    # OPT on demand bounds fetching on demand; a predictor's prefetches move experts before they are
    # missed, so a prefetching candidate may count fewer misses than OPT without any fault
    fetched = [c["misses"] for c in plan.candidates if c["miss"] == "fetch" and c["prefetch"] == "none"]
    prefetching = any(c["prefetch"] != "none" and c["misses"] < b["misses"] for c in plan.candidates)
    what = (
        "shared: OPT's misses, a bound on fetching on demand's (not on other paths' times"
        + ("; prefetching moves experts before they are missed" if prefetching else "")
        + ")"
        if not fetched or b["misses"] <= min(fetched)
        else "shared: Belady's choice, serving a step's experts together: not a bound here (a batched "
        "trace's steps need more than the layer's share at once)"
    )
    times = cols(b)
    rows.append(f"  {'opt':10}{'fetch':20}{'none':14}{times}{b['misses']:>9}  {what}")
    rows += notes
    rows += [f"left out: {line}" for line in plan.source.get("skipped", [])]
    by = "" if plan.objective == "tpot" else f" by {plan.objective}"
    rows.append(
        f"chosen{by}: {plan.describe()}" + (f"; lossy: {', '.join(plan.lossy)}" if plan.lossy else "; exact")
    )
    return "\n".join(rows)
