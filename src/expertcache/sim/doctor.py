"""``expertcache doctor``: can an expert cache help this model at this budget, and what to run.

From a routing trace, before any tuning:

- local routing consistency ("Not all models suit expert offloading"): SRP(m), the best F1 over a
  threshold of predicting a window's routing by one fixed set of experts (those used at least alpha*m
  times in its m tokens), and SCH(m, C), the hit rate of a cache holding each window's C most-used
  experts of a layer (an oracle that knows the window): per layer and overall;
- the knee of the policy's hit-rate curve (LRU by default; a per-layer cache of c experts, c in units of
  the active top-k);
- how predictable the next layers are: the accuracy of the predictors that run on a trace alone
  (MoE-Infinity's EAM, and the engine's recorded predictions when the trace holds them);
- OPT's and LRU's miss ratios at the budget;
- the planner's predicted TPOT against every expert resident and on-demand fetching under the policy
  given (LRU by default);
- for a batched trace (many users in one step: ``serve --record-trace``, ``trace batch``): the steps'
  shape, the token-weighted policy's miss ratio (``tlfu``) beside LRU's, and the ``batch`` miss path's
  miss work against the better of the two per-step references (``sim.bounds``);
- what budget the workload needs: the predicted TPOT (a request's own on a batched trace) at a ladder of
  budgets (``BUDGET_SHARES`` of all experts and the one given), each under the better of the paths the
  plan may use (and ``tlfu`` with ``batch`` on a batched trace), and the smallest budget within
  ``within`` (1.25x) of every expert resident;

and a verdict in words. Torch-free.
"""

from __future__ import annotations

import math
import re
import warnings

import numpy as np

from expertcache.cache.schedule import build_schedule
from expertcache.cache.tiers import HOST_LEVEL_UNUSED, level_experts
from expertcache.config import HostConfig
from expertcache.costs import UNPRICED_WORK, CostModel, as_cost
from expertcache.errors import ExpertcacheError, arguments_checked, option, warn_notes
from expertcache.paths import output_file
from expertcache.sim.bounds import step_bounds
from expertcache.sim.curves import run_policy
from expertcache.sim.planner import check_layout_policy, is_batched, layer_curves, make_plan, objective_key
from expertcache.sim.timing import host_level_of, run_timing, shared_runs, warm_runs
from expertcache.trace.stats import step_shape
from expertcache.trace.trace import Trace, as_trace
from expertcache.units import capped_capacity, one_capacity, whole_number

LOCAL_SRP = 0.40  # below: routing is not local (Qwen1.5-MoE ~0.31-0.38 at m=16, Mixtral ~0.49)
BUDGET_SHARES = (0.125, 0.25, 0.5, 0.75)  # the budgets timed beside the one given (and all resident)
WITHIN = 1.25  # a budget is enough when its predicted TPOT is within this of every expert resident


def window_counts(trace: Trace, m: int) -> np.ndarray:
    """Tokens routed to each expert in each window of ``m`` consecutive tokens of a sequence (a
    sequence's last, shorter window left out): int32 [W, L, E]. A sequence's tokens need not be
    contiguous in the trace: a batched or served trace interleaves its requests' tokens, each request's
    in its own order."""
    if m < 1:
        raise ExpertcacheError(f"the window must be at least 1 token, got {m}")
    seq = trace.seq_id if trace.seq_id is not None else np.zeros(trace.num_tokens, dtype=np.int64)
    order = np.argsort(seq, kind="stable")  # each sequence's tokens together, in their own order
    edges = np.flatnonzero(np.diff(seq[order])) + 1
    starts = []
    for lo, hi in zip(np.r_[0, edges], np.r_[edges, trace.num_tokens], strict=True):
        starts += range(int(lo), int(hi) - m + 1, m)
    if not starts:
        name = "the recorded trace" if str(trace.source).startswith("<") else f"trace {trace.source}"
        longest = int(np.diff(np.r_[0, edges, trace.num_tokens]).max()) if trace.num_tokens else 0
        raise ExpertcacheError(
            f"no sequence of {name} has {m} tokens (the longest has {longest}): give a smaller window "
            f"({option('--window-tokens', 'window_tokens')})"
        )
    L, E = trace.num_layers, trace.num_experts
    idx = order[np.asarray(starts)[:, None] + np.arange(m)[None, :]]  # [W, m] token indices
    ex = trace.experts[idx].astype(np.int64)  # [W, m, L, K]
    w = np.broadcast_to(np.arange(len(starts))[:, None, None, None], ex.shape)
    layer = np.broadcast_to(np.arange(L)[None, None, :, None], ex.shape)
    ok = ex >= 0
    flat = (w[ok] * L + layer[ok]) * E + ex[ok]
    return np.bincount(flat, minlength=len(starts) * L * E).reshape(len(starts), L, E).astype(np.int32)


