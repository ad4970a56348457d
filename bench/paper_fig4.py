"""The LLRU paper, Fig. 4 and Fig. 5 on a real trace: misses against cache size for OPT and online policies.

Fig. 4: misses of each policy for capacities from 1 (top-k in layer order) to L*E, in two orders:

- ``rounds``: the paper's conversion of top-k routing into K rounds per token (one page per layer per
  round), as in the paper's own figures;
- ``layer``: what the engine does: one forward step per decode token or per request prompt (prefill),
  the distinct experts of a layer served as one group, pinned together.

Capacities: a few small ones, then every ``--step`` experts up to L*E; "-dist" policies need capacity
>= L in rounds order and >= L * top-k in layer order (each layer must hold a token's experts of it).
OPT and LRU are stack algorithms: their curves at every capacity >= the largest group come from one
pass each (kept in the JSON as ``dense``).

Fig. 5-like summary: misses normalised by OPT at fixed capacities (default 240 and 480 of 1440, the
constrained regime like the paper's Llama-MoE case, and 1152 = 80%, "almost fits" like its Mixtral
case), Marking over ``--seeds`` seeds; once on the whole trace and once per request (each request of
the trace as its own trace, the closest we have to the paper's ten traces).

Every option is checked before any work (the trace's top-k against the summary capacities once it is
read), a bad one refused in one line (exit 2).

    .venv/bin/python bench/paper_fig4.py
    .venv/bin/python bench/paper_fig4.py --orders rounds --step 48
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from provenance import SHARED, OneLineParser, at_least, fail, figure_args, provenance, write_json  # noqa: E402

from expertcache.cache.schedule import Schedule, min_room  # noqa: E402
from expertcache.errors import ExpertcacheError  # noqa: E402
from expertcache.policy.registry import is_offline, parse_policy  # noqa: E402
from expertcache.sim import build_schedule, run_policy  # noqa: E402
from expertcache.trace import Trace, load_trace  # noqa: E402

PROG = Path(__file__).name
DEFAULT_TRACE = str(SHARED / "traces" / "qwen15_moe_a27b_chat.npz")
CURVE_POLICIES = ["opt", "lru", "lru-dist", "marking", "llru", "lfu", "lcp"]
SUMMARY_POLICIES = ["marking", "lru", "lru-dist", "llru", "lfu", "lcp", "opt-dist"]
STYLE = {
    "opt": {"color": "black", "linewidth": 2.0},
    "lru": {"color": "tab:orange"},
    "lru-dist": {"color": "tab:purple", "linestyle": "--"},
    "marking": {"color": "tab:green"},
    "llru": {"color": "tab:red", "linewidth": 1.8},
    "lfu": {"color": "tab:brown", "linestyle": ":"},
    "lcp": {"color": "tab:cyan", "linestyle": "-."},
    "opt-dist": {"color": "0.4", "linestyle": "--"},
}


def is_dist(name: str) -> bool:
    return name.partition(":")[0].endswith("-dist")  # a spec's parameters (lcp-dist:rho=0.5) aside


def is_randomized(name: str) -> bool:
    return name.partition(":")[0].split("-")[0] in ("marking", "random")


def capacities(schedule: Schedule, step: int, small: list[int]) -> list[int]:
    """Small capacities from the lowest legal one, then every ``step`` experts, then L*E."""
    low = schedule.top_k if schedule.order == "layer" else 1
    top = schedule.num_layers * schedule.num_experts
    caps = {c for c in small if low <= c < step} | {low} | set(range(step, top + 1, step)) | {top}
    return sorted(caps)


def dist_min(schedule: Schedule) -> int:
    """Smallest capacity a uniform "-dist" split accepts: every layer needs room for a token's experts
    of that layer (1 in rounds / flat order, top-k in layer order)."""
    return schedule.num_layers * schedule.min_room


def curves(schedule: Schedule, policies: list[str], caps: list[int], jobs: int) -> dict[str, object]:
    """Misses of each policy at each capacity (seed 0), with the time each policy took."""
    out: dict[str, object] = {}
    for name in policies:
        t0 = time.perf_counter()
        pc = [c for c in caps if not is_dist(name) or c >= dist_min(schedule)]
        res = run_policy(schedule, name, pc, seed=0, jobs=jobs)
        out[name] = {
            "capacities": pc,
            "misses": [r.misses for r in res],
            "seconds": round(time.perf_counter() - t0, 2),
        }
    return out


def dense_stack_curves(schedule: Schedule) -> dict[str, object]:
    """OPT and LRU at every capacity from the largest group to L*E (one stack pass each)."""
    caps = list(range(max(schedule.max_group, 1), schedule.num_layers * schedule.num_experts + 1))
    return {
        "capacities": caps,
        "opt": [r.misses for r in run_policy(schedule, "opt", caps)],
        "lru": [r.misses for r in run_policy(schedule, "lru", caps)],
    }


def curve_stats(cur: dict[str, object]) -> dict[str, object]:
    """Per policy: the largest ratio to OPT on the grid and where, and how often misses rise with capacity."""
    opt = dict(zip(cur["opt"]["capacities"], cur["opt"]["misses"], strict=True))
    stats = {}
    for name, c in cur.items():
        ratios = [m / opt[k] for k, m in zip(c["capacities"], c["misses"], strict=True)]
        i = int(np.argmax(ratios))
        rises = int(np.sum(np.diff(c["misses"]) > 0))
        stats[name] = {"max_ratio": round(ratios[i], 4), "at_capacity": c["capacities"][i], "rises": rises}
    return stats


def sub_trace(trace: Trace, mask: np.ndarray) -> Trace:
    """The tokens of ``mask`` as a trace of their own (one request of a multi-request trace)."""

    def pick(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[mask]

    return Trace(
        trace.experts[mask],
        trace.num_experts,
        weights=pick(trace.weights),
        seq_id=pick(trace.seq_id),
        is_prefill=pick(trace.is_prefill),
        token_id=pick(trace.token_id),
        source=f"{trace.source}[request]",
    )


def normalized(schedule: Schedule, cap: int, policies: list[str], seeds: int) -> dict[str, object]:
    """Misses / OPT at one capacity; randomized policies over ``seeds`` seeds (with phase split)."""
    opt = run_policy(schedule, "opt", [cap])[0]
    out: dict[str, object] = {
        "opt": {"misses": opt.misses, "requests": opt.requests, "phases": opt.to_dict()["phases"]}
    }
    for name in policies:
        if is_dist(name) and cap < dist_min(schedule):
            continue
        runs = [
            run_policy(schedule, name, [cap], seed=s)[0]
            for s in (range(seeds) if is_randomized(name) else [0])
        ]
        ratios = [r.misses / opt.misses for r in runs]
        out[name] = {
            "misses": [r.misses for r in runs],
            "ratio": {
                "mean": float(np.mean(ratios)),
                "min": float(np.min(ratios)),
                "max": float(np.max(ratios)),
            },
            "phases": runs[0].to_dict()["phases"],
        }
    return out


def summary(trace: Trace, orders: list[str], caps: list[int], policies: list[str], seeds: int) -> dict:
    out: dict[str, object] = {}
    requests = sorted(set(trace.seq_id.tolist())) if trace.seq_id is not None else []
    subs = [sub_trace(trace, trace.seq_id == r) for r in requests] if len(requests) > 1 else []
    for order in orders:
        schedule = build_schedule(trace, order)
        sub_schedules = [build_schedule(s, order) for s in subs]
        for cap in caps:
            whole = normalized(schedule, cap, policies, seeds)
            per_request = [normalized(s, cap, policies, seeds) for s in sub_schedules]
            out[f"{order}@{cap}"] = {
                "order": order,
                "capacity": cap,
                "whole_trace": whole,
                "per_request": {
                    name: [pr[name]["ratio"]["mean"] for pr in per_request]
                    for name in policies
                    if per_request and name in per_request[0]
                },
                "per_request_opt_misses": [pr["opt"]["misses"] for pr in per_request],
            }
    return out


def plot_curves(
    order: str, cur: dict, dense: dict, schedule: Schedule, marks: list[int], path: Path, title: str
) -> None:
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    opt = dict(zip(cur["opt"]["capacities"], cur["opt"]["misses"], strict=True))
    for name, c in cur.items():
        style = STYLE.get(name, {})
        ax.plot(c["capacities"], c["misses"], label=name.upper() if name != "opt" else "OPT", **style)
        ratio = [m / opt[k] for k, m in zip(c["capacities"], c["misses"], strict=True)]
        bx.plot(c["capacities"], ratio, label=name.upper() if name != "opt" else "OPT", **style)
    dc = dense["capacities"]
    dr = np.asarray(dense["lru"]) / np.asarray(dense["opt"])
    bx.plot(dc, dr, color="tab:orange", linewidth=0.5, alpha=0.5, label="LRU, every capacity")
    for a in (ax, bx):
        for m in marks:
            a.axvline(m, color="0.6", linewidth=0.8, linestyle=":")
        a.set_xlabel("Cache size k (experts)")
        a.grid(alpha=0.3)
        a.set_xlim(0, schedule.num_layers * schedule.num_experts)
    ax.set_ylabel("Faults (misses)")
    bx.set_ylabel("Faults / OPT faults")
    ax.set_title(f"Misses, {order} order ({schedule.num_requests} requests)", fontsize=10)
    bx.set_title("Normalised by OPT (thin orange: LRU at every capacity; dotted: summary k)", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def plot_summary(summ: dict, policies: list[str], path: Path, seeds: int) -> None:
    """Online policies only (OPT-Dist, an offline bound, would squash the scale; it is in the JSON)."""
    policies = [p for p in policies if not is_offline(parse_policy(p)[0])]
    keys = list(summ)
    ncols = len({s["capacity"] for s in summ.values()})  # one row per order, one column per capacity
    nrows = -(-len(keys) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.0 * ncols, 4.0 * nrows), squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys, strict=False):
        s = summ[key]
        names = [p for p in policies if p in s["whole_trace"]]
        data = [s["per_request"].get(p, []) for p in names]
        if any(data):
            ax.boxplot(data, tick_labels=[p.upper() for p in names], widths=0.5, showfliers=True)
        for i, p in enumerate(names, start=1):
            r = s["whole_trace"][p]["ratio"]
            ax.errorbar(
                i,
                r["mean"],
                yerr=[[r["mean"] - r["min"]], [r["max"] - r["mean"]]],
                fmt="D",
                color="tab:red",
                markersize=5,
                capsize=3,
                label="whole trace" if i == 1 else None,
            )
        ax.set_xticks(range(1, len(names) + 1), [p.upper() for p in names], fontsize=8)
        ax.set_title(f"{s['order']} order, k={s['capacity']}", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    for row in axes:
        row[0].set_ylabel("Faults / OPT faults")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(
        f"Normalised faults: boxes = the trace's requests as separate traces; red = whole trace "
        f"(Marking: mean, min..max over {seeds} seeds)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, each checked before any work (bad: one line, exit 2); the folders made."""
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    one = at_least(1)
    p.add_argument("--trace", default=DEFAULT_TRACE, help="routing trace (.npz)")
    p.add_argument("--orders", nargs="+", default=["rounds", "layer"], choices=["rounds", "layer", "flat"])
    p.add_argument("--policies", nargs="+", default=CURVE_POLICIES, help="policies of the Fig. 4 curves")
    p.add_argument("--step", type=one, default=24, help="capacity step of the grid (default: L of the trace)")
    p.add_argument("--small", type=one, nargs="*", default=[1, 2, 3, 4, 6, 8, 12, 16, 20])
    p.add_argument("--summary-caps", type=one, nargs="+", default=[240, 480, 1152])
    p.add_argument("--summary-policies", nargs="+", default=SUMMARY_POLICIES)
    p.add_argument("--seeds", type=one, default=10, help="seeds of randomized policies in the summary")
    p.add_argument("--jobs", type=one, default=1, help="processes for the replays of one policy's curve")
    args = figure_args(p, argv, "fig4.json", check)  # a shrunk run's figures go elsewhere, said
    folder("--out", args.out, "fig4.json")
    folder("--img", args.img, *(f"fig4_{o}.png" for o in args.orders), "fig5_normalized.png")
    return args


