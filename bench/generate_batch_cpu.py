"""Batched generation on the CPU: throughput of ``generate_text`` at batch sizes 1, 4, 8 and 16, with the
expert cache at several budgets, embedded model, greedy; and how long the CLI takes to start.

Sixteen prompts (the first 60 characters of held-out standard-library files, ``tools.quality``), 32 new
tokens each (``min_new_tokens``, so every row runs to the end), host tier, no link emulation. Throughput
= new tokens of all prompts / wall time of all batches; medians of ``--repeats`` runs of the whole set,
after one warm-up batch. Hits and misses are the cache's over the whole set. Batched rows are checked
against transformers' own ``generate`` on the same left-padded batch (``exact``).

    OMP_NUM_THREADS=1 .venv/bin/python bench/generate_batch_cpu.py [--repeats 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch
from provenance import provenance, results_out, write_json

from expertcache.engine import load
from expertcache.engine.hub import DEFAULT_MODEL
from expertcache.engine.loader import load_reference
from expertcache.tools.quality import heldout_texts

PROMPTS = 16
NEW = 32


def run(budget: str, batch: int, prompts: list[str], repeats: int) -> dict[str, object]:
    with load(None, expert_memory=budget, device="cpu", slow_tier="host", progress=False) as m:
        m.generate_text(prompts[:batch], 4, batch_size=batch)  # warm-up
        times, results = [], None
        before = m.stats
        for _ in range(repeats):
            start = time.perf_counter()
            results = m.generate_text(prompts, NEW, batch_size=batch, min_new_tokens=NEW)
            times.append(time.perf_counter() - start)
        after = m.stats
        tokens = sum(len(g.tokens) for g in results)
        return {
            "budget": budget,
            "batch_size": batch,
            "capacity_experts": m.capacity,
            "wall_s_runs": times,
            "tokens": tokens,
            "tokens_per_s": tokens / statistics.median(times),
            "hits": (after["hits"] - before["hits"]) // repeats,
            "misses": (after["misses"] - before["misses"]) // repeats,
            "rows": [g.tokens for g in results],
        }


def exact(prompts: list[str], batch: int, rows: list[list[int]]) -> bool:
    """Rows equal transformers' generate on the same left-padded batches."""
    with load(None, device="cpu", progress=False) as m:
        tok = m.tokenizer
    ref = load_reference(DEFAULT_MODEL)
    want = []
    for i in range(0, len(prompts), batch):
        enc = tok(prompts[i : i + batch], return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = ref.generate(**enc, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                               pad_token_id=tok.pad_token_id)  # fmt: skip
        want += out[:, enc.input_ids.shape[1] :].tolist()
    return want == rows


def startup() -> dict[str, float]:
    """Median wall time of CLI commands that should not pay for torch."""
    exe = [sys.executable, "-m", "expertcache.cli"]
    out = {}
    for name, argv in {"--help": ["--help"], "policies": ["policies"], "timing": ["timing"]}.items():
        times = []
        for _ in range(5):
            start = time.perf_counter()
            subprocess.run(exe + argv, capture_output=True, check=True)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", nargs="+", default=["100%", "50%", "25%"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--out", help="results file (default: bench/results/generate_batch_cpu.json for the documented run)"
    )
    args = p.parse_args()
    args.out = str(results_out(p, args, "generate_batch_cpu.json", at_least=("repeats",)))
    torch.set_num_threads(1)
    prompts = [t[:60] for t in heldout_texts(PROMPTS)]
    rows = []
    for budget in args.budgets:
        for batch in args.batches:
            r = run(budget, batch, prompts, args.repeats)
            r["exact"] = exact(prompts, batch, r.pop("rows"))
            rows.append(r)
            print(f"{budget:>5} batch {batch:2d}: {r['tokens_per_s']:7.1f} tok/s  hits {r['hits']:6d}  "
                  f"misses {r['misses']:5d}  exact {r['exact']}", file=sys.stderr, flush=True)  # fmt: skip
    result = {"provenance": provenance(), "prompts": len(prompts), "new_tokens": NEW, "rows": rows,
              "cli_startup_s": startup()}  # fmt: skip
    write_json(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
