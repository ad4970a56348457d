"""Packed experts on a GPU: the Triton kernels against bfloat16, and what one miss costs in each format.

At one expert's shapes (default Mixtral-8x7B: hidden 4096, expert FFN 14336, bf16), for bf16 and each of
``--formats`` (default int8 and int4 at group 64, expertcache's own; also GPT-OSS's ``mxfp4`` and
block-scaled ``fp8``, 128 x 128, as the checkpoints of other tools store them), each expert held in pinned
host memory as a slot of the engine's layout:

- ``kernel``: one token through one resident expert (gate_up, the activation, down): bf16 with
  ``F.linear`` (the engine's full-precision path), packed with ``PackedKernels.rows`` (``_packed_triton``);
  also torch's ``_weight_int8pack_mm`` on the int8 matrices for comparison, and the effective bytes per
  second of each;
- ``transfer``: the slot's bytes host-to-device (pinned, one copy, as the transfer worker moves them);
- ``miss``: a miss served on demand, transfer then compute, serially (what the step waits for without
  prefetching), and its ratio to bf16's: the target is int4 at most 0.35x;
- ``blocks``: a sweep of the Triton kernels' block sizes per matrix (what ``_packed_triton.blocks`` fixes);
- a check that each packed kernel equals the product with the expanded matrices (float32, rtol 1e-3).

Medians of ``--reps`` timed runs after warm-up, CUDA events. Writes ``--out`` (JSON) and prints a table.

    python3 bench/packed_gpu.py --out bench/results/packed_gpu_h100.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from provenance import provenance, write_json
from torch.nn import functional as F

from expertcache.engine.memory import SlotLayout, SlotPool
from expertcache.engine.packed import MATRICES, Packed, PackedKernels, SiluExperts
from expertcache.tools.published import quantize_fp8, quantize_mxfp4

SHAPES = {"mixtral-8x7b": (4096, 14336), "qwen15-moe-a2.7b": (2048, 1408), "qwen3-30b-a3b": (2048, 768),
          "gpt-oss-20b": (2880, 2880), "deepseek-v3": (7168, 2048)}  # fmt: skip
FORMATS = ("int8", "int4", "mxfp4", "fp8")


_Module = SiluExperts  # what the kernels read of an experts module


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        runs.append(a.elapsed_time(b) / 1e3)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mixtral-8x7b")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-sweep", action="store_true", help="skip the block-size sweep")
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=["int8", "int4"])
    args = ap.parse_args()
    dev = torch.device("cuda")
    H, Fd = SHAPES[args.shape]
    shapes = {"gate_up_proj": (2 * Fd, H), "down_proj": (H, Fd)}
    torch.manual_seed(0)
    full = {n: (torch.randn(*s, device=dev) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    mod = _Module
    rows = []

    # bf16: the engine's full-precision expert
    layout = SlotLayout.of(shapes, torch.bfloat16)
    host = SlotPool(layout, 1, torch.device("cpu"), pin=True)
    slot = SlotPool(layout, 1, dev)
    for n in shapes:
        host.views[0][n].copy_(full[n])
        slot.views[0][n].copy_(full[n])

    def bf16_expert(v=slot.views[0]):
        gate, up = F.linear(x, v["gate_up_proj"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, v["down_proj"])

    def copy(dst, src):
        return lambda: dst.copy_(src, non_blocking=True)

    bf16 = {
        "format": "bf16", "bytes": layout.nbytes, "kernel_s": timed(bf16_expert, args.reps),
        "transfer_s": timed(copy(slot.buffer, host.buffer), args.reps),
    }  # fmt: skip
    bf16["miss_s"] = timed(lambda: (copy(slot.buffer, host.buffer)(), bf16_expert()), args.reps)
    rows.append(bf16)
    checks = {}
    for fmt in args.formats:
        p, stored = packed(fmt, shapes, full)
        group = p.group
        k = PackedKernels(p)
        hostp = SlotPool(k.layout, 1, torch.device("cpu"), pin=True)
        pool = SlotPool(k.layout, 1, dev)
        for n, t in stored.items():
            hostp.views[0][n].copy_(t)
            pool.views[0][n].copy_(t)
        ids = torch.zeros(1, dtype=torch.int64, device=dev)
        # correctness: each matrix against the expanded product (float32)
        for name in MATRICES:
            r, c = p.matrix(name)
            xi = torch.randn(1, c, device=dev)
            got = k.project(name, pool.buffer, ids, xi)[0]
            w = p.expand(pool.views[0], name)  # another tool's: the model's weights, in its dtype
            want = (w.to(p.dtype).float() if p.method else w) @ xi[0]
            err = float((got - want).abs().max() / want.abs().max())
            checks[f"{fmt}.{name}"] = err
            assert err < 1e-3, (fmt, name, err)

        def packed_expert(k=k, pool=pool, ids=ids):
            return k.rows(mod, pool.buffer, ids, x)

        row = {
            "format": describe(fmt, group), "bytes": k.layout.nbytes,
            "kernel_s": timed(packed_expert, args.reps),
            "transfer_s": timed(copy(pool.buffer, hostp.buffer), args.reps),
        }  # fmt: skip
        move = copy(pool.buffer, hostp.buffer)
        row["miss_s"] = timed(lambda move=move, f=packed_expert: (move(), f()), args.reps)
        if fmt == "int8":  # torch's own weight-only int8 kernel on the same matrices
            q = {n: pool.views[0][f"{n}.q"].view(torch.int8).view(*p.matrix(n)) for n in MATRICES}
            sc = {n: pool.views[0][f"{n}.scale"].view(torch.float32).to(torch.bfloat16) for n in MATRICES}

            def torch_int8(q=q, sc=sc):
                gate, up = torch._weight_int8pack_mm(x, q["gate_up_proj"], sc["gate_up_proj"]).chunk(2, -1)
                return torch._weight_int8pack_mm(F.silu(gate) * up, q["down_proj"], sc["down_proj"])

            try:
                row["torch_int8pack_kernel_s"] = timed(torch_int8, args.reps)
            except RuntimeError as exc:
                row["torch_int8pack_kernel_s"] = None
                row["torch_int8pack_error"] = str(exc).splitlines()[0]
        row["blocks"] = [] if args.no_sweep else sweep(p, k, pool, ids, args.reps)
        rows.append(row)
    for r in rows:
        r["kernel_bytes_per_s"] = r["bytes"] / r["kernel_s"]
        r["miss_vs_bf16"] = r["miss_s"] / bf16["miss_s"]
    print(f"{args.shape}: one token through one expert, on {torch.cuda.get_device_name(dev)}")
    print(f"{'format':10s} {'MB':>8s} {'kernel ms':>10s} {'GB/s':>7s} {'transfer ms':>12s} {'miss ms':>8s} "
          f"{'miss/bf16':>9s}")  # fmt: skip
    for r in rows:
        print(f"{r['format']:10s} {r['bytes'] / 1e6:8.1f} {r['kernel_s'] * 1e3:10.3f} "
              f"{r['kernel_bytes_per_s'] / 1e9:7.0f} {r['transfer_s'] * 1e3:12.3f} {r['miss_s'] * 1e3:8.3f} "
              f"{r['miss_vs_bf16']:9.3f}")  # fmt: skip
        if r.get("torch_int8pack_kernel_s"):
            print(f"{'  torch int8pack':18s} {r['torch_int8pack_kernel_s'] * 1e3:10.3f}")
        for b in r.get("blocks", []):
            print(f"    {b['matrix']:13s} BLOCK_N {b['block_n']:3d} block {b['block']:4d}: "
                  f"{b['s'] * 1e6:8.1f} us" + ("  (fixed)" if b["fixed"] else ""))  # fmt: skip
    body = {**provenance(), "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
            "shape": args.shape, "hidden": H, "ffn": Fd, "reps": args.reps, "checks": checks,
            "rows": rows}  # fmt: skip
    if args.out:
        write_json(args.out, body)


def packed(fmt: str, shapes: dict, full: dict) -> tuple[Packed, dict[str, torch.Tensor]]:
    """The format's description and one expert's stored tensors (slot names -> CPU tensors)."""
    cpu = {n: w.float().cpu() for n, w in full.items()}
    if fmt in ("int8", "int4"):
        p = Packed(fmt, 64 if fmt == "int4" else 0, shapes, torch.bfloat16, False)
        return p, p.pack(cpu)
    if fmt == "mxfp4":
        p = Packed("mxfp4", 32, shapes, torch.bfloat16, False, method="mxfp4")
        stored = {}
        for n in MATRICES:
            stored[f"{n}.q"], stored[f"{n}.scale"] = quantize_mxfp4(cpu[n])
        return p, stored
    (rows, hidden), block = shapes["gate_up_proj"], (128, 128)
    parts = (("gate_up_proj", (rows // 2, rows // 2)), ("down_proj", (hidden,)))
    p = Packed("fp8", 0, shapes, torch.bfloat16, False, block=block, parts=parts, method="fp8")
    stored = {}
    for n in MATRICES:
        qs, ss = zip(*(quantize_fp8(part, block) for part in cpu[n].split(dict(parts)[n])), strict=True)
        stored[f"{n}.q"] = torch.cat(qs).view(torch.uint8)
        stored[f"{n}.scale"] = torch.cat(ss).unsqueeze(-1).view(torch.uint8)
    return p, stored


def describe(fmt: str, group: int) -> str:
    return f"{fmt}-g{group}" if fmt == "int4" else fmt


def sweep(p: Packed, k: PackedKernels, pool: SlotPool, ids: torch.Tensor, reps: int) -> list[dict]:
    """Each matrix's projection under several block sizes (the fixed ones marked)."""
    from expertcache.engine import _packed_triton  # Triton: imported where a GPU runs

    out = []
    fixed = _packed_triton.blocks
    for name in MATRICES:
        r, c = p.matrix(name)
        xi = torch.randn(1, c, device=pool.buffer.device, dtype=torch.bfloat16)
        at = k.offsets_of(name)
        extras = k._gpu_extras(name, pool.buffer.device)  # fp8's scale rows, block columns, rounding
        steps = {"int8": (128, 256, 512), "fp8": (32, 64, 128), "mxfp4": (2, 4, 8, 16, 32)}.get(
            p.format, (1, 2, 4, 8)
        )
        options = [(n, b) for n in (8, 16, 32, 64) for b in steps]
        want = fixed(p.format, r, c, p.block[1] if p.format == "fp8" else p.group)
        for block_n, block in options:
            _packed_triton.blocks = lambda *a, bn=block_n, bb=block: (bn, bb)  # noqa: E731
            try:
                s = timed(
                    lambda at=at, r=r, c=c, xi=xi, extras=extras: _packed_triton.project(
                        p.format, p.group, pool.buffer, at, r, c, ids, xi, **extras
                    ),
                    reps,
                )
            finally:
                _packed_triton.blocks = fixed
            out.append({"matrix": name, "block_n": block_n, "block": block, "s": s,
                        "fixed": (block_n, block) == want})  # fmt: skip
    return out


if __name__ == "__main__":
    main()
