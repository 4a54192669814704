"""Policy losses: loop reference, gradients, metrics-only bitwise, padding/micro-batch invariance, hardening."""

from __future__ import annotations

import math

import pytest
import torch
from corr_reference import ref_policy_loss
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.losses import compute_policy_loss

AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
PRESETS = ("decoupled_token_is", "decoupled_seq_is", "decoupled_seq_is_rs", "decoupled_geo_rs", "ppo_is_bypass", "pg_is", "pg_rs", "disabled")


def _batch(seed, B=6, S=10, mismatch=0.2):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, S, generator=g, dtype=torch.float64) * 2
    ro = old + mismatch * torch.randn(B, S, generator=g, dtype=torch.float64)
    lp = old + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)
    adv = torch.randn(B, S, generator=g, dtype=torch.float64)
    mask = torch.rand(B, S, generator=g) > 0.3
    mask[0] = False
    return lp, old, ro, adv, mask


@pytest.mark.parametrize("agg", AGG)
@pytest.mark.parametrize("preset", PRESETS)
def test_loss_matches_loop_reference(preset, agg):
    cfg = C.preset(preset, loss_agg_mode=agg, **({"rs_upper_bound": 1.5} if "rs" in preset else {}))
    lp, old, ro, adv, mask = _batch(0)
    out = compute_policy_loss(lp, old, ro, adv, mask, cfg)
    corr = out.correction
    anchor = ro if cfg.use_rollout_logprobs else old
    w = corr.weights if corr is not None else None
    ref = ref_policy_loss(lp, anchor, adv, w, corr.loss_mask, corr.denominator_mask, cfg)
    assert out.loss.item() == pytest.approx(ref, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("eps_c,high", [(None, None), (3.0, None), (2.0, 0.28)])
def test_ppo_clip_variants(eps_c, high):
    cfg = C(eps_clip_c=eps_c, eps_clip_high=high)
    lp, old, ro, adv, mask = _batch(1)
    lp = old + 1.5 * (lp - old)  # many clipped ratios
    out = compute_policy_loss(lp, old, None, adv, mask, cfg)
    assert out.loss.item() == pytest.approx(ref_policy_loss(lp, old, adv, None, mask, mask, cfg), rel=1e-10)


def test_dual_clip_hand_computed():
    # ratio e^2 = 7.39, A = -1: max(7.39, clip -> 1.2) = 7.39, dual clip c=3 caps to 3
    lp = torch.tensor([[2.0]], dtype=torch.float64)
    z = torch.zeros(1, 1, dtype=torch.float64)
    a = -torch.ones(1, 1, dtype=torch.float64)
    m = torch.ones(1, 1)
    assert compute_policy_loss(lp, z, None, a, m, C(eps_clip_c=3.0)).loss.item() == pytest.approx(3.0)
    assert compute_policy_loss(lp, z, None, a, m, C()).loss.item() == pytest.approx(math.exp(2.0))


def test_gradients_match_analytic_and_weights_carry_none():
    lp, old, ro, adv, mask = _batch(2)
    # decoupled token IS: d/dlp of w·(-A r) = -A r w on unclipped tokens, 0 on clipped ones
    cfg = C.preset("decoupled_token_is")
    x = lp.clone().requires_grad_()
    out = compute_policy_loss(x, old, ro, adv, mask, cfg)
    out.loss.backward()
    w = out.correction.weights
    r = (lp - old).exp()
    lo, hi = cfg.clip_range
    unclipped = ~(((adv > 0) & (r > hi)) | ((adv < 0) & (r < lo)))
    expected = torch.where(mask & unclipped, -adv * r * w, torch.zeros_like(r)) / mask.sum()
    torch.testing.assert_close(x.grad, expected)
    # pg_is: w is computed from lp.detach(), so d/dlp of -A·lp·w = -A·w exactly
    cfg = C.preset("pg_is")
    x = lp.clone().requires_grad_()
    out = compute_policy_loss(x, None, ro, adv, mask, cfg)
    out.loss.backward()
    expected = torch.where(mask, -adv * out.correction.weights, torch.zeros_like(lp)) / mask.sum()
    torch.testing.assert_close(x.grad, expected)
    assert out.correction.weights.requires_grad is False


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), preset=st.sampled_from(PRESETS), agg=st.sampled_from(AGG))
def test_zero_mismatch_means_plain_ppo(seed, preset, agg):
    lp, old, _, adv, mask = _batch(seed)
    cfg = C.preset(preset, loss_agg_mode=agg)
    ro = lp.detach() if cfg.use_rollout_logprobs else old
    out = compute_policy_loss(lp, old, ro, adv, mask, cfg)
    if out.correction.weights is not None:
        assert (out.correction.weights[mask] == 1.0).all()
    assert torch.equal(out.correction.loss_mask, mask.float())
    plain_cfg = C(loss_type=cfg.loss_type, use_rollout_logprobs=cfg.use_rollout_logprobs, loss_agg_mode=agg)
    plain = compute_policy_loss(lp, old, ro, adv, mask, plain_cfg)
    assert out.loss.item() == pytest.approx(plain.loss.item(), rel=1e-12, abs=1e-15)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), agg=st.sampled_from(AGG), bypass=st.booleans(), float_mask=st.booleans())
