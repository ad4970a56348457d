"""The package's compiled loops get the core's full vector width (``expertcache.jit``), unless the user
chose numba's target or turned AVX off; it holds whether or not numba was imported first, touches no other
numba setting, and leaves the environment (child processes) alone."""

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
