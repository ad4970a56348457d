"""``expertcache sweep``: a grid of simulator (and timing model) cells, run on local processes or Ray.

A grid (``tools/sweep_grid.py``) is traces x policies (with parameters) x seeds x orders x capacities
(expert counts or shares of all experts, resolved per trace), and optionally timing-model cells: x miss
paths x predictors (and windows) x link bandwidths x latencies. Cells that share (trace, policy, seed,
order) are one task, so a stack algorithm (LRU, OPT) gives its whole curve in one pass and every task
finds OPT's misses at its capacities in one more (``sim.curves.run_policy``, ``with_opt``); a timing
cell is a task of its own.

Tasks run in this process (one job), on local processes (``jobs``; fork where the platform has it),
or on a Ray cluster (``ray``): each trace is put in Ray's object store once, so it travels to each node
once, and every task is one remote call. Results do not depend on where a task ran. Rows are written as
tasks finish (``tools/sweep_table.py``), which is what lets an interrupted sweep resume. Torch-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NoReturn

from expertcache.cache.schedule import build_schedule, min_room
from expertcache.config import CacheConfig, MissConfig, PrefetchConfig
from expertcache.costs import CostModel
from expertcache.errors import ExpertcacheError, first_line
from expertcache.plugins import load_plugins
from expertcache.policy.base import PolicyContext
from expertcache.policy.registry import (
    capacity_reason,
    fixed_capacity,
    make_policy,
    min_capacity,
    parse_policy,
    policy_class,
)
from expertcache.predict.registry import trace_readers
from expertcache.sim import fast
from expertcache.sim.curves import run_policy, with_opt
from expertcache.tools.sweep_grid import DIMENSIONS, Grid, Timing, capacity_items
from expertcache.tools.sweep_table import TIMING_IDENTITY, Results, columns, identity
from expertcache.trace.trace import Trace, check_replayable, load_trace
from expertcache.units import capacity_beyond, true_or_false, whole_number
from expertcache.workers import exit_with_parent

__all__ = ["Grid", "Timing", "exit_with_parent", "sweep"]

Log = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# -- cells and tasks -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimingCell:
    """One timing combination: miss path, predictor and window, and the cost model (its link set)."""

    miss: str
    prefetch: str
    window: int | None
    cost: CostModel
    code_shas: str = ""  # ``code_sha`` of a plugin miss path's or predictor's file: another cell if changed

    def columns(self) -> dict[str, object]:
        return {
            "miss": self.miss,
            "prefetch": self.prefetch,
            "window": self.window,
            "link_bandwidth_gb_s": self.cost.link_bandwidth / 1e9,
            "link_latency_us": self.cost.link_latency * 1e6,
        }


@dataclass(frozen=True)
class Task:
    """Cells that run together: one (trace, policy, seed, order) at some capacities, or one timing cell."""

    trace: str
    sha: str
    total: int  # L * E of the trace (for the share)
    policy: str  # the registry name
    params: tuple[tuple[str, object], ...]
    seed: int
    order: str
    capacities: tuple[int, ...]
    timing: TimingCell | None = None
    predictor_sha: str | None = None
    file_shas: str = ""  # ",k_sha=..." for each file a parameter names: a changed file is another cell
    base: str = ""  # the folder a relative file a parameter names is read from (the sweep's own)

    def where(self) -> str:
        """The task, for messages: its trace, policy and order (and timing combination)."""
        text = f"{self.trace}: {_spec(self.policy, dict(self.params))} in {self.order} order"
        if self.timing is not None:
            cell = self.timing
            text += f" at capacity {self.capacities[0]} with miss {cell.miss}, prefetch {cell.prefetch}"
        return text

    def base_row(self, capacity: int) -> dict[str, object]:
        return {
            "trace": self.trace,
            "trace_sha": self.sha,
            "policy": self.policy,
            "params": (format_params(dict(self.params)) + self.file_shas).lstrip(","),
            "seed": self.seed,
            "order": self.order,
            "capacity": capacity,
            "share": capacity / self.total,
        }


@contextlib.contextmanager
def _named_by(grid: Grid):
    """An error about the grid's values names its file (where it came from one), and the file's key for a
    predictor trace where the message names the flag."""
    try:
        yield
    except ExpertcacheError as exc:
        text = str(exc)
        if grid.source is None or text.startswith((f"{grid.source}", "--policy ")):  # (a flag's own)
            raise
        text = text.replace(
            "(--predictor TRACE.npz)", "(--predictor TRACE.npz, or predictor: in the grid's timing)"
        )
        raise ExpertcacheError(f"{grid.source}: {text}") from None


def format_params(params: dict[str, object]) -> str:
    """A policy's or miss path's parameters as ``k=v,...`` (keys sorted; lists as ``a/b/c``)."""
    return ",".join(
        f"{k}={'/'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in sorted(params.items())
    )


def _spec(name: str, params: dict[str, object]) -> str:
    return f"{name}:{format_params(params)}" if params else name


@dataclass
class Cells:
    """A grid's tasks, the order of its rows, and what was left out and why."""

    tasks: list[Task] = field(default_factory=list)
    order: dict[tuple[object, ...], int] = field(default_factory=dict)  # cell identity -> position
    notes: list[str] = field(default_factory=list)
    skipped: int = 0


