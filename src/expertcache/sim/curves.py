"""Misses of a policy at many capacities: one stack pass where the policy allows it, else replays."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from expertcache.cache.schedule import Schedule, check_capacity
from expertcache.errors import ExpertcacheError, arguments_checked
from expertcache.policy.registry import capacity_reason, min_capacity, policy_class, spec_and_params
from expertcache.sim.replay import SimResult, check_schedule, replay_as_given, schedule_capacities
from expertcache.sim.stack import lru_depths, opt_depths
from expertcache.workers import map_in_processes


def _depths(reference: Callable[[Schedule], np.ndarray], name: str) -> Callable[[Schedule], np.ndarray]:
    """The compiled pass (``sim/fast.py``) for large schedules when numba is there, else the reference."""

    def depths(schedule: Schedule) -> np.ndarray:
        from expertcache.sim import fast

        if fast.use_compiled(schedule):
            return getattr(fast, name)(schedule)
        return reference(schedule)

    return depths


# Stack algorithms by registry name: their whole curve comes from one pass over the schedule.
STACK_DEPTHS: dict[str, Callable[[Schedule], np.ndarray]] = {
    "lru": _depths(lru_depths, "lru_depths"),
    "opt": _depths(opt_depths, "opt_depths"),
}


_STACK_FROM = 2  # a stack pass costs about two Python replays: use it from two capacities on
# with the compiled replay, the capacities from which the compiled stack pass is cheaper (6.4M flat
# requests on the development VM: LRU's pass 1.1-1.6 s against 0.11 s a replay, OPT's 1.0 s against 0.33 s)
_STACK_FROM_COMPILED = {"lru": 12, "opt": 3}


def _stack_from(schedule: Schedule, name: str) -> int:
    """Capacities from which one stack pass beats replaying each."""
    from expertcache.sim import fast

    return _STACK_FROM_COMPILED[name] if fast.use_compiled(schedule) else _STACK_FROM


def all_capacities(schedule: Schedule) -> list[int]:
    """1 .. L*E (from top-k in layer order, where a token's experts must co-reside)."""
    low = schedule.top_k if schedule.order == "layer" else 1
    return list(range(low, schedule.num_layers * schedule.num_experts + 1))


@arguments_checked
def run_policy(
    schedule: Schedule,
    name: str,
    capacities: Sequence[int],
    seed: int = 0,
    params: dict[str, object] | None = None,
    jobs: int = 1,
    compiled: bool | None = None,
) -> list[SimResult]:
    """One SimResult per capacity; stack algorithms take one pass for every capacity >= max group when
    that is cheaper, other capacities are replayed: compiled (``sim/fast.py``, on ``jobs`` threads) where
    the policy has a compiled replay and the replays are large (``compiled`` None) or the caller says so
    (it replays many small schedules), else by the Python reference (on ``jobs`` processes)."""
    check_schedule(schedule, "run_policy")
    if isinstance(capacities, str) or not isinstance(capacities, Sequence):
        raise ExpertcacheError(f"run_policy's capacities is a list of whole numbers, got {capacities!r}")
    if params is not None and not isinstance(params, dict):
        raise ExpertcacheError(f"run_policy's params is a dict of the policy's parameters, got {params!r}")
    name, params = spec_and_params(name, params or {})
    capacities = schedule_capacities(schedule, capacities)
    low = min_capacity(name, schedule.num_layers, params, schedule.min_room)
    for c in capacities:
        check_capacity(c, schedule.order, schedule.top_k)
        if c < low:
            why = capacity_reason(name, params, schedule.min_room)
            raise ExpertcacheError(
                f"{name} at capacity {c}: {why} in {schedule.order} order, so it needs capacity >= {low}"
            )
    done: dict[int, SimResult] = {}
    by_stack = [c for c in dict.fromkeys(capacities) if c >= schedule.max_group]
    if name in STACK_DEPTHS and not params and len(by_stack) >= _stack_from(schedule, name):
        layer_misses = misses_by_layer(schedule, STACK_DEPTHS[name](schedule), by_stack)
        for c, m in zip(by_stack, layer_misses, strict=True):
            done[c] = SimResult(name, c, schedule.order, schedule.layer_requests, m)
    todo = [c for c in dict.fromkeys(capacities) if c not in done]
    from expertcache.sim import fast

    if compiled is None:
        compiled = fast.use_compiled(schedule, name, len(todo))
    compiled = compiled and fast.available() and fast.supports(name, params)
    for r in (_fast_all if compiled else _replay_all)(schedule, name, todo, seed, params, jobs):
        done[r.capacity] = r
    if policy_class(name).seeded:  # the run repeats from its row: the seed it drew with
        for r in done.values():
            r.seed = seed
    return [done[c] for c in capacities]


def _replay_all(
    schedule: Schedule, name: str, caps: list[int], seed: int, params: dict[str, object], jobs: int
) -> list[SimResult]:
    """Replays at many capacities, split over ``jobs`` worker processes (results are identical)."""
    jobs = max(1, min(jobs, len(caps)))
    if jobs == 1:
        return [replay_as_given(schedule, name, c, seed, **params) for c in caps]
    parts = map_in_processes(
        _replay_part, [(schedule, name, caps[i::jobs], seed, params) for i in range(jobs)], jobs
    )
    return [r for part in parts for r in part]


def _fast_all(
    schedule: Schedule, name: str, caps: list[int], seed: int, params: dict[str, object], jobs: int
) -> list[SimResult]:
    """Compiled replays at many capacities, on ``jobs`` threads (the kernels release the GIL)."""
    if not caps:
        return []
    jobs = max(1, min(jobs, len(caps)))
    if jobs == 1:
        return [_fast_one(schedule, name, c, params) for c in caps]
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(lambda c: _fast_one(schedule, name, c, params), caps))


