"""What the disk gives the disk tier: exact (``O_DIRECT``) reads of one expert's size at random offsets of
a checkpoint, at several queue depths (reads in flight together, one thread each), alternating.

    python3 bench/disk_reads.py CHECKPOINT/model.safetensors --read-size 1.5MiB --depths 1 2 4 8 --rounds 2

A read of an expert the cache missed is this read: at 25 % on a uniform routing the disk's rate bounds a
decode token from below (misses x expert bytes / rate). Results (GB/s per depth and round) to stdout, as
JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from expertcache.errors import ExpertcacheError  # noqa: E402
from expertcache.units import parse_size  # noqa: E402

ALIGN = 4096  # O_DIRECT's alignment of offset, length and buffer


def rate(fd: int, size: int, file_bytes: int, depth: int, reads: int, rng: random.Random) -> float:
    """GB/s of ``reads`` exact reads of ``size`` bytes at random aligned offsets, ``depth`` in flight."""
    buffers = [mmap.mmap(-1, size) for _ in range(depth)]  # page-aligned, as O_DIRECT wants
    offsets = [rng.randrange(0, file_bytes - size) // ALIGN * ALIGN for _ in range(reads)]

    def read(i: int) -> None:
        os.preadv(fd, [buffers[i % depth]], offsets[i])

    start = time.perf_counter()
    with ThreadPoolExecutor(depth) as pool:
        list(pool.map(read, range(reads)))
    return reads * size / (time.perf_counter() - start) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", help="a checkpoint's weight file (not in the page cache: O_DIRECT bypasses it)")
    ap.add_argument("--read-size", default="1.5MiB", help="bytes a read (an expert's; default 1.5MiB)")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--reads", type=int, default=96, help="reads a measurement (default 96)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        size = -(-int(parse_size(args.read_size, "--read-size")) // ALIGN) * ALIGN
    except ExpertcacheError as e:
        print(f"disk_reads: {e}", file=sys.stderr)
        return 2
    try:
        fd = os.open(args.file, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        print(f"disk_reads: {args.file}: cannot open for O_DIRECT reads ({e.strerror})", file=sys.stderr)
        return 2
    file_bytes = os.fstat(fd).st_size
    if file_bytes < 2 * size:
        print(f"disk_reads: {args.file} is smaller than two reads of {size} bytes", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    results: dict[int, list[float]] = {d: [] for d in args.depths}
    for _ in range(args.rounds):  # depths alternate within each round: the disk's drift is shared
        for depth in args.depths:
            results[depth].append(rate(fd, size, file_bytes, depth, args.reads, rng))
    os.close(fd)
    if args.json:
        print(json.dumps({"file": os.path.basename(args.file), "read_bytes": size, "gb_per_s": results}))
    else:
        for depth, got in results.items():
            print(f"depth {depth}: " + ", ".join(f"{g:.2f}" for g in got) + f" GB/s ({size} B a read)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
