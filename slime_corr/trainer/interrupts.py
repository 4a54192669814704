"""Ctrl-C (SIGINT) and torchrun's SIGTERM end the run as one KeyboardInterrupt: never lost, never mid-write.

`exit_at_once()` covers the job's start (imports, flag checks: nothing to clean up); then `install()` (the main job
calls it before it starts anything) puts `_on_signal` on both signals:
- the first signal raises KeyboardInterrupt in the main thread, as Python's own handler does, and is remembered;
  later ones, while the run cleans up (bounded: engines, client, event loop), are only remembered;
- a KeyboardInterrupt that some code drops (Python prints and drops one raised inside a finalizer) is not lost:
  `raise_if_interrupted()`, called at the loop's safe points, raises it again;
- inside `deferred()` (a checkpoint write) a signal is remembered and raised when the block ends, so a checkpoint is
  never torn. A terminal's Ctrl-C reaches every process of the job, also the ones Megatron's save starts: its
  writers (forked: killed mid-file, their parent would wait for them forever) and, where megatron-core starts one
  (`save_checkpoint` gives it an in-process queue instead), its results-queue manager (spawned: killed while it
  starts, the save fails). Both start from inside the block with SIGINT blocked in the main thread's
  signal mask, which a child inherits (also across exec): they never see it. The job's own SIGINT is taken by
  another of its threads, or by the main thread once the block ends. multiprocessing's resource tracker, started by
  the first spawn of a process, unblocks SIGINT in the thread that starts it (`ensure_running`): the block starts it
  first, so a spawn inside the block leaves the mask alone.
Without `install()` (slime_corr used as a library) Python's own handler stays and these functions change nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from multiprocessing import resource_tracker
from types import FrameType

_installed = False
_signalled = False  # a signal arrived (the run is ending)
_deferring = False  # inside deferred(): remember, do not raise
_pending = False  # a signal arrived inside deferred()


def exit_at_once(program: str) -> None:
    """Before the job has started anything (imports, flag checks): a signal prints one line and exits 130."""

    def handler(signum: int, frame: FrameType | None) -> None:
        print(f"{program}: interrupted while starting; nothing was started yet.", file=sys.stderr, flush=True)
        os._exit(130)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)


def install() -> None:
    """Handle SIGINT and SIGTERM as described in the module doc (main thread only)."""
    global _installed, _signalled, _pending
    _signalled = _pending = False
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _on_signal)
    _installed = True


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _signalled, _pending
    if _deferring:
        _pending = True
        return
    if _signalled:  # the run is already ending: let its clean-up finish
        return
    _signalled = True
    raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt when a signal arrived and its KeyboardInterrupt was dropped on the way."""
    if _signalled:
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A block that a signal does not interrupt: it is raised once the block has ended."""
    global _deferring, _pending, _signalled
    if not _installed or _deferring or threading.current_thread() is not threading.main_thread():
        yield
        return
    resource_tracker.ensure_running()  # here, not inside the block: starting it unblocks SIGINT (see the module doc)
    _deferring = True
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # inherited by what forks from here
    try:
        yield
    finally:
        _deferring = False
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a SIGINT held back is handled here
        if _pending and not _signalled:
            _pending = False
            _signalled = True
            raise KeyboardInterrupt


__all__ = ["deferred", "install", "raise_if_interrupted"]
