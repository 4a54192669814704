"""Which threads run inference: the embedded engine marks the threads of its forwards (`inference_thread()`), so
code that keeps per-process state for training (Megatron-Core's scratch buffer and RNG tracker:
`slime_corr.mcore.threads`) can give those threads their own. The standard library only."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_local = threading.local()


@contextlib.contextmanager
def inference_thread() -> Iterator[None]:
    """Mark the calling thread as running an inference forward for the duration of the block."""
    before = getattr(_local, "inference", False)
    _local.inference = True
    try:
        yield
    finally:
        _local.inference = before


def is_inference_thread() -> bool:
    return getattr(_local, "inference", False)


__all__ = ["inference_thread", "is_inference_thread"]