def srp(counts: np.ndarray, m: int) -> dict[str, object]:
    """SRP(m) from window counts: per layer and overall, the best F1 over thresholds t = 1..m of the
    set {experts used >= t times} held for the whole window against each token's routing."""
    total = counts.sum(axis=(0, 2)).astype(np.float64)  # activations per layer
    best_f1, best_t = np.zeros(counts.shape[1]), np.zeros(counts.shape[1], dtype=np.int64)
    overall, overall_t = 0.0, 0
    for t in range(1, m + 1):
        chosen = counts >= t
        tp = (counts * chosen).sum(axis=(0, 2)).astype(np.float64)
        predicted = m * chosen.sum(axis=(0, 2)).astype(np.float64)
        f1 = np.divide(2 * tp, predicted + total, out=np.zeros_like(tp), where=(predicted + total) > 0)
        better = f1 > best_f1
        best_f1[better], best_t[better] = f1[better], t
        all_f1 = 2 * tp.sum() / (predicted.sum() + total.sum()) if predicted.sum() + total.sum() else 0.0
        if all_f1 > overall:
            overall, overall_t = float(all_f1), t
    return {
        "m": m,
        "srp": overall,
        "alpha": overall_t / m,
        # a layer without a known expert (the trace's -1 entries) has no SRP: None, printed "-"
        "per_layer": [None if n == 0 else f for f, n in zip(best_f1.tolist(), total.tolist(), strict=True)],
        "per_layer_alpha": [
            None if n == 0 else a for a, n in zip((best_t / m).tolist(), total.tolist(), strict=True)
        ],  # fmt: skip
    }


def sch(counts: np.ndarray, sizes: list[int]) -> dict[str, object]:
    """SCH(m, C): the hit rate of each layer's C most-used experts of every window, per layer and
    overall, for each C in ``sizes``."""
    ranked = -np.sort(-counts, axis=2)  # [W, L, E] descending
    top = np.cumsum(ranked, axis=2)  # top[..., c-1]: hits of the c most used
    total = counts.sum(axis=(0, 2)).astype(np.float64)
    per_layer = [(top[:, :, c - 1].sum(axis=0) / np.maximum(total, 1)).tolist() for c in sizes]
    overall = [float(top[:, :, c - 1].sum() / max(total.sum(), 1)) for c in sizes]
    return {"sizes": list(sizes), "sch": overall, "per_layer": per_layer}


def knee(xs: list[float], ys: list[float]) -> float | None:
    """The knee of an increasing, concave curve (Kneedle: the point farthest above the chord)."""
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    if len(x) < 3 or np.ptp(y) == 0:
        return None
    xn, yn = (x - x[0]) / np.ptp(x), (y - y[0]) / np.ptp(y)
    above = yn - xn
    if above.max() <= 0.05:  # never clearly above the chord: not concave, no knee (e.g. a cycle)
        return None
    return float(x[int(np.argmax(above))])


@arguments_checked
def diagnose(
    trace: Trace | str,
    capacity: int | str,
    cost: CostModel | dict | str | None = None,
    *,
    window_tokens: int = 16,
    policy: str = "lru",
    misses: tuple[str, ...] = ("fetch",),
    host: HostConfig | None = None,
    host_capacity: int | None = None,
    jobs: int = 1,
    within: float = WITHIN,
) -> dict[str, object]:
    """Everything ``expertcache doctor`` reports, as one JSON-ready dict (see the module). ``host`` and
    ``host_capacity``: a host level below the cache (``cache.tiers``), and which level bounds the step.
    ``trace`` is a ``Trace`` or its file, ``capacity`` experts or a share of all ("25%"). ``jobs``:
    worker processes for the timing model's runs, which do not depend on each other (the same report).
    ``within``: how close to every expert resident a budget's predicted TPOT must come for the report's
    ``budgets`` to call it enough (a factor above 1). ``expertcache doctor`` on a trace that holds its
    run's clock prices by default the step time the run spent beyond the model (``--step-time recorded``);
    here the cost model is taken as given, so the same report is
    ``diagnose(trace, capacity, dataclasses.replace(cost, step_s=recorded_step_s(trace, cost)[0]))``
    (``sim.timing.recorded_step_s``). ``doctor --concurrency N`` diagnoses the trace's requests served N at
    a time: ``diagnose(batch_requests(trace, N, batch_tokens=max(SERVE_BATCH_TOKENS, N)), capacity)``
    (``trace.batch``, ``config.SERVE_BATCH_TOKENS``). ``format_diagnosis(report)`` is the command's
    text."""
    with shared_runs():  # the on-demand run and the host levels' are among the plan's candidates
        return _diagnose(
            trace, capacity, cost, window_tokens, policy, misses, host, host_capacity, jobs, within
        )


