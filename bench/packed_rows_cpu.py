"""Where the one-token loops stop paying on a CPU: one packed expert on T tokens, both ways.

``engine.packed``'s CPU kernels compute an expert's T tokens either in the one-token loops (``rows_*``: each
token reads and decodes the whole matrix again) or in the several-token loops (``tokens_*``: each weight
row decoded once, then multiplied by every token). ``packed.CPU_ROWS`` is, per format, the largest T that
takes the one-token loops; this script measures both for T = 1, 2, 4, 8 at one expert's shapes (random
bfloat16 weights, stored in each format as ``bench/packed_gpu.py`` stores them), in alternating runs,
and prints the medians (ms for gate_up, the activation and down).

    PYTHONPATH=bench .venv/bin/python bench/packed_rows_cpu.py --hidden 2048 --ffn 1024 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from expertcache.engine.memory import SlotPool
from expertcache.engine.packed import CPU_ROWS, PackedKernels, SiluExperts, slot_bytes

_Module = SiluExperts  # what the kernels read of an experts module


def main() -> None:
    from packed_gpu import FORMATS, packed  # one expert's stored tensors in each format (GPU-free)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--formats", nargs="+", choices=sorted(FORMATS), default=sorted(FORMATS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from expertcache.jit import numba

    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    H, Fd = args.hidden, args.ffn
    shapes = {"gate_up_proj": (2 * Fd, H), "down_proj": (H, Fd)}
    torch.manual_seed(0)
    full = {n: (torch.randn(*s) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    print(f"hidden {H}, expert FFN {Fd}, {args.threads} threads: ms for one expert on T tokens")
    print(f"{'format':7s} {'T':>2s} {'one-token':>10s} {'several':>8s}  taken")
    for fmt in args.formats:
        p, stored = packed(fmt, shapes, full)
        k = PackedKernels(p)
        pool = SlotPool(k.layout, 1, torch.device("cpu"))
        for n, t in stored.items():
            pool.views[0][n].copy_(t)
        one = slot_bytes(pool.views[0], k.layout).numpy()
        for n in (1, 2, 4, 8):
            x = torch.randn(n, H).to(torch.bfloat16)
            ways = {
                "rows": lambda x=x, n=n, k=k, one=one: k.rows(_Module, one, np.zeros(n, dtype=np.int64), x),
                "tokens": lambda x=x, k=k, one=one: k.tokens(_Module, one, x),
            }
            runs: dict[str, list[float]] = {w: [] for w in ways}
            for way in ways.values():  # compile, fault pages in
                way()
            for _ in range(args.reps):
                for name, way in ways.items():
                    t0 = time.perf_counter()
                    way()
                    runs[name].append(time.perf_counter() - t0)
            med = {w: statistics.median(r) * 1e3 for w, r in runs.items()}
            taken = "several" if n > CPU_ROWS[fmt] else "one-token"
            print(f"{fmt:7s} {n:2d} {med['rows']:10.2f} {med['tokens']:8.2f}  {taken}")


if __name__ == "__main__":
    main()
