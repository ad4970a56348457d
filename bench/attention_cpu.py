"""One decode query's attention on a CPU: torch's ``scaled_dot_product_attention`` in bfloat16 and float32
against eager's products (two matrix products and a float32 softmax, the key-value heads repeated).

    .venv/bin/python bench/attention_cpu.py [--keys 100 1000] [--heads 16] [--kv-heads 8] [--dim 64] \\
        [--threads 2] [--calls 2000] [--out FILE]

The shapes default to the Granite-3.1-1B-A400M configuration's attention. Each figure is the best of 5
runs of ``--calls`` calls, in microseconds a call; results to stdout, JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time


def best_us(fn, calls: int) -> float:
    for _ in range(100):
        fn()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t) / calls * 1e6)
    return min(runs)


def eager_products(q, k, v, scale: float, dtype):
    """transformers' eager attention's arithmetic on repeated key-value heads, without a mask."""
    import torch

    return torch.softmax((q @ k.transpose(2, 3)) * scale, -1, dtype=torch.float32).to(dtype) @ v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from torch.nn import functional as F

    torch.set_num_threads(args.threads)
    rep = args.heads // args.kv_heads
    scale = args.dim**-0.5
    results = []
    print("| keys | dtype | sdpa us | eager products us |")
    print("|---|---|---|---|")
    for keys in args.keys:
        for dtype in (torch.bfloat16, torch.float32):
            q = torch.randn(1, args.heads, 1, args.dim, dtype=dtype)
            k, v = (torch.randn(1, args.kv_heads, keys, args.dim, dtype=dtype) for _ in range(2))
            kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            sdpa = best_us(
                lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True),
                args.calls,
            )
            eager = best_us(
                lambda q=q, kr=kr, vr=vr, dt=dtype: eager_products(q, kr, vr, scale, dt), args.calls
            )
            name = str(dtype).removeprefix("torch.")
            print(f"| {keys} | {name} | {sdpa:.1f} | {eager:.1f} |")
            results.append({"keys": keys, "dtype": name, "sdpa_us": sdpa, "eager_us": eager})
    if args.out:
        from provenance import provenance, write_json

        write_json(args.out, {"provenance": provenance(), "settings": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
