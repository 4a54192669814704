"""The rollout-correction flags (a Megatron `extra_args_provider`), and the config they build.

    parser = add_rollout_correction_args(argparse.ArgumentParser())
    args, config = parse_rollout_correction_config(parser, argv)

The help, defaults and choices are `RolloutCorrectionConfig`'s fields'; on a host parser only the flags it lacks are
added (`slime_corr.flags.compose`). The special cases here: verl's `--rollout-rs` / `--rollout-rs-threshold`, and
the REINFORCE/PPO choice `--policy-loss-type` (slime's `--loss-type` picks policy/sft/custom loss), whose older
spelling `--loss-type ppo|reinforce` still works, with a deprecation note, on a parser that does not define it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import slime_corr.correction  # noqa: F401  (registers the built-in weighting functions)
from slime_corr.config import LOSS_TYPES, RolloutCorrectionConfig
from slime_corr.errors import ConfigError
from slime_corr.fields import add_flags
from slime_corr.flags.checks import check_megatron_lm_rl_flags
from slime_corr.flags.compose import (
    EXPLICIT_ATTR,
    HOST_FLAGS_ATTR,
    DeprecatedLossType,
    compose_flag,
    recording,
)
from slime_corr.registry import WEIGHT_FUNCTIONS
from slime_corr.verl_rollout_rs import OPTIONS as VERL_RS_OPTIONS
from slime_corr.verl_rollout_rs import rollout_rs_settings

TITLE = "rollout correction (slime_corr)"
IS_AND_REJECTION = ("use_tis", "tis_mode", "tis_level", "tis_lower_bound", "tis_upper_bound", "tis_batch_normalize",
                    "tis_clip", "tis_clip_low", "use_rs", "rs_level", "rs_lower_bound", "rs_upper_bound",
                    "rs_veto_threshold", "rs_keep_loss_denominator", "rs_metric", "rs_agg", "rs_divergence_bound")
BUDGETS_AND_MODE = ("rs_divergence_budget", "tis_ess_target", "use_rollout_logprobs", "use_rollout_correction",
                    "get_mismatch_metrics")
LOSS_AND_RUN = ("eps_clip", "eps_clip_high", "eps_clip_c", "loss_agg_mode", "policy_ratio_level", "use_opsm",
                "opsm_delta", "rollout_correction_compile", "rollout_correction_cuda_graph",
                "rollout_correction_backend", "logprobs_backend",
                "warn_invalid_inputs",
                "rollout_correction_preset", "custom_config_path", "custom_tis_function_path")
PEER_LOSSES_AND_GATE = ("tau_pos", "tau_neg", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio",
                        "ppo_kl_coef", "m2_threshold", "seq_logprob_error_threshold",
                        "max_train_rollout_logprob_abs_diff", "max_mismatch_k3_kl")
FIELDS = (*IS_AND_REJECTION, *BUDGETS_AND_MODE, "loss_type", *LOSS_AND_RUN, *PEER_LOSSES_AND_GATE)  # every flag field
# A host's --custom-tis-function-path has the host's signature (slime's: `slime_corr.integrations.slime`), not a
# slime_corr weighting function's: it does not configure `config_from_args`.
_HOST_SIGNATURE_FIELDS = frozenset({"custom_tis_function_path"})
_FIELD_NAMES = frozenset(RolloutCorrectionConfig.field_names())


def add_rollout_correction_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the rollout-correction flags (a Megatron `extra_args_provider`; only those the parser lacks, see the
    module doc). Returns the parser."""
    g = parser.add_argument_group(title=TITLE)

    def add(option: str, **kw: Any) -> None:
        compose_flag(parser, g, option, **recording(kw))

    add_flags(g, RolloutCorrectionConfig, IS_AND_REJECTION, add)
    compose_flag(parser, g, "--rollout-rs", default=None, metavar="OPTIONS",
                 help="verl's spelling of rejection: comma-separated criteria (" + ", ".join(VERL_RS_OPTIONS) +
                      "), at most one k1 and one k2/k3; sets --use-rs/--rs-level/bounds and --rs-metric/--rs-agg/"
                      "--rs-divergence-bound (see slime_corr/verl_rollout_rs.py).")
    compose_flag(parser, g, "--rollout-rs-threshold", default=None, metavar="SPEC",
                 help="verl's thresholds of --rollout-rs: one for all or one per option, comma separated; a k1 "
                      "option takes lower_upper or U (= [1/U, U]).")
    add_flags(g, RolloutCorrectionConfig, (*BUDGETS_AND_MODE, "loss_type"), add)
    if "--loss-type" not in parser._option_string_actions:  # slime's parser has its own --loss-type
        compose_flag(parser, g, "--loss-type", action=DeprecatedLossType, dest="policy_loss_type",
                     default=RolloutCorrectionConfig.loss_type, help="Deprecated spelling of --policy-loss-type.",
                     choices=LOSS_TYPES)
    add_flags(g, RolloutCorrectionConfig, LOSS_AND_RUN, add)
    add_flags(g, RolloutCorrectionConfig, PEER_LOSSES_AND_GATE, add)
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


