"""The flags of Megatron-LM's own training loop (`add_megatron_lm_args`, its `extra_args_provider`): slime_corr's
correction flags plus slime's MoE routing flags, `--use-rollout-routing-replay` and `--log-routing-mismatch`, for
the routing replay of `slime_corr.mcore.megatron_lm`. Their checks against Megatron-LM's own flags are in
`slime_corr.flags.checks` (`config_from_args` runs them)."""

from __future__ import annotations

import argparse

from slime_corr.fields import add_flags
from slime_corr.flags.checks import ROUTING_FLAGS_ATTR
from slime_corr.flags.correction import add_rollout_correction_args
from slime_corr.trainer.config import TrainerConfig

TITLE = "MoE rollout routing replay (slime_corr)"
ROUTING_FIELDS = ("use_rollout_routing_replay", "log_routing_mismatch")


def add_megatron_lm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's `extra_args_provider`: slime_corr's correction flags plus slime's routing flags (those the
    parser lacks). Returns the parser."""
    add_rollout_correction_args(parser)
    if "--use-rollout-routing-replay" in parser._option_string_actions:  # the host's own (slime's parser)
        return parser
    # the main job's two fields (`TrainerConfig`), one definition: this loop's routes come from
    # batch["routed_experts"], its model from Megatron-LM, and the rest of TrainerConfig is not its
    add_flags(parser.add_argument_group(title=TITLE), TrainerConfig, ROUTING_FIELDS)
    parser.set_defaults(**{ROUTING_FLAGS_ATTR: True})
    return parser


__all__ = ["TITLE", "add_megatron_lm_args"]
