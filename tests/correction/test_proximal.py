"""The log-linear π_old (`slime_corr.correction.proximal`) against AReaL's formula written with versions, hand
values, and its edge cases: exact π_θ when π_old's weights are π_θ's, π_behave when they are the behaviour's, masked
and non-finite tokens, gradients cut, and the error sums against a plain computation."""

from __future__ import annotations

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction.proximal import (
    check_prox_logp_method,
    loglinear_alpha,
    loglinear_prox_log_probs,
    prox_error_sums,
)


def test_alpha_is_areals_version_ratio():
    # versions (v_behave, v_prox, v_theta) -> lags from v_theta
    cases = [(3, 5, 6), (0, 2, 4), (5, 5, 6), (2, 6, 6), (6, 6, 6), (1, 4, 8)]
    behave_lag = torch.tensor([t - b for b, _, t in cases])
    prox_lag = torch.tensor([t - p for _, p, t in cases])
    areal = [(p - b) / (t - b) if t != b else 1.0 for b, p, t in cases]
    assert loglinear_alpha(behave_lag, prox_lag).tolist() == pytest.approx(areal, abs=0)
    assert loglinear_alpha(torch.tensor([1, 2, 4]), 0).tolist() == [1.0, 1.0, 1.0]  # π_old's weights are π_θ's
    assert loglinear_alpha(torch.tensor([1, 3]), 5).tolist() == [0.0, 0.0]  # behaviour newer than π_old: clamped


def test_interpolation_by_hand_and_its_exact_ends():
    behave = torch.tensor([[-1.0, -2.0, -3.0, -0.5]], dtype=torch.float32)
    current = torch.tensor([[-2.0, -1.0, -1.0, -0.25]], dtype=torch.float64, requires_grad=True)
    lag = torch.tensor([[2, 4, 1, 0]])
    out = loglinear_prox_log_probs(behave, current, lag, 1)  # α = 1/2, 3/4, 0, 1
    assert out.dtype == torch.float64 and not out.requires_grad
    assert out.tolist() == [[-1.5, -1.25, -3.0, -0.25]]
    same = loglinear_prox_log_probs(behave, current, lag, 0)  # the rollout's first step: π_θ itself, bit for bit
    assert torch.equal(same, current.detach())


def test_a_non_finite_behaviour_log_prob_takes_the_current_one():
    behave = torch.tensor([[float("-inf"), float("nan"), -1.0]])
    current = torch.tensor([[-2.0, -3.0, -4.0]])
    out = loglinear_prox_log_probs(behave, current, torch.tensor([[2, 2, 2]]), 1)
    assert out.tolist() == [[-2.0, -3.0, -2.5]]


def test_error_sums_are_over_the_masked_tokens_only():
    approx = torch.tensor([[-1.0, -2.0, float("inf")], [-0.5, 0.0, 0.0]])
    recomputed = torch.tensor([[-1.5, -2.0, -1.0], [-0.25, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    total, count, top = prox_error_sums(approx, recomputed, mask).tolist()
    assert (total, count, top) == (0.75, 3.0, 0.5)
    assert prox_error_sums(approx[:, :0], recomputed[:, :0], mask[:, :0]).tolist() == [0.0, 0.0, 0.0]


def test_loglinear_is_refused_where_it_cannot_stand_for_the_recompute():
    decoupled = RolloutCorrectionConfig.preset("decoupled_seq_is_rs")
    assert check_prox_logp_method("loglinear", decoupled, False) == "loglinear"
    with pytest.raises(ValueError, match="--prox-logp-method 'exact' is not one of recompute, loglinear"):
        check_prox_logp_method("exact", decoupled, False)
    with pytest.raises(ValueError, match="bypass mode"):
        check_prox_logp_method("loglinear", RolloutCorrectionConfig.preset("ppo_is_bypass"), False)
    with pytest.raises(ValueError, match="--rollout-top-p"):
        check_prox_logp_method("loglinear", decoupled, True)
