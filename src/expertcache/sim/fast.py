"""Compiled stack passes (numba): LRU's and OPT's depths for whole miss-ratio curves, at C speed.

The same algorithms as ``sim/stack.py`` (which stays the reference, and the path when numba is missing or
the schedule is small), over arrays instead of Python lists: a group's members are looked up at the
group's start and pinned together, and OPT carries the entry with the later next use down, level by
level (Mattson's priority update). ``tests/test_fast.py`` checks both equal the reference request for
request, on every order, on real and synthetic traces.

numba compiles each function once per process (a second or two; cached on disk where the package folder
is writable), so the compiled pass is used from ``MIN_REQUESTS`` requests on, where it pays for itself.
"""

from __future__ import annotations

import numpy as np

from expertcache.cache.schedule import Schedule
from expertcache.sim.stack import _NEVER, _next_use, group_bounds

MIN_REQUESTS = 200_000  # below this the reference pass is about as fast as compiling
_compiled: dict[str, object] = {}


def available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def _jit():
    if _compiled:
        return _compiled
    import numba

    @numba.njit(cache=True)
    def lru(keys, starts, ends, num_keys):  # pragma: no cover (compiled)
        out = np.zeros(len(keys), dtype=np.int64)
        stack = np.empty(num_keys, dtype=np.int64)  # stack[0] is the most recent
        size = 0
        for g in range(len(starts)):
            i, j = starts[g], ends[g]
            for r in range(i, j):  # depths at the group's start
                k = keys[r]
                for d in range(size):
                    if stack[d] == k:
                        out[r] = d + 1
                        break
            for r in range(i, j):  # remove the members found ...
                if out[r]:
                    k = keys[r]
                    for d in range(size):
                        if stack[d] == k:
                            for e in range(d, size - 1):
                                stack[e] = stack[e + 1]
                            size -= 1
                            break
            for r in range(i, j):  # ... and push every member on top, in service order
                for e in range(size, 0, -1):
                    stack[e] = stack[e - 1]
                stack[0] = keys[r]
                size += 1
        return out

    @numba.njit(cache=True)
    def opt(keys, groups, nxt, starts, ends, num_keys, never):  # pragma: no cover (compiled)
        out = np.zeros(len(keys), dtype=np.int64)
        prio = np.full(num_keys, never, dtype=np.int64)
        stack = np.empty(num_keys, dtype=np.int64)
        size = 0
        for g in range(len(starts)):
            i, j = starts[g], ends[g]
            for r in range(i, j):
                x = keys[r]
                prio[x] = groups[r]  # pinned while its group is served
                d = -1
                for e in range(size):
                    if stack[e] == x:
                        d = e
                        break
                if d >= 0:
                    out[r] = d + 1
                else:
                    d = size
                    stack[size] = x
                    size += 1
                if d == 0:
                    continue
                carried = stack[0]
                stack[0] = x
                cp = prio[carried]
                for pos in range(1, d):
                    y = stack[pos]
                    py = prio[y]
                    if py > cp:
                        stack[pos] = carried
                        carried = y
                        cp = py
                stack[d] = carried
            for r in range(i, j):
                prio[keys[r]] = nxt[r]
        return out

    _compiled.update(lru=lru, opt=opt)
    return _compiled


def lru_depths(s: Schedule) -> np.ndarray:
    """``stack.lru_depths``, compiled."""
    starts, ends = group_bounds(s)
    return _jit()["lru"](s.req_key.astype(np.int64), starts, ends, s.num_layers * s.num_experts)


def opt_depths(s: Schedule) -> np.ndarray:
    """``stack.opt_depths``, compiled."""
    starts, ends = group_bounds(s)
    keys, groups = s.req_key.astype(np.int64), s.req_group.astype(np.int64)
    return _jit()["opt"](keys, groups, _next_use(s), starts, ends, s.num_layers * s.num_experts, _NEVER)
