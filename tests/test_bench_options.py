"""Benchmarks refuse bad options before any work: one line ``PROG: error: ...`` on stderr, exit code 2.

A few of each script's refusals, run as the benchmarks are (``PYTHONPATH=bench``); each is refused in well
under a second, before the minutes of work it used to come after (or crash in).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CASES = [
    ("paper_fig4.py", ["--step", "0"], "argument --step: must be at least 1, got 0"),
    ("paper_fig4.py", ["--seeds", "0"], "argument --seeds: must be at least 1, got 0"),
    ("sim_kernels.py", ["--order", "layer", "--capacity", "40"], "give --capacity 64 or more"),
    ("miss_projection.py", ["--gpu-memory", "24"], "--gpu-memory '24' needs a unit"),
    ("miss_projection.py", ["--workspace", "-1GiB"], "--workspace '-1GiB' must be a non-negative size"),
    ("miss_projection.py", ["--costs", "{tmp}/none.json"], "--costs {tmp}/none.json: no such file"),
    ("plan_projection.py", ["--out", "{tmp}"], "--out {tmp}: a folder"),
    ("inline_layer_cpu.py", ["CKPT", "--rounds", "0"], "--new-tokens and --rounds must be at least 1"),
    ("inline_layer_cpu.py", ["CKPT", "--out", "{tmp}"], "--out {tmp}: not a file in a folder that exists"),
    ("policies_vs_libcachesim.py", ["--link-bandwidth", "0"], "--link-bandwidth '0' must be positive"),
    ("policies_vs_libcachesim.py", ["--link-latency", "50"], "--link-latency '50' needs a unit"),
]


@pytest.mark.parametrize(("script", "args", "message"), CASES, ids=[" ".join([c[0], *c[1]]) for c in CASES])
def test_refused_in_one_line(script: str, args: list[str], message: str, tmp_path: Path) -> None:
    args = [a.format(tmp=tmp_path) for a in args]
    env = {**os.environ, "PYTHONPATH": str(REPO / "bench"), "MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{script}: error: ")
    assert message.format(tmp=tmp_path) in lines[0]
    assert done.stdout == ""
