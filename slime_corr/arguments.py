"""Command-line flags for rollout correction, usable as Megatron's `extra_args_provider`.

    parser = add_rollout_correction_args(argparse.ArgumentParser())
    args, config = parse_rollout_correction_config(parser, argv)

Flags record which of them were given explicitly, so `RolloutCorrectionConfig.from_args` can apply the
precedence explicit flag > YAML (`--custom-config-path`) > preset (`--rollout-correction-preset`) > default.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from slime_corr.config import (
    LEVELS,
    LOSS_AGG_MODES,
    LOSS_TYPES,
    PRESETS,
    TIS_MODES,
    ConfigError,
    RolloutCorrectionConfig,
)

EXPLICIT_ATTR = "_rollout_correction_explicit"
_DEFAULTS = {f: getattr(RolloutCorrectionConfig, f, None) for f in RolloutCorrectionConfig.field_names()}


def _record(namespace: argparse.Namespace, dest: str) -> None:
    explicit = getattr(namespace, EXPLICIT_ATTR, None)
    if explicit is None:
        explicit = set()
        setattr(namespace, EXPLICIT_ATTR, explicit)
    explicit.add(dest)


class _Store(argparse._StoreAction):
    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        super().__call__(parser, namespace, values, option_string)
        _record(namespace, self.dest)


class _StoreTrue(argparse._StoreTrueAction):
    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        super().__call__(parser, namespace, values, option_string)
        _record(namespace, self.dest)


def add_rollout_correction_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the rollout-correction flags (a Megatron `extra_args_provider`). Returns the parser."""
    g = parser.add_argument_group(title="rollout correction (slime_corr)")

    def switch(name: str, help: str) -> None:
        g.add_argument(name, action=_StoreTrue, default=False, help=help)

    def value(name: str, help: str, **kw: Any) -> None:
        dest = name[2:].replace("-", "_")
        g.add_argument(name, action=_Store, default=_DEFAULTS[dest], help=help, **kw)

    switch("--use-tis", "Multiply the policy loss by importance-sampling weights pi_train/pi_rollout.")
    value("--tis-mode", "How IS weights are bounded: truncate (min(w,U)), clip (clamp to [L,U]), mask (0 outside).",
          choices=TIS_MODES)
    value("--tis-level", "IS aggregation: token ratio, sequence product, or geometric mean per sequence.",
          choices=LEVELS)
    value("--tis-lower-bound", "Lower bound L for clip/mask modes (default 1/U).", type=float)
    value("--tis-upper-bound", "Upper bound U for IS weights (default 2.0).", type=float)
    switch("--tis-batch-normalize", "Divide IS weights by their mean over the step (micro-batches, DP and CP ranks).")
    value("--tis-clip", "slime's TIS upper clamp C: weight clamped to [tis_clip_low, C].", type=float)
    value("--tis-clip-low", "slime's TIS lower clamp c (default 0 when --tis-clip is given).",
          type=float)

    switch("--use-rs", "Rejection sampling: drop tokens/sequences whose ratio is outside [L, U] from the loss.")
    value("--rs-level", "RS aggregation: token, sequence (product) or geometric (mean log-ratio).",
          choices=LEVELS)
    value("--rs-lower-bound", "RS lower bound L on the ratio (default 1/U).", type=float)
    value("--rs-upper-bound", "RS upper bound U on the ratio (required with --use-rs).", type=float)
    value("--rs-veto-threshold",
          "Veto: reject a whole sequence if any token ratio is below this (0<C<1, e.g. 1e-4).",
          type=float)
    switch("--rs-keep-loss-denominator", "Rejected tokens still count in the loss denominator.")

    switch("--use-rollout-logprobs",
           "Bypass: use the rollout engine's log-probs as pi_old (no recompute forward pass).")
    switch("--use-rollout-correction",
           "Apply the configured IS/RS to the loss (implied by --use-tis, --use-rs, --rs-veto-threshold).")
    switch("--get-mismatch-metrics", "Log mismatch metrics without changing the loss.")
    value("--loss-type", "Policy loss: ppo (clipped surrogate) or reinforce (pure policy gradient, bypass only).",
          choices=LOSS_TYPES)
    value("--eps-clip", "PPO clip epsilon: ratio clipped to [1-eps, 1+eps_high].", type=float)
    value("--eps-clip-high", "PPO upper clip epsilon (default: --eps-clip).", type=float)
    value("--eps-clip-c", "Dual-clip constant c > 1 capping negative-advantage token losses at -A*c.",
          type=float)
    value("--loss-agg-mode", "How token losses are averaged into the micro-batch loss.", choices=LOSS_AGG_MODES)

    switch("--rollout-correction-compile",
           "torch.compile the per-token work of correction + loss (fused kernels; the first step compiles).")
    switch("--warn-invalid-inputs",
           "Impossible input values (loss mask outside {0,1} or NaN, log-prob > 0 or NaN in the mask) warn and are "
           "counted (mis_invalid_mask_count, mis_positive_logprob_count, mis_nan_logprob_count) instead of "
           "stopping the run.")
    value("--rollout-correction-preset", "Start from a named preset: " + ", ".join(PRESETS) + ".",
          choices=list(PRESETS))
    value("--custom-config-path", "YAML file of rollout-correction settings (overridden by explicit flags).")
    value("--custom-tis-function-path",
          "Your weighting function: pkg.mod.fn, pkg.mod:fn or path/file.py:fn (see README).")
    return parser


def parse_rollout_correction_config(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> tuple[argparse.Namespace, RolloutCorrectionConfig]:
    """Parse `argv`, build and validate the config; any error exits through `parser.error`."""
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as e:
        parser.error(str(e))
    return args, config


def config_from_args(args: argparse.Namespace) -> RolloutCorrectionConfig:
    """Build the config and load the custom weighting function now, so a bad path fails at start-up."""
    from slime_corr.mcore.megatron_lm import check_megatron_lm_rl_flags

    config = RolloutCorrectionConfig.from_args(args)
    check_megatron_lm_rl_flags(args, config)  # Megatron-LM's own IS flags, when its parser is used
    if config.custom_tis_function_path:
        import slime_corr.correction  # noqa: F401  (registers the built-in weighting functions)
        from slime_corr.registry import WEIGHT_FUNCTIONS

        WEIGHT_FUNCTIONS.get(config.custom_tis_function_path, flag="--custom-tis-function-path")
    return config
