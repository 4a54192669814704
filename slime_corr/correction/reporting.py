"""Megatron's reporting format for the correction metrics: `{key: tensor([numerator, denominator])}`.

Megatron-LM's `train_step` sums each pair over a step's micro-batches, all-reduces the sum over DP×CP and logs
numerator / denominator. Every correction metric that is a ratio of sums (KL, k3, ppl terms, chi², fractions,
means) has a pair here, built from the reduced statistics of one call (`CorrectionResult.stats`, already summed
over DP×CP): with r_k the statistics of micro-batch k,

    Σ_k num(r_k) / Σ_k den(r_k) = num(Σ_k r_k) / den(Σ_k r_k) = correction_metrics(merge_stats(r))[key]

because both are linear in the sums. The metrics that are not ratios of sums (`NON_RATIO_METRICS`: extremes, std,
correlation, quantiles, ESS, counts, the normalization factor) have no pair; `correction_metrics` of the merged
statistics gives them for a step. Denominators are clamped to ≥ 1e-30, so an empty set reads 0 (0 / 0 = 0, as in
`correction_metrics`) instead of NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction.statistics import BatchStatistics

MIN_DENOMINATOR = 1e-30
Statistic = Callable[[BatchStatistics], Tensor | None]  # one statistic of a `BatchStatistics`

# metric -> numerator statistic, over the finite valid tokens (`finite_token_count`)
TOKEN_MEANS: dict[str, Statistic] = {
    "mismatch_kl": lambda r: r.negative_log_ratio,
    "mismatch_k3_kl": lambda r: r.k3,
    "mismatch_chi2_token": lambda r: r.chi2_token,
    "train_rollout_logprob_abs_diff": lambda r: r.abs_log_ratio,
    "rollout_probs_diff_mean": lambda r: r.prob_diff,
}
# metric -> numerator statistic, over the finite valid sequences (`finite_seq_count`)
SEQ_MEANS: dict[str, Statistic] = {
    "mismatch_training_log_ppl": lambda r: r.train_log_ppl,
    "mismatch_rollout_log_ppl": lambda r: r.rollout_log_ppl,
    "mismatch_training_ppl": lambda r: r.train_ppl,
    "mismatch_rollout_ppl": lambda r: r.rollout_ppl,
    "mismatch_log_ppl_diff": lambda r: r.log_ppl_diff,
    "mismatch_log_ppl_abs_diff": lambda r: r.log_ppl_abs_diff,
    "mismatch_ppl_ratio": lambda r: r.ppl_ratio,
    "mismatch_chi2_seq": lambda r: r.chi2_seq,
}
# raw-weight fractions per --tis-mode: metric -> numerator statistic, over `raw_weight_units`
RAW_FRACTIONS: dict[str, dict[str, Statistic]] = {
    "truncate": {"mis_truncate_fraction": lambda r: r.raw_above_upper},
    "clip": {"mis_clip_fraction_low": lambda r: r.raw_below_lower, "mis_clip_fraction_high": lambda r: r.raw_above_upper},
    "mask": {"mis_mask_fraction_low": lambda r: r.raw_below_lower, "mis_mask_fraction_high": lambda r: r.raw_above_upper},
}
# metrics of the optional filters and budgets: metric -> (numerator, denominator) statistics, present when the
# numerator is (the veto, the divergence filter, a budgeted bound: the mean over the calls of a step, one per step).
# The one list of them: `correction_metrics` (core.py) and `metric_pairs` read it.
OPTIONAL_RATIOS: dict[str, Callable[[BatchStatistics], tuple[Tensor | None, Tensor | None]]] = {
    "mis_catastrophic_token_fraction": lambda r: (r.vetoed_token_count, r.finite_token_count),
    "mis_catastrophic_seq_fraction": lambda r: (r.vetoed_seq_count, r.finite_seq_count),
    "mis_div_rejected_token_fraction": lambda r: (r.divergence_rejected_token_count, r.finite_token_count),
    "mis_div_rejected_seq_fraction": lambda r: (r.divergence_rejected_seq_count, r.finite_seq_count),
    "mis_rs_divergence_bound": lambda r: (r.divergence_bound_sum, r.divergence_bound_calls),
    "mis_tis_ess_bound": lambda r: (r.tis_ess_bound_sum, r.tis_ess_bound_calls),
}
NON_RATIO_METRICS = frozenset({
    "rollout_probs_diff_max", "rollout_probs_diff_std", "rollout_actor_probs_pearson_corr",
    "mis_valid_token_count", "mis_valid_seq_count", "mis_nonfinite_token_count", "mis_nonfinite_seq_count",
    "mis_contributing_token_count", "mis_custom_nonfinite_weight_count", "mis_all_rejected",
    "mis_invalid_mask_count", "mis_positive_logprob_count", "mis_nan_logprob_count", "mis_custom_negative_weight_count",
    "mis_weight_std", "mis_weight_min", "mis_weight_max", "mis_weight_p10", "mis_weight_p50", "mis_weight_p90",
    "mis_weight_p99", "mis_ess", "mis_batch_norm_factor",
})


def ratio_pair(numerator: Tensor, denominator: Tensor) -> Tensor:
    """`tensor([numerator, max(denominator, 1e-30)])` in float64: one entry of Megatron's reporting dict."""
    return torch.stack([numerator.to(torch.float64), denominator.to(torch.float64).clamp_min(MIN_DENOMINATOR)])


