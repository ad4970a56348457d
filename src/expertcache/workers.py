"""Worker processes that do not outlive their parent: ``exit_with_parent``, for a process pool's
initializer (the sweep's), ``map_in_processes``, a map over worker processes that Ctrl-C stops
cleanly (sim's replays, the planner's and the doctor's timing runs), and ``usable_cpus``, the CPUs
this process may run on (the default of every ``--jobs``, and the engine's reader threads). Standard
library only, and importing nothing of expertcache, so that any module can use it without an import
cycle."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the system has one (``taskset``, a
    container's ``cpuset``), else every CPU of the machine; at least 1. ``os.cpu_count()`` counts the
    machine's, which a process pinned to 2 of 64 CPUs must not start 64 workers for."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


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
