"""The LLRU paper, Fig. 6: OPT-Dist (a fixed per-layer split of the cache) against OPT on Zipf traces.

(a) Zipf a (default 2, b = 0), cache k (default 16), a grid of n experts per layer x l layers: the fault
    ratio OPT-Dist / OPT per cell (mean over seeds). Cells with k < l cannot give every layer a slot, so
    OPT-Dist does not exist there.
(b) l = 32, n = 8, k = 64: the ratio against the Zipf parameter a (mean, min, max over seeds).
(c) A trace-length check: the ratio at a few a for several trace lengths, to show which values are
    stable and which depend on how long the trace is.

The paper's model serves one page per layer per round, so traces have K = 1 and are replayed in "flat"
order (identical to "rounds" for K = 1). OPT-Dist uses the library's uniform budgets: k // l slots per
layer and the first k % l layers one more (``--budgets floor`` gives every layer k // l, the paper's k/l).

    .venv/bin/python bench/paper_fig6.py                 # defaults: 5000 tokens, 3 / 5 seeds
    .venv/bin/python bench/paper_fig6.py --tokens 2000 --no-length-check
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from provenance import figure_args, provenance, write_json  # noqa: E402

from expertcache.errors import ExpertcacheError  # noqa: E402
from expertcache.sim import build_schedule, replay  # noqa: E402
from expertcache.trace import synthesize  # noqa: E402


@functools.cache
def opt_ratio(
    layers: int, experts: int, k: int, a: float, b: float, tokens: int, seed: int, budgets: str
) -> dict[str, float]:
    """Misses of OPT and OPT-Dist at capacity k on one K = 1 Zipf trace, and their ratio."""
    trace = synthesize("zipf", tokens=tokens, layers=layers, experts=experts, top_k=1, a=a, b=b, seed=seed)
    schedule = build_schedule(trace, "flat")
    opt = replay(schedule, "opt", k).misses  # one capacity: a replay is faster than the stack pass
    params = {"budgets": [k // layers] * layers} if budgets == "floor" else {}
    dist = replay(schedule, "opt-dist", k, seed, **params).misses
    return {"opt": opt, "opt_dist": dist, "ratio": dist / opt}


def summarize(ratios: list[float]) -> dict[str, float]:
    return {"mean": float(np.mean(ratios)), "min": float(np.min(ratios)), "max": float(np.max(ratios))}


def run_grid(args: argparse.Namespace) -> dict[str, object]:
    ns = list(range(args.grid_n[0], args.grid_n[1] + 1))
    ls = list(range(args.grid_l[0], args.grid_l[1] + 1))
    mean = np.full((len(ns), len(ls)), np.nan)
    lo, hi = mean.copy(), mean.copy()
    cells = []
    for i, n in enumerate(ns):
        for j, layers in enumerate(ls):
            cell: dict[str, object] = {
                "n": n,
                "l": layers,
                "everything_fits": n * layers <= args.grid_k,
                "possible": args.grid_k >= layers,
            }
            if args.grid_k >= layers:
                runs = [
                    opt_ratio(layers, n, args.grid_k, args.grid_a, args.b, args.tokens, s, args.budgets)
                    for s in range(args.grid_seeds)
                ]
                stats = summarize([r["ratio"] for r in runs])
                mean[i, j], lo[i, j], hi[i, j] = stats["mean"], stats["min"], stats["max"]
                cell.update(ratio=stats, runs=runs)
            cells.append(cell)
    return {
        "a": args.grid_a,
        "b": args.b,
        "k": args.grid_k,
        "n_values": ns,
        "l_values": ls,
        "seeds": list(range(args.grid_seeds)),
        "ratio_mean": [[None if np.isnan(v) else round(float(v), 4) for v in row] for row in mean],
        "ratio_min": [[None if np.isnan(v) else round(float(v), 4) for v in row] for row in lo],
        "ratio_max": [[None if np.isnan(v) else round(float(v), 4) for v in row] for row in hi],
        "cells": cells,
    }


def run_sweep(args: argparse.Namespace) -> dict[str, object]:
    a_values = [round(float(a), 6) for a in np.arange(0.0, args.a_max + 1e-9, args.a_step)]
    points = []
    for a in a_values:
        runs = [
            opt_ratio(args.sweep_l, args.sweep_n, args.sweep_k, a, args.b, args.tokens, s, args.budgets)
            for s in range(args.seeds)
        ]
        points.append({"a": a, "ratio": summarize([r["ratio"] for r in runs]), "runs": runs})
    return {
        "l": args.sweep_l,
        "n": args.sweep_n,
        "k": args.sweep_k,
        "b": args.b,
        "seeds": list(range(args.seeds)),
        "points": points,
    }


def run_length_check(args: argparse.Namespace) -> dict[str, object]:
    rows = []
    for a in args.check_a:
        for tokens in args.check_tokens:
            runs = [
                opt_ratio(args.sweep_l, args.sweep_n, args.sweep_k, a, args.b, tokens, s, args.budgets)
                for s in range(args.check_seeds)
            ]
            rows.append(
                {"a": a, "tokens": tokens, "ratio": summarize([r["ratio"] for r in runs]), "runs": runs}
            )
    return {
        "l": args.sweep_l,
        "n": args.sweep_n,
        "k": args.sweep_k,
        "seeds": list(range(args.check_seeds)),
        "rows": rows,
    }


def plot_grid(grid: dict[str, object], path: Path, tokens: int, budgets: str) -> None:
    ns, ls = grid["n_values"], grid["l_values"]
    m = np.array([[np.nan if v is None else v for v in row] for row in grid["ratio_mean"]])
    fig, ax = plt.subplots(figsize=(2.4 + 0.48 * len(ls), 1.6 + 0.4 * len(ns)))
    vmax = max(3.0, float(np.nanmax(m)))
    im = ax.imshow(m, origin="lower", cmap="viridis", vmin=1.0, vmax=vmax, aspect="equal")
    impossible = np.isnan(m)
    ax.imshow(
        np.where(impossible, 1.0, np.nan), origin="lower", cmap="Greys", vmin=0, vmax=2.5, aspect="equal"
    )
    for i in range(len(ns)):
        for j in range(len(ls)):
            if impossible[i, j]:
                ax.text(j, i, "×", ha="center", va="center", fontsize=8, color="0.35")
            else:
                v = m[i, j]
                color = "white" if v < 1.0 + 0.6 * (vmax - 1.0) else "black"
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=5.5, color=color)
    # Boundary of "everything fits" (n * l <= k): OPT and OPT-Dist only take the compulsory misses.
    k = grid["k"]
    for i, n in enumerate(ns):
        for j, layers in enumerate(ls):
            if n * layers <= k:
                ax.add_patch(
                    plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="white", linewidth=0.4)
                )
    ax.set_xticks(range(len(ls)), [str(v) for v in ls])
    ax.set_yticks(range(len(ns)), [str(v) for v in ns])
    ax.set_xlabel("Number of layers (l)")
    ax.set_ylabel("Pages (experts) per layer (n)")
    ax.set_title(
        f"OPT-Dist / OPT faults, Zipf a={grid['a']:g}, k={k}, {tokens} tokens, "
        f"mean of {len(grid['seeds'])} seeds\n"
        f"× = k < l (no OPT-Dist); outlined = n·l ≤ k (everything fits); budgets: {budgets}",
        fontsize=9,
    )
    fig.colorbar(im, ax=ax, label="Fault ratio", shrink=0.85)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def plot_sweep(sweep: dict[str, object], check: dict[str, object] | None, path: Path, tokens: int) -> None:
    ncols = 2 if check else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6.2 * ncols, 4.3), squeeze=False)
    ax = axes[0, 0]
    a = [p["a"] for p in sweep["points"]]
    mean = [p["ratio"]["mean"] for p in sweep["points"]]
    lo = [p["ratio"]["min"] for p in sweep["points"]]
    hi = [p["ratio"]["max"] for p in sweep["points"]]
    ax.fill_between(a, lo, hi, alpha=0.25, label=f"min..max over {len(sweep['seeds'])} seeds")
    ax.plot(a, mean, marker="o", markersize=3, label="OPT-Dist / OPT (mean)")
    ax.axhline(1.0, color="0.5", linewidth=0.8, linestyle="--")
    ax.set_xlabel("Zipf law parameter a")
    ax.set_ylabel("Fault ratio")
    ax.set_title(f"l={sweep['l']}, n={sweep['n']}, k={sweep['k']}, {tokens} tokens, K=1", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if check:
        ax = axes[0, 1]
        for av in sorted({r["a"] for r in check["rows"]}):
            rows = [r for r in check["rows"] if r["a"] == av]
            t = [r["tokens"] for r in rows]
            ax.errorbar(
                t,
                [r["ratio"]["mean"] for r in rows],
                yerr=[
                    [r["ratio"]["mean"] - r["ratio"]["min"] for r in rows],
                    [r["ratio"]["max"] - r["ratio"]["mean"] for r in rows],
                ],
                marker="o",
                markersize=3,
                capsize=2,
                label=f"a={av:g}",
            )
        ax.set_xscale("log")
        ax.axhline(1.0, color="0.5", linewidth=0.8, linestyle="--")
        ax.set_xlabel("Trace length (tokens)")
        ax.set_ylabel("Fault ratio")
        ax.set_title(f"Trace-length check ({len(check['seeds'])} seeds, min..max bars)", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=5000, help="trace length (rounds) for (a) and (b)")
    p.add_argument("--b", type=float, default=0.0, help="Zipf b (p_j ~ 1/(j+b)^a)")
    p.add_argument("--budgets", choices=("full", "floor"), default="full", help="OPT-Dist per-layer split")
    g = p.add_argument_group("(a) n x l grid")
    g.add_argument("--grid-a", type=float, default=2.0)
    g.add_argument("--grid-k", type=int, default=16)
    g.add_argument("--grid-n", type=int, nargs=2, default=(1, 16), metavar=("MIN", "MAX"))
    g.add_argument(
        "--grid-l",
        type=int,
        nargs=2,
        default=(1, 20),
        metavar=("MIN", "MAX"),
        help="l > k shows the impossible cells",
    )
    g.add_argument("--grid-seeds", type=int, default=3)
    g = p.add_argument_group("(b) sweep over a")
    g.add_argument("--sweep-l", type=int, default=32)
    g.add_argument("--sweep-n", type=int, default=8)
    g.add_argument("--sweep-k", type=int, default=64)
    g.add_argument("--a-max", type=float, default=8.0)
    g.add_argument("--a-step", type=float, default=0.25)
    g.add_argument("--seeds", type=int, default=5)
    g = p.add_argument_group("(c) trace-length check (sweep setting)")
    g.add_argument("--no-length-check", dest="length_check", action="store_false")
    g.add_argument("--check-a", type=float, nargs="+", default=[0.0, 2.0, 4.0, 6.0, 8.0])
    g.add_argument("--check-tokens", type=int, nargs="+", default=[1000, 2000, 5000, 10000, 20000])
    g.add_argument("--check-seeds", type=int, default=3)
    return figure_args(p, argv, "fig6.json")  # a shrunk run's figures go elsewhere, said


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.img.mkdir(parents=True, exist_ok=True)
    start, cpu_start = time.perf_counter(), time.process_time()

    t0 = time.perf_counter()
    grid = run_grid(args)
    t_grid = time.perf_counter() - t0
    print(
        f"(a) OPT-Dist/OPT, Zipf a={args.grid_a:g}, k={args.grid_k}, {args.tokens} tokens, "
        f"mean of {args.grid_seeds} seeds ({t_grid:.1f} s); rows n, columns l; '-' = k < l"
    )
    print("n\\l " + "".join(f"{v:>6}" for v in grid["l_values"]))
    for n, row in zip(grid["n_values"], grid["ratio_mean"], strict=True):
        print(f"{n:>3} " + "".join(f"{'-':>6}" if v is None else f"{v:>6.2f}" for v in row))
    worst = max((c for c in grid["cells"] if c["possible"]), key=lambda c: c["ratio"]["mean"])
    print(f"max mean ratio {worst['ratio']['mean']:.3f} at n={worst['n']}, l={worst['l']}")

    t0 = time.perf_counter()
    sweep = run_sweep(args)
    t_sweep = time.perf_counter() - t0
    print(
        f"\n(b) OPT-Dist/OPT, l={args.sweep_l}, n={args.sweep_n}, k={args.sweep_k}, {args.tokens} tokens, "
        f"{args.seeds} seeds ({t_sweep:.1f} s)"
    )
    print(f"{'a':>6} {'mean':>7} {'min':>7} {'max':>7}")
    for pt in sweep["points"]:
        r = pt["ratio"]
        print(f"{pt['a']:>6.2f} {r['mean']:>7.3f} {r['min']:>7.3f} {r['max']:>7.3f}")

    check, t_check = None, 0.0
    if args.length_check:
        t0 = time.perf_counter()
        check = run_length_check(args)
        t_check = time.perf_counter() - t0
        print(f"\n(c) trace-length check, sweep setting, {args.check_seeds} seeds ({t_check:.1f} s)")
        print(f"{'a':>5} " + "".join(f"{t:>16}" for t in args.check_tokens))
        for av in args.check_a:
            cells = [r["ratio"] for r in check["rows"] if r["a"] == av]
            print(f"{av:>5g} " + "".join(f"{c['mean']:>6.3f} [{c['min']:.2f},{c['max']:.2f}]" for c in cells))

    plot_grid(grid, args.img / "fig6a_opt_dist_grid.png", args.tokens, args.budgets)
    plot_sweep(sweep, check, args.img / "fig6b_opt_dist_vs_a.png", args.tokens)
    runtime, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    result = {
        "figure": "the LLRU paper Fig. 6 (OPT vs OPT-Dist on Zipf traces)",
        **provenance(),
        "runtime_s": {
            "total": round(runtime, 1),
            "cpu": round(cpu, 1),
            "grid": round(t_grid, 1),
            "sweep": round(t_sweep, 1),
            "length_check": round(t_check, 1),
        },
        "setup": {
            "tokens": args.tokens,
            "top_k": 1,
            "order": "flat",
            "generator": "zipf (per-layer shuffled ranking)",
            "budgets": args.budgets,
        },
        "fig6a": grid,
        "fig6b": sweep,
        "length_check": check,
    }
    path = args.out / "fig6.json"
    write_json(path, result)
    print(f"\nwrote {path}, {args.img / 'fig6a_opt_dist_grid.png'}, {args.img / 'fig6b_opt_dist_vs_a.png'}")
    print(f"running time {runtime:.1f} s (CPU {cpu:.1f} s)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ExpertcacheError as e:  # bad input: one line, as the command line says it
        print(f"paper_fig6.py: {e}", file=sys.stderr)
        sys.exit(2)
