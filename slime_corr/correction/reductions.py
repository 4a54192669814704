"""The one set of masked-reduction helpers used by the correction core and the losses.

Distributed contract (all groups optional; `None` or a group of size 1 means "no communication"):
- per-sequence sums over context-parallel (CP) ranks: `seq_sums`, ONE all_reduce of a stacked [B, k] tensor;
- batch statistics over DP x CP: `BatchStats`, ONE SUM and ONE MAX all_reduce per group for all of a step's
  numerators, denominators, histograms and extremes (minima are sent as negated maxima).
Sequence-level quantities are counted once across CP ranks by weighting them with `cp_first(cp_group)`
(1 on CP rank 0, 0 elsewhere) before the batch reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

ProcessGroup = dist.ProcessGroup | None


def valid_mask(mask: Tensor) -> Tensor:
    """Bool mask of valid positions: `mask > 0` (NaN counts as invalid); accepts bool or float masks."""
    return mask if mask.dtype == torch.bool else mask > 0


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 when any input is float64, else float32 (bf16/fp16 inputs are promoted)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def masked_sum(x: Tensor, valid: Tensor, dim: int | None = None) -> Tensor:
    """Σ x over valid positions; `torch.where`, so NaN/inf at invalid positions never leaks."""
    z = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return z.sum() if dim is None else z.sum(dim)


def masked_mean(x: Tensor, valid: Tensor) -> Tensor:
    """Σ_valid x / max(#valid, 1) (local, no communication); 0 when nothing is valid."""
    return masked_sum(x, valid) / valid.sum().clamp_min(1).to(x.dtype)


def group_size(group: ProcessGroup) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def cp_first(cp_group: ProcessGroup) -> float:
    """1.0 on CP rank 0 (or without CP), 0.0 elsewhere: counts sequence-level terms once across CP."""
    if group_size(cp_group) == 1:
        return 1.0
    return 1.0 if dist.get_rank(group=cp_group) == 0 else 0.0


def _active(*groups: ProcessGroup) -> list[dist.ProcessGroup]:
    out: list[dist.ProcessGroup] = []
    for g in groups:
        if g is not None and group_size(g) > 1 and all(g is not h for h in out):
            out.append(g)
    return out


def seq_sums(columns: list[Tensor], cp_group: ProcessGroup = None) -> Tensor:
    """Per-sequence sums over the last dim of each [B, S] column -> [B, k], summed over CP in ONE all_reduce.

    Columns must already be zero at invalid positions (bool columns are counted).
    """
    dtype = compute_dtype(*columns)
    out = torch.stack([c.sum(-1).to(dtype) for c in columns], dim=-1)
    if group_size(cp_group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=cp_group)
    return out


def global_sum(x: Tensor, cp_group: ProcessGroup = None, dp_group: ProcessGroup = None) -> Tensor:
    """Sum of `x` over DP x CP ranks (one all_reduce per group; returns a new tensor)."""
    x = x.clone()
    for g in _active(cp_group, dp_group):
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=g)
    return x


class BatchStats:
    """Collects 0-dim/1-dim batch statistics and reduces them all at once over DP x CP.

    `add_sum(name, t)` for numerators/denominators/histograms, `add_max`/`add_min` for extremes; `reduce()`
    performs one SUM and one MAX all_reduce per group (float64) and returns {name: reduced tensor}.
    """

    def __init__(self) -> None:
        self._sums: dict[str, Tensor] = {}
        self._maxes: dict[str, Tensor] = {}
        self._mins: set[str] = set()

    def add_sum(self, name: str, value: Tensor) -> None:
        self._sums[name] = value.detach().to(torch.float64).reshape(-1)

    def add_max(self, name: str, value: Tensor) -> None:
        self._maxes[name] = value.detach().to(torch.float64).reshape(1)

    def add_min(self, name: str, value: Tensor) -> None:
        self._mins.add(name)
        self._maxes[name] = -value.detach().to(torch.float64).reshape(1)

    def reduce(self, cp_group: ProcessGroup = None, dp_group: ProcessGroup = None) -> dict[str, Tensor]:
        groups = _active(cp_group, dp_group)
        out: dict[str, Tensor] = {}
        for table, op in ((self._sums, dist.ReduceOp.SUM), (self._maxes, dist.ReduceOp.MAX)):
            if not table:
                continue
            flat = torch.cat(list(table.values()))
            for g in groups:
                dist.all_reduce(flat, op=op, group=g)
            offset = 0
            for name, value in table.items():
                n = value.numel()
                piece = flat[offset : offset + n]
                offset += n
                if name in self._mins:
                    piece = -piece
                out[name] = piece[0] if n == 1 else piece
        return out
