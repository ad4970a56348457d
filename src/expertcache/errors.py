"""The one exception type users see: a clear, single-line message about bad input."""


class ExpertcacheError(Exception):
    """Bad input or an impossible request; the CLI prints it as one line and exits with 2."""


class TraceError(ExpertcacheError):
    """A routing trace file or array that does not follow the trace format."""


class PolicyError(ExpertcacheError):
    """An unknown policy name, bad policy parameters, or a capacity the policy cannot work with."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name if it has none), for one-line errors; a
    first line that only announces the next (ending in a colon: a validator's) with that next line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]