def _diagnose(
    trace, capacity, cost, window_tokens, policy, misses, host, host_capacity, jobs, within
) -> dict[str, object]:
    trace = as_trace(trace, replay=True)
    capacity, capped = capped_capacity(
        one_capacity(capacity, trace.num_layers * trace.num_experts), trace.num_layers * trace.num_experts
    )
    warn_notes(capped)  # also in the report's notes; the command line prints them
    if isinstance(misses, str):
        misses = (misses,)
    cost = as_cost(cost, trace)
    # a CPU's costs, the engine's own work a miss at 0: checked against the server, 12.5 % named enough,
    unpriced = [n for n in [cost.unpriced_work(budget=True)] if n]  # served 1.86x (BENCHMARKS.md)
    warn_notes(unpriced)  # also in the report's notes; the command line prints them
    check_layout_policy(policy, "doctor draws the per-layer curves of, and plans with,")
    window_tokens = whole_number(window_tokens, option("--window-tokens", "window_tokens"))
    jobs = whole_number(jobs, option("--jobs", "jobs"))
    within = within_factor(within)
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    level = host_level_of(host, host_capacity, L * E, cost.expert_bytes, K, capacity)
    tiers = {}  # the host level, for the plan and the on-demand run too
    if level is not None:
        warn_notes(level[2])  # also in the report's notes; the command line prints them
        host, host_capacity, _ = level
        if host.exclusive or host.stage:
            raise ExpertcacheError(
                "doctor runs on demand and reports an inclusive and an exclusive host level both: give one "
                "without exclusive or stage"
            )
        tiers = {"host": HostConfig(None, host.policy), "host_capacity": host_capacity}
    free = CostModel.from_dict({"link_bandwidth": math.inf, "link_latency": 0.0}, cost)
    predictors = ("eam", "recorded") if trace.predicted is not None else ("eam",)
    shape = step_shape(trace)
    batched = is_batched(trace)  # steps of several requests (``shape`` is then a step shape)
    levels = [] if level is None else _level_runs(trace, capacity, host, host_capacity, K)
    ladder = _ladder(
        trace,
        capacity,
        cost,
        policy,
        misses,
        host if tiers else None,
        host_capacity if tiers else None,
        batched,
    )
    warm_runs(  # the runs below, side by side (each is then taken from the shared runs)
        [
            *ladder,
            *(dict(trace=trace, capacity=capacity, prefetch=name, cost=cost) for name in predictors),
            dict(trace=trace, capacity=L * E, cost=free),
            dict(trace=trace, capacity=capacity, cache=policy, cost=cost, **tiers),
            *(
                [dict(trace=trace, capacity=capacity, cache="tlfu", miss="batch", cost=cost)]
                if batched
                else []
            ),
            *(
                dict(trace=trace, capacity=capacity, cache=policy, cost=cost, host=cfg, host_capacity=n)
                for _, cfg, n in levels
                if n >= 1
            ),
        ],
        jobs,
    )
    counts = window_counts(trace, window_tokens)
    consistency = srp(counts, window_tokens)
    sizes = list(range(1, E + 1))
    hits = sch(counts, sizes)
    # the policy per layer at every size: its hit-rate curve, and its knee in units of the active experts
    curves = layer_curves(trace, policy).sum(axis=0)  # [L, E + 1], both phases
    schedule = build_schedule(trace, "layer")
    requests = schedule.num_requests  # an expert a step needs (a prefill step's tokens share them)
    per_size = {c: 1 - float(curves[:, c].sum()) / requests for c in range(K, E + 1)}
    knee_c = knee(list(per_size), list(per_size.values()))
    at = {name: run_policy(schedule, name, [capacity])[0] for name in ("lru", "opt")}
    predict = {}
    for name in predictors:
        r = run_timing(trace, capacity, prefetch=name, cost=cost)
        predict[name] = {"accuracy": r.cache.get("accuracy"), "goodpred": r.cache.get("goodpred")}
    hosts = {} if not tiers else {**tiers, "host_policies": (tiers["host"].policy,)}
    with warnings.catch_warnings():  # the plan's note on the costs is the report's own, said once
        warnings.filterwarnings("ignore", message=re.escape(UNPRICED_WORK))
        plan = make_plan(trace, capacity, cost, policy=policy, misses=misses, jobs=jobs, **hosts)
    resident = run_timing(trace, L * E, cost=free)
    on_demand = run_timing(trace, capacity, cache=policy, cost=cost, **tiers)
    saved = 1 - at["lru"].miss_ratio  # without a cache every request is a transfer
    report = {
        "trace": trace.source,
        "shape": {"layers": L, "experts": E, "top_k": K, "tokens": trace.num_tokens},
        "cost": cost.to_dict(),
        "capacity": capacity,
        "capacity_share": capacity / (L * E),
        "capacity_per_layer_in_active": capacity / (L * K),
        "consistency": consistency,
        "sch": hits,
        "policy": policy,
        "curve": {"sizes": list(per_size), "hit_ratio": list(per_size.values())},
        "knee_experts_per_layer": knee_c,
        "knee_in_active": None if knee_c is None else knee_c / K,
        "lru_miss_ratio": at["lru"].miss_ratio,
        "opt_miss_ratio": at["opt"].miss_ratio,
        "predictors": predict,
        "tpot_s": {  # on a batched trace a request's own, its mean time between its tokens (as plan's)
            "all_resident": _tpot(resident, batched),
            "on_demand": _tpot(on_demand, batched),  # under the policy given (lru by default), fetched
            "plan": plan.predicted[objective_key("tpot", batched)],
        },
        "tpot_of": "request" if batched else "step",
        "plan": plan.describe(),
        "plan_misses": list(misses),
        "transfer_saved_by_lru": saved,
        "batch": _batched(trace, shape, schedule, capacity, cost, at["lru"].miss_ratio) if batched else None,
        "levels": None
        if level is None
        else _levels(trace, capacity, cost, policy, host, host_capacity, K, levels, batched),
        "budgets": _budgets(ladder, capacity, L * E, resident, batched, within),
        "notes": capped + ([] if level is None else level[2]) + unpriced,  # the host level's size, as timing
    }
    report["verdict"] = verdict(report)
    return report


