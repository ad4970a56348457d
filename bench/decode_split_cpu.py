"""Where a packed checkpoint's decode token goes on a CPU: the compiled int8 loops, timed in place, and
the rest (transformers' modules, torch's small operations, the engine's Python).

    .venv/bin/python bench/decode_split_cpu.py PACKED_DIR [--quantize-dense int8] [--threads 2] \\
        [--new-tokens 64] [--rounds 3] [--no-huge-pages]

Loads ``PACKED_DIR`` (an int8 checkpoint of ``expertcache quantize --checkpoint``) at 100 % on the CPU,
warms it up, then per round generates greedily from a fixed 64-token prompt (token ids 100-163), once
with 1 new token and once with ``--new-tokens`` + 1, so that TPOT is the difference over the decode
tokens alone. ``_packed_jit.rows_int8`` is wrapped to time each call by matrix shape (rows, columns,
rows of input): the experts' two projections (8 pairs a call in a decode step), the dense layers' and
the output head's (one row). Prints per shape the milliseconds per decode token and the weight bytes
read per second, and TPOT, medians over rounds; results to stdout, progress to stderr.

``--no-huge-pages`` leaves the slot pool on 4 KiB pages (``memory.advise_huge_pages`` switched off), and
``NUMBA_CPU_FEATURES`` set to the host's own features gives numba's default vector width
(``expertcache/jit.py``): together, the engine before full-width vectors and huge pages.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--quantize-dense", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-huge-pages", action="store_true")
    args = ap.parse_args()
    import torch

    import expertcache
    from expertcache.engine import _packed_jit, memory
    from expertcache.jit import wide_vectors

    torch.set_num_threads(args.threads)
    if args.no_huge_pages:
        memory.advise_huge_pages = lambda tensor: False
    kw = {"quantize_dense": args.quantize_dense} if args.quantize_dense else {}
    model = expertcache.load(args.model, expert_memory="100%", slow_tier="disk", device="cpu", **kw)
    ids = torch.arange(100, 164)[None]
    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    inner = _packed_jit.rows_int8

    def timed(pool, qoff, soff, rows, cols, slots, x, out, by_block=False):
        t = time.perf_counter()
        inner(pool, qoff, soff, rows, cols, slots, x, out, by_block)
        key = (rows, cols, len(slots))
        spent[key] += time.perf_counter() - t
        calls[key] += 1

    _packed_jit.rows_int8 = timed
    model.generate(ids, max_new_tokens=4)
    n = args.new_tokens
    tpots, per_shape, rates = [], collections.defaultdict(list), collections.defaultdict(list)
    for r in range(args.rounds):
        spent.clear(), calls.clear()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1)
        first = time.perf_counter() - t
        prefill = dict(spent)
        spent.clear(), calls.clear()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n + 1)
        tpots.append((time.perf_counter() - t - first) / n)
        for key, s in spent.items():
            per_shape[key].append((s - prefill.get(key, 0.0)) / n)
            rates[key].append(key[0] * key[1] * key[2] * calls[key] / s / 1e9)  # the whole run's calls
        print(f"round {r + 1}: TPOT {tpots[-1] * 1e3:.1f} ms", file=sys.stderr)
    print(f"full-width vectors: {wide_vectors()}; huge pages: {not args.no_huge_pages}")
    print("| rows x cols, input rows | ms a decode token | GB/s |")
    print("|---|---|---|")
    total = 0.0
    for key in sorted(per_shape, key=lambda k: -statistics.median(per_shape[k])):
        ms = statistics.median(per_shape[key])
        if ms < 5e-5:  # under 0.05 ms a token: a prefill's shapes
            continue
        rows, cols, k = key
        print(f"| {rows} x {cols}, {k} | {ms * 1e3:.2f} | {statistics.median(rates[key]):.1f} |")
        total += ms
    tpot, low, high = (1e3 * f(tpots) for f in (statistics.median, min, max))
    print(f"int8 loops {total * 1e3:.1f} ms of a {tpot:.1f} ms decode token (TPOT median of {args.rounds}, "
          f"range {low:.1f}-{high:.1f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
