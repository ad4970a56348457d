"""The README's main job under a CPU quota: torch's threads as torch chooses them against the quota's.

A container given less CPU time than it has CPUs (``docker --cpus 1`` on a machine of 2, a Kubernetes CPU
limit) keeps every CPU in its affinity mask, and torch starts a thread per CPU of the mask: the group is
then throttled for most of each scheduling period. ``expertcache`` lowers torch's threads to the quota,
rounded up (``workers.quota_threads``), where ``OMP_NUM_THREADS`` is not set. This runs the README's
first command in a fresh CPU cgroup with a quota, alternating between the default (the quota's
threads) and ``OMP_NUM_THREADS`` set to the mask's CPUs (torch's own choice, what every run got before),
and reports TTFT and TPOT (medians and ranges) with the group's throttling counts; the tokens must be
the same. Needs root and a writable ``cpu`` controller (cgroup v1 ``cpu.cfs_quota_us`` or v2
``cpu.max``).

    PYTHONPATH=bench .venv/bin/python bench/quota_cpu.py --cpus 1 --rounds 5 \
        --out bench/results/quota_cpu.json

Options after ``--`` go to ``generate``, in place of the job's own (``-- --model DIR --expert-memory 100%``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from provenance import ROOT, provenance, write_json

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
DEFAULTS = {"--prompt": "def read_config(path):", "--max-new-tokens": "64", "--expert-memory": "30%"}


def command(extra: list[str]) -> list[str]:
    """The README's job with the options of ``extra`` in place of its own (an option is given once)."""
    kept = [x for k, v in DEFAULTS.items() if k not in extra for x in (k, v)]
    return ["generate", *kept, "--json", *extra]


class CpuGroup:
    """A fresh CPU cgroup with a quota of ``cpus`` CPUs' time (a period of 100 ms)."""

    def __init__(self, cpus: float) -> None:
        self.v1 = (V1 / "cpu.cfs_quota_us").is_file()
        self.path = (V1 if self.v1 else V2) / f"expertcache-quota-{os.getpid()}"
        self.path.mkdir()
        quota = int(cpus * 100_000)
        if self.v1:
            (self.path / "cpu.cfs_period_us").write_text("100000")
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.max").write_text(f"{quota} 100000")

    def prefix(self) -> list[str]:
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$0" "$@"']

    def stat(self) -> dict[str, int]:
        text = (self.path / "cpu.stat").read_text()
        return {k: int(v) for k, v in (line.split() for line in text.splitlines())}

    def remove(self) -> None:
        self.path.rmdir()


def run_once(cpus: float, threads: int | None, python: str, extra: list[str]) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    group = CpuGroup(cpus)
    try:
        run = subprocess.run(
            [*group.prefix(), python, "-m", "expertcache", *command(extra)],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
        )  # fmt: skip
        stat = group.stat()
    finally:
        group.remove()
    if run.returncode != 0:
        raise SystemExit(f"quota_cpu: the run failed ({run.returncode}): {run.stderr.strip()[-500:]}")
    out = json.loads(run.stdout)
    throttled = stat.get("throttled_time", stat.get("throttled_usec", 0) * 1000)
    return {
        "omp_num_threads": threads, "ttft_s": out["ttft_s"], "tpot_s": out["tpot_s"], "tokens": out["tokens"],
        "periods": stat.get("nr_periods"), "throttled_periods": stat.get("nr_throttled"),
        "throttled_s": throttled / 1e9,
    }  # fmt: skip


def summary(runs: list[dict[str, object]], key: str) -> dict[str, float]:
    values = [float(r[key]) for r in runs]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpus", type=float, default=1.0, help="the quota in CPUs (default 1)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--python", default=sys.executable, help="the interpreter with expertcache installed")
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    p.add_argument("extra", nargs="*", help="more generate options after --, e.g. -- --model DIR")
    args = p.parse_args()
    if args.out is not None and not args.out.parent.is_dir():
        p.error(f"--out: no folder {args.out.parent}")
    if os.geteuid() != 0:
        p.error("needs root, to make CPU cgroups")
    mask = len(os.sched_getaffinity(0))
    if args.cpus >= mask:
        p.error(f"--cpus {args.cpus}: a quota below this process's {mask} CPUs is what is measured")
    runs: dict[str, list[dict[str, object]]] = {"quota's threads (default)": [], "torch's threads": []}
    for r in range(args.rounds):
        order = [("quota's threads (default)", None), ("torch's threads", mask)]
        for name, threads in order if r % 2 == 0 else order[::-1]:
            result = run_once(args.cpus, threads, args.python, args.extra)
            runs[name].append(result)
            ttft, tpot = result["ttft_s"] * 1e3, result["tpot_s"] * 1e3
            throttled = f"throttled {result['throttled_periods']} of {result['periods']} periods"
            print(
                f"round {r + 1} {name}: TTFT {ttft:.1f} ms, TPOT {tpot:.2f} ms, {throttled}", file=sys.stderr
            )
    tokens = {json.dumps(r["tokens"]) for rs in runs.values() for r in rs}
    if len(tokens) != 1:
        raise SystemExit("quota_cpu: the runs' tokens differ")
    table = {
        name: {"ttft_s": summary(rs, "ttft_s"), "tpot_s": summary(rs, "tpot_s"),
               "throttled_periods": summary(rs, "throttled_periods"), "periods": summary(rs, "periods")}
        for name, rs in runs.items()
    }  # fmt: skip
    for name, row in table.items():
        t, d = row["ttft_s"], row["tpot_s"]
        throttled, periods = row["throttled_periods"]["median"], row["periods"]["median"]
        print(
            f"{name:28s} TTFT {t['median'] * 1e3:7.1f} ms [{t['min'] * 1e3:.1f}-{t['max'] * 1e3:.1f}]  "
            f"TPOT {d['median'] * 1e3:6.2f} ms [{d['min'] * 1e3:.2f}-{d['max'] * 1e3:.2f}]  "
            f"throttled {throttled:.0f} of {periods:.0f} periods"
        )
    if args.out is not None:
        job = ["expertcache", *command(args.extra)]
        results = {"cpus": args.cpus, "mask_cpus": mask, "job": job, "summary": table, "runs": runs}
        write_json(args.out, {**provenance(), **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
