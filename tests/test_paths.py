"""``paths.output_file``: an output file is replaced whole or not at all, and a file that is not a plain
file (a device, a link) is written where it is."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from expertcache.errors import ExpertcacheError
from expertcache.paths import output_file, write_output


def test_a_written_file_replaces_the_old_one_whole(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("old")
    write_output(path, "new\n", "plan")
    assert path.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_a_write_that_fails_leaves_the_old_file_and_nothing_else(tmp_path):
    """A full disk half-way: the error names the file, the old one stays, no partial file is left."""
    path = tmp_path / "plan.json"
    path.write_text("old")
    full = r"plan.json: cannot write plan \(No space left on device\)"
    with pytest.raises(ExpertcacheError, match=full), output_file(path, "plan") as target:
        assert target != path and target.suffix == ".json"  # writers that go by the suffix keep it
        target.write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    with pytest.raises(KeyboardInterrupt), output_file(tmp_path / "new.json", "plan") as target:
        target.write_text("half")
        raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


@pytest.mark.skipif(not Path(os.devnull).exists(), reason="no null device here")
def test_a_device_is_written_in_place_never_replaced():
    """``-o /dev/null`` writes to the device; a file put in its place would break the machine."""
    before = os.stat(os.devnull)
    write_output(os.devnull, "nothing", "plan")
    after = os.stat(os.devnull)
    assert (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def test_a_link_is_written_through(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_output(link, "new", "plan")
    assert link.is_symlink() and real.read_text() == "new"
