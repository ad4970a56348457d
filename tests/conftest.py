"""Session-wide test settings: one torch thread a process, each pytest-xdist worker on its own CPUs, the
user's cache directory a temporary one, no deadline on hypothesis' examples."""

from __future__ import annotations

import os

import hypothesis
import pytest

# Every test process, and every command a test starts, runs torch's intra-op work on one thread. The
# suite runs a worker a core (pytest-xdist); with torch's default of a thread a core each, two workers'
# OpenMP threads fight over two cores and a tiny model's step ran 5-10x slower (a kernels test 13.9 s in
# the suite against 1.2 s alone). Set before anything imports torch; a test about threads sets its own.
os.environ["OMP_NUM_THREADS"] = "1"

# No time limit on a hypothesis example (its default, 250 ms, fails a test whose example was slow because
# the machine was busy, then calls it flaky when the replay is fast): tests assert behaviour, not time.
hypothesis.settings.register_profile("expertcache", deadline=None)
hypothesis.settings.load_profile("expertcache")


def _own_cpus() -> None:
    """Give each pytest-xdist worker its share of the CPUs (worker i of n: every n-th from the i-th), so
    that what a test starts stays on its worker's share: the commands' ``--jobs`` default
    (``workers.usable_cpus``) and a test's subprocesses. Without it each worker's ``plan`` or ``doctor``
    forked a worker a CPU of the machine, and two pytest workers ran four processes on two cores."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker.startswith("gw") or not count or not hasattr(os, "sched_setaffinity"):
        return
    cpus, count = sorted(os.sched_getaffinity(0)), int(count)
    if count > 1 and len(cpus) >= count:
        os.sched_setaffinity(0, cpus[int(worker[2:]) % count :: count])


_own_cpus()


@pytest.hookimpl(optionalhook=True)  # a run without xdist (``-p no:xdist``) knows no such hook
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: a worker for each CPU this process may use (``taskset``, a container's cpuset), at most
    ``--maxprocesses``. pytest-xdist's own count is the machine's cores where psutil is installed (it is,
    through accelerate), which put two workers on one CPU under ``taskset -c 1``."""
    from expertcache.workers import usable_cpus

    return usable_cpus()


@pytest.fixture(autouse=True, scope="session")
def _user_cache_in_a_temporary_directory(tmp_path_factory: pytest.TempPathFactory):
    """Quantised copies of the embedded model go to the user's cache: keep the tests out of the real one."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old
