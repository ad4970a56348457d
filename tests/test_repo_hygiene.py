"""The repository carries no trace of the machine it was written on.

Benchmarks write their results through ``bench/provenance.write_json``, which makes this checkout's
absolute paths relative; this test catches a result, doc or script that slipped past it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def test_no_tracked_file_names_this_checkout():
    needles = [str(REPO), str(REPO.parent) + "/shared"]
    offenders = []
    for rel in tracked_files():
        path = REPO / rel
        if not path.is_file() or path.stat().st_size > 20_000_000:
            continue
        text = path.read_bytes().decode("utf-8", errors="ignore")
        offenders += [f"{rel}: {n}" for n in needles if n in text]
    assert not offenders, "absolute paths of this machine in tracked files:\n" + "\n".join(offenders)


def test_portable_text_relativises_checkout_paths():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from provenance import portable_text
    finally:
        sys.path.remove(str(REPO / "bench"))
    text = f'{{"model": "{REPO}/src/x", "trace": "{REPO.parent}/shared/t.npz", "root": "{REPO}"}}'
    assert portable_text(text) == '{"model": "src/x", "trace": "../shared/t.npz", "root": "."}'
