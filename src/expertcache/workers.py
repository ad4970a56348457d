"""Worker processes that do not outlive their parent: ``exit_with_parent``, for a process pool's
initializer (the sweep's), ``map_in_processes``, a map over worker processes that Ctrl-C stops
cleanly (sim's replays, the planner's and the doctor's timing runs), and ``usable_cpus``, the CPUs
this process may use, its affinity mask within its cgroups' CPU quota (the default of every ``--jobs``,
and the engine's reader threads). Standard library only, and importing nothing of expertcache, so that
any module can use it without an import cycle."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity mask where the system has one (``taskset``, a
    container's ``cpuset``), else every CPU of the machine, and no more than its cgroups' CPU quota
    allows (``docker --cpus``, a Kubernetes CPU limit; rounded up, ``cpu_quota``); at least 1.
    ``os.cpu_count()`` counts the machine's, which a process pinned to 2 of 64 CPUs, or given 2 CPUs'
    time on 64, must not start 64 workers for."""
    cpus = _mask_cpus()
    quota = cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def _mask_cpus() -> int:
    """The CPUs of the affinity mask, or the machine's where the system has no masks."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def quota_threads(environ: Mapping[str, str] = os.environ) -> int | None:
    """The compute threads a CPU quota calls for where the user has chosen none: ``usable_cpus()`` where
    the cgroups' quota makes it fewer than the CPUs of the affinity mask and neither ``OMP_NUM_THREADS``
    nor ``NUMBA_NUM_THREADS`` is set; else None. torch's thread pool (OpenMP) and numba's start a thread
    per CPU of the affinity mask and do not read quotas: under a quota of one CPU on the 2-core
    development VM, two threads were throttled for most of each period (docs/ENGINE.md). ``load()``
    lowers torch's threads to it; the command line sets both variables (``thread_environment``)."""
    if environ.get("OMP_NUM_THREADS") or environ.get("NUMBA_NUM_THREADS"):
        return None
    cpus = usable_cpus()
    return cpus if cpus < _mask_cpus() else None


def thread_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables the command line sets before torch and numba start: under a CPU quota (and no
    thread count chosen) ``OMP_NUM_THREADS`` and ``NUMBA_NUM_THREADS`` to ``quota_threads()``; else none
    (where the user set ``OMP_NUM_THREADS`` alone, ``expertcache.jit`` gives numba's pool its size). Both
    are read once, when each library starts, and inherited by the command's worker processes."""
    threads = quota_threads(environ)
    if threads is None:
        return {}
    return {"OMP_NUM_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads)}


def cpu_quota(proc: str = "/proc/self") -> float | None:
    """The CPUs' worth of time this process's cgroups allow it (quota / period, the smallest along its
    cgroup's path up to the hierarchy's root, cgroup v2's ``cpu.max`` and v1's ``cpu.cfs_quota_us``
    alike), or None where no quota is set or none can be read (no cgroups: not Linux). ``proc`` is the
    process's ``/proc`` entry, for tests; the cgroup files are found through its ``mountinfo``."""
    try:
        with open(os.path.join(proc, "cgroup")) as f:
            memberships = [line.rstrip("\n").split(":", 2) for line in f]
        with open(os.path.join(proc, "mountinfo")) as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    limits = []
    for fields in mounts:
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if len(fields) < dash + 3 or dash < 5:
            continue
        root, point, fstype, options = fields[3], fields[4], fields[dash + 1], fields[dash + 3].split(",")
        if fstype == "cgroup2":
            paths = [m[2] for m in memberships if len(m) == 3 and m[0] == "0" and m[1] == ""]
            files = ("cpu.max",)
        elif fstype == "cgroup" and "cpu" in options:
            paths = [m[2] for m in memberships if len(m) == 3 and "cpu" in m[1].split(",")]
            files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        for path in paths:
            if root != "/" and not (path == root or path.startswith(root.rstrip("/") + "/")):
                continue  # the process's cgroup is outside what this mount shows
            relative = path[len(root) :] if root != "/" else path
            limit = _quota_along(point, relative.strip("/"), files)
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def _quota_along(point: str, relative: str, files: tuple[str, ...]) -> float | None:
    """The smallest quota / period from the cgroup ``point``/``relative`` up to ``point``."""
    parts = relative.split("/") if relative else []
    smallest = None
    for depth in range(len(parts), -1, -1):
        directory = os.path.join(point, *parts[:depth])
        try:
            texts = []
            for name in files:
                with open(os.path.join(directory, name)) as f:
                    texts.append(f.read().split())
        except OSError:
            continue
        try:
            if len(files) == 1:  # v2: "max 100000" or "200000 100000"
                quota, period = texts[0][0], texts[0][1]
            else:  # v1: "-1" or "200000", and "100000"
                quota, period = texts[0][0], texts[1][0]
            if quota in ("max", "-1") or float(period) <= 0:
                continue
            limit = float(quota) / float(period)
        except (IndexError, ValueError):
            continue
        if limit > 0:
            smallest = limit if smallest is None else min(smallest, limit)
    return smallest


def exit_with_parent(parent: int | None = None, poll_s: float = 1.0) -> None:
    """Make this (worker) process exit once its parent is gone: a daemon thread checks every ``poll_s``
    seconds whether ``os.getppid()`` still is ``parent`` (default: the parent now) and calls ``os._exit``
    when it is not. A pool's initializer calls it, so that a parent killed with SIGKILL, which cannot
    stop its workers, does not leave them waiting for tasks forever (reparented to PID 1). Pass the
    parent's pid as the parent saw it (``os.getpid()`` there, in the initializer's arguments): a parent
    that died before this ran is then noticed too."""
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _start_worker(parent: int) -> None:
    """A pool worker's start: Ctrl-C is the parent's to handle (it stops the workers), and the worker
    exits once the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(parent)


def map_in_processes(fn: Callable[[T], R], items: Sequence[T], jobs: int) -> list[R]:
    """``[fn(x) for x in items]`` on ``jobs`` worker processes (forked where the system forks, so that a
    worker starts with the parent's modules), in order; ``fn`` must be a module-level function and the
    items must pickle. The workers ignore Ctrl-C and exit with their parent. An interrupt or an error in
    the parent, or an error in ``fn`` (a worker killed: ``BrokenProcessPool``), stops every worker at
    once and is raised; while they are being stopped a second Ctrl-C is held off, so that it cannot
    leave them waiting on their queue for ever (a pool whose shutdown was itself interrupted did)."""
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    pool = ProcessPoolExecutor(
        max(1, min(jobs, len(items))), mp_context=ctx, initializer=_start_worker, initargs=(os.getpid(),)
    )
    try:
        results = list(pool.map(fn, items))
    except BaseException:
        _stop(pool)
        raise
    pool.shutdown()
    return results


def _stop(pool: ProcessPoolExecutor) -> None:
    """Stop ``pool``'s workers now (their tasks are lost), with Ctrl-C ignored meanwhile where this is
    the main thread."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        workers = list((getattr(pool, "_processes", None) or {}).values())  # the executor's own record
        pool.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.join()
    finally:
        if main:
            signal.signal(signal.SIGINT, old)
