"""Simulator speed: requests per second per policy, and the time of full LRU and OPT miss curves.

A synthetic Mixtral-shaped trace (L=32, E=8, K=2; 100k tokens = 6.4M requests, sticky Zipf routing)
is replayed in layer order (what the engine does) at 25% and 50% of the 256 experts; then the whole
LRU and OPT curves (every capacity 2..256) are computed from one stack pass each.

    .venv/bin/python bench/speed.py [--tokens 100000] [--out bench/results/speed.json]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from provenance import fail, provenance, results_out, write_json

from expertcache.sim import all_capacities, build_schedule, replay, run_policy
from expertcache.trace import synthesize

POLICIES = ("lru", "fifo", "llru", "lfu", "lcp", "random", "marking", "static", "opt", "lru-dist", "opt-dist")


def _check(ap, args) -> None:
    """Bad options in one line, exit 2, before the work (they ended in tracebacks)."""
    from expertcache.cache.schedule import ORDERS
    from expertcache.errors import ExpertcacheError
    from expertcache.policy.registry import parse_policy

    if args.tokens < 1 or min(args.capacities) < 1:
        fail(
            ap.prog,
            f"--tokens and --capacities take whole numbers >= 1, got {args.tokens}, {args.capacities}",
        )
    if args.order not in ORDERS:
        fail(ap.prog, f"--order {args.order!r}: one of {', '.join(ORDERS)}")
    try:
        for policy in args.policies:
            parse_policy(policy)
    except ExpertcacheError as exc:
        fail(ap.prog, str(exc))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--capacities", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--order", default="layer")
    ap.add_argument(
        "--out", type=Path, help="results file (default: bench/results/speed.json for the documented run)"
    )
    args = ap.parse_args()
    _check(ap, args)
    args.out = results_out(ap, args, "speed.json")  # a shrunk run's elsewhere, said

    t0 = time.perf_counter()
    trace = synthesize(
        "sticky", tokens=args.tokens, layers=32, experts=8, top_k=2, a=1.0, stickiness=0.3, seed=0
    )
    t_synth = time.perf_counter() - t0
    t0 = time.perf_counter()
    schedule = build_schedule(trace, args.order)
    t_sched = time.perf_counter() - t0
    n = schedule.num_requests
    print(
        f"trace: {args.tokens} tokens, {n} requests; "
        f"synth {t_synth:.2f} s, schedule ({args.order}) {t_sched:.2f} s"
    )
    _ = schedule.future, schedule.profile  # offline inputs built once, outside the timed replays

    rows = []
    print(f"{'policy':10s} {'capacity':>8s} {'misses':>9s} {'seconds':>8s} {'Mreq/s':>7s}")
    for name in args.policies:
        for cap in args.capacities:
            t0 = time.perf_counter()
            r = replay(schedule, name, cap)
            dt = time.perf_counter() - t0
            rows.append(
                {"policy": name, "capacity": cap, "misses": r.misses, "seconds": dt, "requests_per_s": n / dt}
            )
            print(f"{name:10s} {cap:8d} {r.misses:9d} {dt:8.2f} {n / dt / 1e6:7.2f}")

    curves = {}
    caps = all_capacities(schedule)
    for name in ("lru", "opt"):
        t0 = time.perf_counter()
        res = run_policy(schedule, name, caps)
        dt = time.perf_counter() - t0
        curves[name] = {"seconds": dt, "capacities": len(caps), "misses": [r.misses for r in res]}
        print(f"full {name} curve: {len(caps)} capacities in {dt:.2f} s")

    out = {
        **provenance(),
        "trace": {
            "kind": "sticky",
            "tokens": args.tokens,
            "layers": 32,
            "experts": 8,
            "top_k": 2,
            "requests": n,
        },
        "synth_seconds": t_synth,
        "schedule_seconds": t_sched,
        "replays": rows,
        "curves": curves,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
