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

import torch
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig

MIN_DENOMINATOR = 1e-30

# metric -> numerator statistic, over the finite valid tokens ("n_tok")
TOKEN_MEANS = {
    "mismatch_kl": "tok_neg_lr",
    "mismatch_k3_kl": "tok_k3",
    "mismatch_chi2_token": "tok_chi2",
    "train_rollout_logprob_abs_diff": "tok_abs_lr",
    "rollout_probs_diff_mean": "tok_d",
}
# metric -> numerator statistic, over the finite valid sequences ("n_seq")
SEQ_MEANS = {
    "mismatch_training_log_ppl": "seq_train_log_ppl",
    "mismatch_rollout_log_ppl": "seq_rollout_log_ppl",
    "mismatch_training_ppl": "seq_train_ppl",
    "mismatch_rollout_ppl": "seq_rollout_ppl",
    "mismatch_log_ppl_diff": "seq_log_ppl_diff",
    "mismatch_log_ppl_abs_diff": "seq_log_ppl_abs_diff",
    "mismatch_ppl_ratio": "seq_ppl_ratio",
    "mismatch_chi2_seq": "seq_chi2",
}
# raw-weight fractions per --tis-mode: metric -> numerator statistic, over "raw_u"
RAW_FRACTIONS = {
    "truncate": {"mis_truncate_fraction": "raw_high"},
    "clip": {"mis_clip_fraction_low": "raw_low", "mis_clip_fraction_high": "raw_high"},
    "mask": {"mis_mask_fraction_low": "raw_low", "mis_mask_fraction_high": "raw_high"},
}
# metrics of the optional filters and budgets: metric -> (numerator, denominator) statistics, present when the
# numerator is (the veto, the divergence filter, a budgeted bound: the mean over the calls of a step, one per step).
# The one list of them: `correction_metrics` (core.py) and `metric_pairs` read it.
OPTIONAL_RATIOS = {
    "mis_catastrophic_token_fraction": ("n_cat_tok", "n_tok"),
    "mis_catastrophic_seq_fraction": ("n_cat_seq", "n_seq"),
    "mis_div_rejected_token_fraction": ("n_div_tok", "n_tok"),
    "mis_div_rejected_seq_fraction": ("n_div_seq", "n_seq"),
    "mis_rs_divergence_bound": ("div_bound_sum", "div_bound_calls"),
    "mis_tis_ess_bound": ("tis_bound_sum", "tis_bound_calls"),
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
    stats: dict[str, Tensor], config: RolloutCorrectionConfig, divisor: Tensor | None = None
) -> dict[str, Tensor]:
    """{metric: tensor([numerator, denominator])} for every ratio-of-sums metric of `stats` (one call's
    `CorrectionResult.stats`). `divisor`: the `--tis-batch-normalize` divisor that call applied (its
    `mis_batch_norm_factor` metric), None when it applied none."""
    r = stats
    pairs = {name: ratio_pair(r[num], r["n_tok"]) for name, num in TOKEN_MEANS.items()}
    pairs.update({name: ratio_pair(r[num], r["n_seq"]) for name, num in SEQ_MEANS.items()})
    n_tok, n_seq, n_valid_seq = r["n_tok"], r["n_seq"], r["n_valid_seq"]
    pairs["mis_nonfinite_seq_fraction"] = ratio_pair(n_valid_seq - n_seq, n_valid_seq)
    if not config.use_rollout_correction:
        return pairs
    pairs["mis_rs_rejected_token_fraction"] = ratio_pair(n_tok - r["n_fn_tok"], n_tok)
    pairs["mis_rs_rejected_seq_fraction"] = ratio_pair(n_seq - r["n_fn_seq"], n_seq)
    pairs.update({name: ratio_pair(r[num], r[den]) for name, (num, den) in OPTIONAL_RATIOS.items() if num in r})
    pairs["mis_rejected_token_fraction"] = ratio_pair(r["n_valid_tok"] - r["n_final_tok"], r["n_valid_tok"])
    pairs["mis_rejected_seq_fraction"] = ratio_pair(n_valid_seq - r["n_final_seq"], n_valid_seq)
    if "raw_u" in r:
        pairs["mis_mean_is_weight_before_clip"] = ratio_pair(r["raw_uw"], r["raw_u"])
        for name, num in RAW_FRACTIONS.get(config.effective_tis_mode, {}).items():
            pairs[name] = ratio_pair(r[num], r["raw_u"])
    if "w_u" in r:
        weighted = r["w_uw"] if divisor is None else r["w_uw"] / divisor.to(torch.float64)
        pairs["mis_ratio_mean_after_mis"] = ratio_pair(weighted, r["w_u"])
    return pairs


__all__ = ["MIN_DENOMINATOR", "NON_RATIO_METRICS", "OPTIONAL_RATIOS", "metric_pairs", "ratio_pair"]