def _fast_one(schedule: Schedule, name: str, capacity: int, params: dict[str, object]) -> SimResult:
    from expertcache.sim import fast

    misses, rooms = fast.replay(schedule, name, capacity, params)
    split = bool((rooms < schedule.max_group_by_layer).any())
    req, order = schedule.layer_requests, schedule.order
    return SimResult(name, capacity, order, req, misses, params=dict(params), split_groups=split)


def _replay_part(task: tuple[Schedule, str, list[int], int, dict[str, object]]) -> list[SimResult]:
    schedule, name, caps, seed, params = task
    return [replay_as_given(schedule, name, c, seed, **params) for c in caps]


def with_opt(
    schedule: Schedule, results: list[SimResult], opt: Sequence[SimResult] | None = None
) -> list[SimResult]:
    """Fill in each result's OPT misses at its capacity (one OPT pass for all of them).

    Belady is optimal when no group is split. When a group is larger than its layer's room (a prefill
    layer above the capacity, or above a -dist budget) the chunked serving rule is not Belady's
    model, and a policy can make fewer misses than OPT: ``opt_is_bound`` says which results are bounded.
    ``opt``: OPT's results, when already computed (they must cover every result's capacity)."""
    caps = sorted({r.capacity for r in results})
    known = {r.capacity: r for r in opt or ()}
    missing = [c for c in caps if c not in known]
    opt = {**known, **{r.capacity: r for r in run_policy(schedule, "opt", missing)}} if missing else known
    for r in results:
        ref = opt[r.capacity]
        r.opt_misses = ref.misses
        r.opt_is_bound = not (r.split_groups or ref.split_groups)
    return results


def misses_by_layer(schedule: Schedule, depths: np.ndarray, capacities: Sequence[int]) -> np.ndarray:
    """Misses per capacity, phase and layer from stack depths (0 = first use). -> int64 [C, 2, L]"""
    L = schedule.num_layers
    layer = (schedule.req_group // schedule.per_layer) % L
    rnd = schedule.req_group // (schedule.per_layer * L)
    cell = schedule.round_prefill[rnd].astype(np.int64) * L + layer  # [R] -> (phase, layer)
    top = int(depths.max(initial=0)) + 1  # first uses count as deeper than any capacity
    d = np.where(depths == 0, top, depths)
    hist = np.bincount(cell * (top + 1) + d, minlength=2 * L * (top + 1)).reshape(2 * L, top + 1)
    deeper = hist[:, ::-1].cumsum(axis=1)[:, ::-1]  # deeper[:, x] = requests with depth >= x
    idx = np.minimum(np.asarray(capacities, dtype=np.int64) + 1, top)  # first uses always miss
    return deeper[:, idx].T.reshape(len(capacities), 2, L)
