"""Megatron's parallel state around the correction core: the process groups, this rank's CP slice of a micro-batch
and its sequences, and Megatron's `PackedSeqParams`. The layout itself (the zig-zag and THD slices) lives in
`slime_corr.layout.context_parallel`; this module only binds it to `megatron.core.parallel_state`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from slime_corr.layout.context_parallel import packed_segments, slice_micro_batch_for_cp
from slime_corr.layout.micro_batch import TOKEN_KEYS, packed_starts
from slime_corr.layout.segments import Segments

ProcessGroup = dist.ProcessGroup | None


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups the loss needs. `None` = no communication (single process or size 1)."""

    tp: ProcessGroup = None
    cp: ProcessGroup = None
    dp: ProcessGroup = None  # data parallel WITHOUT context parallel
    dp_cp: ProcessGroup = None  # data x context parallel (Megatron's gradient / token-count group)
    cp_size: int = 1
    cp_rank: int = 0
    pp_size: int = 1  # pipeline stages; the loss and its metrics live on the last one
    pp_last: bool = True
    pp: ProcessGroup = None  # the pipeline group (MoE routes are merged over it)

    @classmethod
    def from_parallel_state(cls) -> ParallelGroups:
        """Groups from `megatron.core.parallel_state` (must be initialised)."""
        from megatron.core import parallel_state as ps

        return cls(
            tp=ps.get_tensor_model_parallel_group(),
            cp=ps.get_context_parallel_group(),
            dp=ps.get_data_parallel_group(with_context_parallel=False),
            dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
            cp_size=ps.get_context_parallel_world_size(),
            cp_rank=ps.get_context_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            pp_last=ps.is_pipeline_last_stage(ignore_virtual=True),
            pp=ps.get_pipeline_model_parallel_group(),
        )

    @classmethod
    def current(cls) -> ParallelGroups:
        """From parallel_state when it is initialised, else the single-process default."""
        from megatron.core import parallel_state as ps

        if dist.is_available() and dist.is_initialized() and ps.model_parallel_is_initialized():
            return cls.from_parallel_state()
        return cls()


def all_reduce_dp_cp(x: Tensor, groups: ParallelGroups) -> Tensor:
    """In-place SUM of `x` over DP×CP (one collective when `groups.dp_cp` is set); returns `x`."""
    targets = [groups.dp_cp] if groups.dp_cp is not None else [groups.cp, groups.dp]
    for g in targets:
        if g is not None and dist.is_initialized() and dist.get_world_size(group=g) > 1:
            dist.all_reduce(x, group=g)
    return x


def slice_batch_for_cp(batch: dict[str, Tensor], groups: ParallelGroups) -> dict[str, Tensor]:
    """This CP rank's part of every [B, S] / [1, T] micro-batch entry (tokens, labels, masks, log-probs, ...):
    the zig-zag slice of a padded batch, the THD partition of a packed one.

    Also slices `old_log_probs` / `ref_log_probs` (added by the forward-only pass); other keys pass through.
    """
    return slice_micro_batch_for_cp(batch, groups.cp_rank, groups.cp_size,
                                    keys=(*TOKEN_KEYS, "old_log_probs", "ref_log_probs"))


def batch_segments(batch: dict[str, Any], groups: ParallelGroups) -> Segments | None:
    """The sequences of this rank's (CP-sliced) micro-batch for the core: None for padded rows (one sequence per
    row), else the packed row's local sample offsets (`cu_seqlens_padded / CP`)."""
    return packed_segments(batch, groups.cp_size)


def slice_tensor_for_cp(x: Tensor, batch: dict[str, Any], groups: ParallelGroups) -> Tensor:
    """This CP rank's part of `x` [B, S_full, ...], a full-row tensor laid out like `batch` (e.g. the logits of
    the full sequence under emulated CP): its zig-zag slice, or packed, its THD partition."""
    cu = {k: batch[k] for k in ("cu_seqlens", "cu_seqlens_padded") if k in batch}
    return slice_micro_batch_for_cp({**cu, "x": x}, groups.cp_rank, groups.cp_size, keys=("x",))["x"]


def packed_seq_params(batch: dict[str, Any]) -> Any:
    """Megatron's `PackedSeqParams` (qkv_format "thd") of a packed micro-batch, as `get_thd_batch_on_this_cp_rank`
    builds them: the full row's `cu_seqlens` (sample lengths) and `cu_seqlens_padded` (their spans), the longest
    span as max_seqlen. The attention (TransformerEngine) partitions by them under CP."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch["cu_seqlens"].to(torch.int32)
    cu_padded = packed_starts(batch).to(torch.int32)
    max_len = int(cu_padded.diff().max()) if cu_padded.numel() > 1 else 0
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                           cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max_len, max_seqlen_kv=max_len)