@dataclass
class _Loaded:
    name: str
    sha: str
    trace: Trace


def _load_traces(grid: Grid, log: Log | None) -> list[_Loaded]:
    loaded: dict[str, _Loaded] = {}
    for name in grid.traces:
        path = grid.trace_path(name)
        try:
            trace = check_replayable(load_trace(path))
        except ExpertcacheError as e:
            if grid.source is None or name == "default":
                raise
            # the path as resolved, and the grid file that named it: a relative path is read from there
            text = str(e).removeprefix(f"{path}: ")
            raise ExpertcacheError(f"{path} (from grid {grid.source}): {text}") from None
        sha = file_sha(path)
        if sha in loaded:
            if log:
                log(f"note: trace {name} is the same file as {loaded[sha].name}; it runs once")
            continue
        loaded[sha] = _Loaded(name, sha, trace)
    return list(loaded.values())


def _file_shas(name: str, params: dict[str, object]) -> str:
    """``,weights_sha=...`` for each parameter of the policy that names a file (``reuse:weights=``;
    ``params`` as ``_files_from`` resolved them)."""
    text = policy_class(name).text_params
    return "".join(f",{k}_sha={file_sha(str(params[k]))}" for k in sorted(text) if k in params)


def code_sha(cls: type, what: str) -> str:
    """``,{what}_code_sha=...``: a content hash of the file defining a plugin's class (a module outside
    this package, ``EXPERTCACHE_PLUGINS``), so that ``--resume`` runs a cell again once its code changed;
    "" for the package's own classes (a version of the package is one set of results)."""
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if cls.__module__.partition(".")[0] == "expertcache" or not path or not os.path.isfile(path):
        return ""
    return f",{what}_code_sha={file_sha(path)}"


def _files_from(name: str, params: dict[str, object], base: str) -> dict[str, object]:
    """``params`` with each relative file a parameter names (``reuse:weights=w/r.json``) read from ``base``:
    the folder of the grid file that named the policy, else the sweep's own (a worker runs elsewhere)."""
    out = dict(params)
    for key in policy_class(name).text_params & set(params):
        if base and not Path(str(params[key])).is_absolute():
            out[key] = str(Path(base) / str(params[key]))
    return out


def file_sha(path: str | Path) -> str:
    """A short content hash of a file (12 hex digits of SHA-256): a changed trace is another trace."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:12]


def _timing_cells(
    grid: Grid, t: _Loaded, predictor: Trace | None, notes: list[str] | None = None
) -> list[TimingCell]:
    """The timing grid's combinations for one trace; predictors and miss paths are built once here,
    so that a predictor this trace cannot feed, or a bad parameter, is refused before any work. A window
    clipped to the trace's layers is said in ``notes`` (its cells are those of the clipped window)."""
    from expertcache.miss.base import MissContext
    from expertcache.miss.registry import miss_class
    from expertcache.predict.registry import PREDICTORS
    from expertcache.sim.recorded import make_sim_predictor

    assert grid.timing is not None
    tm, base = grid.timing, grid.timing.cost_model(t.trace)
    tr = t.trace
    cells = []
    for miss_spec in tm.miss:
        miss = MissConfig(miss_spec)
        miss_class(miss.name)(MissContext(tr.num_layers, tr.num_experts, tr.top_k, costs=base), **miss.params)
        miss_code = code_sha(miss_class(miss.name), "miss")
        for prefetch in tm.prefetch:
            name = PrefetchConfig(prefetch).predictor
            code = miss_code + (code_sha(PREDICTORS[name], "prefetch") if name in PREDICTORS else "")
            for window in [None] if name == "none" else tm.window:
                pred = make_sim_predictor(name, tr, window, 0, predictor)
                note = None if pred is None or pred.note is None else f"note: {t.name}: {pred.note}"
                if note is not None and notes is not None and note not in notes:
                    notes.append(note)
                for bw in tm.link_bandwidth:
                    for lat in tm.link_latency:
                        link = {"link_bandwidth": bw, "link_latency": lat}
                        cost = CostModel.from_dict({k: v for k, v in link.items() if v is not None}, base)
                        window_used = None if pred is None else pred.window
                        cells.append(TimingCell(_spec(miss.name, miss.params), name, window_used, cost, code))
    return list(dict.fromkeys(cells))


