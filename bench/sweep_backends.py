"""``expertcache sweep`` on one machine: one job, all jobs, and a local Ray, on the same grid.

The grid: the embedded trace, the shared Qwen1.5-MoE trace (when ``../shared`` has it) and a 20,000-token
sticky trace of 16 layers x 64 experts, x opt, lru, fifo, llru, lcp x 8 shares of all experts (5% .. 100%),
layer order. Each backend runs as its own process (start-up, and Ray's start, included), writing its own
CSV; the tables must be identical (the script fails otherwise).

    PYTHONPATH=bench .venv/bin/python bench/sweep_backends.py [--no-ray]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import ROOT, SHARED, provenance, write_json

from expertcache.trace import synthesize

QWEN = SHARED / "traces" / "qwen15_moe_a27b_chat.npz"
SHARES = ["5%", "10%", "20%", "30%", "40%", "50%", "75%", "100%"]
POLICIES = ["opt", "lru", "fifo", "llru", "lcp"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sweep_backends.json")
    args = ap.parse_args()
    exe = str(Path(sys.executable).parent / "expertcache")
    with tempfile.TemporaryDirectory() as tmp:
        sticky = Path(tmp) / "sticky.npz"
        synthesize("sticky", tokens=20_000, layers=16, experts=64, top_k=2, seed=3).save(sticky)
        traces = ["default", str(sticky)] + ([str(QWEN)] if QWEN.exists() else [])
        grid = ["--trace", *traces, "--policy", *POLICIES, "--capacity", *SHARES, "--quiet"]
        backends = {"jobs 1": ["--jobs", "1"], "jobs 2": ["--jobs", "2"]}
        if not args.no_ray:
            backends["ray (local, started by the sweep)"] = ["--ray"]
        rows, tables = [], {}
        for name, flags in backends.items():
            out = Path(tmp) / f"{len(tables)}.csv"
            t0 = time.perf_counter()
            subprocess.run([exe, "sweep", *grid, *flags, "--out", str(out)], check=True)
            seconds = time.perf_counter() - t0
            tables[name] = out.read_text()
            cells = tables[name].count("\n") - 1
            rows.append({"backend": name, "seconds": seconds, "cells": cells})
            print(f"{name:34} {seconds:6.1f} s  ({cells} cells)")
        same = len(set(tables.values())) == 1
        print("tables identical" if same else "TABLES DIFFER", file=sys.stderr)
    names = [Path(t).name for t in traces]
    write_json(args.out, {**provenance(), "traces": names, "rows": rows, "same": same})
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
