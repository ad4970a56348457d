"""The repository carries no trace of the machine it was written on.

Benchmarks write their results through ``bench/provenance.write_json``, which makes this checkout's
absolute paths relative (and the temporary directory ``$TMPDIR``); this test catches a result, doc or
script that slipped past it, and any absolute path of a home, work or temporary directory in the data
under src/ and bench/results (a compressed .npz hides its strings from a plain text search).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from expertcache.trace import default_trace

REPO = Path(__file__).resolve().parents[1]
DATA = [REPO / "src", REPO / "bench" / "results"]
ABSOLUTE = re.compile(r"(?<![\w.~$/-])(?:/(?:home|work|tmp|Users)\b|[A-Za-z]:\\)")  # /home/me, C:\


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
    tmp = Path(tempfile.gettempdir())
    if not REPO.parent.is_relative_to(tmp):  # a checkout inside the temp folder: its paths come first
        want = '{"checkpoint": "$TMPDIR/cache/m"}'
        assert portable_text(f'{{"checkpoint": "{tmp / "cache" / "m"}"}}') == want
    assert portable_text(f'"/var{tmp}/x"') == f'"/var{tmp}/x"'  # another directory that ends alike


def strings(value: object) -> list[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [k, *strings(v)]]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


def npz_strings(path: Path) -> list[str]:
    """Every string element of an .npz's arrays (metadata such as a trace's ``model``)."""
    with np.load(path, allow_pickle=False) as data:
        arrays = [data[name] for name in data.files]
    return [str(s) for a in arrays if a.dtype.kind in "US" for s in a.ravel()]


def test_the_absolute_path_detector():
    found = [s for s in ["/home/me/x", "C:\\Users\\me", "src/x", "/var/tmp/x", "embedded", "a /tmp/b"]
             if ABSOLUTE.search(s)]  # fmt: skip
    assert found == ["/home/me/x", "C:\\Users\\me", "a /tmp/b"]


def test_the_bundled_trace_names_no_path():
    assert default_trace().meta["model"] == "embedded"


def test_no_data_file_holds_an_absolute_path():
    offenders, checked = [], 0
    for root in DATA:
        for path in sorted([*root.rglob("*.npz"), *root.rglob("*.json")]):
            try:
                found = npz_strings(path) if path.suffix == ".npz" else strings(json.loads(path.read_text()))
            except ValueError as e:  # an object array (pickled), or JSON that is not
                offenders.append(f"{path.relative_to(REPO)}: unreadable without pickle or not JSON ({e})")
                continue
            checked += 1
            rel = path.relative_to(REPO)
            offenders += [f"{rel}: {s[:120]!r}" for s in found if ABSOLUTE.search(s)]
    assert checked >= 10  # the bundled trace, the model's JSON files, the benchmark results
    assert not offenders, "absolute paths in data files:\n" + "\n".join(offenders)
