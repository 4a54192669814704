"""slime's metric names for slime_corr's metrics: one table, used by the hook and by `MetricsLogger`.

slime logs its training metrics as `train/<key>` (`slime/backends/megatron_utils/model.py`) and its rollout
metrics as `rollout/<key>` (`slime/observability/rollout_metrics.py`); its CI asserts on
`train/train_rollout_logprob_abs_diff`. The keys of slime's `mis.py` are `mis_<its name>`. Every alias below has
the same meaning as the slime_corr metric it copies (slime_corr's definition: exact batch statistics over the DP
and CP ranks, token means over the batch where slime averages per sample first).
"""

from __future__ import annotations

from collections.abc import Mapping

METRIC_NAMINGS = ("slime_corr", "slime", "both")

# slime_corr correction-metric key (no prefix) -> slime's mis.py key (no prefix)
MIS_NAMES: dict[str, str] = {
    "mismatch_training_log_ppl": "mis_training_log_ppl",
    "mismatch_training_ppl": "mis_training_ppl",
    "mismatch_rollout_log_ppl": "mis_rollout_log_ppl",
    "mismatch_rollout_ppl": "mis_rollout_ppl",
    "mismatch_kl": "mis_kl",
    "mismatch_k3_kl": "mis_k3_kl",
    "mismatch_log_ppl_diff": "mis_log_ppl_diff",
    "mismatch_log_ppl_abs_diff": "mis_log_ppl_abs_diff",
    "mismatch_ppl_ratio": "mis_ppl_ratio",
    "mismatch_chi2_token": "mis_chi2_token",
    "mismatch_chi2_seq": "mis_chi2_seq",
    "mis_mean_is_weight_before_clip": "mis_tis_weight_before_bound",
    "mis_truncate_fraction": "mis_tis_truncate_fraction",
    "mis_clip_fraction_low": "mis_tis_clip_fraction_low",
    "mis_clip_fraction_high": "mis_tis_clip_fraction_high",
    "mis_mask_fraction_low": "mis_tis_mask_fraction_low",
    "mis_mask_fraction_high": "mis_tis_mask_fraction_high",
    "mis_catastrophic_token_fraction": "mis_rs_catastrophic_token_fraction",
    "mis_catastrophic_seq_fraction": "mis_rs_catastrophic_seq_fraction",
    "mis_ratio_mean_after_mis": "mis_is_ratio_mean_final",
    "mis_weight_min": "mis_is_ratio_min_final",
    "mis_weight_max": "mis_is_ratio_max_final",
}
# the vanilla TIS keys slime's loss.py logs: `tis` (mean raw ratio), `tis_clipfrac` (share of bounded weights)
TIS_FRACTIONS = ("mis_truncate_fraction", "mis_clip_fraction_low", "mis_clip_fraction_high",
                 "mis_mask_fraction_low", "mis_mask_fraction_high")

# slime_corr's logged key (with prefix) -> slime's logged keys
LOGGED_NAMES: dict[str, tuple[str, ...]] = {
    **{f"rollout_corr/{ours}": (f"train/{theirs}",) for ours, theirs in MIS_NAMES.items()},
    "rollout_corr/train_rollout_logprob_abs_diff": ("train/train_rollout_logprob_abs_diff",),
    "rollout_corr/ois": ("train/ois",),
    "rollout_corr/mis_mean_is_weight_before_clip": ("train/tis", "train/mis_tis_weight_before_bound"),
    "train/entropy": ("train/entropy_loss",),
    "rollout/reward_mean": ("rollout/raw_reward",),
    "rollout/response_length_mean": ("rollout/response_len/mean",),
    "rollout/truncated_fraction": ("rollout/truncated_ratio",),
}


def tis_clipfrac(metrics: Mapping[str, float], prefix: str = "") -> float | None:
    """slime's `tis_clipfrac` (share of IS weights changed by the bound) from slime_corr's mode fractions."""
    parts = [metrics[prefix + k] for k in TIS_FRACTIONS if prefix + k in metrics]
    return sum(parts) if parts else None


def slime_named(metrics: Mapping[str, float], naming: str = "both") -> dict[str, float]:
    """A step's logged metrics under `naming`: slime_corr's keys, slime's (each key slime has replaced by its
    slime name, `train/tis_clipfrac` added), or both."""
    if naming not in METRIC_NAMINGS:
        raise ValueError(f"--metric-names {naming!r} is not one of {', '.join(METRIC_NAMINGS)}.")
    if naming == "slime_corr":
        return dict(metrics)
    aliases = {alias: v for k, v in metrics.items() for alias in LOGGED_NAMES.get(k, ())}
    clipfrac = tis_clipfrac(metrics, "rollout_corr/")
    if clipfrac is not None:
        aliases["train/tis_clipfrac"] = clipfrac
    kept = metrics if naming == "both" else {k: v for k, v in metrics.items() if k not in LOGGED_NAMES}
    return {**kept, **aliases}


__all__ = ["LOGGED_NAMES", "METRIC_NAMINGS", "MIS_NAMES", "slime_named", "tis_clipfrac"]
