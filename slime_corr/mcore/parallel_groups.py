"""Megatron's parallel state torn down with its process groups.

`parallel_state.destroy_model_parallel()` forgets Megatron's groups without destroying them (only its few `*_GLOO`
ones): torch.distributed keeps every group until the default one is destroyed, and the run's objects (DDP
buffers, optimizers, models) hold them in reference cycles until Python's cyclic collector happens to run. A group
that lives on is not free: on CUDA an NCCL communicator and its buffers; on CPU a gloo device whose thread wakes
every 10 ms (gloo's tcp `Loop::run`: `epoll_wait(..., 10)`; 153 idle ones took 78 ms of CPU per second on a
2-core VM). `initialize_model_parallel` makes ~20 groups; a process that set layouts up one after the other (a test
worker, a notebook running the job twice) kept hundreds of such threads (bench/gloo_threads.py: 300 idle groups
slowed two busy processes 1.19x).
"""

from __future__ import annotations

import gc

import torch.distributed as dist


def _megatron_groups() -> list[dist.ProcessGroup]:
    """The process groups parallel_state's globals hold (directly, or in lists, tuples and dicts), each once."""
    from megatron.core import parallel_state as ps

    groups: dict[int, dist.ProcessGroup] = {}

    def visit(value: object) -> None:
        if isinstance(value, dist.ProcessGroup):
            groups.setdefault(id(value), value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    for value in vars(ps).values():
        visit(value)
    return list(groups.values())


def destroy_model_parallel_groups(world: bool = False) -> None:
    """`parallel_state.destroy_model_parallel()`, then every group it held destroyed, with the default group too
    when `world` (the process leaves torch.distributed), then the cycles that still referenced them collected.
    Every rank calls it, as it called `initialize_model_parallel` (an NCCL communicator's teardown may be
    collective). Every Megatron DDP wrapper in the process is cut from its module first (`_cut_ddp_wrappers`), and
    the globals `destroy_model_parallel` leaves set (0.16 and 0.19: `_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`
    and its `_GLOO` twin) are reset to None with the rest."""
    from megatron.core import parallel_state as ps

    try:
        groups = _megatron_groups() if dist.is_initialized() else []
        _cut_ddp_wrappers()
        _clear_rope_cache()
        ps.destroy_model_parallel()
        for group in groups:
            if group is not dist.group.WORLD and _is_live(group):
                dist.destroy_process_group(group)
        for name, value in list(vars(ps).items()):
            if isinstance(value, dist.ProcessGroup):
                setattr(ps, name, None)
    finally:  # the world goes even when the rest failed: a process left in it cannot join another
        if world and dist.is_initialized():
            dist.destroy_process_group()
    gc.collect()


def _cut_ddp_wrappers() -> None:
    """Megatron's `DistributedDataParallel` hangs its gradient hooks, closures over itself, on its parameters'
    AccumulateGrad nodes. A module that keeps a tensor of its last forward (Megatron's MoE token dispatchers keep
    their routing map and probabilities) ties that autograd graph, through those C++ nodes, back to the wrapper: a
    cycle Python's collector cannot see, so the model, its gradient buffers and its groups lived as long as the
    process (a MoE run in a test worker: 16 groups). Each wrapper is cut from its module, which breaks every such
    cycle; it is unusable anyway once the layout it was built on is torn down."""
    from megatron.core.distributed import DistributedDataParallel

    for obj in gc.get_objects():
        if issubclass(type(obj), DistributedDataParallel):  # not isinstance: a dead weakref proxy raises there
            obj._modules.pop("module", None)


def _clear_rope_cache() -> None:
    """Megatron's `RotaryEmbedding.forward` is an `lru_cache` (32 calls, 0.16 and 0.19) keyed by the module: it
    keeps the RoPE modules of the last runs, and their CP groups."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    cache_clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


def _is_live(group: dist.ProcessGroup) -> bool:
    """Whether torch.distributed still knows `group` (Megatron destroys its `*_GLOO` groups itself)."""
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):
        return False
    return True


__all__ = ["destroy_model_parallel_groups"]
