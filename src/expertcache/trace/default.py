"""The embedded default trace: what ``expertcache sim`` and ``timing`` replay when given no trace."""

from __future__ import annotations

import json
from pathlib import Path

from expertcache.trace.trace import Trace, load_trace

DEFAULT_TRACE = Path(__file__).resolve().parent.parent / "data" / "default_trace.npz"
# The held-out texts the trace's prompts were cut from, as stored: the embedded model's evaluation text
# on every Python (a stdlib may lack some: Debian's idlelib is a package of its own, 3.13 removed crypt
# and lib2to3), written by ``tools/record_default_trace.py --heldout``.
HELDOUT = DEFAULT_TRACE.parent / "default" / "heldout.json"
HELDOUT_STORED_CHARS = 4000  # the most any reader takes (``quality``'s texts)


def default_trace() -> Trace:
    """The routing of the embedded model (6 layers, 16 experts, top-2) on 16 prompts from held-out
    standard-library files, recorded by ``tools/record_default_trace.py``."""
    return load_trace(DEFAULT_TRACE)


def heldout_texts(count: int = 16, chars: int = HELDOUT_STORED_CHARS) -> list[tuple[str, str]]:
    """The first ``chars`` characters of the held-out standard-library files the default trace's prompts
    come from (``(relative path, text)``, in the trace's order), as stored with the embedded model: the
    same text on every Python, whichever files its own standard library has."""
    if chars > HELDOUT_STORED_CHARS:
        raise ValueError(f"the held-out texts are stored to {HELDOUT_STORED_CHARS} characters, not {chars}")
    record = json.loads(HELDOUT.read_text(encoding="utf-8"))
    return [(name, text[:chars]) for name, text in record["texts"][:count]]
