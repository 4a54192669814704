"""Megatron's [numerator, denominator] pairs of the correction metrics (`slime_corr.correction.reporting`).

Property: summing the pairs of several micro-batches and dividing — what Megatron-LM's train_step does — gives the
metrics `correction_metrics(merge_stats(...))` computes for the whole step; every metric is either such a ratio or
listed as a non-ratio metric.
"""

from __future__ import annotations

import math

import pytest
import torch

from slime_corr.config import PRESETS, RolloutCorrectionConfig
from slime_corr.correction import compute_rollout_correction, correction_metrics, merge_stats
from slime_corr.correction.reporting import NON_RATIO_METRICS, metric_pairs

CONFIGS = [RolloutCorrectionConfig.preset(name) for name in PRESETS if name != "disabled"] + [
    RolloutCorrectionConfig(get_mismatch_metrics=True),
    RolloutCorrectionConfig(use_tis=True, tis_mode="clip", tis_level="sequence"),
    RolloutCorrectionConfig(use_tis=True, tis_mode="mask", tis_level="geometric", tis_upper_bound=1.5),
    RolloutCorrectionConfig(use_tis=True, tis_batch_normalize=True),
]


def _micro_batches(seed: int, n: int = 3):
    """Uneven masks, an empty sequence, a non-finite log-prob, an extreme log-ratio."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        lp_train = -torch.rand(4, 12, generator=g, dtype=torch.float64) * 3
        lp_rollout = lp_train + torch.randn(4, 12, generator=g, dtype=torch.float64) * (0.05 if k else 0.6)
        mask = torch.rand(4, 12, generator=g) < 0.7
        mask[2] = False
        if k == 1:
            lp_rollout[0, 3], mask[0, 3] = math.nan, True
            lp_rollout[3, 5], mask[3, 5] = lp_train[3, 5] + 30.0, True
        out.append((lp_train, lp_rollout, mask))
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.describe()[:60])
def test_summed_pairs_give_the_step_metrics(config):
    results = [compute_rollout_correction(lt, lr, m, config) for lt, lr, m in _micro_batches(0)]
    step = correction_metrics(merge_stats([r.stats for r in results]), config)
    pairs = [metric_pairs(r.stats, config, r.metrics.get("mis_batch_norm_factor")) for r in results]
    assert set(pairs[0]) | (NON_RATIO_METRICS & set(step)) == set(step), set(step) ^ set(pairs[0])
    assert not set(pairs[0]) & NON_RATIO_METRICS
    for key in pairs[0]:
        total = torch.stack([p[key] for p in pairs]).sum(0)
        assert total.dtype == torch.float64 and torch.isfinite(total).all(), key
        if not config.tis_batch_normalize:  # normalized: each call divides by its own mean (see below)
            assert (total[0] / total[1]).item() == pytest.approx(step[key].item(), rel=1e-12, abs=1e-15), key
    for p, r in zip(pairs, results, strict=True):  # and one micro-batch's pairs give its own metrics
        for key, pair in p.items():
            assert (pair[0] / pair[1]).item() == pytest.approx(r.metrics[key].item(), rel=1e-12, abs=1e-15), key


def test_a_step_mean_normalization_is_exact_over_the_step():
    """With --tis-batch-normalize each micro-batch is divided by the STEP mean (as the hook passes it): the pairs
    then sum to the step's metrics."""
    config = RolloutCorrectionConfig(use_tis=True, tis_batch_normalize=True, tis_level="sequence")
    data = _micro_batches(1)
    pre = merge_stats([compute_rollout_correction(lt, lr, m, config).stats for lt, lr, m in data])
    from slime_corr.correction import weight_mean

    mean = weight_mean(pre)
    results = [compute_rollout_correction(lt, lr, m, config, batch_norm_mean=mean) for lt, lr, m in data]
    step = correction_metrics(merge_stats([r.stats for r in results]), config)
    pairs = [metric_pairs(r.stats, config, r.metrics["mis_batch_norm_factor"]) for r in results]
    total = torch.stack([p["mis_ratio_mean_after_mis"] for p in pairs]).sum(0)
    assert (total[0] / total[1]).item() == pytest.approx(step["mis_ratio_mean_after_mis"].item(), rel=1e-12)
    assert step["mis_ratio_mean_after_mis"].item() == pytest.approx(1.0, rel=1e-12)  # normalized: mean 1


def test_empty_sets_read_zero_not_nan():
    config = RolloutCorrectionConfig.preset("decoupled_seq_is_rs")
    lp = torch.zeros(2, 5, dtype=torch.float64)
    pairs = metric_pairs(compute_rollout_correction(lp, lp, torch.zeros(2, 5, dtype=torch.bool), config).stats,
                         config)
    for key, pair in pairs.items():
        assert pair[1] > 0 and (pair[0] / pair[1]).item() == 0.0, (key, pair)