def check(args: argparse.Namespace) -> None:
    """The policies, the trace and the summary capacities (against its top-k), before any work."""
    for flag, specs in (("--policies", args.policies), ("--summary-policies", args.summary_policies)):
        for spec in specs:
            try:
                parse_policy(spec)
            except ExpertcacheError as exc:
                fail(PROG, f"{flag}: {exc}")
    if "opt" not in args.policies:
        fail(PROG, "--policies: give opt among them (the curves are compared with OPT's)")
    if args.trace == DEFAULT_TRACE and not Path(args.trace).is_file():
        fail(PROG, "the shared Qwen1.5-MoE trace is not beside this checkout (../shared/traces/); give "
             "--trace FILE")  # fmt: skip
    try:
        K = load_trace(args.trace).top_k  # read again by main (a fraction of a second)
    except ExpertcacheError as exc:
        fail(PROG, f"--trace: {exc}")
    for order in args.orders:  # in layer order a token's experts of a layer are resident together
        low = [c for c in args.summary_caps if c < min_room(order, K)]
        if low:
            fail(PROG, f"--summary-caps {low[0]}: below top-k {K} of the trace, the least a capacity is in "
                 f"{order} order (a token's experts of a layer are resident together)")  # fmt: skip


def folder(flag: str, path: Path, *files: str) -> None:
    """Make the folder ``path`` (of the option ``flag``) now and check that ``files`` can be written in it:
    refused in one line before the work, not when the results are written after it."""
    if path.exists() and not path.is_dir():
        fail(PROG, f"{flag} {path}: not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(PROG, f"{flag} {path}: cannot make the folder ({exc.strerror or exc})")
    blocked = [f for f in files if (path / f).exists() and not os.access(path / f, os.W_OK)]
    if not os.access(path, os.W_OK) or blocked:
        fail(PROG, f"{flag} {path / blocked[0] if blocked else path}: not writable")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start, cpu_start = time.perf_counter(), time.process_time()
    trace = load_trace(args.trace)
    L, E, K, T = trace.num_layers, trace.num_experts, trace.top_k, trace.num_tokens
    model = str(trace.meta.get("model", Path(args.trace).stem)).split(",")[0]
    print(f"trace {args.trace}: {model}; T={T} tokens, L={L}, E={E}, K={K}")
    result: dict[str, object] = {
        "figure": "the LLRU paper Fig. 4 (misses vs capacity) and Fig. 5 (normalised by OPT)",
        **provenance(),
        "trace": {
            "path": str(args.trace),
            "model": model,
            "tokens": T,
            "layers": L,
            "experts": E,
            "top_k": K,
        },
        "orders": {},
    }
    table_caps = sorted({K, 24, 96, 240, 480, 720, 960, 1200, L * E} | set(args.summary_caps))
    for order in args.orders:
        t0 = time.perf_counter()
        schedule = build_schedule(trace, order)
        caps = capacities(schedule, args.step, args.small)
        cur = curves(schedule, args.policies, caps, args.jobs)
        dense = dense_stack_curves(schedule)
        stats = curve_stats(cur)
        seconds = time.perf_counter() - t0
        result["orders"][order] = {
            "requests": schedule.num_requests,
            "rounds": schedule.num_rounds,
            "max_group": schedule.max_group,
            "dist_min_capacity": dist_min(schedule),
            "capacities": caps,
            "curves": cur,
            "dense": dense,
            "stats": stats,
            "seconds": round(seconds, 1),
        }
        print(
            f"\n{order} order: {schedule.num_requests} requests, {schedule.num_rounds} rounds, "
            f"largest group {schedule.max_group}; {len(caps)} capacities, {seconds:.1f} s"
        )
        shown = [c for c in table_caps if c in caps]
        print(
            f"{'misses':<10}" + "".join(f"{c:>8}" for c in shown) + f"{'max/OPT':>10}{'at k':>6}{'rises':>6}"
        )
        for name, c in cur.items():
            m = dict(zip(c["capacities"], c["misses"], strict=True))
            row = "".join(f"{m[k]:>8}" if k in m else f"{'-':>8}" for k in shown)
            s = stats[name]
            print(f"{name:<10}{row}{s['max_ratio']:>10.3f}{s['at_capacity']:>6}{s['rises']:>6}")
        title = f"{model}: T={T} tokens, L={L}, E={E}, top-{K}; {order} order"
        plot_curves(order, cur, dense, schedule, args.summary_caps, args.img / f"fig4_{order}.png", title)

    t0 = time.perf_counter()
    summ = summary(trace, args.orders, args.summary_caps, args.summary_policies, args.seeds)
    result["summary"] = summ
    t_summary = time.perf_counter() - t0
    print(
        f"\nFig. 5-like: misses / OPT ({args.seeds} seeds for randomized policies; per-request = the "
        f"{len(set(trace.seq_id.tolist())) if trace.seq_id is not None else 0} requests as separate traces, "
        f"median [min, max]; {t_summary:.1f} s)"
    )
    for key, s in summ.items():
        print(f"{key}: OPT {s['whole_trace']['opt']['misses']} misses")
        for name in args.summary_policies:
            if name not in s["whole_trace"]:
                continue
            r = s["whole_trace"][name]["ratio"]
            pr = s["per_request"].get(name, [])
            prs = f"{np.median(pr):.3f} [{min(pr):.3f}, {max(pr):.3f}]" if pr else "-"
            rng = f" [{r['min']:.3f}, {r['max']:.3f}]" if r["min"] != r["max"] else ""
            print(f"  {name:<10} whole {r['mean']:.3f}{rng:<16} per-request {prs}")
    plot_summary(summ, args.summary_policies, args.img / "fig5_normalized.png", args.seeds)

    runtime, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    result["runtime_s"] = {"total": round(runtime, 1), "cpu": round(cpu, 1), "summary": round(t_summary, 1)}
    path = args.out / "fig4.json"
    write_json(path, result)
    imgs = ", ".join(str(args.img / f"fig4_{o}.png") for o in args.orders)
    print(f"\nwrote {path}, {imgs}, {args.img / 'fig5_normalized.png'}")
    print(f"running time {runtime:.1f} s (CPU {cpu:.1f} s)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ExpertcacheError as e:  # bad input: one line, as the command line says it
        fail(PROG, str(e))
