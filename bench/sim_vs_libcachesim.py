"""``expertcache sim`` against libCacheSim's C core on the same requests, side by side, whole processes.

The trace: ``synthesize("zipf", tokens=--tokens, layers=32, experts=8, top_k=2, seed=1)`` in flat order
(one request per (token, layer, expert), 6.4M requests at the default 100,000 tokens), written twice: as
an expertcache ``.npz`` and as libCacheSim's ``oracleGeneral`` binary (24-byte records: time, object id,
size 1, the index of the object's next request or -1), so both see the same requests and Belady has the
future. Each side runs as its own process (startup, reading and, for expertcache, OPT's bound included),
once untimed, then ``--repeats`` times, median wall time; the miss ratios must agree (the script fails
otherwise).

Rows: LRU, FIFO and OPT/Belady at one capacity (``--capacity``, 64), and expertcache's whole LRU curve
(every capacity 1..256, OPT's bound at each) against libCacheSim at one capacity.

    PYTHONPATH=bench .venv/bin/python bench/sim_vs_libcachesim.py [--tokens 100000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from provenance import at_least, provenance, results_out, write_json

from expertcache.cache.schedule import build_schedule
from expertcache.trace import synthesize

LCS = {"lru": "LRU", "fifo": "FIFO", "opt": "Belady"}
RECORD = np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])


def write_oracle_general(keys: np.ndarray, path: Path) -> None:
    n = len(keys)
    nxt = np.full(n, -1, dtype=np.int64)
    order = np.lexsort((np.arange(n), keys))
    same = keys[order][1:] == keys[order][:-1]
    nxt[order[:-1][same]] = order[1:][same]
    rec = np.empty(n, dtype=RECORD)
    rec["time"], rec["id"], rec["size"], rec["next"] = np.arange(n) + 1, keys + 1, 1, nxt
    rec.tofile(path)


# As installed: byte code cached (pip writes it; a PYTHONDONTWRITEBYTECODE here would recompile every
# module on every run, about 0.06 s), and one untimed run first (numba's on-disk cache, the file cache).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(cmd: list[str], repeats: int) -> tuple[float, str]:
    first = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    if first.returncode != 0:  # the child's own message, not a CalledProcessError that hides it
        last = (first.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"sim_vs_libcachesim: {Path(cmd[0]).name} failed (exit {first.returncode}): {last}")
    runs, out = [], ""
    for _ in range(repeats):
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=ENV)
        runs.append(time.perf_counter() - t0)
        out = done.stdout
    return statistics.median(runs), out


LCS_SCRIPT = """
import sys, time, libcachesim as lcs
policy, path, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
cache = getattr(lcs, policy)(cap)
t0 = time.perf_counter()
ratio = cache.process_trace(reader)[0]
print(ratio, time.perf_counter() - t0)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=at_least(1), default=100_000)
    ap.add_argument("--capacity", type=at_least(1), default=64)
    ap.add_argument("--repeats", type=at_least(1), default=3)
    ap.add_argument("--no-curve", action="store_true", help="skip the whole-curve row (slow at 100M)")
    ap.add_argument(
        "--out", type=Path, help="default bench/results/sim_vs_libcachesim.json (other sizes: the temp dir)"
    )
    args = ap.parse_args()
    args.out = results_out(ap, args, "sim_vs_libcachesim.json", at_least=("repeats",))
    exe = str(Path(sys.executable).parent / "expertcache")
    with tempfile.TemporaryDirectory() as tmp:
        npz, og = Path(tmp) / "t.npz", Path(tmp) / "t.oracleGeneral"
        trace = synthesize("zipf", tokens=args.tokens, layers=32, experts=8, top_k=2, seed=1)
        trace.save(npz)
        keys = build_schedule(trace, "flat").req_key.astype(np.int64)
        write_oracle_general(keys, og)
        rows = []
        for policy, lcs_name in LCS.items():
            ec_s, out = timed([exe, "sim", str(npz), "--policy", policy, "--capacity", str(args.capacity),
                               "--order", "flat", "--json", "--jobs", "1"], args.repeats)  # fmt: skip
            ec = json.loads(out)[0]
            lcs_s, out = timed([sys.executable, "-c", LCS_SCRIPT, lcs_name, str(og), str(args.capacity)],
                               args.repeats)  # fmt: skip
            lcs_ratio, lcs_process_s = (float(x) for x in out.split())
            agree = abs(lcs_ratio - ec["miss_ratio"]) < 1e-9
            rows.append({
                "policy": policy, "capacity": args.capacity, "requests": ec["requests"],
                "expertcache_s": ec_s, "libcachesim_s": lcs_s, "ratio": ec_s / lcs_s,
                "libcachesim_process_s": lcs_process_s,
                "expertcache_miss_ratio": ec["miss_ratio"], "libcachesim_miss_ratio": lcs_ratio,
                "agree": agree,
            })  # fmt: skip
            print(f"{policy:5} @{args.capacity}: expertcache {ec_s:6.2f} s | libCacheSim {lcs_s:6.2f} s "
                  f"(processing {lcs_process_s:.2f} s) | expertcache's time {ec_s / lcs_s:5.2f}x | "
                  f"miss ratio {ec['miss_ratio']:.6f} vs {lcs_ratio:.6f}")  # fmt: skip
        curve_row = None
        if not args.no_curve:
            cmd = [exe, "sim", str(npz), "--policy", "lru", "--capacity", "all", "--order", "flat", "--json"]
            curve_s, out = timed(cmd, args.repeats)
            curve = json.loads(out)
            lcs_lru = next(r["libcachesim_s"] for r in rows if r["policy"] == "lru")
            per = curve_s / len(curve) * 1e3
            print(f"lru curve ({len(curve)} capacities, OPT's bound at each): expertcache {curve_s:.2f} s, "
                  f"{per:.1f} ms per capacity | libCacheSim {lcs_lru:.2f} s for one")  # fmt: skip
            curve_row = {"capacities": len(curve), "expertcache_s": curve_s,
                         "libcachesim_one_capacity_s": lcs_lru}  # fmt: skip
    write_json(args.out, {**provenance(), "tokens": args.tokens, "rows": rows, "curve": curve_row})
    print(f"wrote {args.out}", file=sys.stderr)
    if not all(r["agree"] for r in rows):
        print("miss ratios differ between expertcache and libCacheSim", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
