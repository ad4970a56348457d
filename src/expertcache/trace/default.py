"""The embedded default trace: what ``expertcache sim`` and ``timing`` replay when given no trace."""

from __future__ import annotations

from pathlib import Path

from expertcache.trace.trace import Trace, load_trace

DEFAULT_TRACE = Path(__file__).resolve().parent.parent / "data" / "default_trace.npz"


def default_trace() -> Trace:
    """The routing of the embedded model (6 layers, 16 experts, top-2) on 16 prompts from held-out
    standard-library files, recorded by ``tools/record_default_trace.py``."""
    return load_trace(DEFAULT_TRACE)
