"""Context parallelism (CP): which positions of a micro-batch each CP rank holds, and the inverse.

Megatron's zig-zag layout, load-balanced for causal attention: with C CP ranks a padded row is split into 2·C chunks
and CP rank r keeps chunks r and 2·C−1−r (``zigzag_slice``); a packed row is partitioned per sample the way
Megatron-Core partitions THD batches (``get_thd_batch_on_this_cp_rank``, i.e. Transformer Engine's
``thd_get_partitioned_indices``): every sample's padded span is split into 2·C chunks and rank r keeps chunks r and
2·C−1−r of each, sample after sample (``thd_partition_index``), so sample i is at local positions
``[cu_seqlens_padded[i] / C, cu_seqlens_padded[i+1] / C)`` (``thd_local_offsets``). Sequence-level sums are NOT
gathered: the correction core all-reduces per-sequence scalars over the CP group once per micro-batch, reading a
rank's sequences from ``packed_segments``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from slime_corr.layout.kept_sets import KEPT_COUNTS_KEY, KEPT_IDS_KEY, take_kept_sets
from slime_corr.layout.micro_batch import TOKEN_KEYS, packed_starts
from slime_corr.layout.segments import Segments


def zigzag_slice(tensor: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """Context-parallel zig-zag slice: split ``dim`` into 2*cp_size chunks, keep chunks r and 2*cp_size-1-r.

    The length of ``dim`` must be a multiple of 2*cp_size (pad with ``pad_to_multiple=2*cp_size``).
    """
    if cp_size == 1:
        return tensor
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} not in [0, {cp_size})")
    n = tensor.size(dim)
    if n % (2 * cp_size):
        raise ValueError(f"size {n} of dim {dim} is not a multiple of 2*cp_size={2 * cp_size}")
    c = n // (2 * cp_size)
    return torch.cat([tensor.narrow(dim, cp_rank * c, c), tensor.narrow(dim, (2 * cp_size - 1 - cp_rank) * c, c)],
                     dim=dim)


def zigzag_indices(seq_len: int, cp_rank: int, cp_size: int, device: torch.device | str | None = None) -> Tensor:
    """Global positions held by `cp_rank` (in local order): chunks r and 2·C−1−r of 2·C, on `device` (pass the
    device of the tensor they index)."""
    return zigzag_slice(torch.arange(seq_len, device=device).unsqueeze(0), cp_rank, cp_size, dim=1)[0]


def zigzag_unslice(parts: list[Tensor], dim: int = 1) -> Tensor:
    """Inverse of `zigzag_slice`: rebuild the full tensor from every CP rank's local slice (rank order)."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    chunks: list[Tensor | None] = [None] * (2 * cp_size)
    for r, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        chunks[r], chunks[2 * cp_size - 1 - r] = first, second
    return torch.cat([c for c in chunks if c is not None], dim=dim)


def thd_partition_index(cu_seqlens_padded: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Positions of a packed row that CP rank `cp_rank` holds, in its local order (see the module docstring):
    for each sample, chunk r then chunk 2·CP−1−r of its padded span split into 2·CP chunks."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} not in [0, {cp_size})")
    cu = cu_seqlens_padded.long()
    spans = cu.diff()
    if bool((spans % (2 * cp_size)).any()):
        raise ValueError(f"cu_seqlens_padded {cu.tolist()}: every sample's padded length must be a multiple of "
                         f"2*cp_size={2 * cp_size}; build the micro-batch with pad_to_multiple=cp_pad_multiple(cp_size).")
    chunk = spans // (2 * cp_size)
    begins = torch.stack([cu[:-1] + cp_rank * chunk, cu[:-1] + (2 * cp_size - 1 - cp_rank) * chunk], 1).reshape(-1)
    sizes = chunk.repeat_interleave(2)
    which = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    start_of = sizes.cumsum(0) - sizes
    return begins[which] + torch.arange(which.numel()) - start_of[which]


def thd_local_offsets(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Where each sample starts in a CP rank's slice of a packed row: `cu_seqlens_padded / cp_size` (int64)."""
    return cu_seqlens_padded.long() // cp_size


def is_packed(batch: dict[str, Any]) -> bool:
    """Whether a micro-batch is packed (THD: one row [1, T] with `cu_seqlens`)."""
    return "cu_seqlens" in batch


def slice_micro_batch_for_cp(batch: dict[str, torch.Tensor], cp_rank: int, cp_size: int,
                             keys: Sequence[str] = TOKEN_KEYS) -> dict[str, torch.Tensor]:
    """This CP rank's part of every `keys` entry ([B, S]; others are passed through): the zig-zag slice of a
    padded batch, the THD partition of a packed one (`cu_seqlens*` stay whole: they describe the full row). The
    kept sets' ids (`layout.kept_sets`) follow the positions the slice keeps."""
    if cp_size == 1:
        return dict(batch)
    if "cu_seqlens" in batch:
        index = thd_partition_index(packed_starts(batch), cp_rank, cp_size)

        def cut(v: Tensor) -> Tensor:
            return v.index_select(1, index.to(v.device))
    else:
        def cut(v: Tensor) -> Tensor:
            return zigzag_slice(v, cp_rank, cp_size, dim=1)
    out = {k: cut(v) if k in keys else v for k, v in batch.items()}
    if KEPT_IDS_KEY in batch and KEPT_COUNTS_KEY in keys:  # the ids of the kept positions, in their new order
        counts = batch[KEPT_COUNTS_KEY]
        positions = cut(torch.arange(counts.numel(), device=counts.device).reshape(counts.shape))
        out.update(take_kept_sets(batch, positions.reshape(-1)))
    return out


def seq_length_for_norm(local_seq_len: int, cp_size: int) -> int:
    """Full (un-sliced) padded sequence length T used by `seq-mean-token-sum-norm`: S_local · C."""
    return local_seq_len * cp_size


def block_causal_mask(starts: Tensor, length: int) -> Tensor:
    """[1, 1, T, T] bool, True where attention is masked (Megatron's convention): causal within each sample of a
    packed row of `length` positions whose samples start at `starts` (`cu_seqlens_padded`), nothing across
    samples — what THD attention computes, for attention implementations without it (the local layer spec on CPU,
    `mcore.local_spec`). Positions past the last sample attend among themselves."""
    starts = starts.long()
    pos = torch.arange(length, device=starts.device)
    ids = torch.searchsorted(starts[1:].contiguous(), pos, right=True)
    allowed = (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed)[None, None]


def packed_segments(batch: dict[str, Any], cp_size: int) -> Segments | None:
    """The sequences of a CP rank's slice of `batch` for the correction core: None for padded rows (one sequence
    per row), else the packed row's local sample offsets (`cu_seqlens_padded / CP`)."""
    if not is_packed(batch):
        return None
    labels = batch["labels"]
    offsets = thd_local_offsets(packed_starts(batch), cp_size).to(labels.device)
    return Segments.packed_row(offsets, labels.shape[-1])
