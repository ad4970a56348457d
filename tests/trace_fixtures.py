"""Short traces for the tests of commands that replay a trace many times (plan, doctor).

What such a test checks (a note, an option's effect, a verdict's wording) rarely needs the embedded
trace's every token; its first few hundred give the same answer in a fraction of the time on a 2-core
machine. Tests of the figures themselves (the issues' targets) keep the whole trace.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from expertcache.trace import Trace
from expertcache.trace.default import default_trace


def prefix(n: int) -> Trace:
    """The embedded trace's first ``n`` tokens, every per-token field kept (requests, phases, ids)."""
    full = default_trace()
    rows = {
        f.name: getattr(full, f.name)[:n]
        for f in dataclasses.fields(full)
        if hasattr(getattr(full, f.name), "shape")
    }
    return dataclasses.replace(full, **rows)


def prefix_file(directory: Path, n: int) -> str:
    """``prefix(n)`` saved in ``directory``, for the command line."""
    path = Path(directory) / f"prefix{n}.npz"
    prefix(n).save(path)
    return str(path)
