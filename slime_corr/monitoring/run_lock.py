"""One run directory, one job: the job that writes RUN_DIR holds a lock on it for its whole life.

The lock is an `flock` on RUN_DIR/.slime_corr.lock, which the operating system releases when the holder exits in any
way (an error, Ctrl-C, `kill -9`, a crashed node's process). The file also records who holds it (PID, host, start
time): a second job is refused with that record, and a job that finds the lock free but a record left behind (its
writer died before it could clear it) takes the directory over with a notice naming the dead job. On shared storage
the lock works where the filesystem supports flock across hosts (NFSv4, Lustre and GPFS do; some NFSv3 mounts do not).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import TextIO

from slime_corr.errors import ConfigError

LOCK_FILE = ".slime_corr.lock"


class RunDirBusyError(ConfigError):
    """Another job holds the run directory."""


class RunDirLock:
    """Held while this job writes its run directory (`acquire`, then `release` or the process's exit)."""

    def __init__(self, path: Path, handle: TextIO, notice: str | None) -> None:
        self.path, self._handle, self.notice = path, handle, notice

    @classmethod
    def acquire(cls, run_dir: str | Path, flag: str = "--run-dir") -> RunDirLock:
        """The lock of `run_dir` (made if missing). Raises RunDirBusyError naming the holder's PID and host; `notice`
        says when a dead job's record was taken over."""
        path = Path(run_dir) / LOCK_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held for the job's life, closed in release()
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read(handle)
            handle.close()
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunDirBusyError(
                f"{flag} {run_dir} is in use by another job ({_describe(holder)}): two jobs writing one run directory "
                "interleave their metrics. Wait for that job to end (or stop it), or pass another --run-dir (or none: "
                "a new runs/DATE-TIME).") from None
        previous = _read(handle)
        notice = None
        if previous:
            notice = (f"{flag} {run_dir}: took the run directory over from a job that ended without releasing it "
                      f"({_describe(previous)})")
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        handle.flush()
        return cls(path, handle, notice)

    def release(self) -> None:
        """Clear the record and unlock (a clean exit leaves no record behind)."""
        if self._handle.closed:
            return
        try:
            self._handle.seek(0)
            self._handle.truncate()
        except OSError:
            pass  # a full or vanished disk: the unlock below still happens
        finally:
            self._handle.close()

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read(handle: TextIO) -> dict:
    try:
        handle.seek(0)
        text = handle.read().strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {"unreadable": True}


def _describe(record: dict) -> str:
    if not record or record.get("unreadable"):
        return "its record is unreadable"
    return f"PID {record.get('pid', '?')} on host {record.get('host', '?')}, since {record.get('started', '?')}"


__all__ = ["LOCK_FILE", "RunDirBusyError", "RunDirLock"]
