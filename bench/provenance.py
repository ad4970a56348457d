"""What every benchmark records beside its numbers: command, date, machine and code version."""

from __future__ import annotations

import argparse
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
# the shared data (``traces/``, ``models/``): beside the repository, or where EXPERTCACHE_SHARED says (a
# clone elsewhere quietly dropped the rows of the real trace)
SHARED = Path(os.environ.get("EXPERTCACHE_SHARED") or ROOT.parent / "shared")


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


def notes_as_lines() -> None:
    """expertcache's warnings (``ExpertcacheWarning``: what a call adjusted) printed as the command line
    prints its notes, one ``note:`` line each, once, without Python's source line."""
    import warnings

    from expertcache.errors import ExpertcacheWarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, ExpertcacheWarning):
            print(f"note: {message}", file=sys.stderr)
        else:
            sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show
    warnings.simplefilter("once", ExpertcacheWarning)


def fail(prog: str, message: str) -> None:
    """Bad input to a benchmark: one line naming it, exit 2 (as the command line's own errors)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class OneLineParser(argparse.ArgumentParser):
    """argparse that refuses bad input as the command line does: one line naming it (no usage block), exit
    2; and a value that starts with a minus and a digit (``--workspace -1GiB``) is the option's value, as a
    plain negative number already is, so that it gets a real message, not "expected one argument"."""

    def error(self, message: str) -> None:  # type: ignore[override]
        fail(self.prog, message)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        args = list(sys.argv[1:] if args is None else args)
        out: list[str] = []
        for arg in args:
            action = self._option_string_actions.get(out[-1]) if out else None
            takes_one = action is not None and action.nargs is None and action.option_strings
            if takes_one and re.match(r"-[0-9.]", arg) and not self._negative_number_matcher.match(arg):
                out[-1] = f"{out[-1]}={arg}"
            else:
                out.append(arg)
        return super().parse_known_args(out, namespace)


def at_least(low: int | float, kind=int):
    """An argparse type: a number (``kind``) of at least ``low``, else argparse's one-line error."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a {kind.__name__}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    return parse


def documented_run(parser, args, skip: tuple[str, ...] = (), at_least: tuple[str, ...] = ()) -> bool:
    """Whether every option but those in ``skip`` is at its default (those in ``at_least`` at it or more):
    the run the committed results are of."""

    def documented(key: str) -> bool:
        value, default = getattr(args, key), parser.get_default(key)
        return value >= default if key in at_least else value == default

    return all(documented(k) for k in vars(args) if k not in skip)


def figure_args(parser, argv, name: str, check=None):
    """A figure's bench's arguments, with ``--out`` (the folder of its ``name`` results) and ``--img`` (its
    plots'): where not given, the committed ``bench/results`` and ``docs/img`` for the documented run, the
    temporary directory for any other, said: a shrunk run replaced the committed figures in silence.
    ``check``, if given, is called with the parsed arguments first, to refuse a bad one before anything is
    said (:func:`fail`)."""
    parser.add_argument(
        "--out", type=Path, help=f"folder for {name} (default: bench/results, documented run)"
    )
    parser.add_argument("--img", type=Path, help="folder for the plots (default: docs/img, documented run)")
    args = parser.parse_args(argv)
    if check is not None:
        check(args)
    if args.out is not None and args.img is not None:
        return args
    full = documented_run(parser, args, ("out", "img"))
    temp = Path(tempfile.gettempdir()) / Path(parser.prog).stem
    if args.out is None:
        args.out = ROOT / "bench" / "results" if full else temp
    if args.img is None:
        args.img = ROOT / "docs" / "img" if full else temp / "img"
    if not full:
        print(f"note: options other than the documented run's: the results and plots go to {args.out} and "
              f"{args.img} (--out DIR and --img DIR write them elsewhere)", file=sys.stderr)  # fmt: skip
    return args


def results_out(parser, args, name: str, at_least: tuple[str, ...] = (), modes: tuple[str, ...] = ()) -> Path:
    """Where a benchmark writes its results, decided and checked writable before any work: ``--out`` as
    given; else ``bench/results/NAME`` for the documented run (every option at its default; those named
    in ``at_least`` at their default or more, as more repeats; ``modes`` any, where NAME already says
    which), and the system's temporary directory for any other, said: a shrunk or partial run never
    replaces the committed results in silence."""
    out = args.out
    if out is None:
        full = documented_run(parser, args, ("out", *modes), at_least)
        out = ROOT / "bench" / "results" / name if full else Path(tempfile.gettempdir()) / name
        if not full:
            print(f"note: options other than the documented run's: the results go to {out} (--out FILE "
                  "writes them elsewhere)", file=sys.stderr)  # fmt: skip
    out = Path(out)
    if out.is_dir():  # found only when the results were written, after all the work
        fail(parser.prog, f"--out {out}: a folder; give the results file's path")
    if not out.parent.is_dir():
        fail(parser.prog, f"--out {out}: the folder {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        fail(parser.prog, f"--out {out}: not writable")
    return out


if __name__ == "__main__":
    sys.exit("provenance.py is the library the benchmarks record their runs with, not a benchmark of its own")
