"""Metric values against a loop reference, quantiles at scale, one host transfer."""

from __future__ import annotations

import math

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import checks, compute_rollout_correction, metrics_to_host
from slime_corr.correction.quantiles import QUANTILES
from tests.correction.corr_reference import ref_mismatch_metrics
from tests.synthetic import correction_batch

MISMATCH_KEYS = {
    "mismatch_kl", "mismatch_k3_kl", "mismatch_training_log_ppl", "mismatch_rollout_log_ppl",
    "mismatch_training_ppl", "mismatch_rollout_ppl", "mismatch_log_ppl_diff", "mismatch_log_ppl_abs_diff",
    "mismatch_ppl_ratio", "mismatch_chi2_token", "mismatch_chi2_seq", "train_rollout_logprob_abs_diff",
    "rollout_probs_diff_max", "rollout_probs_diff_mean", "rollout_probs_diff_std", "rollout_actor_probs_pearson_corr",
}


def nearest_rank(values: torch.Tensor, q: float) -> float:
    """The exact q-quantile the sketch reports: the smallest value v with F(v) >= q, ranked and rounded as float32,
    then clamped into the true [min, max]."""
    v = values.reshape(-1).float().sort().values
    x = v[max(math.ceil(q * v.numel() - 1e-9), 1) - 1].item()
    return min(max(x, values.min().item()), values.max().item())


def _batch(seed, B=7, S=20, dtype=torch.float64):
    lp_t, lp_r, mask = correction_batch(seed, B, S, spread=2.0, noise=0.2, dropped=0.3, dtype=dtype)
    mask[-1] = False
    return lp_t, lp_r, mask


def test_mismatch_metrics_match_reference():
    lp_t, lp_r, mask = _batch(0)
    lp_t[2, 1] = float("nan")
    mask[2, 1] = True  # sequence 2 excluded
    m = metrics_to_host(compute_rollout_correction(lp_t, lp_r, mask, C(get_mismatch_metrics=True)).metrics)
    ref = ref_mismatch_metrics(lp_t, lp_r, mask)
    assert MISMATCH_KEYS <= set(m)
    for k, v in ref.items():
        assert m[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_is_metrics_token_level():
    lp_t, lp_r, mask = _batch(1)
    cfg = C(use_tis=True, tis_mode="clip", tis_upper_bound=1.2)
    res = compute_rollout_correction(lp_t, lp_r, mask, cfg)
    m = metrics_to_host(res.metrics)
    raw = (lp_t - lp_r).exp()[mask]
    w = res.weights[mask]
    assert m["mis_mean_is_weight_before_clip"] == pytest.approx(raw.mean().item())
    assert m["mis_clip_fraction_high"] == pytest.approx((raw > 1.2).double().mean().item())
    assert m["mis_clip_fraction_low"] == pytest.approx((raw < 1 / 1.2).double().mean().item())
    assert m["mis_ratio_mean_after_mis"] == pytest.approx(w.mean().item())
    assert m["mis_weight_min"] == pytest.approx(w.min().item()) and m["mis_weight_max"] == pytest.approx(w.max().item())
    assert m["mis_ess"] == pytest.approx((w.sum() ** 2 / (w.numel() * (w**2).sum())).item())
    assert m["mis_weight_std"] == pytest.approx(w.std(unbiased=False).item(), rel=1e-6)
    for name, q in QUANTILES.items():
        assert m[f"mis_weight_{name}"] == nearest_rank(w, q), name


def test_is_metrics_sequence_level_count_each_sequence_once():
    lp_t, lp_r, mask = _batch(2)
    cfg = C(use_tis=True, tis_level="sequence", tis_upper_bound=1.5)
    m = metrics_to_host(compute_rollout_correction(lp_t, lp_r, mask, cfg).metrics)
    s = ((lp_t - lp_r) * mask).sum(-1)[mask.any(-1)]
    raw = s.clamp(-20, 20).exp()
    w = raw.clamp(max=1.5)
    assert m["mis_mean_is_weight_before_clip"] == pytest.approx(raw.mean().item())
    assert m["mis_truncate_fraction"] == pytest.approx((raw > 1.5).double().mean().item())
    assert m["mis_ratio_mean_after_mis"] == pytest.approx(w.mean().item())
    assert m["mis_ess"] == pytest.approx((w.sum() ** 2 / (w.numel() * (w**2).sum())).item())


def test_quantiles_at_32k_responses():
    # torch.quantile refuses inputs above 2**24 elements; the histogram works at any size.
    B, S = 32768, 520
    g = torch.Generator().manual_seed(0)
    lr = (0.1 * torch.randn(B, 1, generator=g)).expand(B, S).contiguous()
    lp_r = torch.full((B, S), -1.0)
    res = compute_rollout_correction(lp_r + lr, lp_r, torch.ones(B, S, dtype=torch.bool), C(use_tis=True, tis_level="geometric"))
    m = metrics_to_host(res.metrics)
    per_seq = (lp_r[:, 0] + lr[:, 0] - lp_r[:, 0]).exp().clamp(max=2.0)  # exp(lr) as the core computes it
    for name, q in QUANTILES.items():
        assert m[f"mis_weight_{name}"] == nearest_rank(per_seq, q), name
    assert m["mis_weight_max"] == pytest.approx(per_seq.max().item())


def test_metrics_to_host_single_transfer(monkeypatch):
    calls = []
    orig = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(1) or orig(self))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("item() called"))
    lp_t, lp_r, mask = _batch(3)
    res = compute_rollout_correction(lp_t, lp_r, mask, C.preset("decoupled_seq_is_rs", tis_batch_normalize=True))
    host = metrics_to_host(res.metrics)
    assert len(calls) == 1 and all(isinstance(v, float) for v in host.values())
    assert all(t.dim() == 0 for t in res.metrics.values())


