"""The command line run in a test's own process, as ``python -m expertcache`` runs it."""

from __future__ import annotations

from collections.abc import Sequence

from expertcache.cli import main


def exit_code(argv: Sequence[str]) -> int:
    """``main(argv)``'s exit code, argparse's own refusals (its ``SystemExit``) included."""
    try:
        return main(list(argv))
    except SystemExit as e:
        return e.code
