"""The metric key scheme: `<prefix>/<name>`, with docs/metrics.md's names unchanged after the prefix.

| prefix | what | examples |
| --- | --- | --- |
| `rollout_corr/` | the correction metrics of docs/metrics.md, and a custom weighting function's own | `rollout_corr/mismatch_k3_kl`, `rollout_corr/mis_ess`, `rollout_corr/ois` |
| `train/` | the policy loss and the optimizer | `train/loss`, `train/pg_clipfrac`, `train/ppo_kl`, `train/grad_norm`, `train/kl_loss` |
| `rollout/` | the step's samples | `rollout/reward_mean`, `rollout/samples`, `rollout/staleness_mean` |
| `perf/` | time | `perf/step_time`, `perf/rollout_time`, `perf/train_time`, `perf/weight_sync_time` |
| `diag/` | the diagnostics of `slime_corr.correction.diagnostics` | `diag/prob/lt_1e-06/k3`, `diag/drift/mismatch_share` |
"""

from __future__ import annotations

from collections.abc import Mapping

CORRECTION, TRAIN, ROLLOUT, PERF, DIAG = "rollout_corr", "train", "rollout", "perf", "diag"
PREFIXES = (CORRECTION, TRAIN, ROLLOUT, PERF, DIAG)

# Keys of `RolloutCorrectionLoss.reduce_step_metrics` that belong to the loss, not to the correction.
TRAIN_KEYS = frozenset({"loss", "pg_loss", "loss_denominator", "pg_clipfrac", "ppo_kl", "entropy",
                        "pg_nonfinite_token_count", "pg_nonfinite_advantage_count", "pg_opsm_masked_token_count",
                        "pg_opsm_masked_token_fraction", "pg_m2po_masked_token_count", "pg_m2po_masked_token_fraction",
                        "pg_seq_logprob_error_masked_token_count", "pg_seq_logprob_error_masked_token_fraction",
                        "kl_loss", "grad_norm", "loss_scale", "skipped_steps",
                        "baseline_rejected_samples", "prox_logp_abs_error_mean", "prox_logp_abs_error_max"})

# Keys of the loss's report that are MoE routing diagnostics (`slime_corr.correction.routing`): -> `diag/`.
ROUTING_KEY_PREFIXES = ("routing_mismatch_", "logprob_abs_diff_routing_")

# The console line: (key, label) in order; a key the step does not have is left out.
CONSOLE_KEYS = (
    (f"{ROLLOUT}/trained_samples", "trained"),
    (f"{ROLLOUT}/failed_samples", "failed"),
    (f"{ROLLOUT}/reward_mean", "reward"),
    (f"{TRAIN}/loss", "loss"),
    (f"{TRAIN}/pg_clipfrac", "pg_clipfrac"),
    (f"{TRAIN}/ppo_kl", "ppo_kl"),
    (f"{TRAIN}/grad_norm", "grad_norm"),
    (f"{TRAIN}/loss_scale", "loss_scale"),  # --bf16 / --fp16
    (f"{TRAIN}/skipped_steps", "skipped"),
    (f"{ROLLOUT}/staleness_mean", "staleness"),
    (f"{TRAIN}/kl_loss", "kl_loss"),
    (f"{TRAIN}/entropy", "entropy"),
    (f"{PERF}/step_time", "step_time"),
    (f"{CORRECTION}/mismatch_kl", "mismatch_kl"),
    (f"{CORRECTION}/mismatch_k3_kl", "mismatch_k3_kl"),
    (f"{CORRECTION}/train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff"),
    (f"{CORRECTION}/mis_ess", "mis_ess"),
    (f"{CORRECTION}/mis_rejected_seq_fraction", "mis_rejected_seq_fraction"),
    (f"{CORRECTION}/mis_weight_p99", "mis_weight_p99"),
    (f"{DIAG}/routing_mismatch_frac", "routing_mismatch"),  # MoE: trainer vs engine expert choices
    (f"{CORRECTION}/mismatch_nucleus_disagreement", "nucleus_disagreement"),  # --rollout-top-p / --rollout-top-k
    (f"{CORRECTION}/mismatch_nucleus_ratio_mean", "nucleus_ratio"),
    (f"{CORRECTION}/mismatch_nucleus_uncorrected_ratio_mean", "nucleus_uncorrected_ratio"),
    (f"{CORRECTION}/mismatch_nucleus_engine_share", "nucleus_engine_share"),  # --rollout-nucleus-logprobs
    (f"{CORRECTION}/mismatch_nucleus_mass_abs_log_ratio", "nucleus_mass_abs_log_ratio"),
)


def with_prefix(prefix: str, metrics: Mapping[str, float]) -> dict[str, float]:
    """`{f"{prefix}/{key}": value}`; `prefix` must be one of PREFIXES."""
    if prefix not in PREFIXES:
        raise ValueError(f"prefix: {prefix!r} is not one of {', '.join(PREFIXES)}")
    return {f"{prefix}/{k}": v for k, v in metrics.items()}


def loss_step_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The flat dict `RolloutCorrectionLoss.train_step` / `reduce_step_metrics` returns, under the scheme:
    its loss keys (TRAIN_KEYS) -> `train/`, the MoE routing-mismatch keys (ROUTING_KEY_PREFIXES) -> `diag/`,
    everything else (docs/metrics.md's correction metrics and a custom weighting function's) -> `rollout_corr/`."""
    def prefix(k: str) -> str:
        return TRAIN if k in TRAIN_KEYS else DIAG if k.startswith(ROUTING_KEY_PREFIXES) else CORRECTION

    return {f"{prefix(k)}/{k}": v for k, v in metrics.items()}


__all__ = ["CONSOLE_KEYS", "PREFIXES", "ROUTING_KEY_PREFIXES", "TRAIN_KEYS", "loss_step_metrics", "with_prefix"]
