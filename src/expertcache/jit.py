"""numba, as the package's compiled loops take it: ``from expertcache.jit import numba``.

Why: LLVM tunes code for recent Intel cores (Skylake-SP to Sapphire Rapids) to prefer 256-bit vectors
(``prefer-256-bit``) even where the core has AVX-512, because early AVX-512 parts lowered their clock
under 512-bit code. The packed experts' matrix-vector loops (``engine._packed_jit``) are then
compute-bound below the memory's speed: on the 2-core development VM (a Sapphire Rapids core) a decode
step's 8 int8 experts at Granite's shapes took 1287 us with 256-bit vectors and 1136 us with 512-bit ones
(1036 us with the slot pool on huge pages too, as the engine allocates it; ``bench/packed_width_cpu.py``,
docs/BENCHMARKS.md). On a core with AVX-512 the package asks LLVM for full-width vectors by compiling
for the host's features plus ``-prefer-256-bit``.

How: numba takes its target features from ``numba.config.CPU_FEATURES`` (``NUMBA_CPU_FEATURES``) when it makes
its code generator, at its first compile or cached load; this module sets that value in this process only (the
environment, and so child processes, are left alone) to numba's own host features (``NUMBA_ENABLE_AVX=0``
still takes the AVX features away) plus ``-prefer-256-bit``, unless the user chose a target
(``NUMBA_CPU_FEATURES``, ``NUMBA_CPU_NAME``) or turned AVX off. No other numba setting is touched, but for the
size of numba's thread pool where only ``OMP_NUM_THREADS`` is set (``_pool_follows_openmp``). Where numba had
already compiled something in this process before expertcache was imported, its first features stay
(``wide_vectors`` says which). The features are part of numba's on-disk cache key, so a cached kernel is never
reused across them. Sums run in another order at another width, so the packed kernels' float32 results differ
in their last bits from a build with 256-bit vectors; within a process every path runs the same code.
"""

from __future__ import annotations

import os
import sys


def _pool_follows_openmp() -> None:
    """``NUMBA_NUM_THREADS`` set to ``OMP_NUM_THREADS`` where the user set only the latter and numba has
    not started: numba's OpenMP layer starts its pool by setting the OpenMP thread count of the runtime
    it shares with torch, so a pool of every CPU made a torch imported afterwards report and use that
    many threads under ``OMP_NUM_THREADS=1`` (the simulator's loops loaded before a model, in one
    process). The one variable this module writes to the environment, so that the command's worker
    processes start alike (under a CPU quota the command line sets both, ``workers.thread_environment``)."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if (
        "numba" not in sys.modules
        and omp.isdigit()
        and int(omp) > 0
        and not os.environ.get("NUMBA_NUM_THREADS")
    ):
        os.environ["NUMBA_NUM_THREADS"] = omp


_pool_follows_openmp()

import numba  # noqa: E402  (after its pool's size is settled)
import numpy.ma  # noqa: E402, F401  (see below)

# numba's argument typing reads ``np.ma``, which numpy 2 imports on first access (a module
# ``__getattr__``); the simulator's first compiled calls run on two threads at once (OPT's bound beside the
# policy), and in a fresh clone's test run that first access once recursed until RecursionError. Imported
# here, before any thread, ``np.ma`` is a plain attribute.

WIDE = "-prefer-256-bit"


def _configure() -> None:
    config = numba.core.config
    if config.CPU_FEATURES is not None or config.CPU_NAME is not None or not config.ENABLE_AVX:
        return  # the user's target (NUMBA_CPU_FEATURES / NUMBA_CPU_NAME), or AVX turned off
    from numba.core.codegen import get_host_cpu_features  # numba's: '' where LLVM cannot tell

    features = get_host_cpu_features()
    if "+avx512f" in features.split(","):
        config.CPU_FEATURES = f"{features},{WIDE}"


_configure()


def _launch_threads() -> None:
    """Start numba's thread pool now, keeping torch's thread count. numba's OpenMP layer starts its
    threads by setting the calling thread's OpenMP thread count, and where torch was loaded first its
    OpenMP runtime is the one the dynamic linker gives numba: torch then reports and uses that count as
    its own (on the development VM a process that had called ``torch.set_num_threads(1)`` ran torch on
    both cores after its first packed-experts call). torch is not imported here: where it already is, its
    count is put back; where it is imported later, it keeps an OpenMP runtime of its own."""
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    try:
        from numba.np.ufunc.parallel import _launch_threads as launch

        launch()
    except Exception:  # no threading layer here: the first parallel loop reports it, as numba does
        return
    if before is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)


_launch_threads()


def wide_vectors() -> bool:
    """Whether this process's compiled loops use the core's full vector width (AVX-512 asked for): the
    features numba's code generator was made with (made here if it was not yet)."""
    from numba.core.registry import cpu_target

    features = getattr(cpu_target.target_context.codegen(), "_tm_features", "") or ""
    return WIDE in features.split(",")
