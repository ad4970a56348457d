"""What the lossy miss paths cost in accuracy: perplexity and top-1 agreement on held-out text.

The embedded model (its held-out standard-library files, ``tools.quality.heldout_texts``) runs token by
token (every token a decode step, as in generation) through the engine under each lossy configuration,
at the expert memory given (default 25%: a quarter of the experts resident, so most uses are misses)
and LRU, and through transformers' eager reference once; ``expertcache.tools.quality.measure`` compares
them (see its docstring). The low-precision copies are built first if missing (``expertcache quantize``,
groups of 64: int8 and int4 in the packed formats, int2 HQQ's). Targets (the miss-path issue): int8
copies on misses raise perplexity by at most 0.5% with at least 99% top-1 agreement; HOBBIT's default
thresholds with int4 by at most 3%.

    .venv/bin/python bench/miss_quality.py [--tokens 2048] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from provenance import ROOT, provenance, write_json

from expertcache.engine.offloaded import DEFAULT_MODEL
from expertcache.engine.quantized import find_copy
from expertcache.errors import ExpertcacheError
from expertcache.tools.quality import Reference, format_quality, heldout_texts, measure
from expertcache.tools.quantize import quantize_model

CONFIGS = (
    "fetch",  # exact: the measurement's own check (0% change, 100% agreement)
    "hobbit:bits=8,t1=-1",  # every miss served by the int8 copy
    "hobbit:bits=8",  # HOBBIT's thresholds (t1 0.6, t2 0.9) with int8
    "hobbit:bits=4,t1=-1",
    "hobbit",  # HOBBIT's defaults: int4, t1 0.6, t2 0.9
    "hobbit:bits=4,t1=0.3",
    "hobbit:bits=2,t1=-1",
    "hobbit:bits=2",
    "hobbit:skip=1",  # int4, and s > 0.9 skipped
    "hobbit:skip=1,t2=0.6",
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens measured per configuration")
    ap.add_argument("--expert-memory", default="25%")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="256 tokens, three configurations")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "miss_quality.json")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.configs = 256, ["fetch", "hobbit:bits=8,t1=-1", "hobbit"]
    missing = [b for b in (8, 4, 2) if not _has(b)]
    if missing:
        log(f"building the int{'/int'.join(map(str, missing))} copies of the embedded model")
        quantize_model(None, bits=missing, group=64, progress=False)
    texts = heldout_texts()
    reference = Reference(None)
    rows = []
    for spec in args.configs:
        log(spec)
        r = measure(None, spec, args.expert_memory, "lru", texts, args.tokens, reference=reference)
        rows.append(r)
        print(format_quality(r), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"provenance": provenance(), "args": vars(args) | {"out": str(args.out)}, "rows": rows}
        write_json(args.out, record)
    print("\n| miss path | perplexity | change | top-1 agreement | low precision | skipped |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        low, skipped = r["low_precision_share"], r["skipped_share"]
        print(f"| {r['miss']} | {r['perplexity']:.3f} | {r['perplexity_change']:+.2%} | "
              f"{r['top1_agreement']:.2%} | {low:.1%} | {skipped:.1%} |")  # fmt: skip
    return 0


def _has(bits: int) -> bool:
    try:
        find_copy(DEFAULT_MODEL, bits, 64)
        return True
    except ExpertcacheError:
        return False


if __name__ == "__main__":
    sys.exit(main())
