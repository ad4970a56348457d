"""Worker processes that do not outlive their parent: ``exit_with_parent``, for a process pool's
initializer (sim's replays and the sweep's). Standard library only, and importing nothing of
expertcache, so that any module can use it without an import cycle."""

from __future__ import annotations

import os
import threading
import time


def exit_with_parent(parent: int | None = None, poll_s: float = 1.0) -> None:
    """Make this (worker) process exit once its parent is gone: a daemon thread checks every ``poll_s``
    seconds whether ``os.getppid()`` still is ``parent`` (default: the parent now) and calls ``os._exit``
    when it is not. A pool's initializer calls it, so that a parent killed with SIGKILL, which cannot
    stop its workers, does not leave them waiting for tasks forever (reparented to PID 1). Pass the
    parent's pid as the parent saw it (``os.getpid()`` there, in the initializer's arguments): a parent
    that died before this ran is then noticed too."""
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