def metric_pairs(
    stats: BatchStatistics, config: RolloutCorrectionConfig, divisor: Tensor | None = None
) -> dict[str, Tensor]:
    """{metric: tensor([numerator, denominator])} for every ratio-of-sums metric of `stats` (one call's
    `CorrectionResult.stats`). `divisor`: the `--tis-batch-normalize` divisor that call applied (its
    `mis_batch_norm_factor` metric), None when it applied none."""
    r = stats
    finite_tokens, finite_seqs, valid_seqs = r.finite_token_count, r.finite_seq_count, r.valid_seq_count
    pairs = {name: ratio_pair(num(r), finite_tokens) for name, num in TOKEN_MEANS.items()}
    pairs.update({name: ratio_pair(num(r), finite_seqs) for name, num in SEQ_MEANS.items()})
    pairs["mis_nonfinite_seq_fraction"] = ratio_pair(valid_seqs - finite_seqs, valid_seqs)
    if not config.use_rollout_correction:
        return pairs
    pairs["mis_rs_rejected_token_fraction"] = ratio_pair(finite_tokens - r.function_kept_token_count, finite_tokens)
    pairs["mis_rs_rejected_seq_fraction"] = ratio_pair(finite_seqs - r.function_kept_seq_count, finite_seqs)
    for name, ratio in OPTIONAL_RATIOS.items():
        num, den = ratio(r)
        if num is not None:
            pairs[name] = ratio_pair(num, den)
    pairs["mis_rejected_token_fraction"] = ratio_pair(r.valid_token_count - r.final_token_count, r.valid_token_count)
    pairs["mis_rejected_seq_fraction"] = ratio_pair(valid_seqs - r.final_seq_count, valid_seqs)
    if r.has_raw_weights:
        pairs["mis_mean_is_weight_before_clip"] = ratio_pair(r.raw_weight_sum, r.raw_weight_units)
        for name, num in RAW_FRACTIONS.get(config.effective_tis_mode, {}).items():
            pairs[name] = ratio_pair(num(r), r.raw_weight_units)
    if r.has_weights:
        weighted = r.weight_sum if divisor is None else r.weight_sum / divisor.to(torch.float64)
        pairs["mis_ratio_mean_after_mis"] = ratio_pair(weighted, r.weight_units)
    return pairs


__all__ = ["MIN_DENOMINATOR", "NON_RATIO_METRICS", "OPTIONAL_RATIOS", "metric_pairs", "ratio_pair"]
