"""Many users, one expert cache, in the simulator: batched traces at 1, 4, 16 and 64 concurrent requests.

For each trace (the shared Qwen1.5-MoE trace, the embedded model's) and concurrency, at a budget of 25 %
of the experts: the hit ratio of LRU, LFU, TLFU and OPT (replays), and in the timing model the miss time
(the link's busy time plus the host's time computing missed experts; also what compute waited: stall +
host wait) of ``fetch`` (LRU), ``host`` (LRU), ``hybrid`` (HybriMoE, mrs) and ``batch`` (tlfu: token
counts, admission, bypass and streaming; each expert where it costs least, and ``split=makespan``:
HybriMoE's schedule) against the two per-step
references of ``sim.bounds`` (every needed expert moved once; the best static split between cache and
host), summed over the steps, and the better of them in each step summed.

Costs: ``--cost FILE.json`` (a profile or a cost model), else the timing model's defaults (a Mixtral
expert over PCIe 4.0 on an H100 machine) scaled to the trace's expert size by bytes (Qwen1.5-MoE:
3 x 2048 x 1408 bf16 = 17.3 MB; the embedded model: 184 kB (float32)): the expert's
bytes, its device and host compute times all shrink by the same factor, the link and dense times stay.

    python bench/batched_sim.py --out bench/results/batched_sim.json
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import SHARED, at_least, fail, provenance, results_out, write_json  # noqa: E402

from expertcache.cache.schedule import build_schedule  # noqa: E402
from expertcache.costs import CostModel  # noqa: E402
from expertcache.errors import ExpertcacheError  # noqa: E402
from expertcache.sim.bounds import step_bounds  # noqa: E402
from expertcache.sim.replay import replay  # noqa: E402
from expertcache.sim.timing import simulate_timing  # noqa: E402
from expertcache.trace import load_trace  # noqa: E402
from expertcache.trace.batch import batch_requests  # noqa: E402
from expertcache.trace.default import default_trace  # noqa: E402
from expertcache.trace.stats import step_shape  # noqa: E402

QWEN_TRACE = SHARED / "traces" / "qwen15_moe_a27b_chat.npz"
EXPERT_BYTES = {"qwen15": 3 * 2048 * 1408 * 2, "embedded": 184_320}
PATHS = (
    ("fetch", "lru"),
    ("host", "lru"),
    ("hybrid", "mrs"),
    ("batch", "tlfu"),
    ("batch:split=makespan", "tlfu"),
)


def scaled(expert_bytes: int) -> CostModel:
    base = CostModel()
    f = expert_bytes / base.expert_bytes
    return replace(
        base, expert_bytes=expert_bytes, expert_s=base.expert_s * f, expert_token_s=base.expert_token_s * f,
        host_expert_s=base.host_expert_s * f, host_expert_token_s=base.host_expert_token_s * f,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=at_least(1), nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--share", type=at_least(0.0, float), default=0.25, help="budget: a share of all experts")
    ap.add_argument("--cost", help="a cost model or profile (JSON) for every trace")
    ap.add_argument(
        "--host-factor", type=at_least(0.0, float), default=1.0,
        help="the host's expert times scaled by this (sensitivity)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, help="write the results as JSON")
    args = ap.parse_args()
    if not 0 < args.share <= 1:
        fail(ap.prog, f"--share is a share of all experts in (0, 1], got {args.share}")
    if args.out is not None:
        args.out = results_out(ap, args, args.out.name)  # checked before the replays
    try:
        given = CostModel.load(args.cost) if args.cost else None
    except ExpertcacheError as exc:
        fail(ap.prog, str(exc))
    traces = {"embedded": default_trace()}
    if QWEN_TRACE.exists():
        traces["qwen15"] = load_trace(QWEN_TRACE)
    else:  # the table in docs/BENCHMARKS.md has its rows: a run without them is not that table
        print(f"note: {QWEN_TRACE} not found: the Qwen1.5-MoE rows are left out", file=sys.stderr)
    rows = []
    for name, src in traces.items():
        cost = given if given is not None else scaled(EXPERT_BYTES[name])
        cost = replace(cost, host_expert_s=cost.host_expert_s * args.host_factor,
                       host_expert_token_s=cost.host_expert_token_s * args.host_factor)  # fmt: skip
        capacity = int(src.num_keys * args.share)
        for n in args.concurrency:
            t0 = time.perf_counter()
            trace = batch_requests(src, n)
            schedule = build_schedule(trace, "layer")
            row = {"trace": name, "concurrency": n, "capacity": capacity, **step_shape(trace)}
            for policy in ("lru", "lfu", "tlfu", "opt"):
                row[f"{policy}_hit_ratio"] = replay(schedule, policy, capacity).hits / schedule.num_requests
            bounds = step_bounds(trace, capacity, cost)
            row.update({f"bound_{k}": v for k, v in bounds.to_dict().items()})
            for spec, policy in PATHS:
                res = simulate_timing(trace, capacity, cache=policy, miss=spec, cost=cost)
                miss = spec.replace("batch:split=makespan", "batch_makespan")
                work = res.link_busy_s + res.host_busy_s  # the link's and the host's time on misses
                row[f"{miss}_miss_s"] = work
                row[f"{miss}_wait_s"] = res.stall_s + res.host_wait_s  # what compute waited for
                row[f"{miss}_total_s"] = res.total_s
                row[f"{miss}_vs_best"] = work / row["bound_best_s"] if row["bound_best_s"] else None
                row[f"{miss}_hit_ratio"] = res.hits / res.requests if res.requests else None
            rows.append(row)
            print(
                f"{name:9s} x{n:<3d} {row['mean_step_experts']:5.1f}/{src.num_experts} experts a layer-step "
                f"| hits lru {row['lru_hit_ratio']:.3f} lfu {row['lfu_hit_ratio']:.3f} "
                f"tlfu {row['tlfu_hit_ratio']:.3f} opt {row['opt_hit_ratio']:.3f} | "
                f"miss s: stream {row['bound_stream_s']:.2f} static {row['bound_static_s']:.2f} best "
                f"{row['bound_best_s']:.2f} | fetch {row['fetch_miss_s']:.2f} host {row['host_miss_s']:.2f} "
                f"hybrid {row['hybrid_miss_s']:.2f} batch {row['batch_miss_s']:.2f} makespan "
                f"{row['batch_makespan_miss_s']:.2f} (batch / best {row['batch_vs_best']:.2f}; waits: hybrid "
                f"{row['hybrid_wait_s']:.2f} batch {row['batch_wait_s']:.2f} makespan "
                f"{row['batch_makespan_wait_s']:.2f}; {time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )  # fmt: skip
    out = {"provenance": provenance(), "share": args.share, "host_factor": args.host_factor, "rows": rows}
    if args.out:
        write_json(args.out, out)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