def test_all_padding_batch_reports_no_mismatch_value():
    """On the device the means of an empty batch are finite zeros (0 / 0 = 0: Megatron's pairs sum them); on the host
    they have no value rather than 0, while the counts stay."""
    z = torch.zeros(3, 4)
    cfg = C.preset("decoupled_seq_is_rs", tis_batch_normalize=True)
    res = compute_rollout_correction(z, z, torch.zeros(3, 4), cfg)
    assert all(torch.isfinite(v) for v in res.metrics.values()) and res.metrics["mismatch_k3_kl"] == 0
    for m in (metrics_to_host(res.metrics), metrics_to_host(res.metrics, cfg)):
        assert "mismatch_k3_kl" not in m and not any(k.startswith(("mismatch_", "mis_weight_")) for k in m)
        assert m["mis_valid_token_count"] == 0.0 and m["mis_rejected_token_fraction"] == 0.0
    nan = torch.full((2, 3), math.nan)  # every measured token NaN: nothing measured either
    checks._WARNED.clear()
    res = compute_rollout_correction(nan, z[:2, :3], torch.ones(2, 3), C(get_mismatch_metrics=True, warn_invalid_inputs=True))
    with pytest.warns(RuntimeWarning, match="6 NaN log-prob"):
        m = metrics_to_host(res.metrics, C(get_mismatch_metrics=True, warn_invalid_inputs=True))
    assert "mismatch_k3_kl" not in m and m["mis_nonfinite_seq_count"] == 2 and m["mis_nan_logprob_count"] == 6


def test_token_level_quantiles_beyond_torch_quantile_limit():
    # 32k responses x 513 tokens = 16.8M weights > 2**24, where torch.quantile raises; the sketch does not.
    B, S = 32768, 513
    g = torch.Generator().manual_seed(1)
    lp_r = torch.full((B, S), -1.0)
    lp_t = lp_r + 0.3 * torch.randn(B, S, generator=g)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[:, -13:] = False  # padding is not counted
    with pytest.raises(RuntimeError):
        torch.quantile(lp_t.reshape(-1), 0.5)
    res = compute_rollout_correction(lp_t, lp_r, mask, C(use_tis=True, tis_upper_bound=1e3))
    m = metrics_to_host(res.metrics)
    w = res.weights[mask]
    for name, q in QUANTILES.items():
        k = max(math.ceil(q * w.numel() - 1e-9), 1)
        assert m[f"mis_weight_{name}"] == w.kthvalue(k).values.item(), name
    assert m["mis_weight_max"] == w.max().item() and m["mis_weight_min"] == w.min().item()


@pytest.mark.parametrize("level", ("sequence", "geometric"))
def test_sequence_level_quantiles_match_torch_quantile(level):
    lp_t, lp_r, mask = _batch(4, B=300, S=12)
    cfg = C(use_tis=True, tis_level=level, tis_mode="mask", tis_upper_bound=1.3, tis_batch_normalize=True)
    res = compute_rollout_correction(lp_t, lp_r, mask, cfg)
    m = metrics_to_host(res.metrics)
    rows = mask.any(-1)
    w = res.weights[rows].max(-1).values  # one weight per sequence (0 for masked-out ones)
    assert m["mis_weight_min"] == pytest.approx(w.min().item()) and m["mis_weight_max"] == pytest.approx(w.max().item())
    for name, q in QUANTILES.items():  # normalized weights: the exact quantile of the raw ones, divided alike
        exact = nearest_rank(w * m["mis_batch_norm_factor"], q) / m["mis_batch_norm_factor"]
        assert m[f"mis_weight_{name}"] == pytest.approx(exact, rel=1e-12), name
