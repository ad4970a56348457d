"""The package's compiled loops get the core's full vector width (``expertcache.jit``), unless the user
chose numba's target or turned AVX off; it holds whether or not numba was imported first, touches no other
numba setting, and leaves the environment (child processes) alone; but numba's pool takes the size of
``OMP_NUM_THREADS`` where the user set only that."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

llvm = pytest.importorskip("llvmlite.binding")
AVX512 = "+avx512f" in llvm.get_host_cpu_features().flatten().split(",")

ASK = "from expertcache.jit import wide_vectors; print(wide_vectors())"


def _ask(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(not AVX512, reason="full-width vectors are asked for on AVX-512 cores")
def test_avx512_cores_get_full_width_vectors_whatever_was_imported_first():
    assert _ask(ASK) == "True"
    assert _ask("import numba; " + ASK) == "True"  # numba imported before the package


def test_the_users_own_target_wins():
    assert _ask(ASK, NUMBA_CPU_NAME="generic") == "False"
    features = llvm.get_host_cpu_features().flatten()
    assert _ask(ASK, NUMBA_CPU_FEATURES=features) == "False"
    assert _ask("import os; from expertcache import jit; print(os.environ['NUMBA_CPU_FEATURES'])",
                NUMBA_CPU_FEATURES=features) == features  # fmt: skip


def test_avx_turned_off_other_settings_and_the_environment_are_left_alone():
    assert _ask(ASK, NUMBA_ENABLE_AVX="0") == "False"
    code = (
        "import os, numba; numba.config.THREADING_LAYER = 'workqueue'; from expertcache import jit; "
        "print(numba.config.THREADING_LAYER, 'NUMBA_CPU_FEATURES' in os.environ)"
    )
    assert _ask(code) == "workqueue False"


@pytest.mark.skipif(AVX512, reason="a core without AVX-512")
def test_other_cores_keep_numbas_defaults():
    assert _ask(ASK) == "False"


def test_the_users_torch_thread_count_survives_the_first_parallel_loop():
    """numba's OpenMP threads, started at the first parallel loop, once set torch's thread count to
    numba's (torch's OpenMP runtime is the one numba gets where torch was loaded first): a process that
    had asked torch for one thread ran it on every core after its first packed-experts call. The count
    stays, and numba's loops keep their own threads."""
    code = (
        "import torch; torch.set_num_threads(1); torch.get_num_threads(); import numpy as np; "
        "from expertcache.engine import _packed_jit; "
        "pool = np.zeros((2, 4096), np.uint8); x = np.ones((1, 32), np.float32); "
        "out = np.zeros((1, 32), np.float32); "
        "_packed_jit.rows_int8(pool, 0, 2048, 32, 32, np.zeros(1, np.int64), x, out, False); "
        "import numba; print(torch.get_num_threads(), numba.get_num_threads())"
    )
    torch_threads, numba_threads = _ask(code, NUMBA_NUM_THREADS="2").split()
    assert torch_threads == "1" and numba_threads == "2"


def test_numbas_pool_follows_omp_num_threads_whatever_is_imported_first():
    """Under ``OMP_NUM_THREADS=1`` alone, the simulator's loops loaded before torch (one process) made
    numba start a pool of every CPU through the OpenMP runtime it shares with torch, and torch then ran
    on that many threads. numba's pool now takes ``OMP_NUM_THREADS`` where ``NUMBA_NUM_THREADS`` is not
    set, and the user's own ``NUMBA_NUM_THREADS`` stands."""
    code = (
        "from expertcache import jit; import torch, numba; "
        "print(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)"
    )
    clean = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]
    assert _ask(code, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="2").split()[1] == "2"
