"""Monitoring: step metrics to the console, RUN_DIR/metrics.jsonl, TensorBoard and W&B; the rollout progress;
the mismatch diagnostics of a step; `slime-corr report RUN_DIR` (plots and a preset recommendation).

The logger API a trainer uses (see `logger.py` for the sinks and `keys.py` for the key prefixes; the flags are
`slime_corr.flags.monitoring.add_monitoring_args`'s, which this package does not import: the flag layer stands on it):

    from slime_corr.monitoring import MetricsLogger, MonitoringConfig, loss_step_metrics
"""

from slime_corr.monitoring.config import MonitoringConfig
from slime_corr.monitoring.keys import loss_step_metrics, with_prefix
from slime_corr.monitoring.logger import MetricsLogger, is_logging_rank

__all__ = ["MetricsLogger", "MonitoringConfig", "is_logging_rank", "loss_step_metrics", "with_prefix"]
