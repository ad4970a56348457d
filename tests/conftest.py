"""Session-wide test settings: the user's cache directory is a temporary one."""

from __future__ import annotations

import os

import pytest


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
