"""Megatron-Core's per-process scratch state, per thread for the embedded engine's forwards.

With `--async-rollout` and the embedded engine, the engine's forwards run in threads of the trainer's process while
the trainer trains. Two pieces of Megatron-Core's state are per process and not thread-safe:
- the global memory buffer (`parallel_state.get_global_memory_buffer()`): the local attention's `baddbmm` writes
  its scores there, so two threads' attentions would write the same memory;
- the CUDA RNG tracker: `fork()` swaps the device's RNG state in and out; two threads' forks interleave, which
  Megatron-Core reports as "current state name default-rng is not the same as the desired state name
  model-parallel-rng" (seen on an H200), and would otherwise hand the trainer's dropout another stream.
`install()` (idempotent) makes both answer per thread: a thread inside `slime_corr.threads.inference_thread()` gets
a memory buffer of its own and a tracker whose `fork` leaves the RNG alone (the engine's model is in eval mode:
dropout draws nothing); every other thread gets Megatron-Core's own, unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import random as mrandom

from slime_corr.threads import is_inference_thread

_installed = False


class PerThreadMemoryBuffer:
    """Stands in for Megatron-Core's `GlobalMemoryBuffer`: the wrapped one for training threads, one per
    inference thread."""

    def __init__(self, shared: Any) -> None:
        self.shared = shared
        self._local = threading.local()

    def _own(self) -> Any:
        if not is_inference_thread():
            return self.shared
        if getattr(self._local, "buffer", None) is None:
            self._local.buffer = type(self.shared)()
        return self._local.buffer

    def get_tensor(self, *args: Any, **kwargs: Any) -> Any:
        return self._own().get_tensor(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._own(), name)


class _InferenceTracker:
    """The RNG tracker an inference thread sees: its `fork` changes nothing."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker

    @contextlib.contextmanager
    def fork(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        yield

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tracker, name)


def _per_thread_tracker(get_tracker: Callable[..., Any]) -> Callable[..., Any]:
    def get_cuda_rng_tracker(*args: Any, **kwargs: Any) -> Any:
        tracker = get_tracker(*args, **kwargs)
        return _InferenceTracker(tracker) if is_inference_thread() else tracker

    get_cuda_rng_tracker.__wrapped__ = get_tracker  # type: ignore[attr-defined]
    return get_cuda_rng_tracker


def install() -> None:
    """Make Megatron-Core's memory buffer and RNG tracker per thread for inference threads (see the module doc).
    Call after `parallel_state.initialize_model_parallel` (which creates the buffer); idempotent."""
    global _installed
    buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if buffer is not None and not isinstance(buffer, PerThreadMemoryBuffer):
        parallel_state._GLOBAL_MEMORY_BUFFER = PerThreadMemoryBuffer(buffer)
    if _installed:
        return
    for module in (tensor_parallel, mrandom):
        module.get_cuda_rng_tracker = _per_thread_tracker(module.get_cuda_rng_tracker)
    _installed = True


__all__ = ["PerThreadMemoryBuffer", "install"]
