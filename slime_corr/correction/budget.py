"""Bounds from a budget: the truncation / rejection bound of each call, chosen from the call's own statistics.

Both use the level-1 bins of `quantiles.py` (8192 bins, ~3 % wide, over every float32 from 0 to inf, on the bits):
per bin, Σ u, Σ u·v (and Σ u·v² for the ESS) of the values v with units u (`quantiles.bin_sums`: an index addition on
the CPU, sorted cumulative sums elsewhere, no contended atomics), ONE SUM all_reduce over DP x CP, then a cumulative
scan. Nothing is gathered; the bound is exact at bin edges, so it lies within one bin (3 %) of the exact one.

- Mean budget β (`--rs-divergence-budget`): keep the units whose value falls in bins 0..j, for the largest j with
  Σ_kept u·v / Σ_kept u ≤ β. The kept mean never decreases with j, so j is unique; if even the lowest occupied bin's
  mean exceeds β, no unit is kept. With k2 per token this is M2PO's second-moment budget (M2 = 2·mean k2).
- ESS target ρ (`--tis-ess-target`): U = the lower edge of bin j for the largest j with
  ESS(U) = (Σ u·min(w, U))² / (Σ u · Σ u·min(w, U)²) ≥ ρ, exact at the edges from the bin sums. ESS(U) does not
  increase with U (d ln ESS/dU = 2k·Σ_{w≤U} u·w(w − U) / (S1·S2) ≤ 0, k = Σ_{w>U} u); when all weights keep ρ, U is
  the edge above the largest weight (no truncation).

Per optimizer step (`StepBounds`): a step of several micro-batches takes ONE bound from the whole step's statistics,
as if the step were one batch. The bin sums are additive, so each micro-batch's local sums are added up (a
collecting pass over the step, no collective) and reduced once (`StepBounds.finish`: one SUM per group); every
micro-batch of the step then decides with the step's sums, and logs the step's bound.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import quantiles
from slime_corr.correction.builtin_weights import raw_is_weights
from slime_corr.correction.public_types import WeightInputs

NO_WEIGHT_BOUND = 2.0  # U when a call has no weight at all (nothing is truncated either way)
INF_KEY = 0x7F800000 >> quantiles.TOP_SHIFT  # the level-1 bin of inf (the bins above hold NaNs)


def bin_sums(values: Tensor, unit: Tensor, moments: int, groups: list[dist.ProcessGroup]) -> Tensor:
    """[moments + 1, bins] float64: Σ u·v^p per level-1 bin of `values` (≥ 0) for p = 0..moments, summed over
    `groups` in one all_reduce. `unit` is 0 where a value does not count."""
    key = quantiles.level1_keys(values).reshape(-1)
    u = unit.to(torch.float64).expand_as(values).reshape(-1)
    v = torch.where(u > 0, values.to(torch.float64).reshape(-1), 0.0)  # an inf where u = 0 stays out
    rows = [u]
    for _ in range(moments):
        rows.append(rows[-1] * v)
    out = quantiles.bin_sums(key, torch.stack(rows))
    for g in groups:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=g)
    return out


class StepBounds:
    """The budgeted bounds of one optimizer step (all its micro-batches, all DP×CP ranks), for
    `compute_rollout_correction(..., step_bounds=)`:

        bounds = StepBounds()
        for mb in step: compute_rollout_correction(mb..., step_bounds=bounds)   # collecting: results provisional
        bounds.finish(groups)                                                    # one SUM all_reduce per group
        for mb in step: compute_rollout_correction(mb..., step_bounds=bounds)   # each uses the step's bounds

    While collecting, each call adds its local bin sums and decides from them alone (its results are to be
    discarded); once finished, every call decides from the step's reduced sums. Every rank must collect the same
    budgets (the same config) before `finish`."""

    def __init__(self) -> None:
        self._sums: dict[str, Tensor] = {}
        self.finished = False

    def sums(self, name: str, values: Tensor, unit: Tensor, moments: int) -> Tensor:
        """The bin sums for the decision `name`: collecting, this call's local ones (added to the step's);
        finished, the step's."""
        if self.finished:
            if name not in self._sums:
                raise ValueError(f"StepBounds: no {name!r} statistics were collected for this step (collect with "
                                 "the same config as the decisions)")
            return self._sums[name]
        local = bin_sums(values, unit, moments, [])
        if name in self._sums:
            self._sums[name] = self._sums[name] + local
        else:
            self._sums[name] = local
        return local

    def finish(self, groups: list[dist.ProcessGroup]) -> StepBounds:
        """Sum the collected statistics over `groups` (DP and CP: ONE all_reduce per group for all budgets)."""
        if self.finished:
            raise ValueError("StepBounds.finish: already finished (use a new StepBounds per step)")
        names = sorted(self._sums)
        if names and groups:
            flat = torch.cat([self._sums[n].reshape(-1) for n in names])
            for g in groups:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=g)
            self._sums = dict(zip(names, flat.split([self._sums[n].numel() for n in names]), strict=True))
            self._sums = {n: v.view(-1, quantiles.LEVEL1_BINS) for n, v in self._sums.items()}
        self.finished = True
        return self


def budget_sums(name: str, values: Tensor, unit: Tensor, moments: int, groups: list[dist.ProcessGroup],
                step: StepBounds | None) -> Tensor:
    """`bin_sums` of this call over `groups` (no step), or the step's (`StepBounds.sums`)."""
    if step is None:
        return bin_sums(values, unit, moments, groups)
    return step.sums(name, values, unit, moments)


def bin_edge(key: Tensor) -> Tensor:
    """The lower edge of level-1 bin `key` (float64; 0 for bin 0, inf from the bin of inf on, past the last)."""
    bits = key.clamp(0, INF_KEY).to(torch.int32) << quantiles.TOP_SHIFT
    return bits.view(torch.float32).to(torch.float64)


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
    return (quantiles.level1_keys(values) <= last_key).to(values.dtype)


def ess_bound(sums: Tensor, target: float) -> Tensor:
    """The truncation bound U (0-dim float64) for an ESS target, from `bin_sums(w, u, moments=2)`."""
    n = sums[0].sum()
    zero = sums.new_zeros(3, 1)
    below = torch.cat([zero, sums.cumsum(1)[:, :-1]], 1)  # Σ over the bins below each bin
    edge = bin_edge(torch.arange(quantiles.LEVEL1_BINS, device=sums.device))
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
                     groups: list[dist.ProcessGroup], step: StepBounds | None = None) -> Tensor:
    """`--tis-ess-target`: U for the raw weights exp(clamp(ℓ, ±20)) of `config.tis_level`, over `unit` ([B, S] per
    token, or [n] per sequence counted once across CP), from one SUM over `groups` (or the `step`'s)."""
    w = raw_is_weights(inputs, config).reshape(unit.shape)
    return ess_bound(budget_sums("tis", w, unit, 2, groups, step), config.tis_ess_target)


def ess(weights: Tensor, unit: Tensor) -> Tensor:
    """(Σ u·w)² / (Σ u · Σ u·w²): the normalized effective sample size (float64)."""
    u, w = unit.to(torch.float64), weights.to(torch.float64)
    s0, s1, s2 = u.sum(), (u * w).sum(), (u * w * w).sum()
    return s1.square() / (s0 * s2).clamp_min(1e-300)


__all__ = ["StepBounds", "bin_edge", "bin_sums", "budget_sums", "ess", "ess_bound", "ess_target_bound", "keep_below",
           "mean_budget_key"]
