"""Models larger than memory on CPU (issue: models larger than memory).

    PYTHONPATH=bench .venv/bin/python bench/memory_cpu.py [--limit 3GiB] [--experts 64] [--budget 25]

A generated Granite-shaped checkpoint (granitemoe family: hidden 1024, 24 layers, ``--experts`` experts,
top-8, intermediate 512, bf16; 32 experts: 2.5 GB; 64: 4.8 GB), random weights, its routing replayed
from a seeded sticky-Zipf trace (a random router routes degenerately). Each configuration runs in a
process of its own (its own resident memory, page faults and reads), one generation of ``--new-tokens``
after the prompt (a user's first request: TTFT includes every first use), tokens compared with plain
transformers' (its default experts implementation, grouped_mm on a CPU, which the engine's default kernel is
exact against; until 2026-11-29 its eager one, which rounds otherwise):

- ``transformers``: ``from_pretrained`` (bf16 weights used in place from the memory map; the kernel's
  page-cache LRU decides what stays);
- ``accelerate``: ``device_map`` sending the experts of the first round((1 - budget) * L) layers to disk
  (an offload folder), the rest in memory (``engine_cpu.accelerate_device_map``);
- the engine at ``--budget`` % of the expert bytes: the ``disk`` tier with LRU, with ``--policy``, with
  LRU and ``--prefetch``; the ``mapped`` tier with LRU; and at 100 %.

``--cache cold`` (default) evicts the checkpoint from the page cache before each run, ``warm`` reads it
first. With ``--limit``, each run joins a fresh memory cgroup with that limit (cgroup v1
``memory.limit_in_bytes`` on machines like this project's, v2 ``memory.max`` elsewhere; needs root), and
its peak charge is recorded. The floor: OPT's misses for the replayed routing at the budget (simulator,
layer order) x expert bytes / the disk's measured read bandwidth (O_DIRECT, 1 MiB reads), per token.
Results: ``bench/results/memory_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import ROOT, portable_text, provenance, write_json

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")
PROMPT = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\ndef main():"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------- the child
def child(spec: dict) -> dict:
    """One configuration in this process: load, one generation, the process's counters."""
    import torch

    from expertcache.engine.routing import replay_routing
    from expertcache.trace import load_trace

    torch.set_num_threads(spec["threads"])
    path, trace = Path(spec["path"]), load_trace(spec["trace"])
    t0 = time.perf_counter()
    if spec["kind"] == "engine":
        import expertcache

        m = expertcache.load(path, expert_memory=spec["budget"], policy=spec["policy"], device="cpu",
                             slow_tier=spec["tier"], prefetch=spec.get("prefetch", "none"),
                             progress=False)  # fmt: skip
        load_s = time.perf_counter() - t0
        replay = replay_routing(m, trace)
        g = m.generate_text(PROMPT, max_new_tokens=spec["new_tokens"])
        replay.remove()
        out = {"ttft_s": g.ttft_s, "tpot_s": g.tpot_s, "tokens": g.tokens, "misses": g.stats["misses"],
               "stall_s": g.stats["stall_s"], "bytes_transferred": g.stats["bytes_transferred"],
               "memory": g.stats["memory"], "capacity_experts": g.stats["capacity_experts"]}  # fmt: skip
    else:
        from engine_cpu import accelerate_device_map, timed_generate
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kw = {}
        if spec["kind"] == "accelerate":
            dmap, _, _ = accelerate_device_map(path, spec["share"])
            kw = {"device_map": dmap, "offload_folder": spec["offload"]}
        # its default experts implementation: grouped_mm on a CPU
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()
        tok = AutoTokenizer.from_pretrained(str(path))
        load_s = time.perf_counter() - t0
        replay = replay_routing(model, trace)
        run = timed_generate(model, tok, PROMPT, spec["new_tokens"])
        replay.remove()
        ids = tok(PROMPT, return_tensors="pt").input_ids
        out = {"ttft_s": run["ttft_s"], "tpot_s": run["tpot_s"],
               "tokens": run["output"][0, ids.shape[1]:].tolist()}  # fmt: skip
    usage = resource.getrusage(resource.RUSAGE_SELF)  # its maxrss outlives exec: VmHWM instead
    io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    peak = int(status["VmHWM"].split()[0]) * 1024
    return {"load_s": load_s, **out, "peak_rss_bytes": peak, "major_faults": usage.ru_majflt,
            "disk_read_bytes": int(io["read_bytes"])}  # fmt: skip


