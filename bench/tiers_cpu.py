"""Three tiers on a CPU (issue 32): expert slots <- a host cache <- the checkpoint on disk, in a cgroup.

    PYTHONPATH=bench .venv/bin/python bench/tiers_cpu.py [--experts 43] [--limit 1.5GiB]
        [--device-memory 0.25GiB] [--host-memory 0.75GiB] [--link 2GB/s] [--repeats 3] [--exclusive]

The generated Granite-shaped checkpoint of ``bench/memory_cpu.py`` (granitemoe: hidden 1024, 24 layers,
top-8, intermediate 512, bf16, 3 MiB experts; ``--experts 43``: 3.0 GiB of experts), its routing replayed
from a seeded sticky-Zipf trace. Each run is a process of its own in a fresh memory cgroup of ``--limit``
(needs root), the checkpoint evicted from the page cache first, one generation of ``--new-tokens``:

- ``stack``: ``--device-memory`` of expert slots behind an emulated link (``--link``, standing for the
  device's), over ``--host-memory`` of host cache (LRU), over real reads of the checkpoint on disk;
- ``two tiers``: the same slots and link over the disk alone (today's CPU engine, no host level);
- ``stack, exclusive`` (``--exclusive``): the stack with the host level exclusive of the slots (a hit moves
  up, the slots' victim is copied down; the same memory, less a reserve of top-k slots for hits in flight);

alternating, ``--repeats`` times. Tokens are compared with transformers' (run once, outside the cgroup,
by ``load_reference``: the experts implementation the engine's default kernel is exact against, grouped_mm
on a CPU; until 2026-11-29 this compared with eager's, which rounds otherwise, see docs/ENGINE.md).
The prediction: the timing model replays each run's recorded trace at its capacities, with a
cost model measured in a separate process (``expertcache profile --slow-tier disk``: compute, dense
time, and one expert's read from the disk, which becomes ``disk_read_s``) and the emulated link's
figures (two tiers: a miss is a read timed by the emulated link from its start, so the slower of the two);
the ratio measured / predicted TPOT is the target (at most 1.3x). The simulator's inclusive and
exclusive host levels are compared on the same trace (misses at each level). Results:
``bench/results/tiers_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memory_cpu import PROMPT, Cgroup, evict, make_model
from provenance import ROOT, portable_text, provenance, write_json


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def child(spec: dict) -> dict:
    """One configuration in this process: load, one generation, the engine's counts and its trace."""
    import torch

    import expertcache
    from expertcache.engine.routing import replay_routing
    from expertcache.trace import load_trace

    torch.set_num_threads(spec["threads"])
    path, trace = Path(spec["path"]), load_trace(spec["trace"])
    if spec["kind"] == "transformers":
        from engine_cpu import timed_generate
        from transformers import AutoTokenizer

        from expertcache.engine.loader import load_reference

        # the reference the engine's default kernel is exact against (grouped_mm on a CPU), weights cloned
        model = load_reference(path).eval()
        tok = AutoTokenizer.from_pretrained(str(path))
        replay = replay_routing(model, trace)
        run = timed_generate(model, tok, PROMPT, spec["new_tokens"])
        replay.remove()
        ids = tok(PROMPT, return_tensors="pt").input_ids
        return {"tokens": run["output"][0, ids.shape[1] :].tolist(), "tpot_s": run["tpot_s"]}
    t0 = time.perf_counter()
    m = expertcache.load(
        path, expert_memory=spec["device_memory"], device="cpu", prefetch="none", deterministic=True,
        link_bandwidth=spec["link"], link_latency=spec["latency"], host_memory=spec.get("host_memory"),
        host_exclusive=spec.get("host_exclusive", False), progress=False,
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    replay = replay_routing(m, trace)
    g = m.generate_text(PROMPT, max_new_tokens=spec["new_tokens"])
    replay.remove()
    m.save_trace(spec["out_trace"])
    keys = ("misses", "requests", "stall_s", "bytes_transferred", "capacity_experts", "host_requests",
            "host_hits", "host_misses", "host_capacity", "disk_reads", "disk_read_s", "host_memory_bytes",
            "expert_memory_bytes", "memory", "host_exclusive", "host_demoted", "host_dropped",
            "host_returned", "host_slot_waits", "host_slot_wait_s")  # fmt: skip
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {
        "load_s": load_s, "ttft_s": g.ttft_s, "tpot_s": g.tpot_s, "tokens": g.tokens,
        **{k: g.stats.get(k) for k in keys}, "peak_rss_bytes": int(status["VmHWM"].split()[0]) * 1024,
    }  # fmt: skip


def run_child(spec: dict, group: Cgroup | None, python: str = sys.executable) -> dict:
    cmd = [python, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    if group is not None:
        group.reset()
        cmd = group.prefix() + cmd
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": "bench"})
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        return {"failed": done.returncode, "stderr_tail": portable_text(done.stderr[-2000:]), "why": tail[0]}
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if group is not None:
        out["cgroup_peak_bytes"] = group.peak()
    return out


def _has(python: str, module: str) -> bool:
    """Whether ``python`` can import ``module``."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def measured_costs(path: Path, work: Path) -> dict:
    """``expertcache profile --slow-tier disk`` in a process of its own (every expert in memory: outside
    the cgroup): the machine's compute and one expert's read from the disk."""
    out = work / "profile-disk.json"
    cmd = [sys.executable, "-m", "expertcache", "profile", "--model", str(path), "--device", "cpu",
           "--slow-tier", "disk", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def predict(trace_path: str, cost, host_exclusive: bool | None = None) -> dict:
    """The timing model's replay of a run's trace at its capacities; ``host_exclusive`` None: the run's."""
    from expertcache.config import HostConfig
    from expertcache.sim.timing import simulate_timing
    from expertcache.trace import load_trace

    tr = load_trace(trace_path)
    host = None
    if "host_capacity" in tr.meta:
        exclusive = bool(tr.meta.get("host_exclusive", False)) if host_exclusive is None else host_exclusive
        host = HostConfig(None, tr.meta["host_policy"], exclusive=exclusive)
    r = simulate_timing(
        tr, tr.meta["capacity"], cache=tr.meta["policy"], capacities=json.loads(tr.meta["capacities"]),
        cost=cost, host=host, host_capacity=tr.meta.get("host_capacity"),
    )  # fmt: skip
    keys = (
        "misses",
        "host_misses",
        "host_hits",
        "disk_reads",
        "disk_read_s",
        "host_demoted",
        "host_returned",
    )
    return {"tpot_s": r.tpot_s, "ttft_s": r.ttft_s, "stall_s": r.stall_s, **{k: r.cache.get(k) for k in keys}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=43, help="experts per layer (43: 3.0 GiB of experts)")
    ap.add_argument("--limit", default="1.5GiB", help="the memory cgroup of each run (none: no cgroup)")
    ap.add_argument("--device-memory", default="0.25GiB", help="expert slots (the device's tier)")
    ap.add_argument("--host-memory", default="0.75GiB", help="the host cache")
    ap.add_argument("--link", default="2GB/s", help="the emulated device link's bandwidth")
    ap.add_argument("--latency", default="20us", help="the emulated device link's latency per transfer")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-cache", type=Path, default=Path(tempfile.gettempdir()) / "expertcache-bench")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tiers_cpu.json")
    ap.add_argument(
        "--python", default=sys.executable,
        help="the interpreter of the engine's runs (default this one): e.g. one of an environment that "
        "the README's first command made, without the development extras (with hqq installed, "
        "transformers imports it with every model: 113 MiB more)",
    )  # fmt: skip
    ap.add_argument(
        "--exclusive",
        action="store_true",
        help="a third configuration: the stack with an exclusive host level",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    from engine_cpu import replay_trace

    from expertcache.costs import CostModel
    from expertcache.units import parse_duration, parse_rate, parse_size

    if args.out.exists() and not os.access(args.out, os.W_OK):
        raise SystemExit(f"{args.out}: cannot write the results")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.model_cache.mkdir(parents=True, exist_ok=True)
    path = make_model(args.model_cache, args.experts)
    files = sorted(path.glob("*.safetensors"))
    trace, trace_info = replay_trace(path, argparse.Namespace(new_tokens=args.new_tokens, warmup_tokens=0))
    work = Path(tempfile.mkdtemp(prefix="tiers-", dir=args.model_cache))
    trace_path = work / "routing.npz"
    trace.save(trace_path)
    log("measuring the machine's costs (expertcache profile --slow-tier disk) ...")
    evict(files)  # a checkpoint in the page cache is read from there: the disk's reads would not be timed
    profile = measured_costs(path, work)
    disk_cost = CostModel.from_dict(profile["cost"])
    read_s = disk_cost.disk_read_s  # one expert read from the disk
    link = {"link_bandwidth": parse_rate(args.link, "--link"), "link_latency": parse_duration(args.latency)}
    cost = CostModel.from_dict({**link, "host_read_s": 0.0, "chunk_bytes": None}, disk_cost)
    # two tiers: a miss is a read from the disk, timed by the emulated link from its start: the slower
    link_s = cost.transfer_time()
    two = CostModel.from_dict({"link_bandwidth": cost.expert_bytes / max(read_s, link_s) if read_s > link_s
                               else link["link_bandwidth"]}, cost)  # fmt: skip
    log(f"cost model: {cost.describe()} | disk read {read_s * 1e3:.2f} ms an expert")
    base = {"path": str(path), "trace": str(trace_path), "new_tokens": args.new_tokens,
            "threads": args.threads, "device_memory": args.device_memory, "link": args.link,
            "latency": args.latency}  # fmt: skip
    configs = {"stack": {"host_memory": args.host_memory}, "two tiers": {}}
    if args.exclusive:  # the same host memory, exclusive of the slots (a reserve for its hits in flight)
        configs["stack, exclusive"] = {"host_memory": args.host_memory, "host_exclusive": True}
    # a page of a library is charged to the cgroup that first reads it, and stays charged after the run:
    # the engine's interpreter imports what a run imports once outside the groups, as a machine running
    # the engine has those pages cached already (else each run's peak is the limit, filled with them)
    warm = "import torch, expertcache.engine.offloaded; from transformers import GraniteMoeForCausalLM"
    subprocess.run([args.python, "-c", warm], check=True, capture_output=True)
    log("transformers' tokens (outside the cgroup) ...")
    evict(files)
    ref = run_child({**base, "kind": "transformers"}, None)
    group = Cgroup(int(parse_size(args.limit, "--limit"))) if args.limit != "none" else None
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    try:
        for i in range(args.repeats):
            for name, spec in configs.items():
                evict(files)
                out_trace = str(work / f"{name.replace(' ', '-')}-{i}.npz")
                r = run_child({**base, **spec, "kind": "engine", "out_trace": out_trace}, group, args.python)
                if "failed" not in r:
                    stack = name.startswith("stack")
                    r["predicted"] = predict(out_trace, cost if stack else two)
                    r["measured_over_predicted"] = r["tpot_s"] / r["predicted"]["tpot_s"]
                    if stack:
                        r["predicted_exclusive"] = predict(out_trace, cost, host_exclusive=True)
                        # the disk's speed drifts (this VM's: 1.4 or 2.8 ms a read, from run to run): the
                        # model again with the mean read this run measured
                        own = CostModel.from_dict({"disk_read_s": r["disk_read_s"] / r["disk_reads"]}, cost)
                        r["predicted_own_reads"] = predict(out_trace, own)
                        r["measured_over_predicted_own_reads"] = (
                            r["tpot_s"] / r["predicted_own_reads"]["tpot_s"]
                        )
                    r["tokens_match_transformers"] = r["tokens"] == ref.get("tokens")
                    peak = (r.get("cgroup_peak_bytes") or 0) / 2**30
                    log(f"{name}: TPOT {r['tpot_s'] * 1e3:.1f} ms, predicted "
                        f"{r['predicted']['tpot_s'] * 1e3:.1f} ms ({r['measured_over_predicted']:.2f}x; "
                        f"with its own reads {r.get('measured_over_predicted_own_reads', math.nan):.2f}x) | "
                        f"misses {r['misses']} | host misses {r.get('host_misses')} | cgroup peak "
                        f"{peak:.2f} GiB | exact {r['tokens_match_transformers']}")  # fmt: skip
                else:
                    log(f"{name}: failed: {r['why']}")
                runs[name].append(r)
    finally:
        if group is not None:
            group.remove()
    summary = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "failed" not in r]
        if not ok:
            summary[name] = {"failed": True}
            continue

        def med(f, ok=ok):
            vals = [f(r) for r in ok]
            return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}

        summary[name] = {
            "tpot_s": med(lambda r: r["tpot_s"]),
            "predicted_tpot_s": med(lambda r: r["predicted"]["tpot_s"]),
            "measured_over_predicted": med(lambda r: r["measured_over_predicted"]),
            **(
                {
                    "measured_over_predicted_own_reads": med(
                        lambda r: r["measured_over_predicted_own_reads"]
                    ),
                    "disk_read_s_each": med(lambda r: r["disk_read_s"] / r["disk_reads"]),
                }
                if name.startswith("stack")
                else {}
            ),
            "host_misses": med(lambda r: r.get("host_misses") or 0),
            "host_slot_waits": med(lambda r: r.get("host_slot_waits") or 0),
            "cgroup_peak_bytes": med(lambda r: r.get("cgroup_peak_bytes") or 0),
            "exact": all(r["tokens_match_transformers"] for r in ok),
            "runs": len(ok),
        }
    write_json(args.out, {
        "cost_two_tiers": two.to_dict(),
        **provenance(), "model": {"experts": args.experts, "expert_bytes": cost.expert_bytes,
                                  "experts_bytes": 24 * args.experts * cost.expert_bytes},
        "trace": trace_info, "limit": args.limit, "device_memory": args.device_memory,
        "host_memory": args.host_memory, "link": f"{args.link} + {args.latency}", "cost": cost.to_dict(),
        "profile_how": profile.get("how"), "transformers": ref, "summary": summary, "runs": runs,
        "engine_python": args.python, "engine_python_has_hqq": _has(args.python, "hqq"),
    })  # fmt: skip
    log(f"wrote {args.out}")
    return 0 if all(s.get("exact") for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
