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
  share what is left evenly; with room for fewer than four whole layers, as many as fit.

Beside them it reports OPT (Belady, one shared cache, on demand) as the lower bound of on-demand
fetching. MoEpic's configurator (budgets and split ratios together) is not here yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from expertcache.cache.schedule import build_schedule
from expertcache.config import CacheConfig, MissConfig, PrefetchConfig
from expertcache.costs import CostModel
from expertcache.errors import ExpertcacheError
from expertcache.plan import Plan
from expertcache.policy.dist import uniform_budgets
from expertcache.policy.registry import POLICIES, is_offline, parse_policy
from expertcache.sim.curves import run_policy
from expertcache.sim.timing import simulate_timing
from expertcache.trace.trace import Trace

METHODS = ("shared", "uniform", "knapsack", "fate")
OBJECTIVES = ("tpot", "ttft")
FATE_FULL_LAYERS = 4  # Fate caches its first four layers whole


def layer_trace(trace: Trace, layer: int) -> Trace:
    """The trace of one MoE layer alone (its requests, in the same steps)."""

    def one(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[:, layer : layer + 1]

    return replace(
        trace, experts=one(trace.experts), weights=one(trace.weights), predicted=one(trace.predicted),
        source=f"{trace.source} layer {layer}",
    )  # fmt: skip


def layer_curves(trace: Trace, policy: str = "lru") -> np.ndarray:
    """Misses of each layer's own cache at every size: int64 [2, L, E + 1], row 0 decode, row 1
    prefill, column c a cache of c experts for that layer (sizes below top-k are not run: -1)."""
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    out = np.full((2, L, E + 1), -1, dtype=np.int64)
    sizes = list(range(K, E + 1))
    for layer in range(L):
        schedule = build_schedule(layer_trace(trace, layer), "layer")
        for r in run_policy(schedule, policy, sizes):
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
    trace: Trace, capacity: int, policy: str, methods: Sequence[str], objective: str
) -> dict[str, list[int] | None]:
    """Each method's budgets (None: a shared cache); methods that cannot lay this budget out are left
    out (a per-layer layout needs top-k experts in every layer)."""
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    fits = L * K <= capacity <= L * E
    out: dict[str, list[int] | None] = {}
    for method in methods:
        if method == "shared":
            out[method] = None
        elif not fits:
            continue
        elif method == "uniform":
            out[method] = uniform_budgets(capacity, L)
        elif method == "knapsack":
            curves = layer_curves(trace, policy)[0 if objective == "tpot" else 1]
            if not curves[:, K:].any():  # the phase has no request: all phases
                curves = layer_curves(trace, policy).sum(axis=0)
            out[method] = knapsack(curves, capacity, K)
        elif method == "fate":
            out[method] = fate_budgets(capacity, L, E, K)
    return out


