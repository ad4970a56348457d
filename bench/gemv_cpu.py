"""One decode token's matrix products on CPU: torch's ``mm`` against the compiled kernel's loops, per shape.

    .venv/bin/python bench/gemv_cpu.py [--threads 2] [--shape granite] [--out FILE.json]

For each matrix a decode step of one sequence multiplies (Granite-3.1-1B-A400M's shapes by default:
attention projections, router, each of the top-8 experts' two projections, the output head), the time of
one row times the matrix, in bfloat16, with weights cycling over copies that fill 256 MiB (so they come
from memory, not the cache, as a decode step's experts do): torch's ``mm`` (oneDNN, what transformers and
the exact kernels run) and ``engine/_gemv_jit.rows_bf16`` (the compiled kernel's loop, one matrix a call).
Prints per shape the best of 3 runs in microseconds and GB/s, and the sum over one token: the matrix
products' floor of a decode step on this machine for each. Results to stdout; ``--out`` also writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

SHAPES = {  # name -> [(matrix, in, out, count per token)]
    "granite": [
        ("q_proj", 1024, 1024, 24), ("k_proj", 1024, 512, 24), ("v_proj", 1024, 512, 24),
        ("o_proj", 1024, 1024, 24), ("router", 1024, 32, 24), ("expert gate_up", 1024, 1024, 192),
        ("expert down", 512, 1024, 192), ("lm_head", 1024, 49155, 1),
    ],
    "olmoe-4l": [
        ("q_proj", 2048, 2048, 4), ("k_proj", 2048, 2048, 4), ("v_proj", 2048, 2048, 4),
        ("o_proj", 2048, 2048, 4), ("router", 2048, 64, 4), ("expert gate_up", 2048, 2048, 32),
        ("expert down", 1024, 2048, 32), ("lm_head", 2048, 50304, 1),
    ],
}  # fmt: skip


def best_us(fn, copies: int) -> float:
    n = max(20, min(400, copies * 4))
    runs = []
    for _ in range(3):
        for i in range(5):
            fn(i)
        t = time.perf_counter()
        for i in range(n):
            fn(i)
        runs.append((time.perf_counter() - t) / n * 1e6)
    return min(runs)


def one_shape(k: int, n: int) -> tuple[float, float]:
    """(torch mm, compiled loop) microseconds for one row times an ``n x k`` bfloat16 matrix from memory."""
    from expertcache.engine import _gemv_jit

    copies = max(2, (256 << 20) // (n * k * 2))
    w = torch.randn(copies, n, k).bfloat16()
    words = w.view(copies, -1).view(torch.int32).numpy().view(np.uint32)
    x = torch.randn(1, k).bfloat16()
    xf = x.float().numpy()
    even, odd = np.ascontiguousarray(xf[:, 0::2]), np.ascontiguousarray(xf[:, 1::2])
    out = np.empty((1, n), dtype=np.float32)
    slots = [np.array([i], dtype=np.int64) for i in range(copies)]
    mm = best_us(lambda i: torch.mm(x, w[i % copies].t()), copies)
    loop = best_us(lambda i: _gemv_jit.rows_bf16(words, 0, n, k, slots[i % copies], even, odd, out), copies)
    return mm, loop


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="torch's and the loops' threads (default 2)")
    p.add_argument(
        "--shape", choices=sorted(SHAPES), default="granite", help="model shapes (default granite)"
    )
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args()
    if args.threads < 1:
        p.error("--threads must be at least 1")
    from expertcache.jit import numba

    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    rows, total = [], {"torch_mm": 0.0, "compiled": 0.0}
    for name, k, n, count in SHAPES[args.shape]:
        mm, loop = one_shape(k, n)
        gb = n * k * 2 / 1e3
        rows.append({"matrix": name, "in": k, "out": n, "per_token": count, "torch_mm_us": mm,
                     "compiled_us": loop})  # fmt: skip
        total["torch_mm"] += mm * count / 1e3
        total["compiled"] += loop * count / 1e3
        print(f"{name:15s} {k:5d} x {n:<6d} x{count:4d} a token: torch mm {mm:7.1f} us "
              f"({gb / mm:5.1f} GB/s), compiled {loop:7.1f} us ({gb / loop:5.1f} GB/s)")  # fmt: skip
    print(f"a decode token's matrix products: torch mm {total['torch_mm']:.1f} ms, "
          f"compiled {total['compiled']:.1f} ms")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "shape": args.shape, "rows": rows, "total_ms": total,
                       "torch": torch.__version__, "numba": numba.__version__}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