def plan_cells(grid: Grid, traces: list[_Loaded], predictor: _Loaded | None = None) -> Cells:
    """The tasks of a grid in its order (trace, policy, seed, order, [timing,] capacity), infeasible
    cells left out with a note: below a layer's room (top-k in layer order, one slot per layer for
    -dist), other than the sum of given -dist budgets, given budgets that leave a layer less than its
    room or that are not one per layer of the trace, a share below one expert."""
    p = Cells()
    timing = grid.timing is not None
    for t in traces:
        L, K, total = t.trace.num_layers, t.trace.top_k, t.trace.num_keys
        cells = _timing_cells(grid, t, predictor.trace if predictor else None, p.notes) if timing else []
        caps_by_order = {order: _capacities(grid, t, order, p) for order in grid.orders}
        each = {order: len(cells) if timing and order == "layer" else 1 for order in grid.orders}
        base = str(Path(grid.policy_base).resolve())  # where a relative file of a policy is read
        for spec in grid.policies:
            name, params = parse_policy(str(spec))
            budgets = params.get("budgets") if fixed_capacity(name, params) is not None else None
            if budgets is not None and len(budgets) != L:  # another trace of the grid may have L layers
                p.notes.append(f"note: {t.name}: {_spec(name, params)} left out: {len(budgets)} budgets "
                               f"given for its {L} layers")  # fmt: skip
                p.skipped += len(grid.seeds) * sum(len(caps_by_order[o]) * each[o] for o in grid.orders)
                continue
            try:
                _check_policy(name, _files_from(name, params, base), t.trace)
            except ExpertcacheError as e:  # a --policy of the command line is no grid file's (_named_by)
                if grid.source is None or grid.policy_base == grid.base:
                    raise
                raise ExpertcacheError(f"--policy {spec}: {e}") from None
            # the files the policy's cells depend on, hashed once for all its seeds and orders
            shas = _file_shas(name, _files_from(name, params, base)) + code_sha(policy_class(name), "policy")
            seeds = grid.seeds if policy_class(name).seeded else grid.seeds[:1]
            note = (f"note: {_spec(name, params)} draws no random numbers: its cells run once, with seed "
                    f"{seeds[0]} (seeds change only random and marking)")  # fmt: skip
            if not policy_class(name).seeded and tuple(grid.seeds) != (0,) and note not in p.notes:
                p.notes.append(note)
            for seed in seeds:
                for order in grid.orders:
                    wanted, room = caps_by_order[order], min_room(order, K)
                    low, fixed = min_capacity(name, L, params, room), fixed_capacity(name, params)
                    short = [i for i, b in enumerate(budgets or ()) if b < room]
                    if short:  # given budgets that leave a layer less than a token's experts of it
                        mine = ()
                        if seed == grid.seeds[0]:
                            i = short[0]
                            p.notes.append(f"note: {t.name}: {_spec(name, params)} left out in {order} "
                                           f"order (its budgets give layer {i} {budgets[i]} slot(s), "
                                           f"below top-k {room})")  # fmt: skip
                    else:
                        mine = tuple(
                            c for c in wanted if isinstance(c, int) and c >= low and fixed in (None, c)
                        )
                    left = [c for c in wanted if isinstance(c, int) and c >= room and c not in mine]
                    if left and not short and seed == grid.seeds[0]:
                        why = capacity_reason(name, params, room)
                        p.notes.append(f"note: {t.name}: {_spec(name, params)} left out at capacities "
                                       f"{_ranges(left)} in {order} order ({why})")  # fmt: skip
                    p.skipped += (len(wanted) - len(mine)) * each[order]
                    task = Task(t.name, t.sha, total, name, tuple(params.items()), seed, order, mine,
                                file_shas=shas, base=base)  # fmt: skip
                    if timing and order == "layer":
                        pred = predictor.sha if predictor else None
                        p.tasks += [
                            replace(
                                task,
                                capacities=(c,),
                                timing=cell,
                                predictor_sha=pred,
                                file_shas=shas + cell.code_shas,
                            )
                            for cell in cells
                            for c in mine
                        ]
                    elif mine:
                        p.tasks.append(task)
    for task in p.tasks:
        for c in task.capacities:
            p.order.setdefault(cell_identity(task, c, timing), len(p.order))
    return p


