"""Why ``hobbit``'s default thresholds lost to ``fetch`` on the H100 (0.62x), in the timing model.

HOBBIT serves a missed expert at low precision when its importance (the gate weight of the experts
ranked above it) passes ``t1`` (0.6): with top-2 routing, the second expert of a token whose first takes
more than 60 % of the weight. ``bench/engine_gpu.py --shape mixtral-8x7b`` runs random weights: a random
router splits a token's weight about evenly between its two experts, so almost no second expert passes
0.6, nothing runs at low precision, and HOBBIT only loses the quarter of the memory it keeps for its
copies. This replays that benchmark's own synthetic trace (4 layers of Mixtral-8x7B's 8 experts, top-2,
the sticky Zipf of ``engine_gpu.find_trace``; 8 of 32 experts, its 25 %) through the timing model twice:
with the router's weights even (the trace has none: the engine's random router's case), and with weights
drawn to match HOBBIT's reported split for Mixtral (``miss_projection.hobbit_weights``: 34 % / 60 % / 6 %
of tokens' first weight up to 0.6 / 0.9 / above). Costs, from the H100 figures of docs/BENCHMARKS.md: a
bf16 expert of 352.3 MB over pinned memory at 54.8 GB/s + 13 us (``cost_triples_h100.json``), its
one-token computation 0.148 ms and the int4 kernel's 0.025 ms more (``packed_gpu_h100_*.json``: 0.148 and
0.173 ms), and 1.2 ms of dense work a layer plus 0.3 ms a step (the engine's all-resident TPOT there,
6.25 ms, less the experts). No prefetching.

    PYTHONPATH=bench .venv/bin/python bench/hobbit_weights_sim.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses

from miss_projection import hobbit_weights
from provenance import provenance, results_out, write_json

from expertcache.costs import CostModel
from expertcache.sim.timing import simulate_timing
from expertcache.trace import synthesize

COST = CostModel(
    dense_s=1.2e-3, step_s=0.3e-3, expert_s=0.148e-3, expert_token_s=0.21e-6, link_bandwidth=54.8e9,
    link_latency=13e-6, expert_bytes=352_321_536, dequant_s=0.025e-3, weight_bits=16,
)  # fmt: skip
CAPACITY = 8  # of 32 experts: engine_gpu.py's 25 %
RUNS = (
    ("fetch", "lru"),
    ("hobbit", "lru"),
    ("hobbit", "hobbit"),
    ("hobbit:low_share=0.1", "lru"),
    ("hobbit:t1=-1", "lru"),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    if args.out is not None:  # checked before the work (a folder that is not there failed after it)
        args.out = results_out(ap, args, "hobbit_weights_sim.json")
    # engine_gpu.find_trace's for --shape mixtral-8x7b --layers 4 (that script imports torch; this one
    # runs the timing model alone)
    spec = dict(a=1.0, stickiness=0.3, seed=0, sequences=6, prompt_len=60)
    even = synthesize("sticky", tokens=6 * 190, layers=4, experts=8, top_k=2, **spec)
    split = dataclasses.replace(even, weights=hobbit_weights(even.experts.shape, 0))
    rows = []
    print(
        "| router weights | miss path | policy | TPOT ms | speed vs fetch | misses | at low precision "
        "| GB moved |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for label, trace in (("even (random router)", even), ("HOBBIT's split for Mixtral", split)):
        base = None
        for miss, policy in RUNS:
            r = simulate_timing(trace, CAPACITY, cache=policy, miss=miss, cost=COST)
            base = base or r.tpot_s
            row = {
                "weights": label, "miss": miss, "policy": policy, "tpot_s": r.tpot_s,
                "vs_fetch": base / r.tpot_s, "misses": r.misses,
                "low_precision": r.cache.get("low_precision", 0), "bytes_moved": r.bytes_moved,
                "capacities": r.capacities,
            }  # fmt: skip
            rows.append(row)
            print(f"| {label} | {miss} | {policy} | {1e3 * r.tpot_s:.1f} | {row['vs_fetch']:.2f}x | "
                  f"{r.misses} | {row['low_precision']} | {r.bytes_moved / 1e9:.0f} |")  # fmt: skip
    if args.out:
        write_json(args.out, {**provenance(), "cost": COST.to_dict(), "capacity": CAPACITY, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