def test_metrics_only_is_bitwise_plain(seed, agg, bypass, float_mask):
    lp, old, ro, adv, mask = _batch(seed)
    lp, old, ro, adv = (t.float() for t in (lp, old, ro, adv))
    m = mask.float() if float_mask else mask
    grads = []
    for metrics in (False, True):
        x = lp.clone().requires_grad_()
        out = compute_policy_loss(x, old, ro, adv, m, C(get_mismatch_metrics=metrics, use_rollout_logprobs=bypass, loss_agg_mode=agg))
        out.loss.backward()
        grads.append((out.loss.detach(), x.grad))
        assert ("mismatch_kl" in out.metrics) == metrics
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("agg", AGG)
@pytest.mark.parametrize("preset", ("decoupled_seq_is_rs", "pg_is", "decoupled_token_is"))
def test_padding_and_microbatch_invariance(preset, agg):
    lp, old, ro, adv, mask = _batch(3, B=8, S=10)
    cfg = C.preset(preset, loss_agg_mode=agg, tis_batch_normalize=False)
    kw = dict(seq_length_for_norm=16)
    x = lp.clone().requires_grad_()
    full = compute_policy_loss(x, old, ro, adv, mask, cfg, **kw)
    full.loss.backward()
    # padding: 6 extra padded columns (with garbage) change nothing
    pad = lambda t, v: torch.cat([t, torch.full((t.shape[0], 6), v, dtype=t.dtype)], dim=1)  # noqa: E731
    y = pad(lp, float("nan")).requires_grad_()
    padded = compute_policy_loss(y, pad(old, 5.0), pad(ro, -float("inf")), pad(adv, 1e30), pad(mask, False), cfg, **kw)
    padded.loss.backward()
    assert padded.loss.item() == pytest.approx(full.loss.item(), rel=1e-12)
    torch.testing.assert_close(y.grad[:, :10], x.grad)
    # micro-batches: Σ loss_sum / Σ denominator equals the full-batch loss and gradient
    z = lp.clone().requires_grad_()
    parts = [compute_policy_loss(z[s], old[s], ro[s], adv[s], mask[s], cfg, **kw) for s in (slice(0, 3), slice(3, 8))]
    den = sum(p.denominator for p in parts)
    total = sum(p.loss_sum for p in parts) / den.clamp_min(1)
    total.backward()
    assert total.item() == pytest.approx(full.loss.item(), rel=1e-12)
    torch.testing.assert_close(z.grad, x.grad)


@pytest.mark.parametrize("agg", AGG)
def test_all_rejected_and_all_padding_give_zero(agg):
    lp, old, ro, adv, mask = _batch(4)
    for cfg, m in ((C.preset("decoupled_geo_rs", rs_upper_bound=1.000001, loss_agg_mode=agg), mask),
                   (C.preset("decoupled_token_is", loss_agg_mode=agg), torch.zeros_like(mask))):
        x = lp.clone().requires_grad_()
        out = compute_policy_loss(x, old, ro, adv, m, cfg)
        out.loss.backward()
        assert out.loss.item() == 0.0 and (x.grad == 0).all()
    assert out.metrics["mis_all_rejected"].item() == 1.0


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    scale=st.sampled_from([1.0, 50.0, 1e4]),
    preset=st.sampled_from(PRESETS),
    agg=st.sampled_from(AGG),
    n_bad=st.integers(0, 4),
)
def test_extreme_inputs_never_nan(seed, scale, preset, agg, n_bad):
    g = torch.Generator().manual_seed(seed)
    B, S = 5, 9
    old = -scale * torch.rand(B, S, generator=g)
    ro = -scale * torch.rand(B, S, generator=g)
    lp = (-scale * torch.rand(B, S, generator=g)).requires_grad_()
    adv = scale * torch.randn(B, S, generator=g)
    mask = torch.rand(B, S, generator=g) > 0.4
    bad = [float("nan"), float("inf"), -float("inf"), 3e38]
    for k in range(n_bad):
        i, t = k % B, (k * 3) % S
        (ro if k % 2 else old)[i, t] = bad[k % 4]
    cfg = C.preset(preset, loss_agg_mode=agg)
    out = compute_policy_loss(lp, old, ro, adv, mask, cfg)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())


def test_nonfinite_current_logprob_is_dropped_and_counted():
    lp, old, ro, adv, mask = _batch(5)
    mask[2, 3] = True
    lp[2, 3] = float("nan")
    x = lp.clone().requires_grad_()
    out = compute_policy_loss(x, old, ro, adv, mask, C())
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(x.grad).all()
    assert out.metrics["pg_nonfinite_token_count"].item() == 1


def test_custom_loss_by_name_and_callable():
    from slime_corr.registry import LOSS_FUNCTIONS

    lp, old, ro, adv, mask = _batch(6)
    ref = compute_policy_loss(lp, None, ro, adv, mask, C(use_rollout_logprobs=True, loss_type="reinforce"))
    out = compute_policy_loss(lp, old, ro, adv, mask, C(), loss_fn="reinforce")
    assert out.loss.item() == pytest.approx(ref.loss.item())
    assert "ppo" in LOSS_FUNCTIONS.names()
    sq = compute_policy_loss(lp, old, ro, adv, mask, C(), loss_fn=lambda inputs, config: inputs.advantages**2)
    assert sq.loss.item() == pytest.approx((adv**2)[mask].mean().item())