def within_factor(within: object) -> float:
    """``within`` checked: a finite number above 1 (how close to every expert resident is enough), or
    its text with an ``x`` (``"1.25x"``, as the report writes it)."""
    try:
        value = float(within.strip().removesuffix("x") if isinstance(within, str) else within)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(within, bool) or not math.isfinite(value) or value <= 1:
        raise ExpertcacheError(
            f"{option('--within', 'within')} must be a factor above 1 (1.25: within 1.25x of every expert "
            f"resident), got {within!r}"
        )
    return value


def _ladder(
    trace: Trace, capacity: int, cost, policy: str, misses, host, host_capacity, batched: bool
) -> list:
    """The timing runs of the budget ladder: each budget below all resident (``BUDGET_SHARES`` of the
    experts and the one given, at least a layer's top-k) under each path the plan may use on demand: the
    policy given with each miss path; ``tlfu`` with ``batch`` besides on a batched trace; over a host
    level, fetching (the one path it serves) over it inclusive and exclusive in the same memory, as the
    plan weighs both."""
    total = trace.num_layers * trace.num_experts
    caps = sorted(
        c for c in {max(trace.top_k, round(s * total)) for s in BUDGET_SHARES} | {capacity} if c < total
    )
    if host_capacity is not None:
        exclusive = level_experts(host_capacity, True, trace.top_k)
        levels = [(HostConfig(None, host.policy), host_capacity)]
        levels += [(HostConfig(None, host.policy, True), exclusive)] if exclusive >= 1 else []
        return [
            dict(trace=trace, capacity=c, cache=policy, miss="fetch", cost=cost, host=cfg, host_capacity=n)
            for c in caps
            for cfg, n in levels
        ]
    paths = [(policy, m) for m in dict.fromkeys(misses)]
    if batched:  # the batch path, with its background fills and without (on a link far slower than the
        # host the fills of a larger cache keep it busy, and later steps wait for them)
        paths += [p for p in (("tlfu", "batch"), ("tlfu", "batch:fill=0")) if p not in paths]
    return [dict(trace=trace, capacity=c, cache=p, miss=m, cost=cost) for c in caps for p, m in paths]


