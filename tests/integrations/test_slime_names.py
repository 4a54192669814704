"""slime's metric names in slime_corr's logs (`--metric-names`): a slime dashboard and slime's CI guard
(`train/train_rollout_logprob_abs_diff`) read them unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from slime_corr.config import ConfigError, RolloutCorrectionConfig
from slime_corr.correction import compute_rollout_correction
from slime_corr.integrations.slime.names import LOGGED_NAMES, MIS_NAMES, slime_named
from slime_corr.monitoring.config import MonitoringConfig
from slime_corr.monitoring.keys import loss_step_metrics
from slime_corr.monitoring.logger import METRICS_FILE, MetricsLogger
from slime_corr.monitoring.rollout_stats import rollout_metrics
from slime_corr.samples import Sample, SampleStatus


def _step_metrics() -> dict[str, float]:
    """One step's metrics as the trainer logs them: the correction's, the loss's, the rollout's."""
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 9, generator=g, dtype=torch.float64)
    ro = lp + 0.4 * torch.randn(4, 9, generator=g, dtype=torch.float64)
    result = compute_rollout_correction(lp, ro, torch.ones(4, 9, dtype=torch.bool),
                                        RolloutCorrectionConfig(use_tis=True, tis_mode="clip"))
    metrics = {k: float(v) for k, v in result.metrics.items()}
    metrics.update(loss=0.1, pg_loss=0.1, entropy=1.5, ois=1.01, pg_clipfrac=0.02)
    samples = [Sample(prompt_tokens=[1], response_tokens=[2] * n, rollout_log_probs=torch.zeros(n), reward=r, status=s)
               for n, r, s in ((3, 1.0, SampleStatus.COMPLETED), (5, 0.0, SampleStatus.TRUNCATED))]
    return {**loss_step_metrics(metrics), **rollout_metrics(samples)}


@pytest.mark.parametrize("naming", ["both", "slime", "slime_corr"])
def test_logged_keys_under_each_naming(tmp_path, naming):
    step = _step_metrics()
    # every key the table renames is one slime_corr really logs
    assert set(LOGGED_NAMES) - set(step) <= {f"rollout_corr/{k}" for k in MIS_NAMES} | {"train/entropy"}
    with MetricsLogger(MonitoringConfig(metric_names=naming), run_dir=tmp_path, console=False) as logger:
        logger.log(1, step)
    logged = json.loads((tmp_path / METRICS_FILE).read_text().splitlines()[0])
    slime_keys = {"train/train_rollout_logprob_abs_diff", "train/entropy_loss", "train/ois", "train/tis",
                  "train/tis_clipfrac", "rollout/raw_reward", "rollout/response_len/mean", "rollout/truncated_ratio",
                  "train/mis_k3_kl", "train/mis_tis_clip_fraction_high"}
    if naming == "slime_corr":
        assert not slime_keys & set(logged)
        return
    assert slime_keys <= set(logged)
    assert logged["train/train_rollout_logprob_abs_diff"] == step["rollout_corr/train_rollout_logprob_abs_diff"]
    assert logged["rollout/raw_reward"] == 0.5 and logged["rollout/truncated_ratio"] == 0.5
    assert logged["rollout/response_len/mean"] == 4.0 and logged["train/entropy_loss"] == 1.5
    assert logged["train/tis"] == step["rollout_corr/mis_mean_is_weight_before_clip"]
    assert logged["train/tis_clipfrac"] == pytest.approx(step["rollout_corr/mis_clip_fraction_low"]
                                                         + step["rollout_corr/mis_clip_fraction_high"])
    assert 0 < logged["train/tis_clipfrac"] < 1
    assert ("rollout_corr/train_rollout_logprob_abs_diff" in logged) == (naming == "both")
    assert "rollout_corr/mis_ess" in logged  # a key slime has no name for stays


def test_bad_naming_is_refused():
    with pytest.raises(ConfigError, match="--metric-names must be one of slime_corr, slime, both"):
        MonitoringConfig(metric_names="wandb")
    with pytest.raises(ValueError, match="--metric-names 'x'"):
        slime_named({}, "x")
