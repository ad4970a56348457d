"""Output folders checked before the work that fills them. Torch-free."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from expertcache.errors import ExpertcacheError


def writable_dir(folder: str | Path, what: str) -> Path:
    """``folder``, created if need be, after proving a file can be written there: a bad output folder is
    found out before a long job, not after it (``what`` names the output in the message)."""
    if not str(folder).strip():
        raise ExpertcacheError(f"an empty path for {what}: give a folder")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ExpertcacheError(f"{folder}: exists and is not a directory")
    try:
        folder.mkdir(parents=True, exist_ok=True)
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
    import os

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
