"""How often batching flips a greedy token: each prompt served among many, against the same prompt alone.

The server's batcher (transformers' continuous batching through the engine) runs ``--prompts`` greedy
requests at once, in two arrival patterns: all together, and staggered (one joins every few steps, so
requests join running batches mid-way). Each request's tokens are compared with ``generate_text`` on
the same prompt alone, on the same loaded model; so are the requests served one after another
(``one_at_a_time``: the batching path's kernels, without other requests beside). A flip is a request
whose tokens differ; reported: the requests with a flip, and the tokens generated after each request's
first difference (a flipped token changes the rest of its answer).

``--seeded T`` samples instead, at temperature T with request i seeded i, against ``generate_text`` with
the same seed and temperature alone: whether a seeded answer is the same alone or among others. Both
modes also serve the prompts one at a time a second time and compare the two serving runs with each
other (``repeat_one_at_a_time``): whether the server repeats itself at all.

Batching changes the shapes the kernels see (a step packs several requests' tokens; paged attention
instead of ``generate``'s), so on a GPU rounding may differ; on the CPU the tests show equality. Run on
your GPU:

    OMP_NUM_THREADS=1 PYTHONPATH=bench .venv/bin/python bench/serve_exactness.py --device cuda \
        [--model DIR] [--dtype bfloat16] [--expert-memory 25%] [--prompts 32] [--tokens 64] [--out FILE.json]

``--policy`` and ``--miss`` set the cache's (batch-aware: ``--policy tlfu --miss batch``);
``--against-full`` also runs each prompt alone with every expert resident and compares (the budget, the
policy and the miss path must not change a token).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from provenance import ROOT, provenance, write_json

from expertcache.config import SamplingConfig
from expertcache.engine import load
from expertcache.serve.batcher import Batcher
from expertcache.tools.quality import heldout_texts

PATTERNS = (("one_at_a_time", None), ("together", 0.0), ("staggered", 0.05))


def prompts(count: int) -> list[str]:
    """``count`` prompts: 60-character windows of the held-out standard-library files."""
    texts = heldout_texts(chars=60 * count)
    cut = [t[i : i + 60] for t in texts for i in range(0, len(t) - 60, 60)]
    return cut[:count]


async def batched(
    batcher: Batcher, ids: list[list[int]], tokens: int, gap_s: float | None, temperature: float = 0.0
) -> list:
    """Each prompt's tokens through the batcher: all at once, one every ``gap_s`` s, or (None) one
    after another, each alone in the batch; sampled with request i seeded i at ``temperature`` > 0."""

    async def one(i: int, row: list[int]) -> list[int]:
        await asyncio.sleep(i * (gap_s or 0))
        seed = i if temperature > 0 else None
        job = batcher.submit(row, tokens, temperature=temperature, seed=seed)
        async for _ in batcher.pieces(job):
            pass
        return job.tokens

    if gap_s is None:
        return [await one(i, row) for i, row in enumerate(ids)]  # gap None: no wait
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
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    ap.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's)")
    ap.add_argument("--expert-memory", default="25%")
    ap.add_argument("--policy", default="lru", help="the cache's eviction policy (default lru)")
    ap.add_argument("--miss", default="fetch", help="the miss path (default fetch)")
    ap.add_argument(
        "--against-full",
        action="store_true",
        help="also each prompt alone with every expert resident (100%%, lru, fetch): does the budget, the "
        "policy or the miss path change a token",
    )
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument(
        "--seeded", type=float, default=0.0, metavar="T", help="sample at T, seeded (default: greedy)"
    )
    ap.add_argument("--out", default=None, help="JSON file (default: in bench/results/)")
    args = ap.parse_args()
    kw = {"dtype": args.dtype} if args.dtype else {}
    full = None
    if args.against_full:
        with load(args.model, "100%", device=args.device, progress=False, **kw) as model:
            sampling = [SamplingConfig(temperature=args.seeded, seed=i) if args.seeded else None
                        for i in range(args.prompts)]  # fmt: skip
            full = [model.generate_text(t, args.tokens, sampling=sampling[i]).tokens
                    for i, t in enumerate(prompts(args.prompts))]  # fmt: skip
    kw |= {"policy": args.policy, "miss": args.miss}
    with load(args.model, args.expert_memory, device=args.device, progress=False, **kw) as model:
        device = str(model.device)
        texts = prompts(args.prompts)
        ids = [model.tokenizer(t).input_ids for t in texts]
        start = time.perf_counter()

        def reference(i: int, text: str) -> list[int]:
            sampling = SamplingConfig(temperature=args.seeded, seed=i) if args.seeded else None
            return model.generate_text(text, args.tokens, sampling=sampling).tokens

        alone = [reference(i, t) for i, t in enumerate(texts)]
        alone_s = time.perf_counter() - start
        results = {} if full is None else {"alone_against_full_memory": compare(full, alone)}
        batcher = Batcher(model, max_queue=args.prompts)
        try:
            runs = {}
            for name, gap in PATTERNS:
                start = time.perf_counter()
                runs[name] = asyncio.run(batched(batcher, ids, args.tokens, gap, args.seeded))
                results[name] = compare(alone, runs[name]) | {"wall_s": time.perf_counter() - start}
            again = asyncio.run(batched(batcher, ids, args.tokens, None, args.seeded))
            results["repeat_one_at_a_time"] = compare(runs["one_at_a_time"], again)
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
        "policy": args.policy,
        "miss": args.miss,
        "prompts": args.prompts,
        "tokens": args.tokens,
        "sampling": f"temperature {args.seeded}, request i seeded i" if args.seeded else "greedy",
        "alone_wall_s": alone_s,
        **results,
    }
    seeded = "_seeded" if args.seeded else ""
    name = f"serve_exactness_{device.split(':')[0]}_{str(model.dtype).split('.')[-1]}{seeded}.json"
    path = args.out or ROOT / "bench" / "results" / name
    write_json(path, out)
    for name, r in results.items():
        print(
            f"{name}: {r['requests_flipped']}/{r['requests']} requests flipped, "
            f"{r['tokens_after_a_flip']}/{r['tokens']} tokens after a flip"
        )
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