def _check_policy(name: str, params: dict[str, object], trace: Trace) -> None:
    """A policy's parameter values are refused here, before any cell runs, not in a worker (the
    registry checks their names; a policy checks their values when it is built)."""
    total = trace.num_keys
    ctx = PolicyContext(
        capacity=fixed_capacity(name, params) or total, num_layers=trace.num_layers,
        num_experts=trace.num_experts, top_k=trace.top_k, future={}, profile={},
    )  # fmt: skip
    make_policy(name, ctx, **params)


def _capacities(grid: Grid, t: _Loaded, order: str, p: Cells) -> list[int | str]:
    """The grid's capacities on one trace in one order, repeats dropped; a note on those no policy can
    run with (a share below one expert, below top-k in layer order), which stay in the list to be
    counted as left out."""
    total, low = t.trace.num_keys, min_room(order, t.trace.top_k)
    by_item = {item: capacity_items(item, total, low) for item in grid.capacities}
    caps = list(dict.fromkeys(c for items in by_item.values() for c in items))
    beyond = [  # (a range wholly beyond selects no capacity: said below)
        f"{item} ({cut})"
        for item in grid.capacities
        if by_item[item] and (cut := capacity_beyond(item, total))
    ]
    if beyond and order == grid.orders[0]:  # the ranges are cut at all experts: said
        p.notes.append(f"note: {t.name}: capacities {', '.join(beyond)} of the ranges are more than all "
                       f"{total} experts; left out")  # fmt: skip
    none = [str(item) for item, items in by_item.items() if not items]
    if none and order == grid.orders[0]:
        p.notes.append(f"note: {t.name}: capacities {', '.join(none)} select no capacity of its {total} "
                       "experts; left out")  # fmt: skip
    shares = [c for c in caps if isinstance(c, str)]
    if shares and order == grid.orders[0]:
        p.notes.append(f"note: {t.name}: capacities {', '.join(shares)} of {total} experts are less than "
                       "one expert; left out")  # fmt: skip
    above = [c for c in caps if isinstance(c, int) and c > total]
    if above:  # as sim and timing cap them: a share above 100 % in a row would say what no cache did
        if order == grid.orders[0]:
            p.notes.append(f"note: {t.name}: capacities {_ranges(above)} are more than all {total} experts; "
                           f"capped at {total}")  # fmt: skip
        caps = list(dict.fromkeys(min(c, total) if isinstance(c, int) else c for c in caps))
    below = [c for c in caps if isinstance(c, int) and c < low]
    if below:
        p.notes.append(f"note: {t.name}: capacities {_ranges(below)} are below top-k {low}: left out in "
                       "layer order (a token's experts of a layer must be resident together)")  # fmt: skip
    return caps


def _ranges(caps: Sequence[int]) -> str:
    return ", ".join(map(str, caps[:8])) + (f" ... ({len(caps)} in all)" if len(caps) > 8 else "")


def cell_identity(task: Task, capacity: int, timing: bool) -> tuple[object, ...]:
    row = task.base_row(capacity)
    if timing:
        row.update(task.timing.columns() if task.timing else dict.fromkeys(TIMING_IDENTITY))
    return identity(row, timing)


# -- running one task (in this process, a worker process, or a Ray worker) --------------------------
def run_task(task: Task, trace: Trace, predictor: Trace | None = None) -> tuple[list[dict], list[str]]:
    """The rows of one task, and notes on cells it had to leave out."""
    load_plugins()  # a worker started fresh (spawned, a Ray worker's): the user's own policies (once)
    with fast.plain_pages():  # the simulator's large arrays: see plain_pages
        schedule = build_schedule(trace, task.order)
        params = _files_from(task.policy, dict(task.params), task.base)  # (a Ray worker is elsewhere)
        if task.timing is None:
            results = run_policy(schedule, task.policy, list(task.capacities), task.seed, params)
            rows = [_row(task, r.capacity, r.requests, r.misses, r) for r in with_opt(schedule, results)]
            return rows, []
        return _timing_task(task, trace, schedule, params, predictor)


def _row(task: Task, capacity: int, requests: int, misses: int, ref, timing: dict | None = None) -> dict:
    """A table row; ``ref`` carries OPT's misses and whether they bound this cell (a SimResult)."""
    opt = ref.opt_misses
    row = {
        **task.base_row(capacity),
        "requests": requests,
        "misses": misses,
        "miss_ratio": misses / requests if requests else 0.0,
        "opt_misses": opt,
        "ratio_to_opt": misses / opt if opt else 1.0,
        "opt_is_bound": ref.opt_is_bound,
    }
    return {**row, **timing} if timing is not None else row


