"""A step's metrics in Megatron's reporting format, their reduction, and the step's correction statistics.

`loss_func`'s report for one micro-batch holds only what Megatron-LM's `train_step` accepts (and logs through
`training_log` unchanged):

- `[numerator, denominator]` pairs (float64). Megatron sums them over the step's micro-batches, all-reduces the
  sums over DP×CP and logs numerator / denominator, which is the step value:
  `pg_loss` = [loss_sum, count] (the loss the gradients are of); the loss-level token means `ppo_kl`,
  `pg_clipfrac`, `ois` = [mean · tokens, tokens]; `pg_nonfinite_token_fraction` = [dropped tokens, tokens in the
  loss mask]; `pg_nonfinite_advantage_fraction` = [NaN/inf advantages, valid tokens]; `entropy` = [Σ H, valid
  tokens]; every ratio-of-sums correction metric (`slime_corr.correction.reporting`), contributed by DP×CP rank 0
  only (zeros elsewhere), since the core's statistics of a micro-batch are already reduced over DP×CP; and with a
  correction that rejects, the reward-aware rejection pairs (`slime_corr.correction.rejection_outcomes`).
- 1-element tensors: a custom weighting function's own metrics (Megatron averages them over micro-batches).

The correction metrics that are not ratios (min/max, std, quantiles, ESS, counts) cannot be averaged that way:
`StepStatistics` merges the statistics of a step's micro-batches so they are computed exactly for the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import BatchStatistics, correction_metrics, merge_stats
from slime_corr.correction.rejection_outcomes import rejection_outcome_pairs
from slime_corr.correction.reporting import metric_pairs, ratio_pair
from slime_corr.layout.segments import Segments
from slime_corr.losses import M2PO_COUNT, OPSM_COUNT, SEQ_ERROR_COUNT
from slime_corr.mcore.context_parallel import ParallelGroups, all_reduce_dp_cp

NONFINITE_COUNT = "pg_nonfinite_token_count"
NONFINITE_FRACTION = "pg_nonfinite_token_fraction"
ADVANTAGE_COUNT = "pg_nonfinite_advantage_count"  # `compute_policy_loss`'s; an error on the host (check_host_metrics)
# counts reported as [count, tokens] pairs (Megatron logs the fraction), read back as the count over DP×CP
COUNT_FRACTIONS = {NONFINITE_COUNT: NONFINITE_FRACTION, ADVANTAGE_COUNT: "pg_nonfinite_advantage_fraction",
                   OPSM_COUNT: "pg_opsm_masked_token_fraction",  # OPSM: of the valid tokens
                   M2PO_COUNT: "pg_m2po_masked_token_fraction",
                   SEQ_ERROR_COUNT: "pg_seq_logprob_error_masked_token_fraction"}


def _rank(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group=group)


def is_dp_cp_first(groups: ParallelGroups) -> bool:
    """Whether this rank is rank 0 of its DP×CP group (each TP rank has its own)."""
    if groups.dp_cp is not None:
        return _rank(groups.dp_cp) == 0
    return groups.cp_rank == 0 and _rank(groups.dp) == 0


def build_report(
    out: Any,
    config: RolloutCorrectionConfig,
    groups: ParallelGroups,
    loss_mask: Tensor,
    entropy: Tensor | None,
    batch: dict[str, Tensor] | None = None,
    segments: Segments | None = None,
) -> dict[str, Tensor]:
    """Megatron's reporting dict of one micro-batch from the `PolicyLossOutput` `out` (see the module doc). With
    `batch` (its `advantages` and per-sequence `rewards`) and a correction that rejects, the reward-aware
    rejection pairs too (`correction.rejection_outcomes`)."""
    corr = out.correction
    used = corr.loss_mask > 0 if corr is not None and config.use_rollout_correction else loss_mask > 0
    in_mask = used.sum().to(torch.float64)
    nonfinite = out.metrics.get(NONFINITE_COUNT, in_mask.new_zeros(())).to(torch.float64)
    tokens = in_mask - nonfinite  # the tokens the loss-level means are over
    report = {"pg_loss": ratio_pair(out.loss_sum.detach(), out.denominator.detach())}
    skip = set(corr.metrics) if corr is not None else set()
    for key, value in out.metrics.items():
        if key in skip or key == "pg_loss":
            continue
        if key in COUNT_FRACTIONS:  # dropped tokens of the trained ones; NaN/inf advantages of the valid ones
            total = in_mask if key == NONFINITE_COUNT else (loss_mask > 0).sum().to(torch.float64)
            report[COUNT_FRACTIONS[key]] = ratio_pair(value.detach().to(torch.float64), total)
            continue
        report[key] = ratio_pair(value.detach().to(torch.float64) * tokens, tokens)
    report[NONFINITE_FRACTION] = ratio_pair(nonfinite, in_mask)
    if entropy is not None:
        valid = loss_mask > 0
        report["entropy"] = ratio_pair(torch.where(valid, entropy.detach(), 0).sum(), valid.sum())
    if corr is not None and corr.stats:
        first = is_dp_cp_first(groups)
        for key, pair in metric_pairs(corr.stats, config, corr.divisor).items():
            report[key] = pair if first else torch.zeros_like(pair)
        for key, value in corr.function_metrics.items():
            report[key] = value.detach().to(torch.float64).reshape(1)
    if corr is not None and batch is not None and config.rejects:
        report.update(rejection_outcome_pairs(loss_mask, corr.loss_mask, batch["advantages"], batch.get("rewards"),
                                              segments, groups.cp))
    return report


def reduce_reports(reports: Sequence[dict[str, Tensor]], groups: ParallelGroups) -> dict[str, Tensor]:
    """What Megatron-LM's `train_step` does with the reports of a step: pairs summed over micro-batches and
    DP×CP (ONE all-reduce), 1-element values averaged over micro-batches. Returns {key: [Σ num, Σ den]} for
    pairs and {key: mean} for the others."""
    keys = list(reports[0])
    if any(list(r) != keys for r in reports[1:]):
        raise ValueError(f"micro-batch reports have different keys: {[sorted(r) for r in reports]}")
    pairs = [k for k in keys if reports[0][k].numel() == 2]
    out: dict[str, Tensor] = {}
    if pairs:
        total = torch.stack([torch.stack([r[k].reshape(2) for k in pairs]) for r in reports]).sum(0)
        all_reduce_dp_cp(total, groups)
        out.update(zip(pairs, total.unbind(0), strict=True))
    for k in keys:
        if k not in out:
            out[k] = torch.cat([r[k].reshape(1) for r in reports]).mean()
    return out


class StepStatistics:
    """The correction statistics of a step's training micro-batches, merged as they arrive (O(1) memory), and
    the step's custom-function metrics; `pop` finalizes every correction metric of the step and starts anew."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.stats: BatchStatistics | None = None
        self.function_sums: dict[str, Tensor] = {}
        self.advantage_count: Tensor | None = None  # this rank's NaN/inf advantages (the loss's, not the correction's)
        self.micro_batches = 0

    @property
    def empty(self) -> bool:
        return not self.micro_batches and self.advantage_count is None

    def add_advantage_count(self, count: Tensor) -> None:
        self.advantage_count = count if self.advantage_count is None else self.advantage_count + count

    def add(self, stats: BatchStatistics, function_metrics: dict[str, Tensor]) -> None:
        self.stats = merge_stats([self.stats, stats]) if self.stats is not None else stats
        for key, value in function_metrics.items():
            v = value.detach().to(torch.float64)
            self.function_sums[key] = self.function_sums[key] + v if key in self.function_sums else v
        self.micro_batches += 1

    def pop(self, config: RolloutCorrectionConfig) -> dict[str, Tensor]:
        """Every correction metric of the step (exact, as one batch) and the custom-function metrics (mean over
        micro-batches); {} when no micro-batch was added. No collective: the statistics are already global."""
        out: dict[str, Tensor] = {}
        if self.stats is not None:
            out.update(correction_metrics(self.stats, config))
        out.update({k: v / self.micro_batches for k, v in self.function_sums.items()})
        if self.advantage_count is not None:
            out[ADVANTAGE_COUNT] = self.advantage_count
        self.reset()
        return out


__all__ = ["ADVANTAGE_COUNT", "COUNT_FRACTIONS", "StepStatistics", "build_report", "is_dp_cp_first", "reduce_reports"]
