"""Whole miss-ratio curves in one pass for the stack algorithms LRU and OPT (Mattson et al. 1970).

A stack algorithm's cache of size c always holds the top c entries of one priority stack, so one
pass that records each request's stack depth gives the misses at every capacity: a request misses at
capacity c iff its depth is greater than c (or it is the key's first request).

Groups (layer order): whether a member hits is decided at the start of its group, because members
are pinned together; this keeps the algorithms stack algorithms for every capacity that holds the
largest group (``Schedule.max_group``). Below that, groups are split and the simulator replays.

- LRU: the stack is the recency list; a group's members move to the top in service order.
- OPT (MIN): on a reference to x at depth d, x goes to the top and, level by level down to d, the entry
  with the later next use is carried down (Mattson's priority update); members of the group being
  served count as used now, which is the pinning.
"""

from __future__ import annotations

import numpy as np

from expertcache.cache.schedule import Schedule

_NEVER = 1 << 62


def lru_depths(s: Schedule) -> np.ndarray:
    """LRU stack depth (1-based) of every request at the start of its group; 0 for a first use. [R]"""
    keys, out, stack = s.req_key.tolist(), [0] * s.num_requests, []
    for i, j in _group_bounds(s):
        if j - i == 1:
            k = keys[i]
            try:
                d = stack.index(k)
            except ValueError:
                pass
            else:
                out[i] = d + 1
                del stack[d]
            stack.insert(0, k)
            continue
        members = keys[i:j]
        for n, k in enumerate(members):
            try:
                out[i + n] = stack.index(k) + 1
            except ValueError:
                pass
        for n, k in enumerate(members):
            if out[i + n]:
                stack.remove(k)
        for k in members:
            stack.insert(0, k)
    return np.asarray(out, dtype=np.int64)


def opt_depths(s: Schedule) -> np.ndarray:
    """OPT stack depth (1-based) of every request; 0 for a first use. [R]"""
    keys, grp, nxt = s.req_key.tolist(), s.req_group.tolist(), _next_use(s).tolist()
    prio = [_NEVER] * (s.num_layers * s.num_experts)  # key id -> next use (lower = sooner)
    out, stack = [0] * s.num_requests, []
    for i, j in _group_bounds(s):
        g = grp[i]
        for r in range(i, j):
            x = keys[r]
            prio[x] = g  # pinned while its group is served
            try:
                d = stack.index(x)
                out[r] = d + 1
            except ValueError:
                d = len(stack)
                stack.append(x)
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
                    carried, cp = y, py
            stack[d] = carried
        for r in range(i, j):
            prio[keys[r]] = nxt[r]
    return np.asarray(out, dtype=np.int64)


def group_bounds(s: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """First and end request indices of each non-empty group: int64 [G], [G] (cached on the schedule)."""
    return s.bounds


def _group_bounds(s: Schedule) -> zip:
    """(first, end) request indices of each non-empty group, lazily."""
    starts, ends = group_bounds(s)
    return zip(starts.tolist(), ends.tolist(), strict=True)


def _next_use(s: Schedule) -> np.ndarray:
    """Group index of the next request of the same key, or _NEVER. [R]"""
    order = np.lexsort((s.req_group, s.req_key))
    k, g = s.req_key[order], s.req_group[order]
    nxt_sorted = np.full(len(order), _NEVER, dtype=np.int64)
    same = k[1:] == k[:-1]
    nxt_sorted[:-1][same] = g[1:][same]
    out = np.empty_like(nxt_sorted)
    out[order] = nxt_sorted
    return out
