"""Command-line flags for rollout correction, usable as Megatron's `extra_args_provider`.

    parser = add_rollout_correction_args(argparse.ArgumentParser())
    args, config = parse_rollout_correction_config(parser, argv)

The flags are defined once, in `slime_corr.flags` (`flags.correction`, `flags.loss_terms`; host-parser composition
and the record of explicit flags in `flags.compose`); this module keeps their public names.
"""

from __future__ import annotations

from slime_corr.flags.compose import EXPLICIT_ATTR, HOST_FLAGS_ATTR, SHARED_FLAGS, compose_flag
from slime_corr.flags.correction import (
    add_rollout_correction_args,
    config_from_args,
    explicit_fields,
    parse_rollout_correction_config,
)
from slime_corr.flags.loss_terms import add_loss_terms_args

__all__ = ["EXPLICIT_ATTR", "HOST_FLAGS_ATTR", "SHARED_FLAGS", "add_loss_terms_args", "add_rollout_correction_args",
           "compose_flag", "config_from_args", "explicit_fields", "parse_rollout_correction_config"]
