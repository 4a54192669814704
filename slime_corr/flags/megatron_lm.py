"""The flags of Megatron-LM's own training loop (`add_megatron_lm_args`, its `extra_args_provider`): slime_corr's
correction flags plus slime's MoE routing flags, `--use-rollout-routing-replay` and `--log-routing-mismatch`, for
the routing replay of `slime_corr.mcore.megatron_lm`. Their checks against Megatron-LM's own flags are in
`slime_corr.flags.checks` (`config_from_args` runs them)."""

from __future__ import annotations

import argparse

from slime_corr.flags.checks import ROUTING_FLAGS_ATTR
from slime_corr.flags.correction import add_rollout_correction_args

TITLE = "MoE rollout routing replay (slime_corr)"


def add_megatron_lm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's `extra_args_provider`: slime_corr's correction flags plus slime's routing flags (those the
    parser lacks). Returns the parser."""
    add_rollout_correction_args(parser)
    if "--use-rollout-routing-replay" in parser._option_string_actions:  # the host's own (slime's parser)
        return parser
    g = parser.add_argument_group(title=TITLE)
    # Not `TrainerConfig`'s fields: this loop's routes come from batch["routed_experts"], its model from Megatron-LM
    g.add_argument("--use-rollout-routing-replay", action="store_true",
                   help="R3 (slime's flag): the lp_old pre-pass and every training pass route each token to the "
                        "experts the rollout engine chose (batch['routed_experts']); needs "
                        "--moe-enable-routing-replay. Logs the routing-mismatch metrics too.")
    g.add_argument("--log-routing-mismatch", action="store_true",
                   help="Compare the trainer's routes with the engine's (routing_mismatch_* in the loss dict) "
                        "without replaying them.")
    parser.set_defaults(**{ROUTING_FLAGS_ATTR: True})
    return parser


__all__ = ["TITLE", "add_megatron_lm_args"]
