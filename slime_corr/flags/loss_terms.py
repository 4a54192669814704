"""slime's KL-loss and entropy flags (a Megatron `extra_args_provider` too): `LossTermsConfig`'s fields, plus slime's
`--kl-coef`, which slime_corr's trainer accepts only at 0 (`LossTermsConfig.from_args`). On slime's parser its own
definitions are reused (`slime_corr.flags.compose`)."""

from __future__ import annotations

import argparse
import functools

from slime_corr.fields import add_flags
from slime_corr.flags.compose import compose_flag
from slime_corr.loss_terms import LossTermsConfig

TITLE = "KL and entropy loss terms (slime's flags)"
FIELDS = ("use_kl_loss", "kl_loss_coef", "kl_loss_type", "use_unbiased_kl", "entropy_coef")


def add_loss_terms_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """slime's KL-loss and entropy flags (those the parser lacks). Returns the parser."""
    g = parser.add_argument_group(title=TITLE)
    add = functools.partial(compose_flag, parser, g)
    add_flags(g, LossTermsConfig, FIELDS[:2], add)
    add("--kl-coef", type=float, default=0.0,
        help="slime's KL penalty on the reward (before the advantages): not implemented by slime_corr's trainer, so "
             "only 0 is accepted; use --kl-loss-coef for a KL term in the loss.")
    add_flags(g, LossTermsConfig, FIELDS[2:], add)
    return parser


__all__ = ["FIELDS", "TITLE", "add_loss_terms_args"]
