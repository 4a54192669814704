"""Logging flags (Megatron's names where Megatron has them) and the typed config they build.

    add_monitoring_args(parser)                       # slime_corr.flags.monitoring; a Megatron `extra_args_provider` too
    args = parser.parse_args()
    config = MonitoringConfig.from_args(args)         # validated; ConfigError names the flag and the fix

Megatron-LM's logging flags: `--log-interval`, `--tensorboard-dir`, `--tensorboard-log-interval`,
`--tensorboard-queue-size`, `--wandb-project`, `--wandb-exp-name`, `--wandb-save-dir`, `--wandb-entity`. When the
parser already has one of them (Megatron's own parser), it is left as Megatron defined it. slime's `--wandb-mode`
(online / offline / disabled) selects offline mode. The rest are slime_corr's: `--run-dir`, `--rollout-progress`,
`--log-mismatch-diagnostics`, `--log-top-mismatch-samples`.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass, fields
from typing import Any

from slime_corr.errors import ConfigError
from slime_corr.extras import install_hint
from slime_corr.fields import flag
from slime_corr.integrations.slime.names import METRIC_NAMINGS

WANDB_MODES = ("online", "offline", "disabled")
PROGRESS_MODES = ("auto", "bar", "lines", "none")


@dataclass(frozen=True)
class MonitoringConfig:
    """Where and how often the step metrics go. Field names are the flag names with `-` -> `_`.

    run_dir: metrics.jsonl (every metric of every step), top_mismatch.jsonl, run_config.json go here.
    log_interval: console line every N steps. tensorboard_*: Megatron's TensorBoard settings (off without a dir).
    wandb_*: W&B (off without a project); wandb_mode None defers to WANDB_MODE / wandb's default, "offline"
    never touches the network. rollout_progress: "auto" = a tqdm bar on a terminal, plain lines otherwise.
    log_mismatch_diagnostics: the bucketed mismatch views (`slime_corr.correction.diagnostics`);
    log_top_mismatch_samples: how many of the step's sequences with the largest |Σ lr| to record (0 = none).
    metric_names: "both" (default) logs slime's names of the metrics slime has beside slime_corr's, "slime" only
    slime's for those, "slime_corr" none (`slime_corr.integrations.slime.names`; the console line keeps
    slime_corr's names).
    """

    run_dir: str | None = flag(None, help="Directory for metrics.jsonl (every metric of every step), "
                               "top_mismatch.jsonl and run_config.json; `slime-corr report RUN_DIR` reads it.")
    log_interval: int = flag(1, help="Print the step line every N steps.")
    tensorboard_dir: str | None = flag(None, help="Write TensorBoard event files here (needs the tensorboard extra).")
    tensorboard_log_interval: int = flag(1, help="Write to TensorBoard and W&B every N steps.")
    tensorboard_queue_size: int = flag(1000, help="TensorBoard events kept in memory before a flush to disk.")
    wandb_project: str | None = flag(None, help="W&B project; W&B is off without it.")
    wandb_exp_name: str | None = flag(None, help="W&B run name (default: the run dir's name).")
    wandb_save_dir: str | None = flag(None, help="Where W&B keeps its files (default: RUN_DIR/wandb).")
    wandb_entity: str | None = flag(None, help="W&B entity (team or user).")
    wandb_mode: str | None = flag(None, choices=WANDB_MODES, help="online, offline (nothing leaves the machine; "
                                  "`wandb sync` later) or disabled. Default: WANDB_MODE, else wandb's default (online).")
    rollout_progress: str = flag("auto", choices=PROGRESS_MODES, help="Rollout progress: auto = a bar on a terminal, "
                                 "plain lines otherwise (CI logs).")
    log_mismatch_diagnostics: bool = flag(True, help="Log the mismatch by rollout-probability bucket, response "
                                          "position, weight lag, and the decoupled drift split (when mismatch metrics "
                                          "are on).")
    log_top_mismatch_samples: int = flag(4, help="Record the N sequences of each step with the largest |sum of "
                                         "log-ratios| (with their text).")
    metric_names: str = flag("both", choices=METRIC_NAMINGS, help="Metric key names in the logs: both (slime_corr's, "
                             "plus slime's for the metrics slime logs: train/train_rollout_logprob_abs_diff, train/tis, "
                             "rollout/raw_reward, ...), slime, or slime_corr.")

    def __post_init__(self) -> None:
        for name in ("log_interval", "tensorboard_log_interval", "tensorboard_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{_flag(name)} must be an integer >= 1, got {value!r}.")
        if not isinstance(self.log_top_mismatch_samples, int) or self.log_top_mismatch_samples < 0:
            raise ConfigError(f"--log-top-mismatch-samples must be an integer >= 0, got "
                              f"{self.log_top_mismatch_samples!r}.")
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"--wandb-mode must be one of {', '.join(WANDB_MODES)}, got {self.wandb_mode!r}.")
        if self.metric_names not in METRIC_NAMINGS:
            raise ConfigError(f"--metric-names must be one of {', '.join(METRIC_NAMINGS)}, got {self.metric_names!r}.")
        if self.rollout_progress not in PROGRESS_MODES:
            raise ConfigError(f"--rollout-progress must be one of {', '.join(PROGRESS_MODES)}, got "
                              f"{self.rollout_progress!r}.")
        if self.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(f"--tensorboard-dir {self.tensorboard_dir} needs the tensorboard package: "
                              f"{install_hint('tensorboard')}, or drop --tensorboard-dir.")
        if self.wandb_project and self.wandb_mode != "disabled" and importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"--wandb-project {self.wandb_project} needs the wandb package: "
                              f"{install_hint('wandb')}, or drop --wandb-project.")
        if self.rollout_progress == "bar" and importlib.util.find_spec("tqdm") is None:
            raise ConfigError("--rollout-progress bar needs tqdm: pip install tqdm, or use --rollout-progress auto.")

    @property
    def uses_wandb(self) -> bool:
        return bool(self.wandb_project) and self.wandb_mode != "disabled"

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> MonitoringConfig:
        """From parsed flags (Megatron's or `add_monitoring_args`'); empty strings (Megatron's defaults) = unset."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if hasattr(args, f.name):
                value = getattr(args, f.name)
                values[f.name] = None if value == "" else value
        values.update(overrides)
        return cls(**values)


def _flag(name: str) -> str:
    return name.replace("_", "-")


__all__ = ["MonitoringConfig", "PROGRESS_MODES", "WANDB_MODES"]
