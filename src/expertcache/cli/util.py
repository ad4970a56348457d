"""Small helpers the command-line modules share: quiet transformers, outputs checked before the work."""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from expertcache.errors import ExpertcacheError


def beside_plan(args) -> str | None:
    """A note where options that change how a plan's predictor prefetches come beside ``--plan``: the
    plan was timed without them, so a run's counts and times are not its prediction (they are taken,
    as a variant of the plan; --window, which names the predictor's reach, is refused instead)."""
    flags = (
        ("--prefetch-limit", getattr(args, "prefetch_limit", None) is not None),
        ("--no-preemption", bool(getattr(args, "no_preemption", False))),
        ("--no-reorder", bool(getattr(args, "no_reorder", False))),
        ("--no-chunking", bool(getattr(args, "no_chunking", False))),
        ("--chunk-size", getattr(args, "chunk_size", None) is not None),
    )
    given = [flag for flag, on in flags if on]
    if not getattr(args, "plan", None) or not given:
        return None
    return (
        f"note: {', '.join(given)} beside --plan: the plan was timed without "
        f"{'it' if len(given) == 1 else 'them'}, so this run's counts and times are not its prediction"
    )


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
    """Refuse an output file that could not be written, before any work is done for it: the file is
    opened for appending (nothing it holds is lost) and removed again if it was not there, so what is
    refused is what the write would meet (a read-only file system, /proc, a full quota), not only what
    the permission bits say (root passes those everywhere)."""
    full = os.path.abspath(path)
    parent = os.path.dirname(full)
    if os.path.isdir(full):
        raise ExpertcacheError(f"{path}: cannot write the {what}: it is a directory")
    if not os.path.isdir(parent):
        raise ExpertcacheError(f"{path}: cannot write the {what}: directory {parent} does not exist")
    existed = os.path.lexists(full)
    try:
        with open(full, "ab"):
            pass
    except OSError as e:
        raise ExpertcacheError(f"{path}: cannot write the {what}: {why(e)}") from None
    if not existed:
        with contextlib.suppress(OSError):
            os.unlink(full)


def check_writable_dir(path: str, what: str = "output") -> None:
    """Refuse an output folder that could not be made or written into, before any work is done for it
    (a file is made and removed in it, or in the folder above it, which must exist: the command makes
    the folder, not a chain of missing ones, as a file's folder must exist)."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise ExpertcacheError(f"{path}: cannot write the {what} there: it is a file, not a folder")
    base = full if os.path.exists(full) else os.path.dirname(full)  # the folder is made, not its parents
    if not os.path.exists(base):  # as a file's missing folder is refused (check_writable)
        raise ExpertcacheError(f"{path}: cannot write the {what} there: directory {base} does not exist")
    if not os.path.isdir(base):
        raise ExpertcacheError(f"{path}: cannot write the {what} there: {base} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=base, prefix=".expertcache-probe-")
    except OSError as e:
        raise ExpertcacheError(f"{path}: cannot write the {what} there: {why(e)}") from None
    os.close(fd)
    os.unlink(probe)


def why(e: OSError) -> str:
    """An OSError's reason as a message's tail: ``permission denied``."""
    return (e.strerror or str(e)).lower()


def output_option(parser, dest: str, what: str, folder: bool = False) -> None:
    """Mark option ``dest`` of a command's parser as where the command writes (a file, or a ``folder``):
    ``check_outputs`` checks every such option before the command starts, and a test walks them all."""
    marked = list(parser.get_default("outputs") or ())
    parser.set_defaults(outputs=[*marked, (dest, what, folder)])


def check_outputs(args) -> None:
    """Every output the command line names can be written: one line and exit 2 before any work."""
    for dest, what, folder in getattr(args, "outputs", None) or ():
        value = getattr(args, dest, None)
        if value is None:
            continue
        (check_writable_dir if folder else check_writable)(str(value), what)


def unseeded_note(flag: str, seed: int, names: list[str]) -> str | None:
    """The note where a seed is given and no policy of ``names`` draws at random: it changes nothing, and
    is not taken in silence (sim's ``--seed``, generate's ``--policy-seed``)."""
    from expertcache.policy.registry import POLICIES, policy_class

    if any(policy_class(n).seeded for n in names):
        return None
    drawing = ", ".join(n for n in POLICIES if policy_class(n).seeded)
    draws = "draws" if len(names) == 1 else "draw"
    who = ", ".join(names)
    return f"note: {flag} {seed} changes nothing here: {who} {draws} nothing at random (only {drawing} do)"


def lossy_note(stats: dict, lossy_path: bool) -> str | None:
    """What makes a served model's outputs not the full-precision model's, in one note (None: exact)."""
    if not stats["lossy"]:
        return None
    why = []
    if stats["experts_lossy"]:
        made = f", made from {stats['made_from']}" if stats["made_from"] else ""
        why.append(f"experts packed ({stats['expert_format']}{made})")
    if stats["dense"]:
        why.append(f"dense layers {stats['dense']['format']}")
    if lossy_path:
        why.append(f"miss path {stats['miss']}")
    if stats.get("kernel") == "compiled":
        why.append("the compiled kernel (its sums in another order)")
    return (
        f"note: lossy, not the full-precision model's outputs: {', '.join(why)} (expertcache quality with "
        "the same options says how far)"
    )
