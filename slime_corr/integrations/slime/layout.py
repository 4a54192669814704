"""slime's context-parallel layout of a sample's response tokens (`slime/backends/megatron_utils/cp_utils.py`).

slime splits each sample's whole sequence (prompt + response, `total_length` tokens) into 2·C chunks of
`ceil(total_length / 2C)` positions; CP rank r holds chunks r and 2C−1−r. A response token j is predicted at
logit position P−1+j (P = prompt length), so rank r's part of a response-indexed tensor (log-probs, loss mask) is
the response positions whose logit position falls in its two chunks, in chunk order. Per-sample lists handed to
`--custom-tis-function-path` hold these local parts for the log-probs, and the WHOLE loss mask per sample.
This module is the one owner of that layout in slime_corr.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def local_response_ranges(total_length: int, response_length: int, cp_rank: int,
                          cp_size: int) -> list[tuple[int, int]]:
    """The response positions `[start, end)` CP rank `cp_rank` holds, in its local order (empty ranges left out)."""
    if cp_size == 1:
        return [(0, response_length)]
    first_logit = total_length - response_length - 1  # the logit position of response token 0
    chunk = -(-total_length // (2 * cp_size))
    out = []
    for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
        lo, hi = max(c * chunk, first_logit), min((c + 1) * chunk, total_length - 1)
        if lo < hi:
            out.append((lo - first_logit, hi - first_logit))
    return out


def local_part(values: Tensor, ranges: Sequence[tuple[int, int]]) -> Tensor:
    """This rank's part of a whole-response tensor (`values[start:end]` of each range, concatenated)."""
    if len(ranges) == 1 and ranges[0] == (0, values.shape[0]):
        return values
    return torch.cat([values[a:b] for a, b in ranges]) if ranges else values[:0]


def gather_whole(local: Tensor, total_lengths: Sequence[int], response_lengths: Sequence[int],
                 cp_group: dist.ProcessGroup | None) -> list[Tensor]:
    """Whole-response tensors per sample from every CP rank's concatenated local parts (`local` [Σ local]),
    with ONE all_gather over `cp_group`; without a CP group, `local` split by `response_lengths`."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return list(local.split(list(response_lengths)))
    cp_size = dist.get_world_size(cp_group)
    starts = [0]
    for n in response_lengths:
        starts.append(starts[-1] + n)
    positions = []  # per rank: the whole-batch response positions of its local tokens, in its order
    for r in range(cp_size):
        pos = [torch.arange(starts[i] + a, starts[i] + b)
               for i, (t, n) in enumerate(zip(total_lengths, response_lengths, strict=True))
               for a, b in local_response_ranges(t, n, r, cp_size)]
        positions.append(torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long))
    width = max(p.numel() for p in positions)
    padded = torch.zeros(width, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    parts = [torch.empty_like(padded) for _ in range(cp_size)]
    dist.all_gather(parts, padded, group=cp_group)
    whole = torch.zeros(starts[-1], dtype=local.dtype, device=local.device)
    for part, pos in zip(parts, positions, strict=True):
        whole[pos.to(local.device)] = part[: pos.numel()]
    return list(whole.split(list(response_lengths)))


__all__ = ["gather_whole", "local_part", "local_response_ranges"]
