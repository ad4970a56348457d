"""Which policy a host level should use: the timing model's host-level misses (disk reads) per policy.

The host level of a tier stack (``cache.tiers``) sees only the device cache's misses, a stream whose
recency the device's own cache has already taken: the classic case of a second-level cache, where
recency alone (LRU) is known to do poorly. This replays traces through the simulator's tier stack
(``sim.timing.simulate_timing`` with a host level: the decisions the engine makes, as its tests check)
with an LRU device cache and each host policy that decides by hits and insertions, at a few device and
host shares, and prints each configuration's host-level misses beside OPT's at the host's capacity (no
bound for the level as built; a yardstick). Traces: the shared Qwen1.5-MoE trace (``../shared/traces``,
where present), the embedded model's bundled trace, and two seeded sticky-Zipf traces at Mixtral's (8
layers) and a 43-expert Granite-like shape.

    .venv/bin/python bench/host_policies_sim.py [--exclusive] [--out bench/results/host_policies_sim.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from provenance import ROOT, SHARED, notes_as_lines, provenance, results_out, write_json

from expertcache.config import HostConfig
from expertcache.sim import build_schedule, replay
from expertcache.sim.timing import simulate_timing
from expertcache.trace import load_trace, synthesize

POLICIES = ("lru", "fifo", "marking", "lfu", "lfu-dist", "lru-dist", "lcp")
SHARES = ((0.10, 0.30), (0.25, 0.50), (0.10, 0.60))  # (device, host) shares of all experts


def traces() -> dict[str, object]:
    out = {}
    shared = SHARED / "traces" / "qwen15_moe_a27b_chat.npz"
    if shared.is_file():
        out["qwen1.5-moe (shared, real)"] = load_trace(shared)
    else:
        print(f"note: no shared trace at {shared} (the shared/ directory beside the repository): its rows "
              "are left out", file=sys.stderr)  # fmt: skip
    out["embedded (bundled, real)"] = load_trace(ROOT / "src/expertcache/data/default_trace.npz")
    out["mixtral 8 layers (sticky Zipf)"] = synthesize(
        "sticky", tokens=6 * 190, layers=8, experts=8, top_k=2, a=1.0, stickiness=0.3, seed=0, sequences=6,
        prompt_len=60,
    )  # fmt: skip
    out["granite-like 24 x 43 (sticky Zipf)"] = synthesize(
        "sticky", tokens=4 * 150, layers=24, experts=43, top_k=8, a=1.0, stickiness=0.3, seed=1, sequences=4,
        prompt_len=20,
    )  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exclusive", action="store_true", help="an exclusive host level (default inclusive)")
    ap.add_argument(
        "--out", type=Path,
        help="default bench/results/host_policies_sim.json (--exclusive: host_policies_sim_exclusive.json)",
    )  # fmt: skip
    args = ap.parse_args()
    name = "host_policies_sim_exclusive.json" if args.exclusive else "host_policies_sim.json"
    args.out = results_out(ap, args, name, modes=("exclusive",))
    notes_as_lines()
    rows = []
    print(
        "| trace | device / host experts | OPT at the host's capacity | " + " | ".join(POLICIES) + " | best |"
    )
    print("|---|---|---:|" + "---:|" * len(POLICIES) + "---|")
    for name, tr in traces().items():
        total = tr.num_layers * tr.num_experts
        for dev_share, host_share in SHARES:
            cap, hcap = max(int(total * dev_share), 2 * tr.top_k), int(total * host_share)
            misses = {}
            for policy in POLICIES:
                r = simulate_timing(
                    tr, cap, cache="lru", host=HostConfig(None, policy, exclusive=args.exclusive),
                    host_capacity=hcap,
                )  # fmt: skip
                misses[policy] = int(r.cache["host_misses"])
            opt = int(replay(build_schedule(tr, "layer"), "opt", hcap).misses)
            best = min(misses, key=misses.get)
            rows.append({"trace": name, "device_experts": cap, "host_experts": hcap, "total_experts": total,
                         "opt_at_host_capacity": opt, "host_misses": misses, "best": best})  # fmt: skip
            cells = " | ".join(f"{misses[p]}" + (f" ({misses[p] / misses['lru']:.2f}x)" if p != "lru" else "")
                               for p in POLICIES)  # fmt: skip
            print(f"| {name} | {cap} / {hcap} | {opt} | {cells} | {best} |", flush=True)
    write_json(args.out, {**provenance(), "exclusive": args.exclusive, "rows": rows})
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