def _apply_verl_rollout_rs(args: argparse.Namespace, explicit: set[str] | None) -> set[str]:
    """`--rollout-rs` / `--rollout-rs-threshold` (verl's spelling) written into the namespace as this project's
    fields, which then count as given; refused next to an explicit flag that sets the same field."""
    if getattr(args, "rollout_rs", None) is None:
        raise ConfigError("--rollout-rs-threshold without --rollout-rs: name the criteria it bounds, e.g. --rollout-rs "
                          "token_k1.")
    settings = rollout_rs_settings(args.rollout_rs, args.rollout_rs_threshold)
    given = set(explicit or ())
    clash = sorted(given & set(settings))
    if clash:
        flags = ", ".join("--" + name.replace("_", "-") for name in clash)
        raise ConfigError(f"--rollout-rs {args.rollout_rs} sets {flags} itself; give either verl's spelling or "
                          "this project's flags, not both.")
    for name, value in settings.items():
        setattr(args, name, value)
    return given | set(settings)


def explicit_fields(args: argparse.Namespace) -> set[str] | None:
    """The fields given on the command line: recorded by slime_corr's flags, plus the reused host flags whose value
    differs from the host's default (None: the namespace was not made by `add_rollout_correction_args`)."""
    recorded = getattr(args, EXPLICIT_ATTR, None)
    hosted = getattr(args, HOST_FLAGS_ATTR, None)
    if recorded is None and hosted is None:
        return None
    explicit = set(recorded or ())
    explicit.update(dest for dest, default in (hosted or {}).items()
                    if dest in _FIELD_NAMES and dest not in _HOST_SIGNATURE_FIELDS
                    and getattr(args, dest, default) != default)
    return explicit


def config_from_args(args: argparse.Namespace) -> RolloutCorrectionConfig:
    """Build the config, check it against Megatron-LM's own flags, and load the custom weighting function now, so a
    bad path fails at start-up."""
    explicit = explicit_fields(args)
    if getattr(args, "rollout_rs", None) is not None or getattr(args, "rollout_rs_threshold", None) is not None:
        explicit = _apply_verl_rollout_rs(args, explicit)
    config = RolloutCorrectionConfig.from_args(args, explicit=explicit)
    check_megatron_lm_rl_flags(args, config)  # Megatron-LM's own IS flags, when its parser is used
    if config.custom_tis_function_path:
        WEIGHT_FUNCTIONS.get(config.custom_tis_function_path, flag="--custom-tis-function-path")
    return config


__all__ = ["FIELDS", "TITLE", "add_rollout_correction_args", "config_from_args", "explicit_fields",
           "parse_rollout_correction_config"]
