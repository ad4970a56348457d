"""How often batching flips a greedy token: each prompt served among many, against the same prompt alone.

The server's batcher (transformers' continuous batching through the engine) runs ``--prompts`` greedy
requests at once, in two arrival patterns: all together, and staggered (one joins every few steps, so
requests join running batches mid-way). Each request's tokens are compared with ``generate_text`` on
the same prompt alone, on the same loaded model; so are the requests served one after another
(``one_at_a_time``: the batching path's kernels, without other requests beside). A flip is a request
whose tokens differ; reported: the requests with a flip, and the tokens generated after each request's
first difference (a flipped token changes the rest of its answer).

Batching changes the shapes the kernels see (a step packs several requests' tokens; paged attention
instead of ``generate``'s), so on a GPU rounding may differ; on the CPU the tests show equality. Run on
your GPU:

    OMP_NUM_THREADS=1 PYTHONPATH=bench .venv/bin/python bench/serve_exactness.py --device cuda \
        [--model DIR] [--dtype bfloat16] [--expert-memory 25%] [--prompts 32] [--tokens 64] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from provenance import ROOT, provenance, write_json

from expertcache.engine import load
from expertcache.serve.batcher import Batcher
from expertcache.tools.quality import heldout_texts

PATTERNS = (("one_at_a_time", None), ("together", 0.0), ("staggered", 0.05))


def prompts(count: int) -> list[str]:
    """``count`` prompts: 60-character windows of the held-out standard-library files."""
    texts = heldout_texts(chars=60 * count)
    cut = [t[i : i + 60] for t in texts for i in range(0, len(t) - 60, 60)]
    return cut[:count]


async def batched(batcher: Batcher, ids: list[list[int]], tokens: int, gap_s: float | None) -> list:
    """Each prompt's tokens through the batcher: all at once, one every ``gap_s`` s, or (None) one
    after another, each alone in the batch."""

    async def one(i: int, row: list[int]) -> list[int]:
        await asyncio.sleep(i * (gap_s or 0))
        job = batcher.submit(row, tokens)
        async for _ in batcher.pieces(job):
            pass
        return job.tokens

    if gap_s is None:
        return [await one(0, row) for row in ids]
    return list(await asyncio.gather(*(one(i, row) for i, row in enumerate(ids))))


def compare(alone: list[list[int]], served: list[list[int]]) -> dict[str, object]:
    firsts = []
    for a, s in zip(alone, served, strict=True):
        diff = next((i for i, (x, y) in enumerate(zip(a, s, strict=False)) if x != y), None)
        if diff is None and len(a) != len(s):
            diff = min(len(a), len(s))
        firsts.append(diff)
    flipped = [i for i, f in enumerate(firsts) if f is not None]
    after = sum(len(alone[i]) - firsts[i] for i in flipped)
    total = sum(len(a) for a in alone)
    return {
        "requests": len(alone),
        "requests_flipped": len(flipped),
        "first_difference_at": [firsts[i] for i in flipped],
        "tokens": total,
        "tokens_after_a_flip": after,
        "tokens_after_a_flip_ratio": after / total if total else 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's)")
    ap.add_argument("--expert-memory", default="25%")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="JSON file (default: in bench/results/)")
    args = ap.parse_args()
    kw = {"dtype": args.dtype} if args.dtype else {}
    with load(args.model, args.expert_memory, device=args.device, progress=False, **kw) as model:
        device = str(model.device)
        texts = prompts(args.prompts)
        ids = [model.tokenizer(t).input_ids for t in texts]
        start = time.perf_counter()
        alone = [model.generate_text(t, args.tokens).tokens for t in texts]
        alone_s = time.perf_counter() - start
        batcher = Batcher(model, max_queue=args.prompts)
        try:
            results = {}
            for name, gap in PATTERNS:
                start = time.perf_counter()
                served = asyncio.run(batched(batcher, ids, args.tokens, gap))
                results[name] = compare(alone, served) | {"wall_s": time.perf_counter() - start}
        finally:
            batcher.close()
        gpu = None
        if device.startswith("cuda"):
            import torch

            gpu = torch.cuda.get_device_name(model.device)
    out = {
        **provenance(),
        "model": args.model or "embedded",
        "device": device,
        "gpu": gpu,
        "dtype": str(model.dtype),
        "expert_memory": args.expert_memory,
        "prompts": args.prompts,
        "tokens": args.tokens,
        "alone_wall_s": alone_s,
        **results,
    }
    name = f"serve_exactness_{device.split(':')[0]}_{str(model.dtype).split('.')[-1]}.json"
    path = args.out or ROOT / "bench" / "results" / name
    write_json(path, out)
    for name, _ in PATTERNS:
        r = results[name]
        print(
            f"{name}: {r['requests_flipped']}/{r['requests']} requests flipped, "
            f"{r['tokens_after_a_flip']}/{r['tokens']} tokens after a flip ({r['wall_s']:.1f} s)"
        )
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
