"""Which of transformers' experts implementations the engine's kernels equal, bit for bit, on this machine:
the engine's greedy logits with ``kernel="eager"`` and ``kernel="grouped"``, at the tests' three budgets
(the smallest, a middle one, every expert), against transformers' own model run with each of its
implementations (``eager``, ``grouped_mm``, ``batched_mm``), and those against each other.

For each comparison: whether the greedy tokens are equal, the generated steps whose logits differ (step 0
is the prompt's), and the largest difference. ``bench/grouped_gpu.py`` compares single grouped calls; this
compares whole models, which is what ``tests/test_engine.py`` does under ``EXPERTCACHE_TEST_KERNEL``.

``python bench/grouped_exact_gpu.py --out FILE`` (a GPU; the tests' tiny models in float32 by default;
``--device cpu`` runs it on the CPU, a smoke test and the CPU's own answer).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from provenance import provenance, write_json  # bench/provenance.py

from expertcache.engine import load
from expertcache.engine.loader import load_reference
from expertcache.policy.registry import min_capacity
from expertcache.tools.compare import greedy
from expertcache.tools.tiny import PROMPT, TOP_K, make_tiny, make_tokenizer, moe_layers, total_experts

REFERENCES = ("eager", "grouped_mm", "batched_mm")


def difference(got, want) -> dict:
    """Tokens equal or not, the steps whose logits differ, the largest difference."""
    steps = [s for s in range(want[1].shape[0]) if not torch.equal(got[1][s], want[1][s])]
    top = max(((got[1][s] - want[1][s]).abs().max().item() for s in steps), default=0.0)
    return {
        "tokens_equal": got[0].tolist() == want[0].tolist(),
        "steps_differing": steps,
        "max_abs_diff": top,
    }


def words(d: dict) -> str:
    tokens = "equal" if d["tokens_equal"] else "DIFFER"
    return f"tokens {tokens}, steps {d['steps_differing']}, max {d['max_abs_diff']:.2g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--families", default="mixtral,qwen2_moe,olmoe", help="a comma list (default: %(default)s)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", help="write the results here as JSON (default: print them to stdout)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("grouped_exact_gpu.py: no GPU here (--device cpu runs it on the CPU)")
    warnings.simplefilter("ignore")
    ids = torch.tensor([PROMPT])
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = make_tokenizer(Path(tmp) / "tokenizer")
        for family in args.families.split(","):
            path = make_tiny(Path(tmp) / family, family, tokenizer)
            refs = {
                e: greedy(load_reference(path, args.dtype, args.device, experts=e), ids) for e in REFERENCES
            }
            row = {
                "family": family,
                "references": {e: difference(refs[e], refs["eager"]) for e in REFERENCES[1:]},
                "engine": [],
            }
            print(
                family,
                *(f"| transformers' {e} against its eager: {words(d)}" for e, d in row["references"].items()),
                file=sys.stderr,
            )
            with load(path, "100%", device="cpu", progress=False) as model:
                slot = model.layout.slot_bytes
            low, high = min_capacity("lru", moe_layers(family), {}, min_room=TOP_K), total_experts(family)
            for cap in sorted({low, (low + high) // 2, high}):
                for kernel in ("eager", "grouped"):
                    opts = dict(device=args.device, dtype=args.dtype, kernel=kernel, prefetch="none")
                    with load(path, cap * slot, progress=False, **opts) as model:
                        got = greedy(model, ids)
                        misses = model.stats["misses"]
                    vs = {e: difference(got, refs[e]) for e in REFERENCES[:2]}
                    row["engine"].append(
                        {"capacity": cap, "of": high, "kernel": kernel, "misses": misses, "vs": vs}
                    )
                    against = " | ".join(f"against {e}: {words(d)}" for e, d in vs.items())
                    print(
                        f"  {cap:2d}/{high} experts, kernel {kernel:7s} ({misses:3d} misses): {against}",
                        file=sys.stderr,
                        flush=True,
                    )
            results.append(row)
    result = {"provenance": provenance(), "device": args.device, "dtype": args.dtype, "families": results}
    if args.out:
        write_json(args.out, result)
    else:
        print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
