"""``name:key=value,key=value`` specs, as policies and miss paths take them on the command line."""

from __future__ import annotations

from expertcache.errors import ExpertcacheError

Value = int | float | str | list[int] | list[float]


def parse_spec(spec: str, what: str, error: type[ExpertcacheError]) -> tuple[str, dict[str, Value]]:
    """``'name'`` or ``'name:k=v,...'`` -> (lower-case name, params); values are ints, floats, lists
    (``2/2/4``) or words. ``what`` names the kind ("policy") in errors of type ``error``; a key given
    twice is one of them."""
    if not isinstance(spec, str):
        raise error(f"{what} must be a name or 'name:key=value,...', got {spec!r}")
    name, _, rest = spec.partition(":")
    params: dict[str, Value] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise error(f"{what} {spec!r}: parameter {item!r} is not key=value")
        if key.strip() in params:  # not the last one silently
            raise error(f"{what} {spec!r}: parameter {key.strip()!r} is given twice")
        params[key.strip()] = parse_value(value.strip())
    return name.strip().lower(), params


def parse_value(text: str) -> Value:
    """A number, a list of numbers separated by ``/``, or the text itself."""
    if "/" in text:
        items = [parse_value(v) for v in text.split("/")]
        if all(isinstance(v, int) for v in items):
            return items  # type: ignore[return-value]
        if all(isinstance(v, int | float) for v in items):
            return [float(v) for v in items]  # type: ignore[arg-type]
        return text
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