def _budgets(ladder: list, capacity: int, total: int, resident, batched: bool, within: float) -> dict:
    """The budget ladder's report: each budget's best predicted TPOT (a request's on a batched trace),
    tokens a second (every token of the trace, prompts too, as ``timing`` counts them) and path, against
    ``resident`` (the run with every expert resident); the smallest budget within ``within`` of it (None
    where none below all experts is); and the budgets no path could run at, with why (too small for it)."""
    best: dict[int, dict] = {}
    why: dict[int, str] = {}
    for args in ladder:
        c = args["capacity"]
        try:
            r = run_timing(**args)
        except ExpertcacheError as exc:
            why.setdefault(c, str(exc))
            continue
        tpot = _tpot(r, batched)
        level = args.get("host")
        if tpot is not None and (c not in best or tpot < best[c]["tpot_s"]):
            best[c] = {
                "capacity": c, "share": c / total, "tpot_s": tpot, "tokens_per_s": r.tokens_per_s,
                "policy": args["cache"], "miss": args["miss"],
                "host_level": None if level is None else "exclusive" if level.exclusive else "inclusive",
                "vs_resident": None, "given": c == capacity,
            }  # fmt: skip
    rows = [best[c] for c in sorted(best)]
    top = _tpot(resident, batched)
    rows.append({"capacity": total, "share": 1.0, "tpot_s": top, "tokens_per_s": resident.tokens_per_s,
                 "policy": None, "miss": None, "host_level": None, "vs_resident": None,
                 "given": capacity >= total})  # fmt: skip
    for row in rows:
        row["vs_resident"] = row["tpot_s"] / top if top and row["tpot_s"] is not None else None
    enough = next(
        (row for row in rows[:-1] if row["vs_resident"] is not None and row["vs_resident"] <= within), None
    )
    skipped = [
        {"capacity": c, "share": c / total, "given": c == capacity, "reason": reason}
        for c, reason in sorted(why.items())
        if c not in best
    ]
    return {"within": within, "rows": rows, "enough": enough, "skipped": skipped}


def _tpot(r, batched: bool) -> float | None:
    """A run's TPOT as the planner ranks by it: a request's own on a batched trace, else the decode step."""
    return (r.request_tpots or {}).get("mean_s") if batched else r.tpot_s


def _batched(
    trace: Trace, shape: dict, schedule, capacity: int, cost: CostModel, lru: float
) -> dict[str, object]:
    """A batched trace's steps (``shape``: its ``step_shape``), and what token weighting does for them."""
    tlfu = run_policy(schedule, "tlfu", [capacity])[0].miss_ratio
    best = float(step_bounds(trace, capacity, cost).best_s.sum())
    try:
        res = run_timing(trace, capacity, cache="tlfu", miss="batch", cost=cost)
    except ExpertcacheError as exc:  # a budget too small for its parts: said, the report goes on
        return {**shape, "lru_miss_ratio": lru, "tlfu_miss_ratio": tlfu, "batch_error": str(exc),
                "batch_miss_work_s": None, "best_reference_s": best, "batch_vs_best": None,
                "batch_tpot_s": None, "batch_ttft_s": None}  # fmt: skip
    work = res.link_busy_s + res.host_busy_s
    return {
        **shape,
        "lru_miss_ratio": lru,
        "tlfu_miss_ratio": tlfu,
        "batch_miss_work_s": work,
        "best_reference_s": best,
        "batch_vs_best": work / best if best else None,
        "batch_tpot_s": _tpot(res, True),
        "batch_ttft_s": res.ttft_s,
    }


def _level_runs(trace: Trace, capacity: int, host, host_capacity: int, top_k: int) -> list[tuple]:
    """(name, host level, its experts) of the inclusive level as given and its exclusive twin in the same
    memory (less its reserve for hits in flight, as the engine's: ``cache.tiers.exclusive_reserve``);
    none where every expert fits the cache (the host level is not used)."""
    if capacity >= trace.num_layers * trace.num_experts:
        return []
    return [
        ("inclusive", HostConfig(None, host.policy), host_capacity),
        ("exclusive", HostConfig(None, host.policy, True), level_experts(host_capacity, True, top_k)),
    ]


