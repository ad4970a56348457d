"""What every benchmark records beside its numbers: command, date, machine and code version."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def git_state() -> dict[str, object]:
    """The commit the run used and whether src/ had uncommitted changes (read-only git calls)."""

    def git(*cmd: str) -> str | None:
        try:
            out = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("--no-optional-locks", "status", "--porcelain", "--", "src")
    return {"commit": git("rev-parse", "HEAD"), "src_modified": None if status is None else bool(status)}


def cpu_model() -> str | None:
    """The CPU's model name (Linux's ``/proc/cpuinfo``), else None: a VM may move between hosts."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info() -> dict[str, object]:
    """Platform, Python, CPU model, count and load (the machine may be shared), numpy version."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_avg_1_5_15": [round(v, 2) for v in os.getloadavg()],
        "numpy": np.__version__,
    }


def provenance() -> dict[str, object]:
    """Command line, UTC date, machine and git state of this run."""
    return {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "git": git_state(),
    }


def portable_text(text: str) -> str:
    """``text`` with this machine's absolute paths made portable (relative to the repository root).

    Results are committed; the machine that produced them must not leak into them (``/home/me/ec/src``
    becomes ``src``, a file beside the checkout such as the shared traces becomes ``../shared/...``, and
    a file in the system's temporary directory, such as a generated checkpoint, ``$TMPDIR/...``).
    """
    start = r"(?<![\w.~/$-])"  # where a path begins: not inside another one (/var/tmp is not /tmp)
    root, parent = re.escape(str(ROOT)), re.escape(str(ROOT.parent) + os.sep)
    text = re.sub(rf"{start}{root}{re.escape(os.sep)}", "", text)
    text = re.sub(rf'"{root}"', '"."', text)
    text = re.sub(rf"{start}{parent}", lambda _: ".." + os.sep, text)
    tmp = re.escape(tempfile.gettempdir() + os.sep)
    return re.sub(rf"{start}{tmp}", lambda _: "$TMPDIR" + os.sep, text)


def write_json(path: Path, data: object) -> None:
    """Write ``data`` as indented JSON with portable paths (see :func:`portable_text`)."""
    Path(path).write_text(portable_text(json.dumps(data, indent=1, default=str)) + "\n")
