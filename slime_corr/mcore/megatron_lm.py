"""Cross-checks with Megatron-LM's own RL flags (megatron/training/arguments.py, `_add_rl_args`).

Megatron-LM's GRPO loss has its own importance-sampling correction against the inference engine's log-probs:
`--rl-inference-logprobs-is-correction` turns it on and `--rl-importance-sampling-truncation-coef` truncates its
ratio. With slime_corr's correction on as well, the loss would be corrected twice. The check reads the parsed
namespace only (the flags are absent from namespaces that Megatron-LM did not parse) and imports nothing.
"""

from __future__ import annotations

import argparse

from slime_corr.config import ConfigError, RolloutCorrectionConfig


def _our_correction_flags(config: RolloutCorrectionConfig) -> str:
    """The slime_corr flags that turned the loss correction on, as the user would type them."""
    flags = [name for name, on in (("--use-tis", config.use_tis), ("--use-rs", config.use_rs),
                                   ("--rs-veto-threshold", config.rs_veto_threshold is not None)) if on]
    return " / ".join(flags) or "--use-rollout-correction"


def check_megatron_lm_rl_flags(args: argparse.Namespace, config: RolloutCorrectionConfig) -> None:
    """Raise `ConfigError` naming both flags when Megatron-LM's own IS correction is configured together with
    slime_corr's correction (the loss would be corrected twice)."""
    if getattr(args, "rl_inference_logprobs_is_correction", False) and config.use_rollout_correction:
        raise ConfigError(
            f"--rl-inference-logprobs-is-correction (Megatron-LM's GRPO importance sampling) with "
            f"{_our_correction_flags(config)} (slime_corr) corrects the loss twice against the rollout "
            "log-probs. Keep one: drop --rl-inference-logprobs-is-correction to use slime_corr's correction, or "
            "drop the slime_corr correction flags."
        )
    coef = getattr(args, "rl_importance_sampling_truncation_coef", None)
    if coef is not None and config.use_tis:
        raise ConfigError(
            f"--rl-importance-sampling-truncation-coef {coef} (Megatron-LM's IS truncation) with --use-tis "
            "(slime_corr) configures two IS truncations. Set the bound with --tis-upper-bound (--tis-mode "
            "truncate) and drop --rl-importance-sampling-truncation-coef."
        )


__all__ = ["check_megatron_lm_rl_flags"]
