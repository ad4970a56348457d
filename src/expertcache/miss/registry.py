"""Every miss path by the name the CLI and the API use (``--miss NAME[:k=v,...]``), in one dict literal."""

from __future__ import annotations

import inspect

from expertcache.miss.base import MissContext, MissPath, MissPathError
from expertcache.miss.batch import Batch
from expertcache.miss.hobbit import Hobbit
from expertcache.miss.host import Host
from expertcache.miss.hybrid import Hybrid
from expertcache.miss.placement import Placement
from expertcache.miss.split import Split
from expertcache.spec import parse_spec

MISS_PATHS: dict[str, type[MissPath]] = {
    "fetch": MissPath,
    "host": Host,
    "hybrid": Hybrid,
    "placement": Placement,
    "split": Split,
    "hobbit": Hobbit,
    "batch": Batch,
}


def miss_class(name: str) -> type[MissPath]:
    try:
        return MISS_PATHS[name]
    except KeyError:
        raise MissPathError(f"unknown miss path {name!r}; choose from {', '.join(MISS_PATHS)}") from None


def parse_miss(spec: str) -> tuple[str, dict[str, object]]:
    """``'name'`` or ``'name:k=v,...'`` -> (name, params), the name and the parameter names checked."""
    name, params = parse_spec(spec, "miss path", MissPathError)
    allowed = parameters(miss_class(name))
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        takes = ", ".join(allowed) if allowed else "no parameters"
        raise MissPathError(f"miss path {name!r} does not take {', '.join(unknown)} (it takes {takes})")
    return name, params


def parameters(cls: type[MissPath]) -> list[str]:
    """The keyword parameters of a miss path (its constructor's, after the context)."""
    return [p for p in inspect.signature(cls).parameters if p != "ctx"]


def make_miss(spec: str, ctx: MissContext) -> MissPath:
    """Build a registered miss path from its spec; bad names, parameters or values raise MissPathError."""
    name, params = parse_miss(spec)
    return miss_class(name)(ctx, **params)
