"""Start-up on CPU: the time ``expertcache.load()`` takes to be ready, and the first request's TTFT, on a
Granite-shaped checkpoint (issue: the expert step at the hardware's speed).

    PYTHONPATH=bench .venv/bin/python bench/startup_cpu.py [--model DIR] [--rounds 5] \
        [--caches warm cold] [--variants ...] [--baseline-src DIR]

Every measurement is a fresh process: import, load, then one greedy request of ``--new-tokens`` tokens
after ``PROMPT`` (the first request's TTFT, which a warm-up at load shortens). ``ready_s`` is the
``load()`` call (``from_pretrained`` for transformers); ``import_s`` the imports before it; ``spawn_s``
from the process's start to ready. The page cache is set before each process: ``warm`` (every file of
the checkpoint read first) or ``cold`` (its pages dropped with ``posix_fadvise(DONTNEED)``). The variants
alternate within each round (their order rotating from round to round): a shared VM drifts by tens of
percent within minutes. Variants:

- ``engine 100%``: ``expertcache.load(path, expert_memory="100%", device="cpu")``: every expert read
  into its slot at load (the ``disk`` tier, the CPU's default), then the warm-up;
- ``engine 100% no warm-up``: the same with ``warmup=False``;
- ``engine 25% disk``: ``expert_memory="25%", slow_tier="disk"``: nothing read at load but the dense
  weights (the first request's misses read experts from the disk);
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(path, dtype=bfloat16)`` (its default experts
  implementation), whose tokens the engine's must equal;
- with ``--baseline-src DIR`` (a source tree such as ``git archive <commit> src``), ``before: ...``
  runs each engine variant with that code, for comparison.

If no ``--model`` is given, the checkpoint is generated once (``random_checkpoint.make_checkpoint``, the
shape of ``bench/plenty_cpu.py``'s ``GRANITE`` with Granite-3.1-1B-A400M's 8 key-value heads and, where
``../shared/models/granite-3.1-1b-a400m`` exists, its tokenizer). Results: ``bench/results/startup_cpu.json``
(every run, medians and ranges).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import ROOT, SHARED, provenance, write_json

ENGINE, NO_WARMUP, QUARTER, HF = "engine 100%", "engine 100% no warm-up", "engine 25% disk", "transformers"
BEFORE = "before: "
VARIANTS = (ENGINE, NO_WARMUP, QUARTER, HF)
SHARED_TOKENIZER = SHARED / "models" / "granite-3.1-1b-a400m"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_path(cache_dir: Path) -> Path:
    """The generated Granite-shaped checkpoint, built once (atomically) and reused."""
    from plenty_cpu import GRANITE

    from expertcache.engine.random_checkpoint import make_checkpoint

    path = cache_dir / "granite-startup-32e"
    if (path / ".complete").is_file():
        return path
    log(f"generating {path}")
    tmp = cache_dir / ".granite-startup-32e.partial"
    tok = SHARED_TOKENIZER if (SHARED_TOKENIZER / "tokenizer.json").is_file() else None
    make_checkpoint(tmp, "granitemoe", kv_heads=8, max_shard_size="1GB", tokenizer=tok, **GRANITE)
    (tmp / ".complete").write_text("ok\n")
    tmp.rename(path)
    return path


def weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def set_cache(files: list[Path], state: str) -> None:
    """Every file's pages in the page cache (``warm``: read through) or none (``cold``: dropped)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            if state == "cold":
                os.fsync(fd)  # dirty pages are never dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while os.read(fd, 64 << 20):
                    pass
        finally:
            os.close(fd)


def cached_mib(files: list[Path]) -> float | None:
    from expertcache.engine.memory import _cached_bytes

    got = [_cached_bytes(f) for f in files]
    return None if any(g is None for g in got) else round(sum(got) / 2**20, 1)


