"""How long a core keeps its caches between two uses of the same code and data: what a decode token's
thousands of small operations cost on a shared machine.

    .venv/bin/python bench/cache_retention_cpu.py [--gaps-ms 0 0.5 2 5 20] [--rounds 200] [--threads 1] \\
        [--out FILE]

Two probes, each timed right after a gap in which the process spins in Python (busy, touching almost
no memory, so nothing of its own evicts anything):

- **data**: 256 KiB (one read a 64-byte line, in a random order), read once before the gap and again
  after it. Read back from the core's own caches it takes about 16 us on the development VMs; from the
  memory, ten times that.
- **torch**: seven small operations on a 1 x 1024 float32 tensor (an ``add``, then an RMSNorm's
  arithmetic: ``pow``, ``mean``, ``add``, ``rsqrt``, two ``mul``), run before the gap and again after it.
  Warm, each costs a few microseconds of torch's dispatcher and Python; after a gap in which the core's
  caches were taken, the code and data of that path come from the memory again.

A decode token of transformers' eager modules is about 2700 such operations between the weights' loops
(docs/BENCHMARKS.md, issue 30): where the machine's neighbours take the core's caches within a
millisecond or two, they run cold (the token's own weight loops evict the caches too). llama.cpp runs a
token in a few compiled kernels. Medians of ``--rounds`` in microseconds; results to stdout, JSON (with
torch's version) to ``--out``, whose directory is checked first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--gaps-ms", type=float, nargs="+", default=[0.0, 0.5, 2.0, 5.0, 20.0], metavar="MS",
        help="spins between the two uses, in milliseconds (0 to 1000; default 0 0.5 2 5 20)",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=200, help="rounds per gap and probe (default 200)")
    ap.add_argument("--threads", type=int, default=1, help="torch's threads (default 1)")
    ap.add_argument("--out", default=None, metavar="FILE.json", help="also write the results as JSON")
    args = ap.parse_args()
    bad = [
        f"--rounds {args.rounds}: give at least 1" if args.rounds < 1 else "",
        f"--threads {args.threads}: give at least 1" if args.threads < 1 else "",
        *(f"--gaps-ms {g}: give 0 to 1000" for g in args.gaps_ms if not 0 <= g <= 1000),  # nan fails too
        f"--out {args.out}: its directory does not exist"
        if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out)))
        else "",
    ]
    if any(bad):
        print(f"cache_retention_cpu: {next(b for b in bad if b)}", file=sys.stderr)
        return 2
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    data = np.ones(256 * 1024 // 8)
    lines = np.random.default_rng(0).permutation(data.size // 8) * 8
    a, b, w = torch.randn(1, 1024), torch.randn(1, 1024), torch.randn(1024)

    def read() -> None:
        data[lines].sum()

    def norm() -> None:
        x = (a + b).pow(2)
        w * (a * torch.rsqrt(x.mean(-1, keepdim=True) + 1e-6))

    results = []
    print("| gap ms | 256 KiB read again, us | seven torch operations again, us |")
    print("|---|---|---|")
    for gap in args.gaps_ms:
        row = {"gap_ms": gap}
        for name, probe in (("data_us", read), ("torch_us", norm)):
            times = []
            for _ in range(args.rounds):
                probe()
                spin(gap / 1e3)
                t = time.perf_counter()
                probe()
                times.append((time.perf_counter() - t) * 1e6)
            row[name] = statistics.median(times)
        print(f"| {gap:g} | {row['data_us']:.1f} | {row['torch_us']:.1f} |")
        results.append(row)
    if args.out:
        from provenance import provenance, write_json

        settings = {**vars(args), "torch": torch.__version__}
        write_json(args.out, {"provenance": provenance(), "settings": settings, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
