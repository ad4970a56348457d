"""Every miss path against transformers' eager reference, on this machine's device: tokens and logits.

For tiny random-weight checkpoints of every supported family (built here, as the tests build them, with
the embedded model's tokenizer), each miss path generates ``--new-tokens`` greedily from a fixed prompt
through the engine at a small and a middle budget, with prefetching off and on, and is compared with the
same checkpoint run by transformers' eager loop (every expert resident) on the same device and dtype:
are the tokens the same, and how far apart are the logits (largest absolute difference, over the
largest logit). ``host`` and ``hybrid`` get fixed costs that send some misses to the host and others
over the link, so both routes run. ``hobbit`` needs the int copies: they are built first (HQQ, groups of
32). On a CPU the fetch, host, hybrid and placement paths must be bit-exact; on a GPU the host paths
compute on the CPU and round as it does, and bf16 rounds differently from fp32 wherever summation order
changes (split's two products): this measures by how much.

    .venv/bin/python bench/miss_exactness.py --device cuda --dtype bfloat16 float32
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from provenance import ROOT, provenance, write_json

from expertcache.costs import CostModel
from expertcache.engine import load
from expertcache.engine.families import FAMILIES as ENGINE_FAMILIES
from expertcache.engine.loader import load_reference
from expertcache.engine.random_checkpoint import make_checkpoint
from expertcache.tools.quantize import quantize_model

FAMILIES = tuple(ENGINE_FAMILIES)  # every family the engine supports
PATHS = (
    "fetch", "host", "hybrid", "placement", "placement:first=1", "split:theta=0.5,buffer=1",
    "split:theta=0.3/0.7", "hobbit:t1=1,t2=1,group=32", "hobbit:bits=8,t1=-1", "hobbit:group=32",
)  # fmt: skip
PROMPT = [5, 17, 42, 99, 120, 7, 250, 33]
COSTS = CostModel(
    expert_s=1e-3, expert_token_s=1e-4, host_expert_s=2e-3, host_expert_token_s=1e-3,
    link_bandwidth=1e6, link_latency=0.0, expert_bytes=3000, chunk_bytes=None,
)  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def greedy(model, ids: torch.Tensor, new: int) -> tuple[list[int], torch.Tensor]:
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    return out.sequences[0].tolist(), torch.stack(out.logits).float().cpu()


def checkpoint(root: Path, family: str, dtype: str) -> Path:
    layers = 3 if family.startswith("deepseek") else 2
    path = make_checkpoint(
        root / f"{family}-{dtype}", family, hidden=64, layers=layers, experts=8, top_k=2, intermediate=64,
        heads=4, seed=0, dtype=dtype,
    )  # fmt: skip
    quantize_model(path, bits=(8, 4), group=32, progress=False)
    return path


def run(path: Path, args, dtype: str, device: str) -> list[dict[str, object]]:
    ids = torch.tensor([PROMPT], device=device)
    ref = load_reference(path, dtype=getattr(torch, dtype), device=device)
    want_tokens, want_logits = greedy(ref, ids, args.new_tokens)
    del ref
    rows = []
    with load(path, device=device, dtype=dtype, progress=False) as whole:
        slot, total = whole.layout.slot_bytes, whole.num_layers * whole.num_experts
    for miss in PATHS:
        for experts in sorted({6, total // 2 + 2}):
            for prefetch in ("none", "next-gate"):
                kw = {"costs": COSTS} if miss in ("host", "hybrid") else {}
                with load(path, expert_memory=experts * slot, miss=miss, prefetch=prefetch, device=device,
                          dtype=dtype, progress=False, **kw) as model:  # fmt: skip
                    tokens, logits = greedy(model, ids, args.new_tokens)
                    stats = model.stats
                diff = float((logits - want_logits).abs().max())
                rows.append({
                    "miss": miss, "budget_experts": experts, "prefetch": prefetch,
                    "tokens_equal": tokens == want_tokens,
                    "logits_equal": bool(torch.equal(logits, want_logits)),
                    "max_abs_logit_diff": diff, "max_logit": float(want_logits.abs().max()),
                    "host_computed": stats["host_computed"], "low_precision": stats["low_precision"],
                    "hits": stats["hits"], "misses": stats["misses"],
                })  # fmt: skip
    return rows


def summarise(results: list[dict[str, object]]) -> str:
    """Per dtype and path: configurations with equal tokens, bit-equal logits, the largest difference."""
    lines = [
        "| dtype | path | tokens equal | logits bit-equal | largest logit difference |",
        "|---|---|---:|---:|---:|",
    ]
    keys = sorted({(r["dtype"], r["miss"]) for r in results}, key=lambda k: (k[0], PATHS.index(k[1])))
    for dtype, miss in keys:
        rows = [r for r in results if (r["dtype"], r["miss"]) == (dtype, miss)]
        eq = sum(r["tokens_equal"] for r in rows)
        bit = sum(r["logits_equal"] for r in rows)
        worst = max(r["max_abs_logit_diff"] for r in rows)
        lines.append(f"| {dtype} | {miss} | {eq}/{len(rows)} | {bit}/{len(rows)} | {worst:.2e} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or ROOT / "bench" / "results" / f"miss_exactness_{args.device.split(':')[0]}.json"
    torch.manual_seed(0)
    results: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtype:
            for family in args.families:
                log(f"{family} {dtype}")
                path = checkpoint(Path(tmp), family, dtype)
                results += [
                    {"family": family, "dtype": dtype, **r} for r in run(path, args, dtype, args.device)
                ]
                out.parent.mkdir(parents=True, exist_ok=True)
                device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
                write_json(out, {"provenance": provenance(), "device": device, "results": results})
    print(summarise(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
