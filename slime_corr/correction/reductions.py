"""The one set of masked-reduction helpers used by the correction core and the losses.

Distributed contract (all groups optional; `None` or a group of size 1 means "no communication"):
- per-sequence sums over context-parallel (CP) ranks: `seq_sums`, ONE all_reduce of a stacked [B, k] tensor;
- batch statistics over DP x CP: `BatchStats`, ONE SUM and ONE MAX all_reduce per group for all of a step's
  numerators, denominators, histograms and extremes (minima are sent as negated maxima).
Sequence-level quantities are counted once across CP ranks by weighting them with `cp_first(cp_group)`
(1 on CP rank 0, 0 elsewhere) before the batch reduction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from slime_corr.layout.segments import Segments

ProcessGroup = dist.ProcessGroup | None
_CONSTANTS: dict[tuple[str, torch.device], Tensor] = {}


def device_constant(name: str, device: torch.device, build: Callable[[torch.device], Tensor]) -> Tensor:
    """A small constant tensor `build(device)`, made once per device and reused: no host->device copy (an op on an
    accelerator) per call. `name` must identify what `build` makes."""
    key = (name, device)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = build(device)
    return _CONSTANTS[key]


def valid_float(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """The valid positions (`mask > 0`; NaN is invalid) as 0/1 floats, for a bool or float mask, with no bool
    tensor made for a float mask: the compare writes floats (`indicator`; on CPU, bool -> float costs ~3x more)."""
    if mask.dtype == torch.bool:
        return float_mask(mask, dtype)
    return indicator(torch.gt, mask, 0.0, dtype)


def indicator(op: Callable[..., Tensor], x: Tensor, other: Tensor | float, dtype: torch.dtype | None = None
              ) -> Tensor:
    """`op(x, other)` (a comparison: torch.gt, torch.le, ...) as a new tensor of 0/1 floats (`dtype`, default
    x's), written by the compare itself: one pass, no bool tensor (NaN compares false)."""
    dtype = dtype or x.dtype
    if torch.compiler.is_compiling():
        return op(x, other).to(dtype)
    return op(x, other, out=torch.empty(x.shape, dtype=dtype, device=x.device))


def float_not(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """`~mask` of a bool mask as 0/1 floats of `dtype`, written by one op (no bool tensor in between)."""
    if torch.compiler.is_compiling():
        return (~mask).to(dtype)
    return torch.logical_not(mask, out=torch.empty(mask.shape, dtype=dtype, device=mask.device))


def row_products(x: Tensor) -> Tensor:
    """[B, k, S] -> [B, k, k]: Σ_s x[b, i, s]·x[b, j, s], every row product of k stacked [B, S] quantities at once.
    Eager: one batched matmul (one read of x instead of k² passes); under torch.compile: a fused reduction."""
    if torch.compiler.is_compiling():
        return (x.unsqueeze(2) * x.unsqueeze(1)).sum(-1)
    return torch.bmm(x, x.transpose(1, 2))


def valid_mask(mask: Tensor) -> Tensor:
    """Bool mask of valid positions: `mask > 0` (NaN counts as invalid); accepts bool or float masks."""
    return mask if mask.dtype == torch.bool else mask > 0


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 when any input is float64, else float32 (bf16/fp16 inputs are promoted)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def float_mask(valid: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as 0/1 floats. Through a uint8 view: on CPU, bool -> float is about 3x slower."""
    return valid.view(torch.uint8).to(dtype)


def count_greater_(x: Tensor, threshold: float, segments: Segments | None = None) -> Tensor:
    """Per-sequence count of `x > threshold`: over the last dim ([B, S] -> [B]), or per segment of `segments`;
    overwrites `x` (pass a temporary), which must be NaN-free.

    Σ (x > threshold) with the compare written in place as floats (`x.gt_`): one float pass, about 2x faster on
    CPU than a bool compare and bool sum. The count is float32 or wider (bf16/fp16 cannot hold counts above 256
    exactly).
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    hits = x.gt_(threshold)
    return hits.sum(-1, dtype=dtype) if segments is None else segments.sum(hits, dtype=dtype)


def at_most_(x: Tensor, threshold: float) -> Tensor:
    """In place: 1.0 where x <= threshold, else 0.0 (x NaN-free): one float pass, no bool tensor."""
    return x.le_(threshold)


def finite_indicator_(x: Tensor) -> Tensor:
    """In place: 1.0 where `x` is finite, 0.0 at NaN/±inf. x·0 is ±0 for a finite x and NaN otherwise; no bool
    tensor is made (on CPU, isfinite and the bool -> float conversion cost about 3x more)."""
    return x.mul_(0.0).nan_to_num_(nan=-1.0).add_(1.0)


def safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    """numerator / max(denominator, 1e-30) for float64 batch statistics: 0 / 0 = 0."""
    return numerator / denominator.clamp_min(1e-30)


def group_size(group: ProcessGroup) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def cp_first(cp_group: ProcessGroup) -> float:
    """1.0 on CP rank 0 (or without CP), 0.0 elsewhere: counts sequence-level terms once across CP."""
    if group_size(cp_group) == 1:
        return 1.0
    return 1.0 if dist.get_rank(group=cp_group) == 0 else 0.0


def active_groups(*groups: ProcessGroup) -> list[dist.ProcessGroup]:
    """The distinct groups of size > 1 among `groups`, in order."""
    out: list[dist.ProcessGroup] = []
    for g in groups:
        if g is not None and group_size(g) > 1 and all(g is not h for h in out):
            out.append(g)
    return out


def seq_sums(columns: list[Tensor], cp_group: ProcessGroup = None) -> Tensor:
    """Per-sequence sums of [B, S] columns (summed over the last dim) or [n] local per-sequence sums (e.g.
    `Segments.sum`) -> [n, k], summed over CP in ONE all_reduce.

    Columns must already be zero at invalid positions (bool columns are counted).
    """
    dtype = compute_dtype(*columns)
    out = torch.stack([(c if c.dim() == 1 else c.sum(-1)).to(dtype) for c in columns], dim=-1)
    return cp_sum_(out, cp_group)


def cp_sum_(local: Tensor, cp_group: ProcessGroup = None) -> Tensor:
    """[n, k] local per-sequence sums summed over CP in place (ONE all_reduce); returns `local`."""
    if group_size(cp_group) > 1:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=cp_group)
    return local


def global_sum(x: Tensor, cp_group: ProcessGroup = None, dp_group: ProcessGroup = None) -> Tensor:
    """Sum of `x` over DP x CP ranks (one all_reduce per group; returns a new tensor)."""
    x = x.clone()
    for g in active_groups(cp_group, dp_group):
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=g)
    return x


def _float64_vector(value: Tensor) -> Tensor:
    """`value` as a detached 1-D float64 tensor, with no op (not even a view) where it is one already."""
    if value.requires_grad:
        value = value.detach()
    if value.dtype != torch.float64:
        value = value.to(torch.float64)
    return value if value.dim() == 1 else value.reshape(-1)


class BatchStats:
    """Collects 0-dim/1-dim batch statistics and reduces them all at once over DP x CP.

    `add_sum(name, t)` / `add_sums(names, vector)` for numerators/denominators/histograms, `add_max`/`add_min` for
    extremes; `reduce()` performs one SUM and one MAX all_reduce per group (float64; minima are sent as negated
    maxima) and returns {name: reduced tensor} (scalars as 0-dim views). Vectors are kept whole until the
    reduction, and without a group nothing is copied: few small ops per call.
    """

    def __init__(self) -> None:
        self._scalars: dict[str, list] = {"sum": [], "max": [], "min": []}  # [(names, float64 vector)] per op
        self._vectors: list[tuple[str, Tensor]] = []  # summed histograms

    def add_sum(self, name: str, value: Tensor) -> None:
        value = _float64_vector(value)
        if value.numel() == 1:
            self._scalars["sum"].append(((name,), value))
        else:
            self._vectors.append((name, value))

    def add_sums(self, names: tuple[str, ...], values: Tensor) -> None:
        """Several scalar sums at once: `values[i]` is the sum called `names[i]`."""
        self._scalars["sum"].append((tuple(names), _float64_vector(values)))

    def add_max(self, name: str, value: Tensor) -> None:
        self._scalars["max"].append(((name,), _float64_vector(value)))

    def add_min(self, name: str, value: Tensor) -> None:
        self._scalars["min"].append(((name,), _float64_vector(value)))

    def reduce(self, cp_group: ProcessGroup = None, dp_group: ProcessGroup = None) -> dict[str, Tensor]:
        groups = active_groups(cp_group, dp_group)
        out: dict[str, Tensor] = {}
        if not groups:  # the statistics are already the batch's: views, no copy
            for entries in self._scalars.values():
                for names, values in entries:
                    out.update(zip(names, values.unbind(), strict=True))
            out.update(self._vectors)
            return out
        mins = self._scalars["min"]
        for op, entries, vectors in ((dist.ReduceOp.SUM, self._scalars["sum"], self._vectors),
                                     (dist.ReduceOp.MAX, self._scalars["max"] + [(n, -v) for n, v in mins], [])):
            if not entries and not vectors:
                continue
            names = [name for entry_names, _ in entries for name in entry_names]
            flat = torch.cat([v for _, v in entries] + [v for _, v in vectors])
            for g in groups:
                dist.all_reduce(flat, op=op, group=g)
            scalars, rest = flat[:len(names)], flat[len(names):]
            out.update(zip(names, scalars.unbind(), strict=True))
            out.update(zip([n for n, _ in vectors], rest.split([v.numel() for _, v in vectors]), strict=True))
        for names, _ in mins:  # sent as negated maxima
            out[names[0]] = out[names[0]].neg()
        return out
