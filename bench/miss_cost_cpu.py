"""What one miss costs on CPU, next to the compute it enables (issue: models larger than memory).

The issue: "at smaller budgets on CPU with no link, a copy from page cache should not cost more than the
compute it enables: measure and cut the per-miss overhead (copy path, threads, allocation)". Per slow tier
(``host``: every expert in RAM; ``mapped``: the checkpoint's pages in the page cache; ``disk``: exact
reads from the disk, nothing left in the page cache) and model, medians over distinct experts:

- ``copy``: the tier's copy of one whole expert into a slot, on the calling thread;
- ``miss``: a demand transfer through the engine's transfer worker, submitted and waited for (what a
  miss costs the compute thread when nothing overlaps it);
- ``compute``: the expert's computation for one token, from a slot (what the miss enables);
- ``memcpy``: ``np.copyto`` of the same bytes between two buffers (the floor of any copy);
- ``in_generation``: what a miss costs inside a generation, everything around it included (the cache's
  bookkeeping, the worker, the interpreter lock): one model at 25 % and one at 100 % of the experts in one
  process, greedy generations of the same prompt interleaved (each round runs both, one after the other),
  ``(TPOT at 25 % - TPOT at 100 %) / decode misses per token``, the median over rounds of each round's
  difference (the development VM drifts by tens of percent within a minute: a round's two runs see the
  same machine), at one torch thread and at one per processor;
- ``parallel_copies``: the Granite-shaped model's misses copied through torch's intra-op threads (runs of
  ``PARALLEL_BYTES`` or more, as the engine does on the model's thread) against numpy's single thread,
  in one process, interleaved with 100 %, on one torch thread per processor (``parallel_copies``);
- ``plain_layers``: layers with misses served by the cache's plain-layer shortcut against its full path
  (routes, chunks, admission), in one process, interleaved with 100 % (``plain_layers``);
- ``in_context``: a miss's copy and the computation of one expert for one token, both timed inside
  generation at 25 % (``in_context``): the caches as the model's other layers leave them, for both.

Each expert is read once per measurement (a second read of the same one would find it warm). The disk
tier's figures depend on the disk; the mapped tier's on the page cache being warm (it is read once first).
The script runs against older versions of the engine as well (a tier that takes no slot bytes is called
without them), so the numbers before and after a change come from the same measurement:

    OMP_NUM_THREADS=1 .venv/bin/python bench/miss_cost_cpu.py [--quick] [--only SECTION ...] [--out FILE]

(``measure`` is the first four figures; ``--only`` runs the named sections alone.)
"""

from __future__ import annotations

import argparse
import inspect
import os
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


SECTIONS = ("measure", "in_generation", "parallel_copies", "plain_layers", "in_context")
PROMPT = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\ndef main():"


def in_generation(path: Path | None, tier: str, tokens: int, rounds: int, threads: int) -> dict[str, object]:
    """The cost of a miss inside generations (module docstring): 25 % against 100 %, interleaved."""
    torch.set_num_threads(threads)
    kw = dict(device="cpu", slow_tier=tier, prefetch="none", progress=False)
    if "warmup" in inspect.signature(expertcache.load).parameters:
        kw["warmup"] = False  # both models warmed below, the same way
    models = {b: expertcache.load(path, expert_memory=b, **kw) for b in ("25%", "100%")}
    for m in models.values():
        m.generate_text(PROMPT, max_new_tokens=8)
    runs: dict[str, list[tuple[float, float]]] = {b: [] for b in models}
    for r in range(rounds):
        for b in list(models) if r % 2 == 0 else list(models)[::-1]:
            m = models[b]
            before = int(m.cache.stats.misses[0].sum())
            g = m.generate_text(PROMPT, max_new_tokens=tokens, min_new_tokens=tokens)
            misses = (int(m.cache.stats.misses[0].sum()) - before) / (len(g.tokens) - 1)
            runs[b].append((g.tpot_s, misses))
    for m in models.values():
        m.close()
    tpot = {b: statistics.median(t for t, _ in v) for b, v in runs.items()}
    misses = statistics.median(n for _, n in runs["25%"])
    paired = statistics.median(a - b for (a, _), (b, _) in zip(runs["25%"], runs["100%"], strict=True))
    return {
        "torch_threads": threads,
        "tokens": tokens,
        "rounds": rounds,
        "tpot_ms": {b: round(t * 1e3, 3) for b, t in tpot.items()},
        "tpot_runs_ms": {b: [round(t * 1e3, 3) for t, _ in v] for b, v in runs.items()},
        "decode_misses_per_token": round(misses, 2),
        "per_miss_us": round(paired / misses * 1e6, 1) if misses else None,
    }


