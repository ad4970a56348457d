"""Miss paths on the CPU engine with an emulated link: TPOT, stall and transfers against on-demand fetch.

The embedded demo model (6 layers x 16 experts, top-2, fp32), greedy generation of one fixed code prompt.
For each budget (``--budgets``, % of expert memory) and each row of ``PATHS`` (miss path and its cache
policy: ``fetch`` and ``host`` under LRU, ``hybrid`` under HybriMoE's ``mrs``, ``placement:first=2``
under LRU, ``split:theta=0.5,buffer=4`` under MoEpic's ``lcp``), with each prefetch series
(``--prefetch``: ``none``, and optionally ``learned``, the shipped window-2 predictor), ``--repeats``
fresh loads each: one warm-up generation of ``--warmup-tokens`` (the cache stays warm), then
``--new-tokens`` measured; medians of TPOT, TTFT, decode stall per token, host time, and the counts (hits,
misses, experts computed on the host, bytes moved) of the measured generation. An all-resident run (100%,
no link) gives the floor.

The link is emulated (``link_bandwidth``, ``link_latency``) so that one expert's transfer takes
``--link-ratio`` (default 3) times one expert's compute for one token, measured on this machine as
``bench/prefetch_cpu.py`` does (``engine_cpu.expert_costs``); slow tier ``host`` by default (experts in
RAM: a transfer is a memcpy, the emulated link sets its time). ``host`` and ``hybrid`` decide by the
costs the engine measures at load (recorded per run).

On a CPU-only machine the host and the device are the same processor: host compute runs inline on the
compute thread (``host_parallel`` false), so this shows the miss paths' decision logic and the transfers
they avoid, not the CPU/GPU overlap they are built for (``bench/miss_projection.py`` projects that).

Every exact path's tokens (host, hybrid, placement) must equal fetch's at the same budget and prefetch
(the script exits with status 1 otherwise, after writing the JSON); split is mathematically exact but
rounds differently (two products and a sum), so its match is recorded and only warned about.

    OMP_NUM_THREADS=1 .venv/bin/python bench/miss_paths_cpu.py [--quick] [--prefetch none learned]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from engine_cpu import PROMPT, emulated_link
from provenance import ROOT, provenance, write_json

from expertcache.engine import load
from expertcache.engine.offloaded import DEFAULT_MODEL
from expertcache.errors import ExpertcacheError

# (label, miss path spec, cache policy); the first is the baseline every other row is compared with
PATHS: list[tuple[str, str, str]] = [
    ("fetch", "fetch", "lru"),
    ("host", "host", "lru"),
    ("hybrid", "hybrid", "mrs"),
    ("placement:first=2", "placement:first=2", "lru"),
    ("split:theta=0.5,buffer=4", "split:theta=0.5,buffer=4", "lcp"),
    ("hobbit (int4, lossy)", "hobbit", "lru"),
]
INEXACT = {"split", "hobbit"}  # split: exact in arithmetic, not in rounding; hobbit: lossy
PREFETCH = {"none": {}, "learned": {"prefetch": "learned", "window": 2}}
TIMES = ("tpot_s", "ttft_s", "decode_stall_per_token_s", "stall_s", "host_busy_per_token_s", "host_wait_s")
COUNTS = ("hits", "misses", "decode_misses", "host_computed", "bytes_transferred", "experts_moved")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ one run
def generate(m, n: int) -> dict[str, object]:
    """One greedy generation of ``n`` new tokens: the Generation's figures and the cache's work."""
    before = m.stats
    g = m.generate_text(PROMPT, n, min_new_tokens=n)
    after = m.stats
    steps = max(1, len(g.tokens) - 1)
    delta = {k: after[k] - before[k] for k in ("decode_misses", "host_busy_s")}
    return {
        "tokens": g.tokens,
        "tpot_s": g.tpot_s,
        "ttft_s": g.ttft_s,
        **{k: g.stats[k] for k in ("hits", "misses", "stall_s", "host_wait_s", "host_computed")},
        "decode_misses": delta["decode_misses"],
        "decode_stall_per_token_s": g.stats["decode_stall_s"] / steps,
        "host_busy_per_token_s": delta["host_busy_s"] / steps,
        "bytes_transferred": g.stats["bytes_transferred"],
        "experts_moved": g.stats["bytes_transferred"] / m.layout.nbytes,
    }


def run_once(path, args, budget: str, miss: str, policy: str, link: dict, prefetch: dict) -> dict:
    t0 = time.perf_counter()
    m = load(
        path, expert_memory=budget, policy=policy, device="cpu", miss=miss, slow_tier=args.slow_tier,
        progress=False, record=False, **link, **prefetch,
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    try:
        generate(m, args.warmup_tokens)
        r = generate(m, args.new_tokens)
        s = m.stats
        r.update(
            load_s=load_s, capacity_experts=s["capacity_experts"], parts=s["parts"], miss_path=s["miss"],
            costs=s["costs"], link=s["link"], slow_tier=s["slow_tier"],
        )  # fmt: skip
    finally:
        m.close()
    m = None  # free it before the next load
    gc.collect()
    return r


def run_config(path, args, budget: str, row: tuple[str, str, str], link: dict, series: str) -> dict:
    """``--repeats`` fresh loads; medians of the times and counts, every run kept."""
    label, miss, policy = row
    runs = [run_once(path, args, budget, miss, policy, link, PREFETCH[series]) for _ in range(args.repeats)]
    out: dict[str, object] = {"label": label, "miss": miss, "policy": policy, "prefetch": series}
    out["budget"] = budget
    for k in (*TIMES, *COUNTS):
        values = [r[k] for r in runs]
        out[k] = statistics.median(values) if k in TIMES else statistics.median_low(values)
        out[k + "_runs"] = values
    first = runs[0]
    out.update({k: first[k] for k in ("capacity_experts", "parts", "miss_path", "link", "slow_tier")})
    out["costs_runs"] = [r["costs"] for r in runs]
    out["load_s_runs"] = [r["load_s"] for r in runs]
    out["tokens"] = first["tokens"]
    out["tokens_same_every_repeat"] = all(r["tokens"] == first["tokens"] for r in runs)
    out["os_load_avg_1m"] = os.getloadavg()[0]
    return out


# ------------------------------------------------------------------------------------ output
def line(r: dict[str, object]) -> str:
    return (
        f"TPOT {r['tpot_s'] * 1e3:7.2f} ms  stall/token {r['decode_stall_per_token_s'] * 1e3:6.3f} ms  "
        f"host {r['host_computed']:4d}  misses {r['misses']:4d}  moved {r['experts_moved']:6.1f}"
    )


def table(rows: list[dict[str, object]], resident: dict[str, object]) -> str:
    base = next(r for r in rows if r["label"] == PATHS[0][0])
    out = [
        "| path | policy | TPOT ms | vs fetch | TTFT ms | decode stall ms/token | host compute | "
        "misses | experts moved | tokens = fetch |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['label']} | {r['policy']} | {r['tpot_s'] * 1e3:.2f} | "
            f"{base['tpot_s'] / r['tpot_s']:.2f}x | {r['ttft_s'] * 1e3:.1f} | "
            f"{r['decode_stall_per_token_s'] * 1e3:.3f} | {r['host_computed']} | {r['misses']} | "
            f"{r['experts_moved']:.1f} | {r['tokens_match_fetch']} |"
        )
    out.append(
        f"| all-resident (100%, no link) | lru | {resident['tpot_s'] * 1e3:.2f} | "
        f"{base['tpot_s'] / resident['tpot_s']:.2f}x | {resident['ttft_s'] * 1e3:.1f} | 0 | 0 | "
        f"{resident['misses']} | {resident['experts_moved']:.1f} | {resident['tokens'] == base['tokens']} |"
    )
    return "\n".join(out)


def check_tokens(rows: list[dict[str, object]]) -> None:
    """Each row's tokens against fetch's (same budget and prefetch); split only recorded."""
    base = next(r for r in rows if r["label"] == PATHS[0][0])
    for r in rows:
        r["tokens_match_fetch"] = r["tokens"] == base["tokens"] and r["tokens_same_every_repeat"]
        r["exact_path"] = r["miss"].partition(":")[0] not in INEXACT


# ------------------------------------------------------------------------------------ main
def bench_series(args, budget: str, series: str, link: dict, body: dict, save) -> list[str]:
    """Every path at one budget and prefetch series; the table; the exact paths whose tokens differ."""
    rows: list[dict[str, object]] = []
    body["budgets"].setdefault(budget, {})[series] = rows
    for row in PATHS:
        try:
            r = run_config(args.model, args, budget, row, link, series)
        except ExpertcacheError as exc:  # e.g. a budget too small for a path's parts
            log(f"{budget:>4s} {row[0]:26s} {series}: not run ({exc})")
            continue
        rows.append(r)
        log(f"{budget:>4s} {row[0]:26s} {series:7s} {line(r)}")
        save()
    if not any(r["label"] == PATHS[0][0] for r in rows):
        return []
    check_tokens(rows)
    save()
    print(f"### {budget} of expert memory, prefetch {series}\n")
    print(table(rows, body["resident"]) + "\n", flush=True)
    return [
        f"{budget} {series} {r['label']}" for r in rows if r["exact_path"] and not r["tokens_match_fetch"]
    ]


def ensure_copies(model: Path) -> None:
    """hobbit's int4 copies of the model, built once (expertcache quantize) when missing."""
    from expertcache.engine.quantized import find_copy
    from expertcache.errors import ExpertcacheError
    from expertcache.tools.quantize import quantize_model

    try:
        find_copy(model, 4, 64)
    except ExpertcacheError:
        quantize_model(model, bits=(4,), group=64, progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL, help="checkpoint (default: the embedded one)"
    )
    ap.add_argument("--budgets", type=float, nargs="+", default=None, help="%% of expert memory (10 25 50)")
    ap.add_argument("--prefetch", nargs="+", choices=sorted(PREFETCH), default=["none"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="fresh loads per configuration (medians)")
    ap.add_argument("--link-ratio", type=float, default=3.0, help="one expert's transfer / its compute")
    ap.add_argument("--link-latency", default="5us")
    ap.add_argument("--slow-tier", choices=["host", "disk", "mapped"], default="host")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument(
        "--quick", action="store_true", help="one budget (25%% or the first given), 8 tokens, 1 repeat"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="default bench/results/miss_paths_cpu.json (quick: /tmp)"
    )
    args = ap.parse_args()
    ensure_copies(args.model)
    if args.quick:
        args.budgets = (args.budgets or [25.0])[:1]
        args.new_tokens, args.warmup_tokens, args.repeats = 8, 2, 1
    args.budgets = args.budgets or [10.0, 25.0, 50.0]
    out_path = args.out or (
        Path(tempfile.gettempdir()) / "miss_paths_cpu.quick.json"
        if args.quick
        else ROOT / "bench/results/miss_paths_cpu.json"
    )
    torch.set_num_threads(args.threads)
    prov = provenance()  # the code as it is when the run starts
    t_start = time.perf_counter()
    link, costs = emulated_link(args.model, args.link_ratio, args.link_latency)
    log(
        f"one expert: {costs['expert_bytes'] / 1e6:.2f} MB, compute (1 token) "
        f"{costs['compute_one_token_s'] * 1e6:.0f} us; link {link['link_bandwidth'] / 1e9:.3g} GB/s + "
        f"{args.link_latency} = {costs['link_transfer_s'] * 1e6:.0f} us per expert"
    )
    body: dict[str, object] = {
        **prov,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "model": str(args.model),
        "prompt": PROMPT,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
        "paths": [list(p) for p in PATHS],
        "expert_costs": costs,
        "method": (
            "per budget x path x prefetch: `repeats` fresh loads (policy as listed, emulated link, slow tier "
            f"{args.slow_tier}); each: one warm-up generation, then one measured; medians; TPOT = mean gap "
            "between new tokens; decode stall per token = decode_stall_s / (new tokens - 1); host compute "
            "= experts computed on the host (inline: the same CPU); experts moved = bytes transferred / one "
            "expert's bytes; tokens compared with fetch's at the same budget and prefetch"
        ),
        "resident": None,
        "budgets": {},
    }

    def save() -> None:
        body["wall_s"] = time.perf_counter() - t_start
        out_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(out_path, body)

    resident = run_config(args.model, args, "100%", ("all-resident", "fetch", "lru"), {}, "none")
    body["resident"] = resident
    log(f"{'100%':>4s} {'all-resident':26s} {line(resident)}")
    save()
    failed = []
    for b in args.budgets:
        budget = f"{b:g}%"
        for series in args.prefetch:
            failed += bench_series(args, budget, series, link, body, save)
    body["exact_paths_match_fetch"] = not failed
    save()
    log(f"wrote {out_path} ({time.perf_counter() - t_start:.0f} s)")
    inexact = [
        f"{b} {s} {r['label']}"
        for b, per in body["budgets"].items()
        for s, rows in per.items()
        for r in rows
        if not r.get("exact_path", True) and not r.get("tokens_match_fetch", True)
    ]
    if inexact:
        log(f"note: tokens differ from fetch's (rounding) for {', '.join(inexact)}")
    if failed:
        log(f"ERROR: an exact path's tokens differ from fetch's: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