# ------------------------------------------------------------------------------------- cgroups
class Cgroup:
    """A fresh memory cgroup with a limit, for one child at a time (v1 or v2)."""

    def __init__(self, limit: int) -> None:
        self.v1 = (CGROUP_V1 / "memory.limit_in_bytes").is_file()
        base = CGROUP_V1 if self.v1 else CGROUP_V2
        self.path = base / f"expertcache-bench-{os.getpid()}"
        self.path.mkdir()
        if self.v1:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            swap = self.path / "memory.memsw.limit_in_bytes"  # where swap accounting is on: no swap either
            if swap.exists():
                swap.write_text(str(limit))
        else:
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").write_text("0")

    def prefix(self) -> list[str]:
        """A command prefix that moves the child into the group before it starts Python."""
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$0" "$@"']

    def peak(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        f = self.path / name
        return int(f.read_text()) if f.is_file() else None

    def reset(self) -> None:
        if self.v1:
            (self.path / "memory.max_usage_in_bytes").write_text("0")
        else:  # memory.peak resets per open file on v2 kernels >= 6.12; a new group per run otherwise
            pass

    def remove(self) -> None:
        self.path.rmdir()


# ------------------------------------------------------------------------------------- the parent
def evict(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def warm(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def disk_bandwidth(files: list[Path]) -> float:
    """Bytes/s of O_DIRECT 1 MiB reads over up to 512 MiB of the checkpoint (cold)."""
    import mmap

    evict(files)
    buf, total, t0 = mmap.mmap(-1, 1 << 20), 0, time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        try:
            off = 0
            while total < 512 << 20 and (n := os.preadv(fd, [buf], off)) > 0:
                off += n
                total += n
        finally:
            os.close(fd)
        if total >= 512 << 20:
            break
    return total / (time.perf_counter() - t0)


def make_model(cache: Path, experts: int) -> Path:
    from expertcache.engine.random_checkpoint import make_checkpoint

    path = cache / f"granite-shape-{experts}e"
    if (path / ".complete").is_file():
        return path
    log(f"generating {path} ...")
    make_checkpoint(path, "granitemoe", hidden=1024, layers=24, experts=experts, top_k=8, intermediate=512,
                    heads=16, dtype="bfloat16", max_shard_size="1GB")  # fmt: skip
    (path / ".complete").write_text("ok\n")
    return path


def opt_floor(
    trace_path: Path, budget_share: float, expert_bytes: int, bandwidth: float, tokens: int
) -> dict:
    from expertcache.sim import simulate
    from expertcache.trace import load_trace

    tr = load_trace(trace_path)
    cap = max(tr.top_k, int(budget_share * tr.num_layers * tr.num_experts))
    r = simulate(tr, ["lru"], [cap], "layer")[0]
    return {"capacity_experts": cap, "opt_misses": r.opt_misses, "lru_misses_sim": r.misses,
            "stall_floor_s": r.opt_misses * expert_bytes / bandwidth,
            "stall_floor_per_token_s": r.opt_misses * expert_bytes / bandwidth / tokens}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=32, help="experts per layer (32: 2.5 GB, 64: 4.8 GB)")
    ap.add_argument("--budget", type=float, default=25.0, help="the engine's expert memory, %% (default 25)")
    ap.add_argument("--limit", help="run each configuration in a memory cgroup of this size, e.g. 3GiB")
    ap.add_argument("--cache", choices=["cold", "warm"], default="cold", help="page cache before each run")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--policy", default="lfu", help="the engine's second policy (default lfu)")
    ap.add_argument("--prefetch", default="next-gate", help="the engine's prefetch row (default next-gate)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="run only these configurations (names as printed)")
    ap.add_argument(
        "--repeats", type=int, default=1,
        help="runs of each configuration, each in a fresh process, round-robin (medians reported)",
    )  # fmt: skip
    ap.add_argument("--model-cache", type=Path, default=Path(tempfile.gettempdir()) / "expertcache-bench")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "memory_cpu.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    from expertcache.units import parse_size

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.model_cache.mkdir(parents=True, exist_ok=True)
    path = make_model(args.model_cache, args.experts)
    files = sorted(path.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    from engine_cpu import replay_trace

    from expertcache.engine.loader import build_skeleton
    from expertcache.engine.memory import SlotLayout

    ns = argparse.Namespace(new_tokens=args.new_tokens, warmup_tokens=0)
    trace, trace_info = replay_trace(path, ns)
    trace_path = args.model_cache / f"trace-{args.experts}e-{args.new_tokens}.npz"
    trace.save(trace_path)
    sk = build_skeleton(path)
    expert_bytes = SlotLayout.of(sk.shapes, sk.dtype).slot_bytes
    del sk
    bw = disk_bandwidth(files)
    share = args.budget / 100
    budget = f"{args.budget:g}%"
    base = {
        "path": str(path),
        "trace": str(trace_path),
        "new_tokens": args.new_tokens,
        "threads": args.threads,
    }
    offload = Path(tempfile.mkdtemp(prefix="offload-", dir=args.model_cache))
    configs = {
        "transformers": {"kind": "transformers"},
        f"accelerate {budget}": {"kind": "accelerate", "share": share, "offload": str(offload)},
        f"engine disk lru {budget}": {"kind": "engine", "tier": "disk", "policy": "lru", "budget": budget},
        f"engine disk {args.policy} {budget}": {"kind": "engine", "tier": "disk", "policy": args.policy,
                                                "budget": budget},
        f"engine disk lru+{args.prefetch} {budget}": {"kind": "engine", "tier": "disk", "policy": "lru",
                                                      "budget": budget, "prefetch": args.prefetch},
        f"engine mapped lru {budget}": {"kind": "engine", "tier": "mapped", "policy": "lru",
                                        "budget": budget},
        f"engine disk default {budget}": {"kind": "engine", "tier": "disk", "policy": "lru",
                                          "budget": budget, "prefetch": "auto"},
        "engine disk 100%": {"kind": "engine", "tier": "disk", "policy": "lru", "budget": "100%"},
    }  # fmt: skip
    if args.only:
        configs = {k: v for k, v in configs.items() if k in args.only}
    group = Cgroup(int(parse_size(args.limit, "--limit"))) if args.limit else None
    results: dict[str, dict] = {}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    todo = [name for _ in range(max(1, args.repeats)) for name in configs]  # round-robin: drift falls alike
    try:
        for name in todo:
            spec = configs[name]
            (evict if args.cache == "cold" else warm)(files)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps({**base, **spec})]
            if group is not None:
                group.reset()
                cmd = group.prefix() + cmd
            t0 = time.perf_counter()
            done = subprocess.run(
                cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": "bench"}
            )
            wall = time.perf_counter() - t0
            if done.returncode != 0:
                tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
                log(f"{name}: failed (exit {done.returncode}): {tail[0]}")
                runs[name].append(
                    {"failed": done.returncode, "stderr_tail": portable_text(done.stderr[-2000:])}
                )
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            r["wall_s"] = wall
            if group is not None:
                r["cgroup_peak_bytes"] = group.peak()
            runs[name].append(r)
            log(f"{name}: load {r['load_s']:.1f} s | TTFT {r['ttft_s']:.2f} s | "
                f"TPOT {r['tpot_s'] * 1e3:.0f} ms | peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB | "
                f"major faults {r['major_faults']} | "
                f"read {r['disk_read_bytes'] / 2**30:.2f} GiB"
                + (f" | cgroup peak {r['cgroup_peak_bytes'] / 2**30:.2f} GiB" if group else ""))  # fmt: skip
    finally:
        shutil.rmtree(offload, ignore_errors=True)
        if group is not None:
            group.remove()
    for name, done_runs in runs.items():
        ok = [r for r in done_runs if "failed" not in r]
        if not ok:
            results[name] = done_runs[0] if done_runs else {"failed": "not run"}
            continue
        results[name] = dict(ok[0])
        if len(done_runs) > 1:  # medians of the timings; every run's kept
            for key in ("load_s", "ttft_s", "tpot_s", "wall_s"):
                results[name][key] = statistics.median(r[key] for r in ok)
            results[name]["each"] = [
                {k: r.get(k) for k in ("load_s", "ttft_s", "tpot_s", "peak_rss_bytes", "failed")}
                for r in done_runs
            ]
            results[name]["tokens_agree_across_runs"] = all(r["tokens"] == ok[0]["tokens"] for r in ok)
    ref = results.get("transformers", {}).get("tokens")
    engines = [r["tokens"] for name, r in results.items() if name.startswith("engine") and "tokens" in r]
    for r in results.values():
        if "tokens" in r and ref is not None:  # in place from the map, bf16 may round otherwise
            r["tokens_match_transformers"] = r["tokens"] == ref
    engines_agree = all(t == engines[0] for t in engines)
    floor = opt_floor(trace_path, share, expert_bytes, bw, trace.num_tokens)
    tpots = [r["tpot_s"] for r in results.values() if "tpot_s" in r]
    write_json(args.out, {
        **provenance(),
        "model": {"experts": args.experts, "checkpoint_bytes": size, "expert_bytes": expert_bytes},
        "trace": trace_info, "budget": budget, "limit": args.limit, "cache": args.cache,
        "disk_read_Bps": bw, "floor": floor, "engine_runs_agree": engines_agree,
        "median_tpot_s": statistics.median(tpots) if tpots else None,
        "runs": results,
    })  # fmt: skip
    return 0 if engines_agree else 1


if __name__ == "__main__":
    sys.exit(main())
