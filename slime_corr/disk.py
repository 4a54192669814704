"""Writing the run's files when the disk fills: one named error, never a half-written record left as if whole.

`write_failure(path, error)` turns an OSError of a write into `DiskWriteError` ("no space left on DEVICE while writing
PATH", DEVICE being the filesystem's source and mount point from /proc/self/mountinfo); `append_line` appends one whole
line or nothing (a failed write is truncated back). The metrics sinks, checkpoints and the report use them.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from slime_corr.errors import DiskWriteError

FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left, disk quota exceeded
NEARLY_FULL_BYTES = 1 << 20  # free space below this after a failed write: the disk is the cause


def device_of(path: str | Path) -> str:
    """"SOURCE (mounted at MOUNT)" for the filesystem holding `path` (its nearest existing parent), or the mount
    point alone where /proc/self/mountinfo cannot be read."""
    target = Path(path).absolute()
    while not target.exists() and target != target.parent:
        target = target.parent
    best, source = "/", "?"
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            mount_point = fields[4].replace("\\040", " ")
            after = fields[fields.index("-") + 1:]
            inside = str(target) == mount_point or str(target).startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best):
                best, source = mount_point, after[1] if len(after) > 1 else "?"
    except (OSError, ValueError, IndexError):
        return best
    return f"{source} (mounted at {best})"


def out_of_space(path: str | Path) -> bool:
    """Whether the filesystem of `path` has (almost) no space left for this user."""
    target = Path(path).absolute()
    while not target.exists() and target != target.parent:
        target = target.parent
    try:
        stats = os.statvfs(target)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < NEARLY_FULL_BYTES


def write_failure(path: str | Path, error: BaseException, done: str = "") -> DiskWriteError:
    """The DiskWriteError for a failed write of `path` (`done`: what was done about a half-written file)."""
    full = isinstance(error, OSError) and error.errno in FULL or out_of_space(path)
    what = f"no space left on {device_of(path)}" if full else f"could not write to {device_of(path)} ({error})"
    fix = "; free space there (or point the run elsewhere) and run again" if full else ""
    return DiskWriteError(f"{what} while writing {path}{'; ' + done if done else ''}{fix}")


def append_line(fd: int, path: str | Path, line: str) -> None:
    """Append `line` (one record, newline-terminated) to the file open on `fd` whole or not at all: a write that
    fails part-way is truncated back, then DiskWriteError."""
    data = memoryview(line.encode())
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError as e:
        try:
            os.ftruncate(fd, start)
            done = "the partial record was removed"
        except OSError:
            done = "the file may end in a partial record"
        raise write_failure(path, e, done) from None


def write_text(path: str | Path, text: str) -> None:
    """Write `path` whole (a temporary file beside it, then renamed over it) or leave it as it was: DiskWriteError."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_failure(path, e, f"{path.name} was left as it was") from None


__all__ = ["append_line", "device_of", "out_of_space", "write_failure", "write_text"]
