"""Shares of one thread's time per frame in a py-spy raw profile (``py-spy record -f raw --threads``).

    python3 bench/profile_shares.py PROFILE.txt [--thread _run_generation_loop] [--top 40]

Each line of the file is a stack (frames joined by ';', the thread first) and its sample count. A frame's
inclusive share is the samples whose stack holds it, over the thread's samples; its self share those
where it is the innermost frame (where a C call such as a CUDA synchronisation or a kernel launch is
counted against the Python line that made it). Frames are named ``function (file:line)``, so two lines of
one function count apart. Results to stdout.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys


def shares(path: str, thread: str) -> tuple[int, collections.Counter, collections.Counter]:
    inclusive, innermost, total = collections.Counter(), collections.Counter(), 0
    with open(path, encoding="utf-8") as lines:
        rows = [line.rstrip("\n").rpartition(" ") for line in lines]
    for stack, _, count in rows:
        if thread not in stack.split(";", 1)[0] or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [re.sub(r"\((?:[^():]*/)?([^/():]+:\d+)\)$", r"(\1)", f) for f in stack.split(";")[1:]]
        for frame in set(frames):
            inclusive[frame] += n
        if frames:
            innermost[frames[-1]] += n
    return total, inclusive, innermost


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile")
    ap.add_argument("--thread", default="_run_generation_loop", help="a part of the thread's name")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    total, inclusive, innermost = shares(args.profile, args.thread)
    if not total:
        print(f"profile_shares: no samples of a thread named like {args.thread!r}", file=sys.stderr)
        return 2
    print(f"{total} samples of the thread")
    print("inclusive:")
    for frame, n in inclusive.most_common(args.top):
        print(f"  {100 * n / total:5.1f} %  {frame}")
    print("self:")
    for frame, n in innermost.most_common(args.top // 2):
        print(f"  {100 * n / total:5.1f} %  {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
