"""Wall time of expertcache commands under two versions of the code, in alternating rounds.

A change meant to make a command faster is measured against the commit before it on the same machine,
each command run as a new process (imports included, as a user runs it) by the two versions in turn,
A B then B A, so a slow phase of a shared machine falls on both:

    git worktree add /tmp/before <commit>
    PYTHONPATH=bench .venv/bin/python bench/command_times.py --before /tmp/before/src --rounds 3 \\
        -- "doctor" "plan" "doctor --concurrency 16" "plan --capacity 24 --host-capacity 60"

``--before`` is the other version's ``src`` directory (put first on ``PYTHONPATH`` for its runs); the
working tree's runs use the installed package. Each command's median and range per version, and their
ratio, go to stdout; ``-o FILE.json`` also writes them with the run's provenance.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from provenance import provenance, results_out, write_json


def run_once(command: str, src: str | None) -> float:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "expertcache", *shlex.split(command)], env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"command_times: '{command}' failed ({src or 'this tree'}): {done.stderr.strip()}")
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="the other version's src directory")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("-o", "--out", type=Path, help="also write the results here (JSON)")
    p.add_argument("commands", nargs="+", help="expertcache command lines, quoted")
    args = p.parse_args()
    before = str(Path(args.before).resolve())
    if not (Path(before) / "expertcache").is_dir():
        p.error(f"--before {args.before}: no expertcache package there")
    if args.rounds < 1:
        p.error("--rounds must be 1 or more")
    for command in args.commands:  # each splits as a shell would, before any is timed
        try:
            shlex.split(command)
        except ValueError as exc:
            p.error(f"command {command!r}: {exc}")
    if args.out is not None:
        results_out(p, args, args.out.name)  # writable, before the rounds
    times: dict[str, dict[str, list[float]]] = {c: {"before": [], "after": []} for c in args.commands}
    for r in range(args.rounds):
        order = [("before", before), ("after", None)]
        for command in args.commands:
            for name, src in order if r % 2 == 0 else order[::-1]:
                times[command][name].append(run_once(command, src))
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    rows = []
    for command, t in times.items():
        b, a = statistics.median(t["before"]), statistics.median(t["after"])
        rows.append({"command": command, "before_s": t["before"], "after_s": t["after"], "ratio": a / b})
        print(
            f"{command:48} before {b:6.2f} s [{min(t['before']):.2f}-{max(t['before']):.2f}]  "
            f"after {a:6.2f} s [{min(t['after']):.2f}-{max(t['after']):.2f}]  {a / b:.2f}x"
        )
    if args.out is not None:
        write_json(args.out, {"provenance": provenance(), "before": args.before, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
