"""Output folders checked before the work that fills them. Torch-free."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from expertcache.errors import ExpertcacheError


def writable_dir(folder: str | Path, what: str, parents: bool = False) -> Path:
    """``folder``, created if need be, after proving a file can be written there: a bad output folder is
    found out before a long job, not after it (``what`` names the output in the message). The folder is
    made, not a chain of missing ones (a mistyped path is refused, as a file's missing folder is), but
    with ``parents``: a place of the program's own (the user's cache)."""
    if not str(folder).strip():
        raise ExpertcacheError(f"an empty path for {what}: give a folder")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ExpertcacheError(f"{folder}: exists and is not a directory")
    above = folder.absolute().parent
    if not parents and not folder.exists() and not above.is_dir():
        raise ExpertcacheError(f"{folder}: cannot write {what} there: directory {above} does not exist")
    try:
        folder.mkdir(parents=parents, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ExpertcacheError(f"{folder}: cannot write {what} there ({exc.strerror or exc})") from None
    return folder


def save_tensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, the file then given the permissions the process's umask allows
    (``0666 & ~umask``), as ``open`` would: safetensors writes its files readable by their owner alone
    (0600), so a checkpoint or copy written for a server running as another user could not be read."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    as_umask_allows(path)


def as_umask_allows(path: str | Path) -> None:
    """Give a file the permissions ``open`` would have: ``0666 & ~umask`` (safetensors, and so
    transformers' ``save_pretrained``, write theirs for the owner alone)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


@contextmanager
def output_dir(folder: str | Path, what: str) -> Iterator[Path]:
    """``writable_dir`` for a job that fills ``folder``, which must be new or empty: if the job fails or
    is interrupted (Ctrl-C), what it wrote goes (a folder it created is removed, an empty one it was given
    is emptied), so that a half-written output is never left to be taken for a whole one."""
    folder = Path(folder)
    existed = folder.exists()
    target = writable_dir(folder, what)
    try:
        yield target
    except BaseException:
        if not existed:
            shutil.rmtree(target, ignore_errors=True)
        else:
            for child in target.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
        raise


@contextmanager
def output_file(path: str | Path, what: str) -> Iterator[Path]:
    """A file to write ``what`` into, put in place of ``path`` once written whole: the caller writes the
    path this yields (a new file beside ``path``, with its suffix, for writers that go by it), and a write
    that fails (a full disk, a quota) or is interrupted leaves ``path`` as it was, not empty or half
    written to be taken for a whole one later, and raises one line naming ``path``. Where ``path`` is not
    a plain file (``/dev/stdout``, a pipe, a link) or no new file can be made beside it, it is written in
    place, the failure still named."""
    path = Path(path)
    try:
        mode = path.lstat().st_mode
    except OSError:
        mode = None
    in_place = mode is not None and not stat.S_ISREG(mode)
    temp = path.with_name(f".{path.stem}.{os.getpid()}.partial{path.suffix}")
    if not in_place:
        try:
            temp.touch(exist_ok=False)
        except OSError:
            in_place = True
    target = path if in_place else temp
    try:
        yield target
        if not in_place:
            os.replace(temp, path)
    except OSError as e:
        raise ExpertcacheError(f"{path}: cannot write {what} ({e.strerror or e})") from None
    finally:
        if not in_place:
            temp.unlink(missing_ok=True)


def write_output(path: str | Path, text: str, what: str) -> None:
    """``text`` written to ``path`` whole or not at all (``output_file``)."""
    with output_file(path, what) as target:
        target.write_text(text)


def not_json_kind(path: str | Path) -> str | None:
    """What a file that was not JSON is, where its first bytes say (a zip: a trace, as traces are
    written, or another ``.npz``), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return None
    if head.startswith(b"PK\x03\x04"):  # a zip: numpy's .npz, as traces are written
        return "a trace or another .npz archive"
    return None
