"""`--rollout-correction-backend triton` where its kernel cannot run (no triton here, or triton without a GPU or its
interpreter): the correction goes on with the eager token pass, the same weights, masks and metrics, after one
warning for the process (slime_corr/kernel_fallback.py). The kernel itself: tests/kernels (Triton's interpreter)."""

from __future__ import annotations

import warnings

import torch

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import compute_rollout_correction, metrics
from slime_corr.kernel_fallback import KernelFallback


def test_a_token_pass_kernel_that_cannot_run_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(metrics, "TRITON", KernelFallback("--rollout-correction-backend triton"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(0)
    lp_rollout = -torch.rand(5, 12, generator=g) * 2
    lp_train = lp_rollout + 0.05 * torch.randn(5, 12, generator=g)
    mask = (torch.arange(12)[None] < torch.tensor([12, 3, 0, 7, 1])[:, None]).float()
    config = RolloutCorrectionConfig.preset("decoupled_seq_is_rs")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fused = [compute_rollout_correction(lp_train, lp_rollout, mask,
                                            config.replace(rollout_correction_backend="triton")) for _ in range(2)]
    eager = compute_rollout_correction(lp_train, lp_rollout, mask, config)
    fallbacks = [w for w in seen if "--rollout-correction-backend triton" in str(w.message)]
    assert len(fallbacks) == 1 and not metrics.TRITON.usable
    for result in fused:
        assert torch.equal(result.weights, eager.weights) and torch.equal(result.loss_mask, eager.loss_mask)
        assert result.metrics.keys() == eager.metrics.keys()
        assert all(torch.equal(result.metrics[k], eager.metrics[k]) for k in eager.metrics)
