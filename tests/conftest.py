"""Session-wide test settings: one torch thread a process, the user's cache directory a temporary one."""

from __future__ import annotations

import os

import pytest

# Every test process, and every command a test starts, runs torch's intra-op work on one thread. The
# suite runs a worker a core (pytest-xdist); with torch's default of a thread a core each, two workers'
# OpenMP threads fight over two cores and a tiny model's step ran 5-10x slower (a kernels test 13.9 s in
# the suite against 1.2 s alone). Set before anything imports torch; a test about threads sets its own.
os.environ["OMP_NUM_THREADS"] = "1"


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