def make_plan(
    trace: Trace,
    capacity: int,
    cost: CostModel | None = None,
    *,
    policy: str = "lru",
    misses: Sequence[str] = ("fetch",),
    prefetches: Sequence[PrefetchConfig | str] = ("none",),
    methods: Sequence[str] = METHODS,
    objective: str = "tpot",
    seed: int = 0,
    predictor_trace: Trace | None = None,
) -> Plan:
    """Lay ``capacity`` experts out by every method, run each with each miss path and predictor through
    the timing model, and return the best as a ``Plan`` (every candidate's figures inside)."""
    cost = cost or CostModel()
    if objective not in OBJECTIVES:
        raise ExpertcacheError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ExpertcacheError(
            f"unknown planning method {unknown[0] if unknown else ''!r}; choose from {', '.join(METHODS)}"
        )
    name, params = parse_policy(policy)
    if params or name.endswith("-dist") or f"{name}-dist" not in POLICIES:
        raise ExpertcacheError(
            f"the planner lays out a policy with a -dist form and no parameters, not {policy!r} "
            f"(e.g. lru, lfu, llru)"
        )
    if is_offline(name):
        raise ExpertcacheError(f"policy {name} needs the future: it cannot run in an engine")
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    if not K <= capacity <= L * E:
        raise ExpertcacheError(
            f"a cache of {capacity} experts: the planner needs {K} .. {L * E} (top-k .. all of the model's)"
        )
    prefetch_cfgs = [p if isinstance(p, PrefetchConfig) else PrefetchConfig(p) for p in prefetches]
    candidates, seen = [], {}
    for method, budgets in layouts(trace, capacity, name, methods, objective).items():
        spec = name if budgets is None else f"{name}-dist:budgets={'/'.join(map(str, budgets))}"
        for miss in misses:
            for pf in prefetch_cfgs:
                cell = (spec, miss, pf.predictor, pf.window)
                if cell in seen:  # another method laid the budget out the same way
                    figures = {**seen[cell], "same_as": seen[cell]["method"]}
                else:
                    r = simulate_timing(
                        trace, capacity, cache=CacheConfig(spec, seed=seed), prefetch=pf,
                        miss=MissConfig(miss), cost=cost, predictor_trace=predictor_trace,
                    )  # fmt: skip
                    figures = seen[cell] = {"method": method, **_figures(r)}
                candidates.append(
                    {**figures, "method": method, "budgets": budgets, "miss": miss, "prefetch": pf.predictor,
                     "window": pf.window}
                )  # fmt: skip
    if not candidates:
        raise ExpertcacheError(
            f"no method could lay out {capacity} experts over {L} layers (a per-layer layout needs "
            f"{L * K}: top-{K} in every layer); add 'shared'"
        )
    key = f"{objective}_s"
    best = min(candidates, key=lambda c: (_value(c[key]), c["misses"]))  # the first of equals
    bound = simulate_timing(trace, capacity, cache="opt", miss="fetch", cost=cost)
    return Plan(
        layers=L, experts=E, top_k=K, capacity=capacity, policy=name,
        budgets=None if best["budgets"] is None else tuple(best["budgets"]), miss=best["miss"],
        prefetch=best["prefetch"], window=best["window"], method=best["method"], objective=objective,
        predicted={k: best[k] for k in _FIGURES}, candidates=tuple(candidates),
        lower_bound={"method": "opt (shared, on demand)", **_figures(bound)},
        source={"trace": trace.source, "tokens": trace.num_tokens, "cost": cost.to_dict()},
    )  # fmt: skip


_FIGURES = ("tpot_s", "ttft_s", "stall_s", "misses", "requests")


def _figures(r) -> dict[str, object]:
    return {
        "tpot_s": r.tpot_s,
        "ttft_s": r.ttft_s,
        "stall_s": r.stall_s,
        "misses": r.misses,
        "requests": r.requests,
    }


def _value(x: float | None) -> float:
    return float("inf") if x is None else x


def format_plan(plan: Plan) -> str:
    """The candidates side by side, the chosen one marked, and the lower bound (what ``plan`` prints)."""

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.3f}"

    rows = [
        f"{'':2}{'method':10}{'miss':20}{'prefetch':12}{'TPOT ms':>10}{'TTFT ms':>10}{'misses':>9}  budgets"
    ]
    for c in plan.candidates:
        chosen = (
            c["method"] == plan.method and c["miss"] == plan.miss and c["prefetch"] == plan.prefetch
            and (c["budgets"] is None) == (plan.budgets is None)
        )  # fmt: skip
        budgets = "shared" if c["budgets"] is None else "/".join(map(str, c["budgets"]))
        if "same_as" in c:
            budgets += f" (as {c['same_as']})"
        rows.append(
            f"{'* ' if chosen else '  '}{c['method']:10}{c['miss']:20}{c['prefetch']:12}{ms(c['tpot_s']):>10}"
            f"{ms(c['ttft_s']):>10}{c['misses']:>9}  {budgets}"
        )
    b = plan.lower_bound
    rows.append(
        f"  {'opt':10}{'fetch':20}{'none':12}{ms(b['tpot_s']):>10}{ms(b['ttft_s']):>10}{b['misses']:>9}  "
        "shared (lower bound of on-demand fetching)"
    )
    rows.append(
        f"chosen: {plan.describe()}" + (f"; lossy: {', '.join(plan.lossy)}" if plan.lossy else "; exact")
    )
    return "\n".join(rows)
