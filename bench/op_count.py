"""Aten ops per call: what a function dispatches below autograd, views and other metadata-only ops aside.

On an accelerator each counted op is (at least) one kernel launch, so the count is the launch-bound floor of a call;
on a CPU it is deterministic where times are not, which is what a regression test can pin. Counted with a
`TorchDispatchMode` (ops as the backend sees them: after autograd and composite decompositions, backward included).

Not counted: ops that only make a new view of existing memory (`OpOverload.is_view`: view, reshape, expand, slice,
select, transpose, ...), the few other metadata-only ops (detach, alias, lift_fresh, ...), allocations without a
kernel (empty*) and dtype arithmetic (promote_types). Everything else counts once per dispatch, `.item()`/`.tolist()` reads (`_local_scalar_dense`)
included.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

METADATA_ONLY = frozenset({
    "detach", "alias", "lift_fresh", "lift_fresh_copy", "_unsafe_view", "view", "reshape", "as_strided", "expand",
    "squeeze", "unsqueeze", "t", "transpose", "permute", "slice", "select", "split", "split_with_sizes", "unbind",
    "chunk", "narrow", "view_as", "expand_as", "unflatten", "flatten", "diagonal", "movedim", "resolve_conj",
    "resolve_neg", "_reshape_alias", "unfold", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "set_", "resize_", "_has_compatible_shallow_copy_type", "is_same_size", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset", "is_nonzero", "_shape_as_tensor", "dim", "size", "stride",
    "numel", "_nested_tensor_size", "promote_types", "result_type",
})


def kernel_op(func: torch._ops.OpOverload) -> bool:
    """Whether `func` (an aten OpOverload) does work: neither a view nor a metadata-only op nor a bare allocation."""
    name = func.overloadpacket.__name__
    return not (func.is_view or name in METADATA_ONLY or name.rstrip("_") in METADATA_ONLY)


class OpCounter(TorchDispatchMode):
    """`with OpCounter() as c: fn()` counts the kernel ops `fn` dispatches: `c.total`, `c.ops` (name -> count)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if kernel_op(func):
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def count_ops(fn: Callable[[], object], warmup: int = 1) -> OpCounter:
    """The kernel ops of one call of `fn`, after `warmup` calls (first-call caches and lazy inits out)."""
    for _ in range(warmup):
        fn()
    with OpCounter() as counter:
        fn()
    return counter


SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"})


def cuda_profile(fn: Callable[[], object], warmup: int = 1) -> tuple[int, float, int, Counter[str]]:
    """(kernels, GPU busy ms, host syncs, GPU ms per kernel name) of one call of `fn` on CUDA, by `torch.profiler`:
    every device activity (kernels, memsets, copies) counts, busy time is their summed durations (one stream), syncs
    are the runtime's synchronize calls (a `.item()` is one; the caller's own closing synchronize is not counted)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    by_name: Counter[str] = Counter()
    for e in events:
        if e.device_type == DeviceType.CUDA:
            by_name[e.name[:80]] += (getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)) / 1e3
    kernels = sum(1 for e in events if e.device_type == DeviceType.CUDA)
    syncs = sum(1 for e in events if e.name in SYNC_CALLS) - 1
    return kernels, sum(by_name.values()), syncs, by_name
