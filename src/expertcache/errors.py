"""The one exception type users see: a clear, single-line message about bad input."""


class ExpertcacheError(Exception):
    """Bad input or an impossible request; the CLI prints it as one line and exits with 2."""


class TraceError(ExpertcacheError):
    """A routing trace file or array that does not follow the trace format."""


class PolicyError(ExpertcacheError):
    """An unknown policy name, bad policy parameters, or a capacity the policy cannot work with."""


class NoVictim(PolicyError):
    """A full cache whose every evictable key is pinned (``policy.base.no_victim``, or a policy's None
    from a full cache): a prefetch or a background fill is skipped, a host level's miss read straight
    through, a demand waits for transfers. Any other ``PolicyError`` of a policy's choice (a victim not
    resident, or pinned) is the policy's fault and goes to the caller."""


class ExpertcacheWarning(UserWarning):
    """A result the Python API returns that is not what it may look like (a replay of a run that
    prefetched, without its prefetches); the CLI says the same in a note on stderr."""


_command_line = [False]  # the command line is running (``cli.main``): messages name its flags


def option(flag: str, argument: str) -> str:
    """How a message names an option: the command line's flag (``--host-memory``) while a command runs
    (``command_line``), the Python argument (``host_memory``) otherwise; one message serves both."""
    return flag if _command_line[0] else argument


def did_you_mean(name: str, choices, n: int = 2) -> str:
    """`` (did you mean a or b?)`` for a misspelt ``name`` among ``choices``, or nothing."""
    import difflib

    near = difflib.get_close_matches(name, sorted(choices), n=n)
    return f" (did you mean {' or '.join(near)}?)" if near else ""


def arguments_checked(func):
    """``func``, its caller's misspelt keyword refused in one ``ExpertcacheError`` naming what it meant
    (Python's ``TypeError`` named no alternative), as ``load`` and ``simulate_timing`` refuse theirs."""
    import functools
    import inspect

    params = inspect.signature(func).parameters.values()
    takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return func

    @functools.wraps(func)
    def checked(*args, **kwargs):
        unknown = [k for k in kwargs if k not in takes]
        if unknown:
            name = unknown[0]
            raise ExpertcacheError(
                f"{func.__name__} got an unknown argument {name!r}{did_you_mean(name, takes)}"
            )
        return func(*args, **kwargs)

    return checked


def say_notes(notes: list[str]) -> None:
    """Notes where the caller hears them: on stderr under the command line, else as ``warn_notes``."""
    if _command_line[0]:
        import sys

        for note in notes:
            print(f"note: {note}", file=sys.stderr)
    else:
        warn_notes(notes, stacklevel=4)


def warn_notes(notes: list[str], stacklevel: int = 3) -> None:
    """A Python caller's notes (what was adjusted, what a result leaves out) as ``ExpertcacheWarning``s,
    each pointing at the caller's line: the first frame outside the package (it pointed at a line of the
    package's own, ``sim/doctor.py:156``, wherever the note was made deep in it: a new user's trial;
    ``stacklevel`` where every frame is the package's); the command line prints them itself, as notes
    on stderr."""
    if not _command_line[0]:
        import warnings

        level = caller_stacklevel(stacklevel)  # counted from warn_notes itself, as warn counts
        for note in notes:
            warnings.warn(note, ExpertcacheWarning, stacklevel=level)


def caller_stacklevel(default: int = 2) -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the function that calls this one that points at the
    first frame outside the package: the user's line, however deep in the package the warning is made
    (``default`` where every frame is the package's: a command line's)."""
    import os
    import sys

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else default


class command_line:
    """``with command_line():`` around a command's work: messages name the command line's flags."""

    def __enter__(self) -> None:
        self._before = _command_line[0]
        _command_line[0] = True

    def __exit__(self, *exc) -> None:
        _command_line[0] = self._before


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name if it has none), for one-line errors; a
    first line that only announces the next (ending in a colon: a validator's) with that next line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]
