"""Divergence rejection: `--rs-metric k2|k3`, `--rs-agg token|mean|max`, `--rs-divergence-bound b` (or `-budget`).

Per valid token, with lr = lp_train − lp_rollout (unclamped): k2 = lr²/2, k3 = exp(lr) − 1 − lr, and the binary KL
(KPop; AReaL's `binary_kl`) of the two-outcome split {the sampled token, the rest} under q = π_rollout(y) and
p = π_train(y): q·log(q/p) + (1−q)·log((1−q)/(1−p)), which also sees a token whose probability moved where the
ratio hardly did (q = 0.99 → p = 0.9999). All are ≥ 0 and 0 on-policy (k3's mean over π_rollout's samples is
KL(π_rollout ‖ π_train)), so only an UPPER bound applies, on both sides of p = q: a unit is kept iff its divergence
is ≤ b.
- token: each token with d_t ≤ b stays (its sequence stays);
- mean: a sequence stays iff Σ_t m·d_t / Σ_t m ≤ b;  sum: iff Σ_t m·d_t ≤ b;  max: iff max_t d_t ≤ b, i.e.
  #{t: d_t > b} = 0.
Both sequence decisions come from sums over the sequence's tokens, so under context parallelism they are columns of
the core's ONE per-sequence all_reduce (no MAX collective). A non-finite log-prob makes d = inf (the sequence is
rejected anyway). verl's names: token_k3 = (k3, token), seq_mean_k3 = (k3, mean), seq_sum_k2 = (k2, sum), seq_max_k2 = (k2, max).
With `--rs-divergence-budget β` the bound is set from the statistics of the call, or of its optimizer step
(`budget.StepBounds`): token level before the sequence sums, over the finite valid tokens; mean/sum level after
them, over the finite valid sequences.
It applies with any weighting function, ratio RS (`--use-rs`) and the veto; each rejection is counted on its own
(`mis_div_rejected_token_fraction`, `mis_div_rejected_seq_fraction`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import budget
from slime_corr.correction.reductions import at_most_, count_greater_, indicator
from slime_corr.layout.segments import Segments

MAX_FINITE_LOG_RATIO = 1e30  # |lr| above this marks a non-finite log-prob (`metrics.MAX_ABS_LOG_RATIO`)


def token_divergence(lr: Tensor, metric: str, rollout_log_probs: Tensor | None = None) -> Tensor:
    """k2 = lr²/2, k3 = exp(lr) − 1 − lr, or the binary KL (needs `rollout_log_probs`, NaN-free) per token: a new
    tensor, 0 where lr = 0, never NaN for NaN-free inputs (+inf where p reaches 1 and q does not)."""
    if metric == "k2":
        return lr.square().mul_(0.5)
    if metric == "k3":
        return torch.expm1(lr).sub_(lr)
    if metric == "binary_kl":
        if rollout_log_probs is None:
            raise ValueError("--rs-metric binary_kl needs the rollout's log-probs")
        q_rest = -torch.expm1(rollout_log_probs)  # 1 − q
        p_rest = (-torch.expm1(rollout_log_probs + lr)).clamp_min_(0)  # 1 − p
        return (torch.xlogy(q_rest, q_rest) - torch.xlogy(q_rest, p_rest)).sub_(rollout_log_probs.exp() * lr)
    raise ValueError(f"--rs-metric {metric!r} is not a divergence (k2, k3, binary_kl)")


class TokenStage(NamedTuple):
    """The divergence filter before the sequence sums."""

    columns: Tensor  # [n, 2] local per-sequence sums for the CP all_reduce (see `token_stage`)
    keep: Tensor | None  # token level: the 0/1 keep of the filter AND `ratio_keep` (valid tokens only)
    bound: Tensor | None  # the budgeted bound of this call (0-dim float64), else None


def token_stage(lr: Tensor, valid: Tensor, ratio_keep: Tensor | None, config: RolloutCorrectionConfig,
                seg: Segments, groups: list[dist.ProcessGroup], step: budget.StepBounds | None = None,
                rollout_log_probs: Tensor | None = None) -> TokenStage:
    """Columns: token level [Σ filter keep, Σ filter keep·ratio keep]; mean/sum [Σ m·d, 0]; max [#{d > b}, 0].
    `lr` is 0 outside `valid` and NaN-free; `ratio_keep` the token-RS keep (`--use-rs --rs-level token`) or None;
    `step`: the budget's step statistics (None: this call's); `rollout_log_probs` for binary_kl."""
    lq = None
    if config.rs_metric == "binary_kl":  # 0 outside the valid finite tokens, as lr is
        assert rollout_log_probs is not None, "binary_kl needs rollout_log_probs"
        lq = torch.where((valid > 0) & torch.isfinite(rollout_log_probs), rollout_log_probs, 0).to(lr.dtype)
    d = token_divergence(lr, config.rs_metric, lq)
    bound = None
    if config.rs_agg == "token":
        if config.rs_divergence_budget is not None:
            finite = at_most_(lr.abs(), MAX_FINITE_LOG_RATIO).mul_(valid)
            sums = budget.budget_sums("div", d, finite, 1, groups, step)
            last = budget.mean_budget_key(sums, config.rs_divergence_budget)
            keep = budget.keep_below(d, last).mul_(valid)
            bound = budget.bin_edge(last + 1)
        else:
            keep = indicator(torch.le, d, config.rs_divergence_bound).mul_(valid)
        both = keep if ratio_keep is None else keep * ratio_keep
        return TokenStage(seg.sum(torch.stack([keep, both], 1)), both, bound)
    if config.rs_agg in ("mean", "sum"):
        column = seg.sum(d.mul_(valid))
    else:  # max: the count of tokens above the bound (0 outside the mask: d = 0 there)
        column = count_greater_(d, config.rs_divergence_bound, seg)
    column = column.to(lr.dtype)
    return TokenStage(torch.stack([column, torch.zeros_like(column)], -1), None, None)


def sequence_keep(columns: Tensor, n_tok: Tensor, seq_ok: Tensor, config: RolloutCorrectionConfig, cp0: float,
                  groups: list[dist.ProcessGroup], step: budget.StepBounds | None = None) -> tuple[Tensor, Tensor | None]:
    """Sequence level (mean/sum/max): ([n] 0/1 keep, the budgeted bound or None) from the CP-reduced `columns` of
    `token_stage`. `n_tok` [n]: valid tokens per sequence; `seq_ok`: the finite valid sequences (budget units,
    counted once across CP with `cp0`)."""
    value = columns[:, 0]
    if config.rs_agg == "max":
        return (value <= 0).to(value.dtype), None
    mean = value / n_tok.clamp_min(1) if config.rs_agg == "mean" else value
    if config.rs_divergence_budget is None:
        return (mean <= config.rs_divergence_bound).to(value.dtype), None
    safe = torch.where(seq_ok, mean, torch.zeros_like(mean))  # a rejected sequence's inf/NaN stays out
    sums = budget.budget_sums("div", safe, seq_ok.to(torch.float64) * cp0, 1, groups, step)
    last = budget.mean_budget_key(sums, config.rs_divergence_budget)
    return budget.keep_below(safe, last), budget.bin_edge(last + 1)


__all__ = ["TokenStage", "sequence_keep", "token_divergence", "token_stage"]
