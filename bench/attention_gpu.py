"""Decode attention on a GPU as the engine and the server call it: one query a step over a key length that
grows by one each step, so that every call has a shape the process has not seen before.

    python3 bench/attention_gpu.py [--heads 16] [--kv-heads 16] [--dim 128] [--start 60] [--steps 64] \\
        [--backends default no-cudnn cudnn flash efficient math] [--device cpu] [--out FILE]

Why: on the H100 (torch 2.11) the server's generation thread spent 62 % of a single request's decode
step on the line of transformers' ``sdpa_attention_forward`` that calls
``torch.nn.functional.scaled_dot_product_attention`` on a freshly started machine, and 10 % on the same
machine a minute later; engine runs' first configuration decoded several times slower than the next ones
with the same prompt length. One explanation fits both: a backend that builds a kernel plan per shape
(cuDNN's attention graphs), whose compiled kernels a warm machine finds in the driver's JIT cache. This
script measures it: each backend set runs in a process of its own, twice, with the driver's JIT cache on
and off (``CUDA_CACHE_DISABLE=1``, as on a fresh machine), with the server's mask (an additive
``(1, 1, 1, keys)`` mask, transformers' continuous batching) and without (``generate``, one sequence).
Per run: the backend torch picks, the first call at each new key length (median and sum over the steps)
and a second pass over the same lengths (median). Results to stdout, JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BACKENDS = {  # name: torch.nn.attention.SDPBackend members allowed (None: torch's own priority)
    "default": None,
    "no-cudnn": ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"),
    "cudnn": ("CUDNN_ATTENTION",),
    "flash": ("FLASH_ATTENTION",),
    "efficient": ("EFFICIENT_ATTENTION",),
    "math": ("MATH",),
}


def one(args) -> dict[str, object]:
    """This process's run of one backend set, with or without the mask."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    dev, dt = args.device, torch.bfloat16
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    allowed = BACKENDS[args.one]
    ctx = (lambda: sdpa_kernel([getattr(SDPBackend, b) for b in allowed])) if allowed else None
    gqa = args.heads != args.kv_heads
    torch.manual_seed(0)
    warm = torch.randn(1, args.heads, 8, args.dim, device=dev, dtype=dt)  # the library's one-time setup
    sdpa(warm, warm[:, : args.kv_heads], warm[:, : args.kv_heads], enable_gqa=gqa)
    sync()

    def call(keys: int) -> float:
        q = torch.randn(1, args.heads, 1, args.dim, device=dev, dtype=dt)
        k, v = (torch.randn(1, args.kv_heads, keys, args.dim, device=dev, dtype=dt) for _ in range(2))
        mask = torch.zeros(1, 1, 1, keys, device=dev, dtype=dt) if args.mask else None
        sync()
        t = time.perf_counter()
        if ctx:
            with ctx():
                sdpa(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            sdpa(q, k, v, attn_mask=mask, enable_gqa=gqa)
        sync()
        return time.perf_counter() - t

    lengths = range(args.start, args.start + args.steps)
    first = [call(n) for n in lengths]
    again = [call(n) for n in lengths]
    q = torch.randn(1, args.heads, 1, args.dim, device=dev, dtype=dt)
    k = torch.randn(1, args.kv_heads, args.start, args.dim, device=dev, dtype=dt)
    mask = torch.zeros(1, 1, 1, args.start, device=dev, dtype=dt) if args.mask else None
    try:
        from torch.backends.cuda import SDPAParams, can_use_cudnn_attention, can_use_flash_attention

        params = SDPAParams(q, k, k, mask, 0.0, False, gqa)
        usable = {"cudnn": can_use_cudnn_attention(params), "flash": can_use_flash_attention(params)}
    except Exception as exc:  # the probe's signature differs between torch versions
        usable = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    try:
        chosen = SDPBackend(torch._fused_sdp_choice(q, k, k, mask, 0.0, False, enable_gqa=gqa)).name
    except Exception as exc:
        chosen = f"unknown ({type(exc).__name__})"
    return {
        "backends": args.one, "mask": args.mask, "jit_cache": os.environ.get("CUDA_CACHE_DISABLE") != "1",
        "torch_choice_unrestricted": chosen, "usable": usable,
        "first_call_median_us": statistics.median(first) * 1e6, "first_calls_sum_ms": sum(first) * 1e3,
        "first_call_max_us": max(first) * 1e6, "repeat_median_us": statistics.median(again) * 1e6,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=16, help="query heads (default 16: Qwen1.5-MoE's)")
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--start", type=int, default=60, help="the first key length (default 60)")
    ap.add_argument("--steps", type=int, default=64, help="key lengths, one new each (default 64)")
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke test")
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", choices=list(BACKENDS), help=argparse.SUPPRESS)  # a child's backend set
    ap.add_argument("--mask", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        try:
            print(json.dumps(one(args)))
        except Exception as exc:  # a backend that cannot take these shapes
            print(
                json.dumps(
                    {"backends": args.one, "mask": args.mask, "error": f"{type(exc).__name__}: {exc}"[:300]}
                )
            )
        return 0
    common = ["--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--dim", str(args.dim),
              "--start", str(args.start), "--steps", str(args.steps), "--device", args.device]  # fmt: skip
    rows = []
    print("| backends | mask | JIT cache | torch's pick, all allowed | first call median us | sum ms "
          "| max us | again us |")  # fmt: skip
    print("|---|---|---|---|---:|---:|---:|---:|")
    for cache in ("0", "1"):
        for mask in ([], ["--mask"]):
            for name in args.backends:
                env = {**os.environ, "CUDA_CACHE_DISABLE": cache}
                out = subprocess.run([sys.executable, __file__, "--one", name, *mask, *common], env=env,
                                     capture_output=True, text=True, timeout=300)  # fmt: skip
                lines = out.stdout.strip().splitlines()
                row = json.loads(lines[-1]) if lines else {"backends": name, "error": out.stderr[-300:]}
                rows.append(row)
                if "error" in row:
                    print(f"| {name} | {bool(mask)} | {cache == '0'} | error: {row['error'][:80]} | | | | |")
                    continue
                print(f"| {name} | {row['mask']} | {row['jit_cache']} | {row['torch_choice_unrestricted']} | "
                      f"{row['first_call_median_us']:.0f} | {row['first_calls_sum_ms']:.1f} | "
                      f"{row['first_call_max_us']:.0f} | {row['repeat_median_us']:.0f} |",
                      flush=True)  # fmt: skip
    if args.out:
        from provenance import provenance, write_json

        write_json(args.out, {"provenance": provenance(), "settings": vars(args), "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
