"""A decode step's packed-expert products on a CPU at numba's default vector width and at the core's full
width (``expertcache.jit``), over a slot pool with and without huge pages (``memory.advise_huge_pages``),
and without the loops' prefetch hints (``_packed_jit.AHEAD``).

    .venv/bin/python bench/packed_width_cpu.py [--threads 2] [--rounds 5] [--out FILE.json]

Each case runs in a fresh process (numba reads its target once per process), the cases alternating over
``--rounds`` rounds. A case: a slot pool of ``--pool-gib`` (1.1 GiB: far beyond the caches, as a model's
experts are) of int8 (or int4-g64) experts at Granite-3.1-1B-A400M's shapes (gate_up 1024 x 1024, down
1024 x 512), then 300 decode steps of 8 random experts, timing ``PackedKernels``' compiled loop alone
(``_packed_jit.rows_*``) for both projections. ``default`` compiles with the host's features as numba
picks them (LLVM's tuning for the core: 256-bit vectors on Intel's AVX-512 cores), ``wide`` with
``-prefer-256-bit`` added, as the package does; ``no prefetch hints`` is the package's case with the
loops compiled afresh (in a cache folder of its own) with ``AHEAD`` beyond every row, so that they ask
for nothing ahead, as before the hints. Prints the median step's time in microseconds and the
weight bytes read per second; ``--out`` also writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CASES = {  # name -> (vector width asked, huge pages, prefetch hints)
    "default width, 4 KiB pages": ("default", False, True),
    "default width, huge pages": ("default", True, True),
    "full width, 4 KiB pages": ("wide", False, True),
    "full width, huge pages (the package)": ("wide", True, True),
    "full width, huge pages, no prefetch hints": ("wide", True, False),
}


def one(
    fmt: str, huge: bool, pool_gib: float, threads: int, steps: int, hints: bool = True
) -> dict[str, float]:
    """In this process: the median decode step's compiled-loop time."""
    import time

    import numpy as np
    import torch

    from expertcache.engine import _packed_jit

    if not hints:  # read when the loops compile (the parent gave this process a cache folder of its own)
        _packed_jit.AHEAD = 1 << 62
    from expertcache.engine.memory import advise_huge_pages
    from expertcache.jit import numba, wide_vectors

    numba.set_num_threads(threads)
    hidden, ffn = 1024, 512
    shapes = {"gate_up_proj": (2 * ffn, hidden), "down_proj": (hidden, ffn)}
    layout, total = {}, 0
    for name, (rows, cols) in shapes.items():  # q, then per-row float32 scales (int8) or bf16 scale+min
        q = rows * cols if fmt == "int8" else rows * cols // 2
        scales = 4 * rows if fmt == "int8" else 2 * rows * (cols // 64)
        layout[name] = (total, total + q, total + q + scales)
        total += q + 2 * scales
    slot = -(-total // 64) * 64
    num = int(pool_gib * 2**30 // slot)
    buffer = torch.empty((num, slot), dtype=torch.uint8)
    advised = advise_huge_pages(buffer) if huge else False
    pool = buffer.numpy()
    rng = np.random.default_rng(0)
    for s in range(num):  # random bytes for the weights, small positive scales
        pool[s] = rng.integers(0, 256, slot, dtype=np.uint8)
        for name, (rows, cols) in shapes.items():
            qoff, soff, moff = layout[name]
            if fmt == "int8":
                pool[s, soff : soff + 4 * rows] = np.full(rows, 1e-3, np.float32).view(np.uint8)
            else:
                n = rows * (cols // 64)
                one_bf16 = np.full(n, 0x3A83, np.uint16).view(np.uint8)  # about 1e-3 in bfloat16
                pool[s, soff : soff + 2 * n] = one_bf16
                pool[s, moff : moff + 2 * n] = one_bf16
    x = {n: rng.standard_normal((1, c), dtype=np.float32) for n, (_, c) in shapes.items()}
    outs = {n: np.empty((8, r), np.float32) for n, (r, _) in shapes.items()}

    def step(slots):
        for name, (rows, cols) in shapes.items():
            qoff, soff, moff = layout[name]
            if fmt == "int8":
                _packed_jit.rows_int8(pool, qoff, soff, rows, cols, slots, x[name], outs[name], False)
            else:
                xf = x[name]
                even, odd = np.ascontiguousarray(xf[:, 0::2]), np.ascontiguousarray(xf[:, 1::2])
                xsum = xf.reshape(1, -1, 64).sum(-1)
                _packed_jit.rows_int4(
                    pool, qoff, soff, moff, rows, cols, 64, slots, even, odd, xsum, outs[name]
                )

    step(np.arange(8, dtype=np.int64))
    times = []
    for _ in range(steps):
        slots = rng.choice(num, 8, replace=False).astype(np.int64)
        t = time.perf_counter()
        step(slots)
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    weight_bytes = 8 * sum((r * c if fmt == "int8" else r * c // 2) for r, c in shapes.values())
    return {"us": med * 1e6, "gb_s": weight_bytes / med / 1e9, "wide": wide_vectors(), "huge": advised}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--pool-gib", type=float, default=1.1)
    ap.add_argument("--formats", nargs="+", choices=("int8", "int4"), default=["int8", "int4"])
    ap.add_argument("--out")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), metavar="CASE",
                    help="the cases to run, by name (default: all)")  # fmt: skip
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # internal: FORMAT HUGE HINTS in this process
    args = ap.parse_args()
    if args.one:
        fmt, huge, hints = args.one
        print(json.dumps(one(fmt, huge == "1", args.pool_gib, args.threads, args.steps, hints == "1")))
        return
    import llvmlite.binding as ll

    features = ll.get_host_cpu_features().flatten()
    results: dict[str, dict[str, list[dict]]] = {f: {c: [] for c in args.cases} for f in args.formats}
    fresh = tempfile.mkdtemp(prefix="expertcache-nohints-")  # loops compiled without hints, apart
    for r in range(args.rounds):
        for fmt in args.formats:
            names = list(args.cases)
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotating order
                width, huge, hints = CASES[name]
                env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")}
                if width == "default":
                    env["NUMBA_CPU_FEATURES"] = features  # the host's, as numba takes them by default
                if not hints:
                    env["NUMBA_CACHE_DIR"] = fresh  # never the hinted loops' cache (globals are not its key)
                sizes = [
                    "--threads",
                    str(args.threads),
                    "--steps",
                    str(args.steps),
                    "--pool-gib",
                    str(args.pool_gib),
                ]
                cmd = [
                    sys.executable,
                    __file__,
                    "--one",
                    fmt,
                    "1" if huge else "0",
                    "1" if hints else "0",
                    *sizes,
                ]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                results[fmt][name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1} {fmt} {name}: {results[fmt][name][-1]['us']:.0f} us", file=sys.stderr)
    print("| format | case | step us, median [range] | GB/s | full width | huge pages |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for fmt, cases in results.items():
        for name, runs in cases.items():
            us = [x["us"] for x in runs]
            gb = statistics.median(x["gb_s"] for x in runs)
            summary[f"{fmt} {name}"] = {"us_median": statistics.median(us), "us_range": [min(us), max(us)],
                                        "gb_s_median": gb, "runs": runs}  # fmt: skip
            print(f"| {fmt} | {name} | {statistics.median(us):.0f} [{min(us):.0f}-{max(us):.0f}] | {gb:.1f} "
                  f"| {runs[0]['wide']} | {runs[0]['huge']} |")  # fmt: skip
    if args.out:
        sys.path.insert(0, os.path.dirname(__file__))
        from provenance import provenance, write_json

        write_json(args.out, {"provenance": provenance(), "threads": args.threads, "results": summary})


if __name__ == "__main__":
    main()
