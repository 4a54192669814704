"""Bounds from a budget: the truncation / rejection bound of each call, chosen from the call's own statistics.

Both use the level-1 bins of `quantiles.py` (4097 bins, ~3 % wide, over [2^-64, 2^64) on the float32 bits): per bin,
Σ u, Σ u·v (and Σ u·v² for the ESS) of the values v with units u, ONE SUM all_reduce over DP x CP, then a cumulative
scan. Nothing is gathered; the bound is exact at bin edges, so it lies within one bin (3 %) of the exact one.

- Mean budget β (`--rs-divergence-budget`): keep the units whose value falls in bins 0..j, for the largest j with
  Σ_kept u·v / Σ_kept u ≤ β. The kept mean never decreases with j, so j is unique; if even the lowest occupied bin's
  mean exceeds β, no unit is kept. With k2 per token this is M2PO's second-moment budget (M2 = 2·mean k2).
- ESS target ρ (`--tis-ess-target`): U = the lower edge of bin j for the largest j with
  ESS(U) = (Σ u·min(w, U))² / (Σ u · Σ u·min(w, U)²) ≥ ρ, exact at the edges from the bin sums. ESS(U) does not
  increase with U (d ln ESS/dU = 2k·Σ_{w≤U} u·w(w − U) / (S1·S2) ≤ 0, k = Σ_{w>U} u); when all weights keep ρ, U is
  the edge above the largest weight (no truncation).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import quantiles as Q
from slime_corr.correction.types import WeightInputs
from slime_corr.correction.weights import raw_is_weights

NO_WEIGHT_BOUND = 2.0  # U when a call has no weight at all (nothing is truncated either way)


def bin_sums(values: Tensor, unit: Tensor, moments: int, groups: list[dist.ProcessGroup]) -> Tensor:
    """[moments + 1, bins] float64: Σ u·v^p per level-1 bin of `values` (≥ 0) for p = 0..moments, summed over
    `groups` in one all_reduce. `unit` is 0 where a value does not count."""
    key = Q.level1_keys(values).reshape(-1)
    u = unit.to(torch.float64).expand_as(values).reshape(-1)
    v = torch.where(u > 0, values.to(torch.float64).reshape(-1), 0.0)  # an inf where u = 0 stays out
    rows = [u]
    for _ in range(moments):
        rows.append(rows[-1] * v)
    index = torch.cat([key + i * Q.LEVEL1_BINS for i in range(len(rows))])  # one flat index addition
    out = torch.zeros(len(rows) * Q.LEVEL1_BINS, dtype=torch.float64, device=values.device)
    out = out.index_add_(0, index, torch.cat(rows)).view(len(rows), Q.LEVEL1_BINS)
    for g in groups:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=g)
    return out


def bin_edge(key: Tensor) -> Tensor:
    """The lower edge of level-1 bin `key` (float64; 0 for bin 0, 2^64 past the last bin)."""
    k = key.clamp(1, Q.LEVEL1_BINS).to(torch.int64)
    bits = (k - 1 + Q.EXP_OFFSET) << Q.TOP_SHIFT
    value = bits.to(torch.int32).view(torch.float32).to(torch.float64)
    return torch.where(key > 0, value, torch.zeros_like(value))


def _leading_true(ok: Tensor) -> Tensor:
    """How many entries of the 1-D bool `ok` are true before its first false."""
    return ok.to(torch.int64).cumprod(0).sum()


def mean_budget_key(sums: Tensor, budget: float) -> Tensor:
    """The last bin j whose units are kept under a mean budget (−1: none), from `bin_sums(..., moments=1)`."""
    count, total = sums[0].cumsum(0), sums[1].cumsum(0)
    occupied = torch.nonzero(sums[0] > 0)
    top = occupied.max() if occupied.numel() else torch.zeros((), dtype=torch.int64, device=sums.device)
    return torch.minimum(_leading_true(total <= budget * count) - 1, top)  # all kept: the bound is the top bin's


def keep_below(values: Tensor, last_key: Tensor) -> Tensor:
    """0/1 floats (the dtype of `values`): the value's level-1 bin is ≤ `last_key`."""
    return (Q.level1_keys(values) <= last_key).to(values.dtype)


def ess_bound(sums: Tensor, target: float) -> Tensor:
    """The truncation bound U (0-dim float64) for an ESS target, from `bin_sums(w, u, moments=2)`."""
    n = sums[0].sum()
    zero = sums.new_zeros(3, 1)
    below = torch.cat([zero, sums.cumsum(1)[:, :-1]], 1)  # Σ over the bins below each bin
    edge = bin_edge(torch.arange(Q.LEVEL1_BINS, device=sums.device))
    above = n - below[0]
    s1 = below[1] + edge * above
    s2 = below[2] + edge.square() * above
    ess = s1.square() / (n * s2).clamp_min(1e-300)
    j = _leading_true(ess[1:] >= target * (1 - 1e-12)).clamp_min(1)  # bins 1..: U = 0 (bin 0's edge) is no bound
    occupied = torch.nonzero(sums[0] > 0)
    top = occupied.max() + 1 if occupied.numel() else torch.zeros((), dtype=torch.int64, device=sums.device)
    u = torch.where(j >= top, bin_edge(top), bin_edge(j))  # every edge up to the top keeps ρ: no truncation
    return torch.where(n > 0, u, torch.full_like(u, NO_WEIGHT_BOUND))


def ess_target_bound(inputs: WeightInputs, config: RolloutCorrectionConfig, unit: Tensor,
                     groups: list[dist.ProcessGroup]) -> Tensor:
    """`--tis-ess-target`: U for the raw weights exp(clamp(ℓ, ±20)) of `config.tis_level`, over `unit` ([B, S] per
    token, or [n] per sequence counted once across CP), from one SUM over `groups`."""
    w = raw_is_weights(inputs, config).reshape(unit.shape)
    return ess_bound(bin_sums(w, unit, 2, groups), config.tis_ess_target)


def ess(weights: Tensor, unit: Tensor) -> Tensor:
    """(Σ u·w)² / (Σ u · Σ u·w²): the normalized effective sample size (float64)."""
    u, w = unit.to(torch.float64), weights.to(torch.float64)
    s0, s1, s2 = u.sum(), (u * w).sum(), (u * w * w).sum()
    return s1.square() / (s0 * s2).clamp_min(1e-300)


__all__ = ["bin_edge", "bin_sums", "ess", "ess_bound", "ess_target_bound", "keep_below", "mean_budget_key"]