def _timing_task(task, trace, schedule, params, predictor) -> tuple[list[dict], list[str]]:
    from expertcache.sim.timing import run_timing

    (capacity,) = task.capacities
    cell = task.timing
    prefetch = PrefetchConfig(cell.prefetch, window=cell.window if cell.prefetch != "none" else None)
    try:
        r = run_timing(
            trace, capacity, cache=CacheConfig(_spec(task.policy, params), seed=task.seed),
            prefetch=prefetch, miss=cell.miss, cost=cell.cost,
            predictor_trace=predictor if trace_readers([prefetch.predictor]) else None,  # its readers only
        )  # fmt: skip
    except ExpertcacheError as e:  # a capacity this miss path cannot divide among its parts
        where = f"{task.trace}: {_spec(task.policy, params)} at capacity {capacity} with miss {cell.miss}"
        return [], [f"note: {where} left out ({first_line(e)})"]
    # OPT bounds the demand misses of a plain cache (whose misses are the replay's: its SimResult says
    # whether a group was split); prefetching and other miss paths change what a miss is, so there OPT
    # is a reference, not a bound
    if cell.miss == "fetch" and cell.prefetch == "none":
        ref = with_opt(schedule, run_policy(schedule, task.policy, [capacity], task.seed, params))[0]
    else:
        ref = run_policy(schedule, "opt", [capacity])[0]
        ref.opt_misses, ref.opt_is_bound = ref.misses, False
    ms = lambda s: None if s is None else s * 1e3  # noqa: E731
    timing = {
        **cell.columns(),
        "ttft_ms": ms(r.ttft_s),
        "tpot_ms": ms(r.tpot_s),
        "stall_s": r.stall_s,
        "total_s": r.total_s,
        "tokens_per_s": r.tokens_per_s,
        "bytes_moved": r.bytes_moved,
        "transfers": r.transfers,
    }
    return [_row(task, capacity, r.requests, r.misses, ref, timing)], []


# -- backends ------------------------------------------------------------------------------------------
_WORKER_TRACES: dict[str, Trace] = {}  # a worker process's traces, shipped once when it starts


def _init_worker(traces: dict[str, Trace], parent: int | None = None) -> None:
    exit_with_parent(parent)
    _WORKER_TRACES.update(traces)


def _run_in_worker(task: Task) -> tuple[list[dict], list[str]]:
    pred = _WORKER_TRACES[task.predictor_sha] if task.predictor_sha else None
    return run_task(task, _WORKER_TRACES[task.sha], pred)


Done = Callable[[Task, list[dict], list[str]], None]