def _levels(
    trace: Trace,
    capacity: int,
    cost: CostModel,
    policy: str,
    host,
    host_capacity: int,
    top_k: int,
    runs,
    batched: bool = False,
) -> dict:
    """Three tiers: each level's misses and the time it keeps busy, on demand under ``policy``, for the
    levels of ``_level_runs``; the level that bounds the step is the busiest of the computation (the step
    less its stall), the link (its transfers, reads aside) and the disk (its reads), over the whole run."""
    out: dict[str, object] = {"host_capacity": host_capacity, "host_policy": host.policy}
    if not runs:  # as timing and generate say it
        return out | {"unused": HOST_LEVEL_UNUSED}
    for name, cfg, experts in runs:
        if experts < 1:  # its memory is all reserve for hits in flight
            out[name] = {
                "host_capacity": experts,
                "error": f"its {host_capacity} experts of memory are all kept for hits in flight, a layer's "
                f"top-{top_k}",
            }
            continue
        try:
            r = run_timing(trace, capacity, cache=policy, cost=cost, host=cfg, host_capacity=experts)
        except ExpertcacheError as exc:  # too small for an exclusive level under this policy
            out[name] = {"host_capacity": experts, "error": str(exc)}
            continue
        disk = float(r.cache["disk_read_s"])
        busy = {
            "compute": r.total_s - r.stall_s,
            "link": r.link_busy_s,  # reads aside
            "disk": disk,
        }
        out[name] = {
            "host_capacity": experts,
            "tpot_s": _tpot(r, batched), "device_misses": r.misses, "host_misses": r.cache["host_misses"],
            "host_miss_ratio": r.cache["host_miss_ratio"], "busy_s": busy, "total_s": r.total_s,
            "bound": max(busy, key=busy.get),
        }  # fmt: skip
    return out


