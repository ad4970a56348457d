"""The compiled simulator (numba): per-capacity replays of the policies sweeps use most, and the LRU and
OPT stack passes for whole curves, at C speed over arrays (no Python object per request).

- ``replay(schedule, name, capacity, params)``: LRU, FIFO, LFU, LCP, LLRU and OPT, and their ``-dist``
  forms (uniform or given budgets), on every order: the rules of ``cache.residency.Residency`` (a layer's
  group pinned together; a group above its room served in chunks, resident experts first) with each
  policy's victim, tie-breaks included (``sim/_kernels.py``); and ``reuse``, whose policy object runs on
  compiled kernels itself, replayed by a kernel beside them (``policy/_reuse_jit.py``).
- ``lru_depths`` / ``opt_depths``: ``sim/stack.py``'s passes, compiled.

The Python policy objects stay the reference, and the route for every other policy and for plug-ins;
``tests/test_fast.py`` checks that the compiled paths equal them request for request, on every order, at
many capacities, on real and synthetic traces. ``sim.curves.run_policy`` picks the compiled path by
itself (``use_compiled``): from ``MIN_REQUESTS`` requests on, where compiling (once per machine: numba
caches the code on disk) or loading it pays for itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from expertcache.cache.schedule import Schedule
from expertcache.errors import PolicyError
from expertcache.policy.base import PolicyContext
from expertcache.policy.dist import Dist
from expertcache.policy.registry import make_policy
from expertcache.sim.replay import check_rooms
from expertcache.sim.stack import _NEVER

_NEVER32 = (1 << 31) - 1  # never, in an int32 next-use array
MIN_REQUESTS = 200_000  # below this the reference is about as fast as loading the compiled code
# registry names -> kernel kinds (sim/_kernels.py); each also runs as "<name>-dist"
_KINDS = {"lru": 0, "fifo": 1, "lfu": 2, "lcp": 3, "opt": 4, "llru": 5}
_PARAMS = {"lcp": {"rho", "omega"}}  # parameters the compiled path takes (-dist forms: also budgets)


def available() -> bool:
    try:
        from expertcache.jit import numba  # noqa: F401
    except ImportError:
        return False
    return True


def _k():
    from expertcache.sim import _kernels

    return _kernels


def supports(name: str, params: dict[str, object] | None = None) -> bool:
    """Whether ``replay`` runs this registry name with these parameters."""
    if name == "reuse":
        return set(params or {}) <= {"lr", "weights", "horizon"}
    base, dist = (name[:-5], True) if name.endswith("-dist") else (name, False)
    allowed = _PARAMS.get(base, set()) | ({"budgets"} if dist else set())
    return base in _KINDS and set(params or {}) <= allowed


def use_compiled(schedule: Schedule, name: str | None = None, replays: int = 1) -> bool:
    """Whether the compiled paths pay for ``replays`` replays of this schedule (and numba is installed):
    from ``MIN_REQUESTS`` requests in all (the planner's per-layer curves replay a small schedule at every
    size). For ``reuse`` always: the policy object runs on the same compiled kernels, so loading them is
    paid either way."""
    return (name == "reuse" or schedule.num_requests * replays >= MIN_REQUESTS) and available()


def next_use(s: Schedule) -> tuple[np.ndarray, int]:
    """``stack._next_use``, compiled: the group index of each request's next use of its key, and the
    value that stands for never. int32 where the group indices fit (100M requests: 400 MB, not 800). [R]"""
    small = s.num_groups < _NEVER32
    out = np.empty(s.num_requests, dtype=np.int32 if small else np.int64)
    never = _NEVER32 if small else _NEVER
    _k().next_use(s.req_key, s.req_group, s.num_layers * s.num_experts, never, out)
    return out, never


@contextmanager
def plain_pages() -> Iterator[None]:
    """Allocate without numpy's transparent-huge-page advice meanwhile. The simulator's large arrays are
    written once and streamed, so huge pages save it little, while on machines whose kernel compacts
    memory for them on first touch (``/sys/kernel/mm/transparent_hugepage/defrag`` = madvise, this
    project's VM) they cost up to 2 s per GB (measured: 100M requests, 6.0 s -> 4.7 s for a whole run)."""
    toggle = getattr(getattr(getattr(np, "_core", None), "multiarray", None), "_set_madvise_hugepage", None)
    if toggle is None:  # another numpy: leave its default
        yield
        return
    before = toggle(False)
    try:
        yield
    finally:
        toggle(before)


def replay(
    schedule: Schedule,
    name: str,
    capacity: int,
    params: dict[str, object] | None = None,
    record: bool = False,
):
    """Misses of one policy at one capacity: ``sim.replay.replay``'s result, compiled.
    -> (layer_misses int64 [2, L], rooms: each layer's room), and with ``record`` a third item: uint8 [R],
    1 where a request hit."""
    params = dict(params or {})
    if not supports(name, params):
        raise PolicyError(f"{name!r} with {sorted(params)} has no compiled replay")
    base = name.removesuffix("-dist")
    policy = make_policy(name, _context(schedule, capacity, base == "opt"), **params)  # validates
    rooms = np.asarray(check_rooms(schedule, policy), dtype=np.int64)  # the reference's refusals
    hits = np.zeros(schedule.num_requests if record else 0, dtype=np.uint8)
    if name == "reuse":
        misses, status = _reuse(schedule, policy, hits)
        if status < 0:
            raise PolicyError(f"{name}: no evictable expert (capacity {capacity}, all pinned)")
        return (misses, rooms, hits) if record else (misses, rooms)
    L = schedule.num_layers
    decay = float(getattr(policy.layers[0] if isinstance(policy, Dist) else policy, "_decay", 0.0))
    k = _k()
    nxt, never = next_use(schedule) if base == "opt" else (np.zeros(0, dtype=np.int32), _NEVER32)
    if name == "opt" and _scans(schedule, capacity):
        args = (schedule.req_key, schedule.req_group, schedule.per_layer, L, schedule.num_experts)
        single = schedule.order != "layer"  # flat and rounds: one request a group
        misses, status = k.opt_replay(*args, schedule.round_prefill, nxt, never, rooms, single, hits)
    else:
        misses, status = k.replay(
            _KINDS[base],
            name.endswith("-dist"),
            schedule.req_key,
            schedule.req_group,
            schedule.per_layer,
            L,
            schedule.num_experts,
            schedule.round_prefill,
            schedule.round_token,
            nxt,
            rooms,
            decay,
            hits,
        )
    if status == k.NO_VICTIM:
        raise PolicyError(f"{name}: no evictable expert (capacity {capacity}, all pinned)")
    return (misses, rooms, hits) if record else (misses, rooms)


def _reuse(s: Schedule, policy, hits: np.ndarray) -> tuple[np.ndarray, int]:
    """The ``reuse`` policy's compiled replay (``policy/_reuse_jit.replay``: the kernels the policy object
    itself calls, so the same floats and decisions)."""
    from expertcache.policy import _reuse_jit

    model = policy.model
    return _reuse_jit.replay(
        s.req_key, s.req_group, s.req_score, s.per_layer, s.num_layers, s.num_experts, model.top_k,
        s.round_prefill, s.round_token, policy.capacity, policy._horizon, model.w.copy(), model.lr, hits,
    )  # fmt: skip


SCAN_MAX = 1024  # OPT's scan kernel up to this capacity (it scans on each miss), the heap above


def _scans(schedule: Schedule, capacity: int) -> bool:
    """Whether OPT runs on its scan kernel: a capacity it pays at (measured from 16 to 1400 slots: 1.3-2.4x
    the heap's speed in layer order, 2.6-4x in flat order, misses falling as capacity grows), and next
    uses and stamps that fit its 31 + 32 bits."""
    return capacity <= SCAN_MAX and schedule.num_groups < _NEVER32 and schedule.num_requests < _NEVER32


def _context(schedule: Schedule, capacity: int, offline: bool) -> PolicyContext:
    """A context to build (and so validate) the policy: the compiled replay reads the future itself."""
    return PolicyContext(
        capacity=capacity,
        num_layers=schedule.num_layers,
        num_experts=schedule.num_experts,
        top_k=schedule.top_k,
        future={} if offline else None,
    )


def lru_depths(s: Schedule) -> np.ndarray:
    """``stack.lru_depths``, compiled."""
    return _k().lru_depths(s.req_key, s.req_group, s.num_layers * s.num_experts)


def opt_depths(s: Schedule) -> np.ndarray:
    """``stack.opt_depths``, compiled."""
    keys, groups, num_keys = s.req_key, s.req_group, s.num_layers * s.num_experts
    nxt, never = next_use(s)
    return _k().opt_depths(keys, groups, nxt, num_keys, never)
