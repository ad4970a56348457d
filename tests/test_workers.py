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

from expertcache import workers
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


def _fake_proc(tmp_path, cgroup: str, mountinfo: str, files: dict[str, str]):
    """A ``/proc/self`` of ``cgroup`` and ``mountinfo`` lines, with cgroup files under ``tmp_path/fs``."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo.replace("FS", str(tmp_path / "fs")))
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(proc)


def test_cpu_quota_reads_cgroup_v2_and_takes_the_smallest_along_the_path(tmp_path):
    """``docker --cpus 1.5`` writes ``150000 100000`` to the container's ``cpu.max``; a parent's quota
    below the child's bounds it too, and ``max`` is no quota."""
    mounts = "30 23 0:26 / FS rw,nosuid - cgroup2 cgroup2 rw\n"
    proc = _fake_proc(
        tmp_path, "0::/pod/box\n", mounts,
        {"cpu.max": "max 100000\n", "pod/cpu.max": "250000 100000\n", "pod/box/cpu.max": "150000 100000\n"},
    )  # fmt: skip
    assert workers.cpu_quota(proc) == 1.5
    (tmp_path / "fs" / "pod" / "cpu.max").write_text("50000 100000\n")
    assert workers.cpu_quota(proc) == 0.5
    for name in ("pod/cpu.max", "pod/box/cpu.max"):
        (tmp_path / "fs" / name).write_text("max 100000\n")
    assert workers.cpu_quota(proc) is None


def test_cpu_quota_reads_cgroup_v1_below_a_mount_of_part_of_the_hierarchy(tmp_path):
    """cgroup v1 (a hybrid system's ``cpu,cpuacct`` controller), mounted from the container's own
    cgroup (its root field ``/docker/abc``) as older Docker does: the quota is read where the mount
    shows the process's cgroup, and ``-1`` is no quota."""
    mounts = (
        "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
        "32 31 0:29 /docker/abc FS rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
        "33 31 0:30 / /elsewhere rw - cgroup cgroup rw,memory\n"
    )
    proc = _fake_proc(
        tmp_path, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n", mounts,
        {"cpu.cfs_quota_us": "200000\n", "cpu.cfs_period_us": "100000\n"},
    )  # fmt: skip
    assert workers.cpu_quota(proc) == 2.0
    (tmp_path / "fs" / "cpu.cfs_quota_us").write_text("-1\n")
    assert workers.cpu_quota(proc) is None


def test_cpu_quota_is_none_without_cgroups_or_with_files_it_cannot_read(tmp_path):
    assert workers.cpu_quota(str(tmp_path / "no-such-proc")) is None
    mounts = "30 23 0:26 / FS rw - cgroup2 cgroup2 rw\n"
    proc = _fake_proc(tmp_path, "0::/box\n", mounts, {"box/cpu.max": "lots\n"})
    assert workers.cpu_quota(proc) is None


def test_usable_cpus_is_the_affinity_within_the_quota_rounded_up(monkeypatch):
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    for quota, expected in ((None, 4), (1.5, 2), (0.2, 1), (2.0, 2), (16.0, 4)):
        monkeypatch.setattr(workers, "cpu_quota", lambda quota=quota: quota)
        assert workers.usable_cpus() == expected


def test_quota_threads_only_where_a_quota_lowers_the_cpus_and_the_user_chose_none(monkeypatch):
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(workers, "cpu_quota", lambda: 1.5)
    assert workers.quota_threads({}) == 2
    both = {"OMP_NUM_THREADS": "2", "NUMBA_NUM_THREADS": "2"}
    assert workers.thread_environment({}) == both
    for chosen in ({"OMP_NUM_THREADS": "3"}, {"NUMBA_NUM_THREADS": "3"}):  # the user's choice stands
        assert workers.quota_threads(chosen) is None
    assert workers.thread_environment({"NUMBA_NUM_THREADS": "3"}) == {}
    assert workers.quota_threads({"OMP_NUM_THREADS": ""}) == 2
    for quota in (None, 4.0, 9.0):  # no quota, or one the mask is within
        monkeypatch.setattr(workers, "cpu_quota", lambda quota=quota: quota)
        assert workers.quota_threads({}) is None
        assert workers.thread_environment({}) == {}
        assert workers.thread_environment({"OMP_NUM_THREADS": "1"}) == {}  # jit's to follow


def test_the_command_line_and_load_give_torch_the_quota_s_threads(monkeypatch, tmp_path):
    """Under a quota the command line starts torch and numba on the quota's threads (``OMP_NUM_THREADS``,
    ``NUMBA_NUM_THREADS``, which its worker processes inherit too), and ``load()`` lowers the threads of a
    torch already running."""
    code = (
        "import os, sys\n"
        "from expertcache import workers\n"
        "workers.quota_threads = lambda environ=os.environ: 1\n"
        "from expertcache.cli import main\n"
        "code = main(['sim', '--policy', 'lru', '--capacity', '8', '--order', 'layer'])\n"
        "import torch\n"
        "from numba import config\n"
        "print(os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads(), config.NUMBA_NUM_THREADS, code)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-4:] == ["1", "1", "1", "0"]
    torch = pytest.importorskip("torch")
    from expertcache.engine import offloaded
    from expertcache.errors import ExpertcacheError

    before = torch.get_num_threads()
    monkeypatch.setattr(offloaded, "quota_threads", lambda: 1)
    try:
        torch.set_num_threads(2)
        with pytest.raises(ExpertcacheError):  # refused after the threads are set: no model is built
            offloaded.load(str(tmp_path / "no-such-model"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
