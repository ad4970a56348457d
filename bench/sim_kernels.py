"""The compiled replays against the Python reference: seconds and requests/s per policy, one capacity.

The trace: ``synthesize("zipf", tokens=--tokens, layers=32, experts=8, top_k=2, seed=1)`` (6.4M requests
in flat order at the default 100,000 tokens; the same as ``sim_vs_libcachesim.py``). Each compiled replay
runs once to load its code, then ``--repeats`` times (best kept); the Python reference runs on the first
``--reference-tokens`` tokens only (it is slow) and its rate is scaled from there. The misses of both
must agree on the part both ran (the script fails otherwise). A ``--capacity`` some policy cannot run at in
the ``--order`` given (below top-k in layer order; the ``-dist`` forms, below a layer's least room in each
of the 32 layers) is refused in one line before any work.

    PYTHONPATH=bench .venv/bin/python bench/sim_kernels.py [--tokens 100000] [--order flat]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from provenance import OneLineParser, at_least, fail, provenance, results_out, write_json

from expertcache.cache.schedule import ORDERS, build_schedule, min_room
from expertcache.errors import ExpertcacheError
from expertcache.policy.registry import capacity_reason, min_capacity
from expertcache.sim import fast
from expertcache.sim.replay import replay
from expertcache.trace import Trace, synthesize

POLICIES = ["lru", "fifo", "lfu", "lcp", "llru", "opt", "lru-dist", "lfu-dist", "llru-dist", "opt-dist"]
LAYERS, EXPERTS, TOP_K = 32, 8, 2  # the synthetic trace's shape


def main() -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=at_least(1), default=100_000)
    ap.add_argument("--reference-tokens", type=at_least(1), default=10_000)
    ap.add_argument("--order", choices=ORDERS, default="flat")
    ap.add_argument("--capacity", type=at_least(1), default=64)
    ap.add_argument("--repeats", type=at_least(1), default=3)
    ap.add_argument("--out", type=Path, help="default bench/results/sim_kernels.json (other sizes: temp dir)")
    args = ap.parse_args()
    check_capacity(ap, args)
    args.out = results_out(ap, args, "sim_kernels.json", at_least=("repeats",))
    try:
        return _run(args)
    except ExpertcacheError as exc:  # a capacity a policy cannot run at, say
        fail(ap.prog, str(exc))


def check_capacity(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every policy must run at ``--capacity`` in ``--order``: a combination one refuses (its replay
    would say so only after the policies before it ran) is refused here, in one line, naming the least
    capacity that order allows."""
    room = min_room(args.order, TOP_K)
    need = {name: min_capacity(name, LAYERS, None, room) for name in POLICIES}
    short: dict[int, list[str]] = {}
    for name in POLICIES:
        if args.capacity < need[name]:
            short.setdefault(need[name], []).append(name)
    if short:
        which = "; ".join(f"{', '.join(names)} need at least {n}" for n, names in short.items())
        why = capacity_reason(POLICIES[0], None, room)
        fail(ap.prog, f"--capacity {args.capacity} in {args.order} order: {which} ({why}); give --capacity "
             f"{max(short)} or more")  # fmt: skip


def _run(args) -> int:
    trace = synthesize("zipf", tokens=args.tokens, layers=LAYERS, experts=EXPERTS, top_k=TOP_K, seed=1)
    s = build_schedule(trace, args.order)
    part = Trace(trace.experts[: args.reference_tokens], trace.num_experts)
    small = build_schedule(part, args.order)
    rows = []
    for name in POLICIES:
        fast.replay(s, name, args.capacity)  # load (or compile) the code
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            misses, _ = fast.replay(s, name, args.capacity)
            runs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref = replay(small, name, args.capacity)
        ref_s = time.perf_counter() - t0
        agree = fast.replay(small, name, args.capacity)[0].tolist() == ref.layer_misses.tolist()
        compiled_rate = s.num_requests / min(runs)
        reference_rate = small.num_requests / ref_s
        rows.append({
            "policy": name, "requests": s.num_requests, "compiled_s": min(runs),
            "compiled_requests_per_s": compiled_rate, "reference_requests_per_s": reference_rate,
            "speedup": compiled_rate / reference_rate, "miss_ratio": int(misses.sum()) / s.num_requests,
            "agree": agree,
        })  # fmt: skip
        print(f"{name:10} compiled {min(runs):6.3f} s ({compiled_rate / 1e6:5.1f}M req/s) | Python "
              f"{reference_rate / 1e6:5.2f}M req/s | {compiled_rate / reference_rate:5.0f}x | "
              f"agree {agree}")  # fmt: skip
    write_json(args.out, {**provenance(), "tokens": args.tokens, "order": args.order, "rows": rows})
    print(f"wrote {args.out}", file=sys.stderr)
    if not all(r["agree"] for r in rows):
        print("the compiled and the reference replays disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
