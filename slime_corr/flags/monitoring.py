"""The logging flags (`add_monitoring_args`, a Megatron `extra_args_provider` too): `MonitoringConfig`'s fields.
Megatron-LM's own parser has some of them (`--log-interval`, `--tensorboard-dir`, `--wandb-project`, ...): those
are left as Megatron defined them."""

from __future__ import annotations

import argparse
from typing import Any

from slime_corr.fields import add_flags
from slime_corr.monitoring.config import MonitoringConfig

TITLE = "monitoring (slime_corr)"
FIELDS = ("run_dir", "log_interval", "tensorboard_dir", "tensorboard_log_interval", "tensorboard_queue_size",
          "wandb_project", "wandb_exp_name", "wandb_save_dir", "wandb_entity", "wandb_mode", "rollout_progress",
          "log_mismatch_diagnostics", "log_top_mismatch_samples", "metric_names")


def add_monitoring_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the logging flags the parser does not have yet (so Megatron's own stay as they are). Returns it."""
    have = set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public "has option"
    g = parser.add_argument_group(title=TITLE)

    def add(option: str, **kw: Any) -> None:
        if option not in have:
            g.add_argument(option, **kw)

    add_flags(g, MonitoringConfig, FIELDS, add)
    return parser


__all__ = ["FIELDS", "TITLE", "add_monitoring_args"]
