"""The main job's parser (`python -m slime_corr.main`): every flag group, and `--self-check`."""

from __future__ import annotations

import argparse

from slime_corr.flags.correction import add_rollout_correction_args
from slime_corr.flags.loss_terms import add_loss_terms_args
from slime_corr.flags.model import add_model_args, add_tiny_model_args
from slime_corr.flags.monitoring import add_monitoring_args
from slime_corr.flags.trainer import add_trainer_args

MAIN_JOB_DEFAULTS = {"vocab_size": 256}  # byte-level tokens, as the embedded engine uses (the tiny GPT's is 128)


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The main job's parser; `description` heads its --help."""
    # a short usage line: a parse error prints it above its one-line message (the full list is --help's)
    parser = argparse.ArgumentParser(prog="slime_corr.main", description=description, allow_abbrev=False,
                                     usage="python -m slime_corr.main [FLAGS]  (every flag: --help, docs/flags.md)",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--self-check", action="store_true", help="Parse flags, build the config, print it, exit.")
    add_trainer_args(parser)
    add_loss_terms_args(parser)
    add_tiny_model_args(parser)
    add_model_args(parser)
    add_monitoring_args(parser)
    parser.set_defaults(**MAIN_JOB_DEFAULTS)
    return add_rollout_correction_args(parser)


__all__ = ["MAIN_JOB_DEFAULTS", "build_parser"]
