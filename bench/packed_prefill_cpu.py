"""A packed checkpoint's prefill on CPU: the several-token loops against expanding each expert.

For each packed checkpoint given, every expert resident (``expert_memory="100%"``), one forward pass over a
``--prompt-tokens`` prompt (token ids 1000, 1001, ...), alternating between the two ways a step of more than
``DECODE_ROWS`` tokens on an expert is computed on a CPU:

- ``tokens``: ``_packed_jit.tokens_int8`` / ``tokens_int4``, each weight row unpacked once for all the
  expert's tokens (``PREFILL_ROWS`` = 64, the default);
- ``expand``: the expert's matrices expanded to the compute dtype and multiplied by torch
  (``PREFILL_ROWS`` = 0, as before the loops).

Medians over ``--rounds`` after the first (which compiles and faults pages in). Writes ``--out`` (JSON).

    PYTHONPATH=bench .venv/bin/python bench/packed_prefill_cpu.py MODEL_INT8 MODEL_INT4 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from provenance import provenance, write_json

import expertcache.engine.packed as packed
from expertcache.engine import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "models", nargs="+", type=Path, help="packed checkpoints (expertcache quantize --checkpoint)"
    )
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("/tmp/packed_prefill_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ids = torch.tensor([list(range(1000, 1000 + args.prompt_tokens))])
    modes = {"expand": 0, "tokens": packed.PREFILL_ROWS}
    results = {}
    for path in args.models:
        m = load(path, expert_memory="100%", progress=False)
        runs: dict[str, list[float]] = {mode: [] for mode in modes}
        try:
            for _ in range(args.rounds):
                for mode, rows in modes.items():
                    packed.PREFILL_ROWS = rows
                    with torch.inference_mode():
                        t0 = time.perf_counter()
                        m.model(input_ids=ids)
                        runs[mode].append(time.perf_counter() - t0)
        finally:
            packed.PREFILL_ROWS = modes["tokens"]
            fmt = m.stats["expert_format"]
            m.close()
        med = {mode: statistics.median(r[1:] or r) for mode, r in runs.items()}
        results[path.name] = {"expert_format": fmt, "runs_s": runs, "median_s": med}
        print(f"{path.name} ({fmt}): prefill of {args.prompt_tokens} tokens, tokens loops "
              f"{med['tokens'] * 1e3:.0f} ms, expanding {med['expand'] * 1e3:.0f} ms")  # fmt: skip
    write_json(
        args.out, {**provenance(), "args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    )


if __name__ == "__main__":
    main()
