"""``expertcache.workers``: ``map_in_processes`` gives results in order, raises a killed worker (not
waited for forever), and Ctrl-C, even twice, stops every worker and the parent; ``usable_cpus`` counts
the CPUs the process may use, and ``--jobs`` defaults to it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures.process import BrokenProcessPool

import pytest

from expertcache.workers import map_in_processes


def test_results_come_in_the_items_order():
    assert map_in_processes(abs, [-3, 2, -1, 0, -7], 2) == [3, 2, 1, 0, 7]
    assert map_in_processes(abs, [-4], 8) == [4]  # never more workers than items


def test_a_worker_that_dies_is_raised_not_waited_for():
    with pytest.raises(BrokenProcessPool):
        map_in_processes(os._exit, [3, 3], 2)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and pgrep: Linux")
def test_ctrl_c_twice_stops_the_workers_and_the_command():
    """Ctrl-C reaches every process of the terminal's group: the workers ignore it, the parent stops
    them, and a second Ctrl-C while it does cannot leave them waiting on their queue (it did with a
    pool's own shutdown, which the second interrupt cut short)."""
    # the planner's candidates on two workers: each a timing run of about a second, the parent waiting.
    # Ctrl-C handled as in a terminal even where this test's own process ignores it (a CI job started in
    # the background of a shell does, and a child inherits that)
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv[0] = 'expertcache'; runpy.run_module('expertcache', run_name='__main__')"
    )
    argv = [sys.executable, "-c", start, "plan", "--capacity", "24", "--host-capacity", "60", "--jobs", "2"]
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while len(_children(proc.pid)) < 2 and time.monotonic() < deadline:  # both workers started
            time.sleep(0.05)
        workers = _children(proc.pid)
        assert len(workers) >= 2
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.05)
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0 and err.decode().strip().splitlines()[-1:] == ["expertcache: interrupted"]
    time.sleep(0.5)
    assert not [w for w in workers if os.path.exists(f"/proc/{w}") and _state(w) != "Z"]


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity masks on this system")
def test_the_jobs_default_is_the_cpus_the_process_may_use():
    """Pinned to one CPU (``taskset``, a container's cpuset), a process counts one CPU, and ``--jobs``
    of every command that has it defaults to that, not to the machine's count."""
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from expertcache.cli import _build_parser\n"
        "from expertcache.workers import usable_cpus\n"
        "p = _build_parser()\n"
        "print(usable_cpus(), *(p.parse_args([c]).jobs for c in ('sim', 'plan', 'doctor')))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1", "1", "1", "1"]
    # sweep's --jobs is None until it runs (it is refused beside --ray): its summary names the jobs used
    code = (
        "import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from expertcache.cli import main\n"
        "sys.exit(main(['sweep', '--policy', 'lru', '--capacity', '8', '--order', 'layer']))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "on 1 job(s)" in run.stderr, run.stderr