def against_full(
    path: Path | None, tier: str, tokens: int, rounds: int, threads: int, variants: tuple[str, str], switch
) -> dict[str, object]:
    """Two variants of the model at 25 % and the model at 100 %, in one process: each round generates
    greedily on each of the three, the order rotating; ``switch(model, name)`` sets the 25 % model up as
    variant ``name`` before each of its runs (``switch(model, None)`` restores it at the end). Per
    variant, the median over rounds of the TPOT over 100 %'s of the same round, over the decode misses
    per token; and the median of the two variants' paired difference."""
    torch.set_num_threads(threads)
    kw = dict(device="cpu", slow_tier=tier, prefetch="none", progress=False, warmup=False)
    low, full = (expertcache.load(path, expert_memory=b, **kw) for b in ("25%", "100%"))
    names = [*variants, "100%"]
    for m in (low, full):
        m.generate_text(PROMPT, max_new_tokens=8)
    runs: dict[str, list[tuple[float, float]]] = {v: [] for v in names}
    tokens_of: dict[str, list[int]] = {}
    try:
        for r in range(rounds):
            for name in names[r % 3 :] + names[: r % 3]:
                m = full if name == "100%" else low
                if m is low:
                    switch(low, name)
                before = int(m.cache.stats.misses[0].sum())
                g = m.generate_text(PROMPT, max_new_tokens=tokens, min_new_tokens=tokens)
                runs[name].append(
                    (g.tpot_s, (int(m.cache.stats.misses[0].sum()) - before) / (len(g.tokens) - 1))
                )
                tokens_of.setdefault(name, list(g.tokens))
    finally:
        switch(low, None)
        low.close()
        full.close()
    misses = statistics.median(n for v in variants for _, n in runs[v])
    out: dict[str, object] = {"torch_threads": threads, "tokens": tokens, "rounds": rounds}
    out["tpot_ms"] = {v: round(statistics.median(t for t, _ in runs[v]) * 1e3, 3) for v in names}
    out["tpot_runs_ms"] = {v: [round(t * 1e3, 3) for t, _ in runs[v]] for v in names}
    out["decode_misses_per_token"] = round(misses, 2)
    out["tokens_equal"] = len({tuple(t) for t in tokens_of.values()}) == 1
    for v in variants:
        paired = statistics.median(a - b for (a, _), (b, _) in zip(runs[v], runs["100%"], strict=True))
        out[f"per_miss_us {v}"] = round(paired / misses * 1e6, 1) if misses else None
    first, second = (runs[v] for v in variants)
    diff = statistics.median(a - b for (a, _), (b, _) in zip(first, second, strict=True))
    out["tpot_{}_minus_{}_ms".format(*(v.replace(" ", "_") for v in variants))] = round(diff * 1e3, 3)
    return out


def parallel_copies(
    path: Path, tier: str, tokens: int, rounds: int, threads: int
) -> dict[str, object] | None:
    """A miss's copy through torch's intra-op threads (``store.PARALLEL_BYTES``) against numpy's one
    (the limit out of reach), at 25 %, against 100 % (``against_full``). None before the change (no
    ``PARALLEL_BYTES``)."""
    from expertcache.engine import store

    limit = getattr(store, "PARALLEL_BYTES", None)
    if limit is None:
        return None

    def switch(m, name: str | None) -> None:
        store.PARALLEL_BYTES = 1 << 62 if name == "numpy" else limit

    return against_full(path, tier, tokens, rounds, threads, ("torch threads", "numpy"), switch)


def plain_layers(
    path: Path | None, tier: str, tokens: int, rounds: int, threads: int
) -> dict[str, object] | None:
    """A layer with misses served by ``ExpertCache._plain_layer`` (no routing or admission machinery)
    against the full path (the cache's ``_fetches`` off: what every layer with a miss took before), at
    25 %, against 100 % (``against_full``). None before the change."""
    from expertcache.cache.expert_cache import ExpertCache

    if not hasattr(ExpertCache, "_plain_layer"):
        return None

    def switch(m, name: str | None) -> None:
        m.cache._fetches = name != "full path"

    return against_full(path, tier, tokens, rounds, threads, ("plain layers", "full path"), switch)


