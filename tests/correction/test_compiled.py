"""`--rollout-correction-compile`: the torch.compile'd per-token stages give the eager results (weights, masks,
metrics, loss and gradient). Each configuration compiles for seconds, so CI runs two; `-m slow` runs the rest."""

from __future__ import annotations

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import metrics_to_host
from slime_corr.losses import compute_policy_loss
from tests.synthetic import policy_batch

pytestmark = pytest.mark.cost(35)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)


def _batch(dtype: torch.dtype, seed: int = 0, b: int = 16, s: int = 96):
    lp, old, ro, adv, mask = policy_batch(seed, b, s, rollout_noise=0.3, policy_noise=0.2, dropped=0.25, dtype=dtype)
    mask[3] = False  # an empty sequence
    ro[5, 7], mask[5, 7] = float("nan"), True  # a non-finite sequence
    lp[0, 10] = 30.0  # a saturated PPO ratio (|lp - lp_old| > 20)
    return lp, old, ro, adv, mask


def _run(cfg: C, dtype: torch.dtype):
    lp, old, ro, adv, mask = _batch(dtype)
    x = lp.clone().requires_grad_()
    out = compute_policy_loss(x, None if cfg.use_rollout_logprobs else old, ro, adv, mask, cfg)
    out.loss.backward()
    return out, x.grad


def _check(cfg: C, dtype: torch.dtype, rtol: float) -> None:
    eager, g_eager = _run(cfg, dtype)
    compiled, g_compiled = _run(cfg.replace(rollout_correction_compile=True), dtype)
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=rtol, atol=rtol)
    torch.testing.assert_close(g_compiled, g_eager, rtol=rtol, atol=rtol)
    assert torch.equal(compiled.correction.loss_mask, eager.correction.loss_mask)
    if eager.correction.weights is not None:
        torch.testing.assert_close(compiled.correction.weights, eager.correction.weights, rtol=rtol, atol=rtol)
    got, want = metrics_to_host(compiled.metrics), metrics_to_host(eager.metrics)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=rtol, abs=rtol), k


CI_CASES = [
    (C(use_tis=True, eps_clip_c=3.0, rs_veto_threshold=1e-3), torch.float64, 1e-10),  # PPO + token TIS + veto
    (C.preset("pg_is", tis_batch_normalize=True), torch.float32, 2e-5),  # REINFORCE + sequence IS, float32
]
SLOW_CASES = [
    (C.preset("decoupled_seq_is_rs", rs_veto_threshold=1e-3), torch.float64, 1e-10),
    (C(use_tis=True, tis_mode="mask", tis_lower_bound=0.7, tis_upper_bound=1.4, use_rs=True, rs_level="token",
       rs_upper_bound=1.8, tis_batch_normalize=True), torch.float64, 1e-10),
    (C(use_tis=True, tis_mode="clip", tis_level="geometric"), torch.float32, 2e-5),
    (C(get_mismatch_metrics=True), torch.float32, 2e-5),
    (C.preset("ppo_is_bypass"), torch.float64, 1e-10),
]


@pytest.mark.parametrize("cfg, dtype, rtol", CI_CASES)
def test_compiled_equals_eager(cfg, dtype, rtol):
    _check(cfg, dtype, rtol)


@pytest.mark.slow
@pytest.mark.parametrize("cfg, dtype, rtol", SLOW_CASES)
def test_compiled_equals_eager_more_configs(cfg, dtype, rtol):
    _check(cfg, dtype, rtol)
