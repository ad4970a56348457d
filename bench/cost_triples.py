"""The cost triple of one expert, measured on this machine: link, device compute, host compute.

Every miss path decides by these figures (SPEC: "a cost triple per expert and per precision, measured on
the user's machine, is what every one of these decisions needs"). For each expert shape (Mixtral-8x7B,
Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B by default) and dtype this measures, with random weights:

- link: pinned host -> device copies of one expert at full precision and of its quantised copies
  (int8/int4/int2, group-wise, as ``expertcache quantize`` writes them), fitted to ``latency + bytes / bw``;
- device compute: one expert's forward (gate_up, activation, down: transformers' eager operations) on
  n tokens, fitted to ``a + b * n``; and the dequantisation of each quantised copy on the device;
- host compute: the same forward on the CPU (all cores, ``torch.get_num_threads()``), fitted to ``a + b*n``.

On a machine without a GPU the device is the CPU and the link is a host memory copy: the figures then
describe that machine, not a GPU one. Results go to ``--out`` (JSON) and a summary to stdout:

    python bench/cost_triples.py --out bench/results/cost_triples_h100.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from provenance import provenance, write_json

SHAPES = {  # hidden H, expert intermediate F (gate_up [2F, H], down [H, F])
    "mixtral-8x7b": (4096, 14336),
    "qwen1.5-moe-a2.7b": (2048, 1408),
    "qwen3-30b-a3b": (2048, 768),
}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
HOST_TOKENS = (1, 4, 16, 64)
BITS = (8, 4, 2)
GROUP = 64


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (each synchronised)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit(xs, ys) -> tuple[float, float]:
    """Least squares ``y = a + b * x`` (a, b clamped at 0)."""
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return max(float(a), 0.0), max(float(b), 0.0)


def expert(x, gate_up, down):
    gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down)


def measure_compute(h: int, f: int, dtype, device, tokens, reps: int) -> dict[str, object]:
    gate_up = torch.randn(2 * f, h, device=device, dtype=dtype) * 0.02
    down = torch.randn(h, f, device=device, dtype=dtype) * 0.02
    samples = []
    for n in tokens:
        x = torch.randn(n, h, device=device, dtype=dtype)
        samples.append((n, timeit(lambda x=x: expert(x, gate_up, down), device, reps)))
    a, b = fit(*zip(*samples, strict=True))
    return {"samples": samples, "a_s": a, "b_s_per_token": b}


def measure_link(nbytes: list[int], device, reps: int) -> dict[str, object]:
    samples = []
    for n in nbytes:
        src = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
        src.random_(0, 255)
        dst = torch.empty(n, dtype=torch.uint8, device=device)
        samples.append((n, timeit(lambda s=src, d=dst: d.copy_(s, non_blocking=True), device, reps)))
    lat, inv_bw = fit(*zip(*samples, strict=True))
    return {"samples": samples, "latency_s": lat, "bandwidth_Bps": 1 / inv_bw if inv_bw else None}


def measure_quant(h: int, f: int, dtype, device, reps: int) -> dict[str, object]:
    from hqq.core.quantize import Quantizer

    w = torch.randn(2 * f, h, dtype=torch.float32) * 0.02
    out = {}
    for bits in BITS:
        wq, meta = Quantizer.quantize(w, nbits=bits, group_size=GROUP, axis=1, optimize=False, device="cpu")
        wq = wq.to(device)
        meta = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in meta.items()}
        meta["compute_dtype"] = dtype
        stored = wq.numel() * wq.element_size() + 2 * meta["scale"].numel() * 2  # scale, zero in 16 bits
        secs = timeit(lambda wq=wq, meta=meta: Quantizer.dequantize(wq, meta), device, reps)
        out[f"int{bits}"] = {"bytes_per_gate_up": stored, "dequant_gate_up_s": secs}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--host-reps", type=int, default=5)
    p.add_argument("--no-quant", action="store_true", help="skip the quantised copies (no hqq)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    size = torch.empty((), dtype=dtype).element_size()
    result = {"provenance": provenance(), "device": str(device), "dtype": args.dtype,
              "host_threads": torch.get_num_threads(), "shapes": {}}  # fmt: skip
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    for name in args.shapes:
        h, f = SHAPES[name]
        expert_bytes = 3 * h * f * size
        row = {"hidden": h, "intermediate": f, "expert_bytes": expert_bytes}
        print(f"{name}: expert {expert_bytes / 2**20:.1f} MiB", file=sys.stderr, flush=True)
        sizes = sorted({expert_bytes, expert_bytes // 2, expert_bytes // 4, expert_bytes // 8, 2**20})
        row["link"] = measure_link(sizes, device, args.reps)
        row["device_compute"] = measure_compute(h, f, dtype, device, TOKENS, args.reps)
        row["host_compute"] = measure_compute(h, f, dtype, torch.device("cpu"), HOST_TOKENS, args.host_reps)
        if dtype != torch.float32:
            row["host_compute_fp32"] = measure_compute(
                h, f, torch.float32, torch.device("cpu"), HOST_TOKENS, args.host_reps
            )
        if not args.no_quant:
            row["quant"] = measure_quant(h, f, dtype, device, args.reps)
        result["shapes"][name] = row
        link, dev, host = row["link"], row["device_compute"], row["host_compute"]
        bw = link["bandwidth_Bps"] or float("inf")
        print(
            f"  link {bw / 1e9:.2f} GB/s + {link['latency_s'] * 1e6:.1f} us -> expert "
            f"{(link['latency_s'] + expert_bytes / bw) * 1e3:.3f} ms | device {dev['a_s'] * 1e3:.3f} ms + "
            f"{dev['b_s_per_token'] * 1e6:.2f} us/token | host {host['a_s'] * 1e3:.3f} ms + "
            f"{host['b_s_per_token'] * 1e6:.1f} us/token",
            flush=True,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