def in_context(path: Path | None, tier: str, tokens: int, rounds: int, threads: int) -> dict[str, object]:
    """A miss's copy and the computation it enables, both timed inside generation at 25 % (``rounds``
    greedy generations after one to warm up): every copy of an expert into a slot (the tier's
    ``copy_chunk``, on whichever thread makes it) and every computation of one expert for one token (the
    cache part's ``compute``). Both see the caches as the model's other layers leave them, where the
    ``compute`` figure of ``measure`` (one expert again and again) sees them warm."""
    torch.set_num_threads(threads)
    kw = dict(device="cpu", slow_tier=tier, prefetch="none", progress=False, warmup=False)
    m = expertcache.load(path, expert_memory="25%", **kw)
    m.generate_text(PROMPT, max_new_tokens=8)
    copies: list[float] = []
    computes: list[float] = []
    source, part = next(iter(m.targets.values())).source, m.parts["full"]
    copy_chunk, compute = source.copy_chunk, part.compute

    def timed_copy(*args) -> None:
        start = time.perf_counter()
        copy_chunk(*args)
        copies.append(time.perf_counter() - start)

    def timed_compute(module, views, x):
        start = time.perf_counter()
        out = compute(module, views, x)
        if x.shape[0] == 1:
            computes.append(time.perf_counter() - start)
        return out

    source.copy_chunk, part.compute = timed_copy, timed_compute  # both are looked up at every call
    try:
        for _ in range(rounds):
            m.generate_text(PROMPT, max_new_tokens=tokens, min_new_tokens=tokens)
    finally:
        source.copy_chunk, part.compute = copy_chunk, compute
        m.close()
    copy_us, compute_us = statistics.median(copies) * 1e6, statistics.median(computes) * 1e6
    return {
        "torch_threads": threads,
        "tokens": tokens,
        "rounds": rounds,
        "copies": len(copies),
        "copy_us": round(copy_us, 1),
        "compute_1_token_us": round(compute_us, 1),
        "copy_over_compute": round(copy_us / compute_us, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=150, help="distinct experts per measurement")
    p.add_argument("--quick", action="store_true", help="smoke test: a small generated model, 20 experts")
    p.add_argument("--rounds", type=int, default=15, help="interleaved generations per model in generation")
    p.add_argument("--only", nargs="+", choices=SECTIONS, help="these measurements only (default: all)")
    p.add_argument("--out", type=Path, help="JSON results (default: bench/results/miss_cost_cpu.json, with "
                   "--only miss_cost_cpu_<sections>.json)")  # fmt: skip
    args = p.parse_args()
    if args.quick:
        args.count, args.rounds = 20, 2
    only = set(args.only or SECTIONS)
    name = "miss_cost_cpu" + ("" if args.only is None else "_" + "_".join(s for s in SECTIONS if s in only))
    out = args.out or ROOT / "bench" / "results" / (name + ("_quick" if args.quick else "") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    results = {"provenance": provenance(), "settings": vars(args) | {"out": str(out)}, "models": {}}
    for label, path in (("embedded", None), ("granite", granite(args.quick))) if "measure" in only else ():
        results["models"][label] = {}
        for tier in ("host", "mapped", "disk"):
            r = measure(path, tier, args.count)
            results["models"][label][tier] = r
            log(f"{label} {tier}: {r}")
            write_json(out, results)
    processors = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    tokens = {"embedded": 64, "granite": 4 if args.quick else 16}
    results["in_generation"] = {}
    for label, path in (
        (("embedded", None), ("granite", granite(args.quick))) if "in_generation" in only else ()
    ):
        for tier in ("host", "mapped"):
            for threads in sorted({1, processors}):
                r = in_generation(path, tier, tokens[label], args.rounds, threads)
                results["in_generation"][f"{label} {tier} {threads} thread(s)"] = r
                log(f"in generation, {label} {tier} {threads} thread(s): {r['per_miss_us']} us a miss, {r}")
                write_json(out, results)
    if processors > 1 and "parallel_copies" in only:
        results["parallel_copies"] = {}
        for tier in ("host", "mapped"):
            r = parallel_copies(granite(args.quick), tier, tokens["granite"], args.rounds, processors)
            if r is None:
                break
            results["parallel_copies"][f"granite {tier} {processors} threads"] = r
            log(f"parallel copies, granite {tier}: {r}")
            write_json(out, results)
    results["plain_layers"] = {}
    runs = [("embedded", None, tier, t) for tier in ("host", "mapped") for t in sorted({1, processors})]
    for label, path, tier, threads in (
        runs + [("granite", None, "host", processors)] if "plain_layers" in only else ()
    ):
        r = plain_layers(
            granite(args.quick) if label == "granite" else path, tier, tokens[label], args.rounds, threads
        )
        if r is None:
            log("plain layers: this version of the engine has no plain-layer shortcut")
            break
        results["plain_layers"][f"{label} {tier} {threads} thread(s)"] = r
        log(f"plain layers, {label} {tier} {threads} thread(s): {r}")
        write_json(out, results)
    results["in_context"] = {}
    for label, tier, threads in (
        [(lab, tier, t) for lab in tokens for tier in ("host", "mapped") for t in sorted({1, processors})]
        if "in_context" in only
        else ()
    ):
        path = granite(args.quick) if label == "granite" else None
        r = in_context(path, tier, tokens[label], args.rounds, threads)
        results["in_context"][f"{label} {tier} {threads} thread(s)"] = r
        log(f"in context, {label} {tier} {threads} thread(s): {r}")
        write_json(out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
