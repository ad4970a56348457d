"""Is a slow round the process's or the machine's? Two processes, each with the same model loaded, decode
in alternating rounds (A B, then B A, ...): a slowdown of the process's own state (its heap, its
recorder, its caches) shows in one of them; a slowdown of the machine (a noisy neighbour, the host's
memory bandwidth, the clock) shows in both at once.

    NUMBA_NUM_THREADS=2 python3 bench/process_pair_cpu.py MODEL --quantize-dense int8 --dtype float32

Each round: one prefill alone (timed), then a prompt of 64 tokens and ``--new-tokens`` more; the round's
TPOT is (that time - the prefill's) / new tokens. Results to stdout (``--json``: one object).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = "The history of the city begins with a small settlement on the river, and " * 4


def worker(args: argparse.Namespace) -> int:
    import warnings

    warnings.simplefilter("ignore")
    import expertcache

    model = expertcache.load(
        args.model, "100%", quantize_dense=args.quantize_dense, dtype=args.dtype, progress=False
    )
    ids = model.encode(PROMPT).reshape(1, -1)[:, :64]
    print("ready", flush=True)
    for _ in sys.stdin:
        model.generate(ids, max_new_tokens=1)  # warm: the timed prefill below is a repeat
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=args.new_tokens + 1, min_new_tokens=args.new_tokens + 1)
        print(f"{(time.perf_counter() - start - prefill) / args.new_tokens * 1e3:.3f}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--quantize-dense", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    argv = [sys.executable, __file__, args.model, "--worker", "--new-tokens", str(args.new_tokens)]
    argv += [f for flag in ("quantize_dense", "dtype") if getattr(args, flag)
             for f in (f"--{flag.replace('_', '-')}", getattr(args, flag))]  # fmt: skip
    procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in "AB"]
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            print("process_pair_cpu: a worker failed to load the model", file=sys.stderr)
            return 2
    tpot: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in "AB" if r % 2 == 0 else "BA":
            p = procs["AB".index(name)]
            p.stdin.write("go\n")
            p.stdin.flush()
            tpot[name].append(float(p.stdout.readline()))
        if not args.json:
            print(f"round {r}: A {tpot['A'][-1]:.2f} ms  B {tpot['B'][-1]:.2f} ms", flush=True)
    for p in procs:
        p.stdin.close()
        p.wait()
    diffs = [a - b for a, b in zip(tpot["A"], tpot["B"], strict=True)]
    # the two processes' TPOT round by round: near 1 where the machine's phases move both, near 0 where
    # each round's own noise dominates; a drift of one process's own shows in A - B
    corr = statistics.correlation(tpot["A"], tpot["B"]) if args.rounds > 2 else None
    summary = {
        "model": os.path.basename(os.path.normpath(args.model)), "tpot_ms": tpot,
        "a_minus_b_ms": {"median": statistics.median(diffs), "min": min(diffs), "max": max(diffs)},
        "range_ms": {k: [min(v), max(v)] for k, v in tpot.items()},
        "correlation_by_round": corr,
    }  # fmt: skip
    if args.json:
        print(json.dumps(summary))
    else:
        a, b = tpot["A"], tpot["B"]
        print(f"A - B: median {statistics.median(diffs):+.2f} ms [{min(diffs):+.2f}, {max(diffs):+.2f}]; "
              f"A {min(a):.2f}-{max(a):.2f} ms, B {min(b):.2f}-{max(b):.2f} ms; correlation by round "
              f"{corr:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
