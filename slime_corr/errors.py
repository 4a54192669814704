"""The project's user-error types, imported by every layer (this module imports nothing of the project).

A user error is one the main job reports as one line naming the flag, field or file, what it got and the fix
(`slime_corr.main`); the message is the whole report. Errors of one layer only (the rollout client's, the engines')
live with that layer.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration (flags, YAML, presets, config objects); the message names the flag(s) and the fix."""


class DeviceError(ValueError):
    """A device that cannot be used here (CUDA asked for without a GPU, a LOCAL_RANK without its GPU)."""


class DiskWriteError(OSError):
    """A file of the run could not be written (a full disk above all): the message names the device, the file and
    what was done about what was half-written (`slime_corr.disk.write_failure`)."""


__all__ = ["ConfigError", "DeviceError", "DiskWriteError"]
