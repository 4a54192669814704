"""The opt-in rule of the project's Triton kernels (`--logprobs-backend triton`, `--rollout-correction-backend triton`):
a kernel that cannot compile or launch (no triton, no GPU, a compiler error) never ends a run — the first failure
warns once for the process, names the flag and the error, and every later call takes the torch path."""

from __future__ import annotations

import warnings


class KernelFallback:
    """One kernel's state in this process: usable until it fails once."""

    def __init__(self, flag: str) -> None:
        self.flag = flag
        self.failure: str | None = None

    @property
    def usable(self) -> bool:
        return self.failure is None

    def failed(self, error: BaseException) -> None:
        """Record `error` and warn (once: later calls do not try the kernel again)."""
        self.failure = f"{type(error).__name__}: {error}"
        warnings.warn(f"{self.flag}: the kernel could not run ({self.failure[:300]}); this process uses the torch "
                      "path from now on", RuntimeWarning, stacklevel=3)

    def reset(self) -> None:
        """Try the kernel again (tests)."""
        self.failure = None


__all__ = ["KernelFallback"]
