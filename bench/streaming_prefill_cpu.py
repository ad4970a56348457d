"""Streaming prefill on CPU: a long prompt's layers computed as their experts land, against waiting.

One model loaded at ``--expert-memory`` (LRU, fetch, no prefetch, the grouped kernel) runs one forward
pass over a ``--prompt-tokens`` prompt (held-out standard-library text) in each of two ways of computing a
layer whose experts are still moving (``LayerWork.batches``, swapped in this process between runs):

- ``stream`` (what the engine does): the experts ready now, then each one still moving as soon as it
  lands, with any that landed meanwhile;
- ``wait`` (before it): the experts ready now, then all the rest once the last has landed.

The cache takes the same decisions either way (the same transfers, in the same order; only when the
computation runs differs), so every run after the first starts from the same cache state. Runs alternate
between the two (the machine is shared and noisy); medians and ranges over ``--rounds``, per link: the
machine's own copies (``native``), or an emulated link (``--links``, e.g. ``2GB/s``) standing for a
device link. Writes ``--out`` (JSON).

    OMP_NUM_THREADS=1 PYTHONPATH=bench .venv/bin/python bench/streaming_prefill_cpu.py \
        [--model DIR] [--prompt-tokens 512] [--links native,2GB/s] [--rounds 7] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from provenance import ROOT, provenance, write_json

from expertcache.cache.expert_cache import LayerWork
from expertcache.engine import load
from expertcache.tools.quality import heldout_texts

STREAM = LayerWork.batches


def wait_batches(self):
    """The layer as it was computed before streaming: the units ready now, then the rest at once."""
    cache = self.cache
    for i, chunk in enumerate(self.chunks):
        if i:
            cache.admit(self.layer, chunk)
        order = cache.order(chunk)
        if not cache.inflight:
            yield order
            continue
        ready = 0
        while ready < len(order) and self._landed(order[ready]):
            ready += 1
        for group in (order[:ready], order[ready:]):
            for key, part in group:
                cache.wait(key, part)
            if group:
                yield group


MODES = {"stream": STREAM, "wait": wait_batches}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--expert-memory", default="25%")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--links", default="native,2GB/s", help="comma list: native, or a link bandwidth")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "streaming_prefill_cpu.json"))
    args = ap.parse_args()
    results = {}
    for link in args.links.split(","):
        kw = {} if link == "native" else {"link_bandwidth": link, "link_latency": "10us"}
        if args.dtype:
            kw["dtype"] = args.dtype
        with load(
            args.model, args.expert_memory, prefetch="none", kernel="grouped", progress=False, **kw
        ) as m:
            text = "".join(heldout_texts(8))
            ids = m.tokenizer(text, return_tensors="pt").input_ids[:, : args.prompt_tokens]
            runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
            for r in range(args.rounds + 1):  # the first warms up (pages, allocator): not counted
                for mode in list(MODES) if r % 2 else list(MODES)[::-1]:
                    LayerWork.batches = MODES[mode]
                    before = m.stats
                    start = time.perf_counter()
                    with torch.inference_mode():
                        m.model(ids)
                    wall = time.perf_counter() - start
                    after = m.stats
                    if r:
                        runs[mode].append({"wall_s": wall, "stall_s": after["stall_s"] - before["stall_s"],
                                           "misses": after["misses"] - before["misses"]})  # fmt: skip
            LayerWork.batches = STREAM
            row = {"prompt_tokens": int(ids.shape[1]), "kernel": m.stats["kernel"]}
            for mode, got in runs.items():
                walls = [x["wall_s"] for x in got]
                stalls = [x["stall_s"] for x in got]
                row[mode] = {"wall_s_median": statistics.median(walls), "wall_s_min": min(walls),
                             "wall_s_max": max(walls), "stall_s_median": statistics.median(stalls),
                             "misses": sorted({x["misses"] for x in got})}  # fmt: skip
            row["stream_over_wait"] = row["stream"]["wall_s_median"] / row["wait"]["wall_s_median"]
            results[link] = row
            print(f"{link}: {json.dumps(row)}", file=sys.stderr, flush=True)
    out = {"provenance": provenance(), "model": args.model or "embedded", "expert_memory": args.expert_memory,
           "results": results}  # fmt: skip
    write_json(args.out, out)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