# ------------------------------------------------------------------------------------ one process
def child(spec: dict) -> None:
    """Import, load, one request; one JSON line on standard output."""
    start = time.perf_counter()
    import torch
    from engine_cpu import timed_generate
    from plenty_cpu import PROMPT
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import expertcache

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    path = spec["model"]
    tok = AutoTokenizer.from_pretrained(path)
    imported = time.perf_counter()
    name = spec["variant"].removeprefix(BEFORE)
    if name == HF:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    else:
        kw = {"expert_memory": "25%", "slow_tier": "disk"} if name == QUARTER else {}
        model = expertcache.load(path, device="cpu", progress=False, warmup=name != NO_WARMUP, **kw)
    ready = time.perf_counter()
    run = timed_generate(model, tok, PROMPT, spec["new_tokens"])
    out = {
        "import_s": imported - start,
        "ready_s": ready - imported,
        "spawn_s": ready - spec["spawned"],
        "ttft_s": run["ttft_s"],
        "tokens": run["tokens"],
        "warmup_s": getattr(model, "warmup_s", None),
        "expertcache": str(Path(expertcache.__file__).parents[1]),
    }
    print(json.dumps(out), flush=True)


def run_child(variant: str, args, baseline: str | None) -> dict:
    env = dict(os.environ)
    src = baseline if variant.startswith(BEFORE) else str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, str(ROOT / "bench")])
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    spec = {"variant": variant, "model": str(args.model), "new_tokens": args.new_tokens}
    spec["threads"] = args.threads
    spec["spawned"] = time.perf_counter()  # CLOCK_MONOTONIC: the same clock in the child (Linux)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
        env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{variant}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help="checkpoint (default: generated in --cache-dir)")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "expertcache-bench")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--caches", nargs="+", choices=("warm", "cold"), default=["warm", "cold"])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--threads", type=int, help="torch threads in each process (default: torch's, one a core)")
    p.add_argument("--baseline-src", help="a source tree (its src/) to run as 'before: ...' variants")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "startup_cpu.json")
    args = p.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    if args.rounds < 1 or args.new_tokens < 2:
        p.error("--rounds must be at least 1 and --new-tokens at least 2")
    if args.baseline_src and not (Path(args.baseline_src) / "expertcache").is_dir():
        p.error(f"--baseline-src {args.baseline_src}: no expertcache package there")
    args.model = (args.model or model_path(args.cache_dir)).resolve()
    files = weight_files(args.model)
    variants = list(args.variants)
    if args.baseline_src:
        variants += [BEFORE + v for v in (ENGINE, NO_WARMUP, QUARTER) if v in args.variants]
    runs: dict[str, dict[str, list[dict]]] = {c: {v: [] for v in variants} for c in args.caches}
    for r in range(args.rounds):
        for cache in args.caches:
            k = r % len(variants)
            for variant in variants[k:] + variants[:k]:
                set_cache(files, cache)
                before = cached_mib(files)
                got = run_child(variant, args, args.baseline_src)
                got.update(cached_before_mib=before, cached_after_mib=cached_mib(files),
                           load_avg_1min=round(os.getloadavg()[0], 2))  # fmt: skip
                runs[cache][variant].append(got)
                log(f"round {r + 1} {cache:4s} {variant:26s} ready {got['ready_s']:6.2f} s  "
                    f"TTFT {got['ttft_s']:6.3f} s  import {got['import_s']:5.2f} s  "
                    f"page cache {before} -> {got['cached_after_mib']} MiB")  # fmt: skip
    want = next((rs[0]["tokens"] for c in runs.values() for v, rs in c.items() if v == HF and rs), None)
    summary: dict[str, dict[str, dict]] = {}
    for cache, by in runs.items():
        summary[cache] = {}
        for variant, rs in by.items():
            summary[cache][variant] = {
                "ready_s": spread([x["ready_s"] for x in rs]),
                "spawn_to_ready_s": spread([x["spawn_s"] for x in rs]),
                "import_s": spread([x["import_s"] for x in rs]),
                "first_ttft_s": spread([x["ttft_s"] for x in rs]),
                "tokens_equal_transformers": None if want is None else all(x["tokens"] == want for x in rs),
            }
            s = summary[cache][variant]
            log(f"{cache:4s} {variant:26s} ready {s['ready_s']}  first TTFT {s['first_ttft_s']}  "
                f"tokens equal: {s['tokens_equal_transformers']}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, {
        "provenance": provenance(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "child"},
        "checkpoint_bytes": sum(f.stat().st_size for f in files),
        "summary": summary,
        "runs": runs,
    })  # fmt: skip
    bad = [v for c in summary.values() for v, s in c.items() if s["tokens_equal_transformers"] is False]
    if bad:
        log(f"tokens differ from transformers': {sorted(set(bad))}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