def run_local(tasks: Sequence[Task], traces: dict[str, Trace], jobs: int, done: Done) -> None:
    """Tasks on ``jobs`` processes (in this one for one job), each result handed to ``done`` as its task
    finishes. Each worker gets the traces once, when it starts."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    jobs = max(1, min(jobs, len(tasks)))
    if jobs == 1:
        for task in tasks:
            pred = traces[task.predictor_sha] if task.predictor_sha else None
            try:
                result = run_task(task, traces[task.sha], pred)
            except Exception as e:
                _raise_for(task, e)
            done(task, *result)
        return
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    pool = ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker, initargs=(traces, os.getpid()))
    finished = False
    try:
        pending = {pool.submit(_run_in_worker, task): task for task in tasks}
        while pending:
            ready, _ = wait(pending, return_when=FIRST_COMPLETED)
            failed = None
            for future in ready:  # the tasks that finished beside a failed one keep their rows
                task = pending.pop(future)
                try:
                    result = future.result()
                except Exception as e:
                    failed = failed or (task, e)
                    continue
                done(task, *result)
            if failed is not None:
                _raise_for(*failed)
        finished = True
    finally:
        if not finished:  # interrupted or failed: stop the workers now, not after their current task
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.terminate()
        pool.shutdown(wait=finished, cancel_futures=True)


def run_ray(tasks: Sequence[Task], traces: dict[str, Trace], address: str | None, done: Done) -> str:
    """Tasks as Ray remote calls, each result handed to ``done`` as its task finishes. A Ray already
    initialised in this process is used as it is (an address given beside it is refused); else
    ``address`` is joined, or the one ``RAY_ADDRESS`` names, or (neither) a new local Ray is started for
    this sweep and stopped after it, never a cluster that happens to run here. Returns where the cells
    ran, in words."""
    ray = _import_ray()
    started = not ray.is_initialized()
    if not started and address:
        raise ExpertcacheError(
            f"ray={address!r}: Ray is already initialised in this process; ray=True runs the cells on it "
            "(or ray.shutdown() first)"
        )
    ran = _start_ray(ray, address) if started else "the Ray initialised in this process"
    try:
        refs = {sha: ray.put(trace) for sha, trace in traces.items()}  # once: the object store ships it
        remote = ray.remote(num_cpus=1)(run_task)
        pending = {
            remote.remote(
                task, refs[task.sha], refs[task.predictor_sha] if task.predictor_sha else None
            ): task
            for task in tasks
        }
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                task = pending.pop(ref)
                try:
                    rows, notes = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    _raise_for(task, e.cause if isinstance(e.cause, ExpertcacheError) else e)
                done(task, rows, notes)
    except ray.exceptions.RayError as e:  # not a task's own error: the cluster (a node gone, Ray stopped)
        if isinstance(e, ray.exceptions.RayTaskError):
            raise
        raise ExpertcacheError(f"{ran}: the cluster failed during the sweep ({first_line(e)})") from None
    finally:
        if started:
            ray.shutdown()
    return ran


def _start_ray(ray, address: str | None) -> str:
    """Join ``address`` or the cluster ``RAY_ADDRESS`` names, or start a new local Ray (never a cluster
    that happens to run here); where the cells run, in words."""
    import logging

    env = os.environ.get("RAY_ADDRESS")  # what ray.init joins for "auto" or no address
    where = f"--ray {address}" if address else f"RAY_ADDRESS={env}" if env else "--ray (a local Ray)"
    if address and address != "auto":
        _check_reachable(address)
    elif env:  # "auto" resolves it too: a stale one would have Ray retry for minutes
        _check_reachable(env, "RAY_ADDRESS=")
    joined = address or env
    try:
        with _no_native_stderr():  # Ray's C++ client logs each retry there; its failure comes as an error
            ray.init(address=joined or "local", logging_level=logging.ERROR, log_to_driver=False,
                     include_dashboard=False if not joined else None)  # fmt: skip
    except Exception as e:  # Ray raises ConnectionError, RuntimeError, ValueError, ... for this
        why = first_line(e)
        if "failed to connect" in why.lower():
            why += (
                "; a cluster that authenticates by token (recent Ray's `ray start` does by default) is "
                "joined with RAY_AUTH_MODE=token set here too, or with --ray auto on one of its nodes"
            )
        raise ExpertcacheError(f"{where}: cannot start or join Ray ({why})") from None
    return f"Ray at {joined}" if joined else "a local Ray started for the sweep"


def _raise_for(task: Task, error: Exception) -> NoReturn:
    """Raise what a task raised, naming the task: an ExpertcacheError as one line (trace, policy,
    order: the problem), a worker that died as one line too, anything else (a bug) as it was, with a
    note naming the task under its traceback."""
    from concurrent.futures.process import BrokenProcessPool

    if isinstance(error, ExpertcacheError):
        raise ExpertcacheError(f"{task.where()}: {error}") from None
    if isinstance(error, BrokenProcessPool):
        raise ExpertcacheError(
            f"{task.where()} (or a task beside it): a worker process died (out of memory, or killed?)"
        ) from None
    error.add_note(f"in the sweep task {task.where()}")
    raise error


@contextlib.contextmanager
def _no_native_stderr():
    """File descriptor 2 pointed at the null device for a while (what native code writes there)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _check_reachable(address: str, flag: str = "--ray ") -> None:
    """Something answers at a cluster's ``host:port`` (or ``ray://host:port``): Ray's own connection
    attempts to an address where nothing does go on for minutes. ``flag`` names where the address came
    from in the message (``--ray `` or the environment's ``RAY_ADDRESS=``)."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # auto, local: Ray resolves these itself, and says so at once when it cannot
    try:
        conn = socket.create_connection((host, int(port)), timeout=5)
    except OSError as e:
        raise ExpertcacheError(f"{flag}{address}: nothing answers there ({e.strerror or e})") from None
    with conn:  # Ray's head (and its client server) speak gRPC: an HTTP/2 server answers a preface
        try:  # with a SETTINGS frame at once; something else there would have Ray retry for minutes
            conn.settimeout(3)
            conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
            head = b""
            while len(head) < 9:
                part = conn.recv(9 - len(head))
                if not part:
                    break
                head += part
        except OSError:
            head = b""
    if len(head) < 9 or head[3] != 4:
        raise ExpertcacheError(
            f"{flag}{address}: something answers there, but not a Ray cluster (no gRPC server)"
        )


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ExpertcacheError(
            "--ray needs Ray: pip install 'expertcache[cluster]' (or pip install ray)"
        ) from None
    return ray


# -- the sweep -----------------------------------------------------------------------------------------
def sweep(
    grid: Grid | str | Path | None = None,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    force: bool = False,
    jobs: int = 1,
    ray: str | bool | None = None,
    plot: str | Path | None = None,
    progress: bool = False,
    quiet: bool = False,
    log: Log | None = _stderr,
    **dimensions: object,
) -> list[dict[str, object]]:
    """Run a grid (a ``Grid``, a YAML/TOML file, or the defaults; keyword dimensions such as
    ``policies=[...]`` replace the grid's) and return its rows in the grid's order. ``out``: a ``.csv``,
    ``.json`` or ``.parquet`` results file, written as cells finish; with ``resume`` the cells it holds are
    not run again, with ``force`` it is replaced (without either an existing file is refused). ``jobs``: local
    processes (default 1 here, in this process; the command line's ``--jobs`` defaults to all CPUs this
    process may use: pass ``jobs=expertcache.workers.usable_cpus()`` for that); ``ray``: run on Ray instead
    (True or "": a local Ray, or an address). ``plot``: a folder for miss-ratio curves and heat maps of the
    ratio to OPT. Notes (not with ``quiet``) and a one-line summary go to ``log``. A keyword that is none of
    these is refused, naming the ones there are."""
    t0 = time.perf_counter()
    unknown = [k for k in dimensions if k not in DIMENSIONS]
    if unknown:
        raise ExpertcacheError(
            f"sweep() has no keyword {unknown[0]!r}; it takes grid, {', '.join(_OPTIONS)} and the "
            f"dimensions {', '.join(DIMENSIONS)}"
        )
    if grid is not None and not isinstance(grid, Grid | str | os.PathLike):
        raise ExpertcacheError(f"sweep's grid is a Grid, a YAML or TOML file, or None, got {grid!r}")
    if not isinstance(grid, Grid):
        grid = Grid.load(grid) if grid is not None else Grid()
    grid = grid.with_overrides(**dimensions)
    if grid.timing is not None:
        with _named_by(grid):
            grid.timing.check_used()
    for name, value in (("resume", resume), ("force", force), ("progress", progress), ("quiet", quiet)):
        true_or_false(value, name)
    jobs = whole_number(jobs, "jobs")
    if resume and out is None:
        raise ExpertcacheError("resuming reads the results file: give it (--out FILE; out=FILE)")
    if force and out is None:  # nothing to replace: the rows go to the caller (standard output)
        raise ExpertcacheError(
            "--force (force=True) replaces the results file: give it (--out FILE; out=FILE)"
        )
    if resume and force:
        raise ExpertcacheError(
            "--resume (resume=True) goes on from the results, --force (force=True) replaces them: choose one"
        )
    if plot is not None:
        from expertcache.tools.sweep_plots import check_plot_dir

        check_plot_dir(plot)
    timing = grid.timing is not None
    results = Results(out, timing) if out is not None else None
    if ray is not None and not isinstance(ray, bool | str):  # ray=0 was taken as the address "0"
        raise ExpertcacheError(f"ray is True, False, None or a cluster's address, got {ray!r}")
    on_ray = ray is not None and ray is not False
    if on_ray:
        _import_ray()  # missing Ray is found before any work
        if jobs != 1:  # taken and ignored before
            raise ExpertcacheError(
                "jobs sets local processes; with ray the cluster's CPUs run the cells (leave out jobs)"
            )
    notes = None if quiet else log
    traces = _load_traces(grid, notes)
    with _named_by(grid):
        predictor = _load_predictor(grid)
    with _named_by(grid):
        p = plan_cells(grid, traces, predictor)
    if not p.tasks:  # the notes say why, even with quiet; without a log the first is the message
        if log and p.notes:
            for note in p.notes:
                log(note)
            raise ExpertcacheError("no cell of the grid can run (see the notes above)")
        why = p.notes[0].removeprefix("note: ") if p.notes else "the grid is empty"
        raise ExpertcacheError(f"no cell of the grid can run ({why})")
    for note in p.notes if notes else ():
        notes(note)
    rows = {}
    if results is not None:
        for row in results.start(resume, force):
            rows[identity(row, timing)] = row
    before = [key for key in rows if key in p.order]  # cells of this grid the file already holds
    stale = len(rows) - len(before)  # rows of other cells (another trace content, a smaller grid)
    if stale and notes:
        notes(f"note: {stale} rows in {_files(results, (k for k in rows if k not in p.order))} are not "
              "cells of this grid (another trace content, a plugin's changed code, or removed from the "
              "grid): kept")  # fmt: skip

    def in_order() -> list[dict[str, object]]:  # the grid's cells in its order, then any others
        return sorted(rows.values(), key=lambda r: p.order.get(identity(r, timing), len(p.order)))

    try:
        computed, skipped, ran = _run(grid, p, traces, predictor, rows, results, jobs, ray, progress, notes)
    except Exception:  # a task failed: the rows so far stay, in the grid's order, for --resume
        if results is not None and rows:
            try:
                results.finish(in_order())
            except ExpertcacheError:
                pass  # they stay in the journal, as they were
            if log:
                log(f"note: {len(rows)} rows are in {results.path}; run again with --resume "
                    "(resume=True) to go on")  # fmt: skip
        raise
    finally:
        if results is not None:
            results.close()
    table = in_order()
    if not table:  # every cell a miss path could not divide
        raise ExpertcacheError("no cell of the grid could run (see the notes above)")
    if results is not None:
        results.finish(table)
    written = []
    if plot is not None:
        from expertcache.tools.sweep_plots import plot_sweep

        written = plot_sweep(table, plot)
    if log:
        where = ran if on_ray else f"{jobs} job(s)"
        kept = f", {len(before)} already in {_files(results, before)}" if resume else ""
        kept += f", {stale} kept that are not cells of this grid" if stale else ""
        wrote = [str(out)] if out else []
        wrote += [f"{len(written)} plots in {plot}"] if plot is not None else []
        log(
            f"sweep: {len(table)} rows ({computed} computed{kept}), {p.skipped + skipped} cells left out, "
            f"{time.perf_counter() - t0:.1f} s on {where}" + (f"; wrote {', '.join(wrote)}" if wrote else "")
        )
    return table


_OPTIONS = ("out", "resume", "force", "jobs", "ray", "plot", "progress", "quiet", "log")


def _files(results: Results | None, keys) -> str:
    """The results files that rows (by identity) were read from, for messages."""
    if results is None:
        return "the results"
    paths = list(dict.fromkeys(results.read_from.get(k, results.path) for k in keys)) or [results.path]
    return " and ".join(map(str, paths))


def _load_predictor(grid: Grid) -> _Loaded | None:
    """The timing grid's predictor trace (for ``token`` and ``eam``), if it names one."""
    if grid.timing is None or grid.timing.predictor is None:
        return None
    trace = load_trace(grid.timing.predictor)
    return _Loaded(grid.timing.predictor, file_sha(grid.timing.predictor), trace)


def _run(
    grid, p: Cells, traces, predictor, rows, results, jobs, ray, progress, log
) -> tuple[int, int, str | None]:
    """Run the plan's cells that ``rows`` lacks; each finished task's rows go to ``rows`` and the file."""
    timing = grid.timing is not None
    todo = []
    for task in p.tasks:
        caps = tuple(c for c in task.capacities if cell_identity(task, c, timing) not in rows)
        if caps:
            todo.append(replace(task, capacities=caps))
    cells = sum(len(t.capacities) for t in todo)
    shipped = {t.sha: t.trace for t in traces}
    if predictor is not None:
        shipped[predictor.sha] = predictor.trace
    count = {"rows": 0, "skipped": 0}
    bar = _progress_bar(cells, progress)

    names = [name for name, _ in columns(timing)]
    said: set[str] = set()

    def done(task: Task, new_rows: list[dict], notes: list[str]) -> None:
        new_rows = [{name: row.get(name) for name in names} for row in new_rows]  # the table's columns
        for row in new_rows:
            rows[identity(row, timing)] = row
        if results is not None and new_rows:
            results.append(new_rows)
        for note in notes:  # once each: a capacity a miss path cannot divide fails every link alike
            if log and note not in said:
                said.add(note)
                (bar.write if bar is not None else log)(note)
        count["rows"] += len(new_rows)
        count["skipped"] += len(task.capacities) - len(new_rows)
        if bar is not None:
            bar.update(len(task.capacities))

    ran = None
    try:
        if ray is not None and ray is not False:
            ran = run_ray(todo, shipped, None if ray is True else str(ray), done)
        else:
            run_local(todo, shipped, jobs, done)
    except KeyboardInterrupt:
        if results is not None and log:
            log(
                f"note: {count['rows']} new rows are in {results.journal}; run again with --resume "
                "(resume=True) to go on"
            )
        raise
    finally:
        if bar is not None:
            bar.close()
    return count["rows"], count["skipped"], ran


def _progress_bar(total: int, show: bool):
    if not show or total == 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="cell", file=sys.stderr, dynamic_ncols=True, desc="sweep")
