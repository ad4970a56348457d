"""What one miss costs on CPU, next to the compute it enables (issue: models larger than memory).

The issue: "at smaller budgets on CPU with no link, a copy from page cache should not cost more than the
compute it enables: measure and cut the per-miss overhead (copy path, threads, allocation)". Per slow tier
(``host``: every expert in RAM; ``mapped``: the checkpoint's pages in the page cache; ``disk``: exact
reads from the disk, nothing left in the page cache) and model, medians over distinct experts:

- ``copy``: the tier's copy of one whole expert into a slot, on the calling thread;
- ``miss``: a demand transfer through the engine's transfer worker, submitted and waited for (what a
  miss costs the compute thread when nothing overlaps it);
- ``compute``: the expert's computation for one token, from a slot (what the miss enables);
- ``memcpy``: ``np.copyto`` of the same bytes between two buffers (the floor of any copy).

Each expert is read once per measurement (a second read of the same one would find it warm). The disk
tier's figures depend on the disk; the mapped tier's on the page cache being warm (it is read once first).
The script runs against older versions of the engine as well (a tier that takes no slot bytes is called
without them), so the numbers before and after a change come from the same measurement:

    OMP_NUM_THREADS=1 .venv/bin/python bench/miss_cost_cpu.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from engine_cpu import log
from provenance import ROOT, provenance, write_json

import expertcache
from expertcache.cache.transfers import DEMAND
from expertcache.engine.random_checkpoint import make_checkpoint

GRANITE = dict(hidden=1024, layers=24, experts=32, top_k=8, intermediate=512, heads=16, dtype="bfloat16")


def granite(quick: bool) -> Path:
    spec = dict(GRANITE, layers=4, experts=16) if quick else GRANITE
    path = (
        Path(tempfile.gettempdir()) / "expertcache-bench" / ("granite-miss-quick" if quick else "granite-32e")
    )
    if not (path / ".complete").is_file():
        log(f"generating {path}")
        make_checkpoint(path, "granitemoe", max_shard_size="1GB", **spec)
        (path / ".complete").write_text("ok\n")
    return path


def median_us(fn, items) -> float:
    times = []
    for item in items:
        start = time.perf_counter()
        fn(item)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


def measure(path: Path | None, tier: str, count: int) -> dict[str, object]:
    m = expertcache.load(path, expert_memory="25%", device="cpu", slow_tier=tier, progress=False)
    pid = next(iter(m.targets))
    target = m.targets[pid]
    keys = [(layer, e) for layer in range(m.num_layers) for e in range(m.num_experts)]
    half = len(keys) // 2
    copy_keys, miss_keys = keys[:half][:count], keys[half:][:count]
    whole = target.plan(keys[0], None)
    views = target.pool.views[0]
    takes_bytes = "flat" in inspect.signature(target.source.copy_chunk).parameters
    flat = target.pool.buffer[0].view(torch.uint8).numpy() if takes_bytes else None
    if tier == "mapped":  # the page cache warm, as the tier assumes: every expert read once first
        for k in keys:
            for chunk in whole:
                target.source.copy_chunk(k, views, chunk, *([flat] if takes_bytes else []))

    def copy(key) -> None:
        for chunk in whole:
            target.source.copy_chunk(key, views, chunk, *([flat] if takes_bytes else []))

    def miss(key) -> None:
        m.worker.wait(m.worker.submit(key, 1, DEMAND, pid))

    module = m.engine._experts[0]
    x = torch.randn(1, m.config.hidden_size, dtype=m.dtype)
    with torch.inference_mode():
        for _ in range(20):
            m.parts["full"].compute(module, views, x)
        compute = median_us(lambda _: m.parts["full"].compute(module, views, x), range(200))
    a = np.empty(m.layout.nbytes, dtype=np.uint8)
    b = np.ones_like(a)
    memcpy = median_us(lambda _: np.copyto(a, b), range(200))
    out = {
        "expert_kib": round(m.layout.nbytes / 1024, 1),
        "copy_us": median_us(copy, copy_keys),
        "miss_us": median_us(miss, miss_keys),
        "compute_1_token_us": compute,
        "memcpy_us": memcpy,
        "copies_by_byte_ranges": takes_bytes,
    }
    m.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=150, help="distinct experts per measurement")
    p.add_argument("--quick", action="store_true", help="smoke test: a small generated model, 20 experts")
    p.add_argument("--out", type=Path, help="JSON results (default: bench/results/miss_cost_cpu.json)")
    args = p.parse_args()
    if args.quick:
        args.count = 20
    out = args.out or ROOT / "bench" / "results" / (
        "miss_cost_cpu_quick.json" if args.quick else "miss_cost_cpu.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    results = {"provenance": provenance(), "settings": vars(args) | {"out": str(out)}, "models": {}}
    for label, path in (("embedded", None), ("granite", granite(args.quick))):
        results["models"][label] = {}
        for tier in ("host", "mapped", "disk"):
            r = measure(path, tier, args.count)
            results["models"][label][tier] = r
            log(f"{label} {tier}: {r}")
            write_json(out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
