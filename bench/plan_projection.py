"""Plans for Mixtral-8x7B and Qwen1.5-MoE on a 24 GB GPU over PCIe 4 (timing model, declared costs).

The machine, the traces, the expert memory and the cost model are ``bench/miss_projection.py``'s: device
and host compute measured on an H100 machine, the link declared (PCIe 4.0 x16, 25 GB/s + 10 us per
chunk), the expert memory what 24 GiB leaves after the dense weights and a 2 GiB workspace. The planner
(``expertcache.sim.planner.make_plan``) compares its layouts (shared, uniform, AdapMoE's knapsack, Fate's,
MoEpic's split configuration) with the miss paths ``fetch``, ``host`` and ``hybrid`` and chooses by TPOT.

Reported: every candidate, the chosen plan, on-demand LRU (shared cache, fetch), OPT's on-demand TPOT,
and the limit ``max(all-resident TPOT, OPT's decode transfers per token)`` of paths that move whole
experts (host compute can go below it). The plan is made and scored on the same trace (in-sample);
``bench/plan_cpu.py`` measures plans out of sample.

The options and files are checked as ``bench/miss_projection.py`` checks them, before any work. The
results go to ``bench/results/plan_projection.json`` for the documented run (every option at its
default), to the temporary directory for any other (``--quick``: ``plan_projection.quick.json``), or to
``--out FILE``.

    .venv/bin/python bench/plan_projection.py [--quick] [--out bench/results/plan_projection.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import miss_projection as mp
from provenance import OneLineParser, fail, provenance, results_out, write_json

from expertcache.costs import CostModel
from expertcache.errors import ExpertcacheError
from expertcache.sim.planner import format_plan, make_plan

MISSES = ("fetch", "host", "hybrid", "split")  # split: laid out by moepic


def main() -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    mp.add_machine_args(ap)
    ap.add_argument(
        "--out", type=Path, default=None,
        help="default bench/results/plan_projection.json (documented run; other runs: the temp dir)",
    )  # fmt: skip
    args = ap.parse_args()
    given = argparse.Namespace(**vars(args))  # as parsed: what decides whether this is the documented run
    triples = mp.resolve_machine_args(ap, args)
    for name in args.models:  # the plan's report reads its cost model back as a cost file is read
        try:
            CostModel.from_dict(mp.cost_model(mp.SHAPES[name], mp.measured(triples, name), args)[0].to_dict())
        except ExpertcacheError as exc:
            fail(ap.prog, f"{name}'s cost model, as the plan's report reads it back: {exc}")
    out_path = results_out(ap, given, "plan_projection.quick.json" if args.quick else "plan_projection.json")
    models = []
    for name in args.models:
        s = mp.SHAPES[name]
        trace, source = mp.model_trace(name, s, args)
        if trace is None:
            print(f"{name}: skipped ({source})", file=sys.stderr)
            models.append({"model": name, "skipped": source})
            continue
        b = mp.budget(s, args)
        cost, derived = mp.cost_model(s, mp.measured(triples, name), args)
        cap = b["capacity_experts"]
        t0 = time.perf_counter()
        plan = make_plan(trace, cap, cost, misses=MISSES)
        lim = mp.limit(trace, cost, cap)
        shared = next(c for c in plan.candidates if c["method"] == "shared" and c["miss"] == "fetch")
        print(f"== {name}: {source}; {cap}/{b['total_experts']} experts; {cost.describe()}")
        print(format_plan(plan))
        tpot, lru, bound = plan.predicted["tpot_s"], shared["tpot_s"], lim["limit_tpot_s"]
        print(
            f"plan {tpot * 1e3:.2f} ms | on-demand LRU {lru * 1e3:.2f} ms ({lru / tpot:.2f}x) | limit "
            f"{bound * 1e3:.2f} ms (plan / limit {tpot / bound:.2f}) | planned in "
            f"{time.perf_counter() - t0:.1f} s\n"
        )
        models.append({
            "model": name, "trace": source, "budget": b, "cost": cost.to_dict(), "derived": derived,
            "plan": plan.to_dict(), "on_demand_lru_tpot_s": shared["tpot_s"], "limit": lim,
            "plan_s": time.perf_counter() - t0,
        })  # fmt: skip
    write_json(
        out_path, {**provenance(), "args": {k: str(v) for k, v in vars(args).items()}, "models": models}
    )
    print(f"wrote {out_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
