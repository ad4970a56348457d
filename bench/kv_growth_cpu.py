"""The key-value cache grown in place (``engine.kv``) against transformers' concatenation, in one process.

    .venv/bin/python bench/kv_growth_cpu.py MODEL [--quantize-dense int8] [--prompt-tokens 64 1000] \\
        [--attention sdpa eager] [--new-tokens 32] [--rounds 4] [--threads 2] [--out FILE]

Loads ``MODEL`` at 100 % on the CPU once per attention implementation; per prompt length and round,
decodes ``--new-tokens`` tokens greedily after the prompt (token ids 100, 101, ...) in a plain loop of the
model's forward (no ``generate``), once with the engine converting the cache (``runtime.grow``) and once
without (transformers' ``DynamicCache`` as it is), the order alternating from round to round. Prints the
median TPOT of each way and the saving; results to stdout, progress to stderr, JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--quantize-dense", default=None)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[64, 1000])
    ap.add_argument("--attention", nargs="+", default=["sdpa", "eager"])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    import expertcache
    import expertcache.engine.runtime as runtime
    from expertcache.engine import kv

    torch.set_num_threads(args.threads)
    results = []
    print("| attention | prompt tokens | grown in place, ms | concatenated, ms | saved, ms |")
    print("|---|---|---|---|---|")
    for attention in args.attention:
        kw = {"quantize_dense": args.quantize_dense} if args.quantize_dense else {}
        m = expertcache.load(
            args.model, expert_memory="100%", device="cpu", progress=False, attention=attention, **kw
        )
        vocab = m.model.config.vocab_size

        for length in args.prompt_tokens:
            ids = (torch.arange(100, 100 + length) % vocab)[None]
            decode(m.model, ids, 4)
            runs = {"grown": [], "concatenated": []}
            for r in range(args.rounds):
                for way in ("grown", "concatenated") if r % 2 else ("concatenated", "grown"):
                    runtime.grow = kv.grow if way == "grown" else (lambda cache: None)
                    runs[way].append(decode(m.model, ids, args.new_tokens))
                print(f"{attention} {length}: round {r + 1}/{args.rounds}", file=sys.stderr)
            runtime.grow = kv.grow
            g, c = (statistics.median(runs[w]) * 1e3 for w in ("grown", "concatenated"))
            print(f"| {attention} | {length} | {g:.2f} | {c:.2f} | {c - g:.2f} |")
            results.append({"attention": attention, "prompt_tokens": length, "tpot_s": runs})
        m.close()
    if args.out:
        from provenance import provenance, write_json

        write_json(args.out, {"provenance": provenance(), "threads": args.threads, "results": results})
    return 0


def decode(model, ids, n: int) -> float:
    """Seconds a token of ``n`` greedy decode steps after the prompt ``ids``, in a plain forward loop."""
    import torch

    with torch.inference_mode():
        out = model(ids, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(n):
            out = model(tok, cache=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - t) / n


if __name__ == "__main__":
    sys.exit(main())