def verdict(r: dict[str, object]) -> list[str]:
    """The diagnosis in a few sentences."""
    out = []
    srp_m, m = r["consistency"]["srp"], r["consistency"]["m"]
    lru, opt = r["lru_miss_ratio"], r["opt_miss_ratio"]
    share = r["capacity_share"]
    # LRU no better than the budget's share by chance (every expert fits: no chance)
    chance = share < 1 and 1 - lru <= min(share * 1.1, share + (1 - share) / 2)
    out.append(
        f"caching will save about {100 * (1 - lru):.0f} % of transfers at this budget ({100 * share:.0f} % "
        f"of the experts) with LRU; an oracle (OPT) would save {100 * (1 - opt):.0f} %"
    )
    if srp_m < LOCAL_SRP:
        out.append(
            f"this model's routing is not local (SRP({m}) = {srp_m:.3f} < {LOCAL_SRP:.2f}): a cache gains "
            "little beyond its share; prefer host compute ("
            + option("--miss host or hybrid", "miss='host' or 'hybrid'")
            + ") or a larger budget"
        )
    elif chance:  # local by SRP, yet LRU finds no reuse here: said as one thing (a trial read two verdicts)
        out.append(
            f"routing is local (SRP({m}) = {srp_m:.3f}), but not at this budget: the experts a step needs "
            "come back later than the cache keeps them"
            + (" (a step of several requests needs the union of theirs)" if r.get("batch") else "")
        )
    else:
        out.append(f"routing is local (SRP({m}) = {srp_m:.3f}): a cache can exploit it")
        per = r["consistency"]["per_layer"]
        # well below the rest (a layer without a known expert has no SRP to be below it)
        low = [i for i, x in enumerate(per) if x is not None and x < LOCAL_SRP and x < 0.8 * srp_m]
        if low:
            shown = ", ".join(f"{i} ({per[i]:.2f})" for i in low[:8]) + (" ..." if len(low) > 8 else "")
            out.append(
                f"but not in layer(s) {shown}: there a cache gains little; per-layer budgets "
                f"({option('expertcache plan', 'make_plan')}) can give those layers less"
            )
    if chance:
        out.append(
            "LRU hits no more than the budget's share of experts would by chance: the cache is not finding "
            "reuse at this budget"
        )
    if r["knee_in_active"] is None:
        out.append("the hit-rate curve has no knee: it does not bend before the cache holds the layer")
    else:
        out.append(
            f"the hit-rate curve bends at about {r['knee_in_active']:.1f}x the active experts per layer "
            f"({r['knee_experts_per_layer']:.0f} of {r['shape']['experts']}); this budget gives "
            f"{r['capacity_per_layer_in_active']:.1f}x"
        )
    b = r.get("batch")
    if b is not None and b.get("batch_error"):
        out.append(
            f"a step serves {b['mean_step_tokens']:.1f} tokens on average and needs "
            f"{b['mean_step_experts']:.1f} of {r['shape']['experts']} experts a layer: LRU misses "
            f"{100 * b['lru_miss_ratio']:.0f} % of them, token-weighted frequency (tlfu) "
            f"{100 * b['tlfu_miss_ratio']:.0f} %; the batch miss path cannot run at this budget "
            f"({b['batch_error']})"
        )
    elif b is not None and b["batch_vs_best"] is None:  # every expert fits: nothing misses, nothing to split
        out.append(
            f"a step serves {b['mean_step_tokens']:.1f} tokens on average and needs "
            f"{b['mean_step_experts']:.1f} of {r['shape']['experts']} experts a layer; at this budget every "
            "expert stays in the cache after its first use, so no step waits for a transfer beyond those"
        )
    elif b is not None:
        weighed = {m.split(":")[0] for m in r.get("plan_misses", ())}
        advice = (
            ""
            if {"batch", "host"} <= weighed
            else "; give the plan the paths to weigh with "
            + option(
                "--policy tlfu --miss fetch --miss batch --miss host (here or in plan, the same trace and "
                "--concurrency)",
                "policy='tlfu', misses=('fetch', 'batch', 'host') (here or in make_plan, on the same trace)",
            )
        )
        out.append(
            f"a step serves {b['mean_step_tokens']:.1f} tokens on average and needs "
            f"{b['mean_step_experts']:.1f} of {r['shape']['experts']} experts a layer: LRU misses "
            f"{100 * b['lru_miss_ratio']:.0f} % of them, token-weighted frequency (tlfu) "
            f"{100 * b['tlfu_miss_ratio']:.0f} %; "
            + option("--miss batch --policy tlfu", "miss path batch under policy tlfu")
            + " moves and computes misses in "
            f"{b['batch_vs_best']:.2f}x the better per-step reference (TPOT {1e3 * b['batch_tpot_s']:.3f} ms"
            + (
                ", without the host level: it serves the fetch miss path only, so batch means giving it up)"
                if r.get("levels") is not None
                else ")" + advice
            )
        )
    own_tpot = "a request's TPOT" if r.get("tpot_of") == "request" else "TPOT"
    lv = r.get("levels")
    if lv is not None and "unused" in lv:
        out.append(lv["unused"])
    elif lv is not None:
        inc, exc = lv["inclusive"], lv["exclusive"]
        busy = ", ".join(f"{k} {v:.3f} s" for k, v in inc["busy_s"].items())
        out.append(
            f"with a host level of {lv['host_capacity']} experts ({lv['host_policy']}): the disk serves "
            f"{100 * inc['host_miss_ratio']:.0f} % of the cache's misses; the run keeps busy {busy} of "
            f"{inc['total_s']:.3f} s: bound by the {inc['bound']}; "
            + (
                f"an exclusive host level in the same memory ({exc['host_capacity']} experts, "
                + option("--host-exclusive", "HostConfig(exclusive=True)")
                + f") would read {exc['host_misses']} experts from the disk instead of "
                f"{inc['host_misses']} ({own_tpot} {1e3 * exc['tpot_s']:.3f} against "
                f"{1e3 * inc['tpot_s']:.3f} ms)"
                if "error" not in exc
                else f"an exclusive host level does not fit that memory ({exc['error']})"
            )
            + f"; under {lv['host_policy']} only ("
            + option("--host-policy", "HostConfig(policy=...)")
            + "), where "
            + option("`plan`", "make_plan")
            + " compares other host policies too"
        )
    bud = r.get("budgets")
    resident = None if bud is None else bud["rows"][-1]["tpot_s"]
    if resident:
        e, within = bud["enough"], bud["within"]
        goal = f"{own_tpot} within {within:g}x of all resident ({1e3 * resident:.3f} ms)"
        if e is not None:
            at = f"{e['capacity']}; {_path(e)}: {1e3 * e['tpot_s']:.3f} ms"
            said = f"{_share(e['share'])} of the experts ({at}) brings {goal}"
        else:
            said = f"no budget below all experts brings {goal}"
        rungs = [
            f"{_share(row['share'])} {_factor(row['vs_resident'])} {_path(row)}"
            + (" (this budget)" if row["given"] else "")
            for row in bud["rows"][:-1]
        ] + (["100 % (this budget)"] if bud["rows"][-1]["given"] else [])
        left = [
            f"{_share(x['share'])}{' (this budget)' if x['given'] else ''}: {x['reason']}"
            for x in bud["skipped"]
        ]
        out.append(
            f"budget for this workload: {said}"
            + (f"; by budget, against all resident: {', '.join(rungs)}" if rungs else "")
            + (f"; not timed: {'; '.join(left)}" if left else "")
        )
    t = r["tpot_s"]
    over = (  # the level as given (doctor takes no exclusive one; its twin is compared above)
        f" over the inclusive host level ({lv['host_capacity']} experts)"
        if lv is not None and "unused" not in lv
        else ""
    )
    if t["on_demand"] and t["plan"] and t["all_resident"]:
        named = "LRU" if r["policy"] == "lru" else r["policy"]
        own = " (a request's, between its tokens)" if r.get("tpot_of") == "request" else ""
        out.append(
            f"predicted TPOT{own}: {1e3 * t['plan']:.3f} ms with the plan ({r['plan']}), "
            f"{1e3 * t['on_demand']:.3f} ms on-demand {named}{over}, "
            f"{1e3 * t['all_resident']:.3f} ms all resident"
        )
    return out


