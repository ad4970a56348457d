"""Small helpers the command-line modules share: quiet transformers, outputs checked before the work."""

from __future__ import annotations

import os

from expertcache.errors import ExpertcacheError


def quiet_transformers() -> None:
    """One line per problem: transformers' advice and progress bars stay out of the output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


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
