"""Small helpers the command-line modules share: quiet transformers, outputs checked before the work."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager

from expertcache.errors import ExpertcacheError


def quiet_transformers() -> None:
    """One line per problem: transformers' advice and progress bars stay out of the output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


@contextmanager
def startup_gc(whole_process: bool) -> Iterator[None]:
    """Import torch and transformers and build a model without the cyclic garbage collector.

    Those imports leave about 560,000 objects that the collector tracks, and they live until the
    process ends. The collector walks them again and again while they are created (about 0.5 s of a
    ``generate`` on a 2-core machine), and once more at exit (about 1 s). Inside the block the collector
    is off. After it, the collector goes back to its earlier state, and cycles made meanwhile are found
    at its next run.

    ``whole_process`` means the command line is the program, not ``main()`` called from Python. Then
    everything alive at the end of the block (modules, the model) is moved to the collector's permanent
    generation (``gc.freeze``), so neither later collections nor the one at exit walk it again. Only the
    collector's work changes; what the model computes is the same. The price is the cyclic garbage left
    over from the imports, which is never reclaimed: about 9 MB of peak RSS for ``generate``. In-process
    callers (tests) never freeze, so the cycles of their models are reclaimed as usual.
    See docs/BENCHMARKS.md, "Start-up"."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if whole_process:
            gc.freeze()
        if enabled:
            gc.enable()


def check_writable(path: str, what: str = "output") -> None:
    """Refuse an output file that could not be written, before any work is done for it."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ExpertcacheError(f"{path}: cannot write the {what}: directory {parent} does not exist")
    if os.path.isdir(path):
        raise ExpertcacheError(f"{path}: cannot write the {what}: it is a directory")
    target = path if os.path.exists(path) else parent
    if not os.access(target, os.W_OK):
        raise ExpertcacheError(f"{path}: cannot write the {what}: permission denied")