def _path(row: dict) -> str:
    """A ladder row's path: ``tlfu/batch``, ``lru/fetch``, ``lru/fetch over an exclusive host level``."""
    level = row.get("host_level")
    return f"{row['policy']}/{row['miss']}" + (f" over an {level} host level" if level else "")


def _factor(x: float | None) -> str:
    """A TPOT against all resident, with the digits a threshold like 1.04 needs to be read against it."""
    return "-" if x is None else f"{x:.3f}x" if x < 10 else f"{x:.1f}x"


def _share(x: float) -> str:
    return f"{100 * x:.1f}".rstrip("0").rstrip(".") + " %"


def format_diagnosis(r: dict[str, object]) -> str:
    c, s = r["consistency"], r["sch"]
    sh = r["shape"]
    K = sh["top_k"]
    picks = [x for x in (K, 2 * K, 4 * K) if x <= sh["experts"]]
    sch_txt = ", ".join(f"C={x}: {s['sch'][s['sizes'].index(x)]:.2f}" for x in picks)
    pred = ", ".join(
        f"{k} {v['accuracy']:.2f}" for k, v in r["predictors"].items() if v["accuracy"] is not None
    )
    head = f"{r['trace']}: {sh['tokens']} tokens, {sh['layers']} layers x {sh['experts']} experts, top-{K}"
    lines = [
        f"trace        {head}",
        f"cost         {CostModel.from_dict(r['cost']).describe()}",
        f"budget       {r['capacity']} experts ({_share(r['capacity_share'])}), "
        f"{r['capacity_per_layer_in_active']:.1f}x the active per layer",
        f"{'SRP(' + str(c['m']) + ')':13}{c['srp']:.3f} (alpha {c['alpha']:.2f}); per layer "
        + " ".join("-" if x is None else f"{x:.2f}" for x in c["per_layer"]),
        f"{'SCH(' + str(c['m']) + ', C)':13}{sch_txt}",
        f"miss ratio   LRU {r['lru_miss_ratio']:.3f} | OPT {r['opt_miss_ratio']:.3f}",
        f"predictors   accuracy {pred or '-'}",
        "verdict",
        *(f"  - {v}" for v in r["verdict"]),
    ]
    return "\n".join(lines)


def plot_diagnosis(r: dict[str, object], path: str) -> None:
    """Hit rate against the per-layer cache size: LRU's curve and SCH(m, C), the knee marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K = r["shape"]["top_k"]
    fig, ax = plt.subplots(figsize=(6, 4))
    lc = r["curve"]
    ax.plot(
        [c / K for c in lc["sizes"]], lc["hit_ratio"], marker="o", ms=3, label=f"{r['policy']} (per layer)"
    )
    s = r["sch"]
    ax.plot(
        [c / K for c in s["sizes"]],
        s["sch"],
        ls="--",
        label=f"SCH({r['consistency']['m']}, C): each window's C most used",
    )
    if r["knee_in_active"] is not None:
        ax.axvline(r["knee_in_active"], color="grey", lw=0.8, label="knee")
    ax.axvline(r["capacity_per_layer_in_active"], color="black", lw=1, ls=":", label="this budget")
    ax.set_xlabel("cache per layer, in active experts (top-k)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title(str(r["trace"]).split("/")[-1])
    fig.tight_layout()
    try:
        with output_file(path, "plot") as target:
            fig.savefig(target, dpi=120)
    except (OSError, ValueError) as e:  # as plot_curves: one line, not matplotlib's traceback
        raise ExpertcacheError(f"{path}: cannot write plot ({e})") from None
    finally:
        plt.close(fig)


__all__ = ["diagnose", "format_diagnosis", "knee", "plot_diagnosis", "sch", "srp", "window_counts"]
