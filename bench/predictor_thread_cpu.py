"""The predictor inline against on its own thread (``predictor_thread``), demo model, CPU.

Same setting as ``prefetch_cpu.py``'s demo rows: LRU, host tier, emulated link at 3.19 GB/s + 5 us
(one expert's transfer = 3x its compute), 64 new tokens of the ``engine_cpu`` prompt after an 8-token
warm-up, medians of ``--repeats`` generations; prefetch + preemption + reorder (the engine's defaults,
chunking off). Tokens of every run are checked against the on-demand run's.

    OMP_NUM_THREADS=1 .venv/bin/python bench/predictor_thread_cpu.py [--repeats 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from engine_cpu import PROMPT
from provenance import ROOT, provenance, write_json

from expertcache.engine import load


def run(budget: str, args, **kw) -> dict[str, object]:
    with load(
        None,
        expert_memory=budget,
        slow_tier="host",
        progress=False,
        link_bandwidth=args.bandwidth,
        link_latency=args.latency,
        chunking=False,
        **kw,
    ) as m:
        m.generate_text(PROMPT, 8, min_new_tokens=8)
        runs = []
        for _ in range(args.repeats):
            g = m.generate_text(PROMPT, args.new_tokens, min_new_tokens=args.new_tokens)
            steps = len(g.tokens) - 1
            runs.append(
                {"tokens": g.tokens, "tpot_s": g.tpot_s, "stall_s": g.stats["decode_stall_s"] / steps}
            )
    return {
        "tpot_s": statistics.median(r["tpot_s"] for r in runs),
        "decode_stall_per_step_s": statistics.median(r["stall_s"] for r in runs),
        "tokens": runs[0]["tokens"],
        "same_tokens_every_repeat": all(r["tokens"] == runs[0]["tokens"] for r in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", nargs="+", default=["25%", "50%"])
    ap.add_argument("--predictors", nargs="+", default=["learned", "next-gate"])
    ap.add_argument("--bandwidth", default="3.19GB/s")
    ap.add_argument("--latency", default="5us")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "predictor_thread_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for budget in args.budgets:
        base = run(budget, args, prefetch="none", preemption=False, reorder=False)
        rows.append({"budget": budget, "config": "on-demand", **base})
        for name in args.predictors:
            for thread in (False, True):
                r = run(budget, args, prefetch=name, predictor_thread=thread)
                assert r["tokens"] == base["tokens"], f"{budget} {name} thread={thread}: tokens differ"
                label = f"{name} {'thread' if thread else 'inline'}"
                rows.append({"budget": budget, "config": label, **r})
                print(
                    f"{budget:>4} {label:18} TPOT {r['tpot_s'] * 1e3:5.2f} ms "
                    f"(on-demand {base['tpot_s'] * 1e3:5.2f}) stall/step "
                    f"{r['decode_stall_per_step_s'] * 1e3:5.3f} ms "
                    f"(on-demand {base['decode_stall_per_step_s'] * 1e3:5.3f})",
                    flush=True,
                )
    for r in rows:
        r.pop("tokens")
    write_json(args.out, {"provenance": provenance(), "args": vars(args), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
