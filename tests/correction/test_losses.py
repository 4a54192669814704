"""Policy losses: loop reference, gradients, metrics-only bitwise, padding/micro-batch invariance, hardening."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import (
    compute_rollout_correction,
    correction_metrics,
    merge_stats,
    metrics_to_host,
    weight_mean,
)
from slime_corr.losses import compute_policy_loss
from tests.correction.corr_reference import ref_policy_loss
from tests.synthetic import policy_batch

AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
PRESETS = ("decoupled_token_is", "decoupled_seq_is", "decoupled_seq_is_rs", "decoupled_geo_rs", "ppo_is_bypass", "pg_is", "pg_rs", "disabled")


def _batch(seed, B=6, S=10, mismatch=0.2):
    lp, old, ro, adv, mask = policy_batch(seed, B, S, rollout_noise=mismatch, policy_noise=0.3, dropped=0.3)
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


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), level=st.sampled_from(("token", "sequence", "geometric")), bypass=st.booleans(), norm=st.booleans())
def test_gradients_match_analytic_and_weights_carry_none(seed, level, bypass, norm):
    """d loss / d lp against the analytic formula with w treated as a constant (token-mean, N valid tokens).

    pg_is (bypass REINFORCE): w is computed from lp.detach(), so d/dlp (-A·lp·w) = -A·w exactly; a weight that
    carried gradient (through the whole sequence at sequence/geometric level) would add terms.
    Decoupled PPO with IS: d/dlp (w·max(-A r, -A clip(r))) = -A·r·w on unclipped tokens, 0 on clipped ones.
    """
    lp, old, ro, adv, mask = _batch(seed)
    is_kw = dict(use_tis=True, tis_level=level, tis_batch_normalize=norm)
    cfg = C(use_rollout_logprobs=True, loss_type="reinforce", **is_kw) if bypass else C(**is_kw)
    x = lp.clone().requires_grad_()
    out = compute_policy_loss(x, None if bypass else old, ro, adv, mask, cfg)
    out.loss.backward()
    w = out.correction.weights
    assert w.requires_grad is False and w.grad_fn is None
    if bypass:
        per_token = -adv * w
    else:
        r = (lp - old).exp()
        lo, hi = cfg.clip_range
        unclipped = ~(((adv > 0) & (r > hi)) | ((adv < 0) & (r < lo)))
        per_token = torch.where(unclipped, -adv * r * w, torch.zeros_like(r))
    expected = torch.where(mask, per_token, torch.zeros_like(lp)) / max(int(mask.sum()), 1)
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-15)


def test_asymmetric_clip_hand_computed():
    # ratios e^0.5 = 1.6487 (A=+1), e^-0.5 = 0.6065 (A=-1), 1.1 (A=+2); eps 0.2 / eps_high 0.28
    lp = torch.tensor([[0.5, -0.5, math.log(1.1)]], dtype=torch.float64)
    z = torch.zeros_like(lp)
    a = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    m = torch.ones(1, 3, dtype=torch.bool)
    asym = compute_policy_loss(lp, z, None, a, m, C(eps_clip_high=0.28)).loss.item()
    assert asym == pytest.approx((-1.28 + 0.8 - 2.2) / 3)  # max(-1.6487, -1.28), max(0.6065, 0.8), -2.2
    sym = compute_policy_loss(lp, z, None, a, m, C()).loss.item()
    assert sym == pytest.approx((-1.2 + 0.8 - 2.2) / 3)


@pytest.mark.parametrize(
    "agg,keep,drop",
    [("token-mean", -6 / 5, -6 / 3), ("seq-mean-token-sum", -6 / 2, -6 / 1), ("seq-mean-token-mean", -2 / 2, -2 / 1)],
)
def test_rs_keep_loss_denominator_hand_computed(agg, keep, drop):
    # ratio 1 everywhere, so the per-token loss is -A; RS (sequence, U=1.4) rejects sequence 1 (ratio 1.5)
    old = torch.full((2, 4), -1.0, dtype=torch.float64)
    ro = old.clone()
    ro[1, 0] -= math.log(1.5)
    adv = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    cfg = C(use_rs=True, rs_level="sequence", rs_upper_bound=1.4, loss_agg_mode=agg)
    for keep_den, expected in ((True, keep), (False, drop)):
        out = compute_policy_loss(old, old, ro, adv, mask, cfg.replace(rs_keep_loss_denominator=keep_den))
        assert out.loss.item() == pytest.approx(expected)


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


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    preset=st.sampled_from(("decoupled_seq_is_rs", "decoupled_geo_rs", "pg_is", "pg_rs", "decoupled_token_is")),
    agg=st.sampled_from(AGG),
    pad_len=st.integers(1, 7),
    cuts=st.lists(st.integers(1, 7), min_size=1, max_size=3, unique=True),
    normalize=st.booleans(),
)
def test_padding_and_microbatch_invariance(seed, preset, agg, pad_len, cuts, normalize):
    lp, old, ro, adv, mask = _batch(seed, B=8, S=10)
    extra = {"rs_upper_bound": 1.5} if "rs" in preset else {}
    cfg = C.preset(preset, loss_agg_mode=agg, tis_batch_normalize=normalize and C.preset(preset).use_tis, **extra)
    kw = dict(seq_length_for_norm=16)
    x = lp.clone().requires_grad_()
    full = compute_policy_loss(x, old, ro, adv, mask, cfg, **kw)
    full.loss.backward()
    # padding: extra padded columns holding garbage change nothing (loss, gradient, weights, masks, metrics)
    pad = lambda t, v: torch.cat([t, torch.full((t.shape[0], pad_len), v, dtype=t.dtype)], dim=1)  # noqa: E731
    y = pad(lp, float("nan")).requires_grad_()
    padded = compute_policy_loss(y, pad(old, 5.0), pad(ro, -float("inf")), pad(adv, 1e30), pad(mask, False), cfg, **kw)
    padded.loss.backward()
    assert padded.loss.item() == pytest.approx(full.loss.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(y.grad[:, :10], x.grad)
    assert (y.grad[:, 10:] == 0).all()
    assert torch.equal(padded.correction.loss_mask[:, :10], full.correction.loss_mask)
    if full.correction.weights is not None:
        torch.testing.assert_close(padded.correction.weights[:, :10], full.correction.weights)
    got, want = metrics_to_host(padded.metrics), metrics_to_host(full.metrics)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    # micro-batches: Σ loss_sum / Σ denominator equals the full-batch loss and gradient; with batch normalization
    # the step's mean comes from a pre-pass; merged statistics give the full-batch metrics
    z = lp.clone().requires_grad_()
    bounds = [0, *sorted(cuts), 8]
    rows = list(zip(bounds[:-1], bounds[1:], strict=True))
    lp_train = lp if cfg.use_rollout_logprobs else old
    pre = [compute_rollout_correction(lp_train[a:b], ro[a:b], mask[a:b], cfg).stats for a, b in rows]
    step_mean = weight_mean(merge_stats(pre)) if cfg.tis_batch_normalize else None
    parts = [compute_policy_loss(z[a:b], old[a:b], ro[a:b], adv[a:b], mask[a:b], cfg, batch_norm_mean=step_mean,
                                 **kw) for a, b in rows]
    den = sum(p.denominator for p in parts)
    total = sum(p.loss_sum for p in parts) / den.clamp_min(1)
    total.backward()
    assert total.item() == pytest.approx(full.loss.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(z.grad, x.grad)
    if full.correction.weights is not None:
        torch.testing.assert_close(torch.cat([p.correction.weights for p in parts]), full.correction.weights)
    merged = metrics_to_host(correction_metrics(merge_stats([p.correction.stats for p in parts]), cfg))
    want = metrics_to_host(full.correction.metrics)
    assert set(merged) == set(want)
    for k, v in want.items():
        assert merged[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k  # quantiles too: every bin was refined


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
    n_bad=st.integers(0, 5),
    float_mask=st.booleans(),
)
def test_extreme_inputs_never_nan(seed, scale, preset, agg, n_bad, float_mask):
    g = torch.Generator().manual_seed(seed)
    B, S = 5, 9
    old = -scale * torch.rand(B, S, generator=g)
    ro = -scale * torch.rand(B, S, generator=g)
    lp = (-scale * torch.rand(B, S, generator=g)).requires_grad_()
    adv = scale * torch.randn(B, S, generator=g)
    mask = torch.rand(B, S, generator=g) > 0.4
    bad = [float("nan"), float("inf"), -float("inf"), 3e38, -3e38]
    with torch.no_grad():
        for k in range(n_bad):
            i, t = k % B, (k * 3) % S
            # log-probs get any of them; advantages only non-finite ones (a finite |A| ~ 1e38 overflows any loss)
            (ro, old, lp, adv)[k % 4][i, t] = bad[k % 5] if k % 4 != 3 else bad[k % 3]
    cfg = C.preset(preset, loss_agg_mode=agg)
    out = compute_policy_loss(lp, old, ro, adv, mask.float() if float_mask else mask, cfg)
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


@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("preset", ["decoupled_seq_is_rs", "disabled"])
def test_nonfinite_advantages_are_an_error_on_the_host(per_sequence, preset, monkeypatch):
    """A NaN/inf advantage at a token in the loss mask is counted on the device (every mask token, a rejected
    sequence's included) and raises when the metrics reach the host; outside the mask it is ignored; with
    --warn-invalid-inputs it warns and the loss stays finite."""
    from slime_corr.correction import checks

    monkeypatch.setattr(checks, "_WARNED", set())  # warned once per process and kind
    lp, old, ro, adv, mask = _batch(7)
    lp, ro = lp.clamp(max=0), ro.clamp(max=0)
    mask[1] = False
    mask[2, :4] = True
    if per_sequence:
        adv = adv[:, 0].clone()
        adv[1] = float("nan")  # a sequence without a token in the mask: nothing to count
        adv[2] = float("inf")
        expected = int(mask[2].sum())
    else:
        adv[1, 0] = float("nan")  # outside the mask
        adv[2, 0], adv[2, 3] = float("nan"), -float("inf")
        expected = 2
    reference = mask.float() * (~torch.isfinite(adv if not per_sequence else adv[:, None].expand_as(mask))).float()
    assert reference.sum().item() == expected
    out = compute_policy_loss(lp, old, ro, adv, mask, C.preset(preset))
    assert out.metrics["pg_nonfinite_advantage_count"].item() == expected
    with pytest.raises(checks.InputValueError, match=rf"{expected} NaN/inf advantage\(s\).*pg_nonfinite_advantage_count"):
        metrics_to_host(out.metrics, C.preset(preset))
    assert metrics_to_host(out.metrics)["pg_nonfinite_advantage_count"] == expected  # no config: no check
    lenient = C.preset(preset, warn_invalid_inputs=True)
    with pytest.warns(RuntimeWarning, match="advantage"):
        metrics_to_host(compute_policy_loss(lp, old, ro, adv, mask, lenient).metrics, lenient)
    assert torch.isfinite(out.loss)
    clean = torch.where(torch.isfinite(adv), adv, 0.0)
    assert metrics_to_host(compute_policy_loss(lp, old, ro, clean, mask, C.preset(preset)).metrics,
                           C.preset(preset))["pg_nonfinite_advantage_count"] == 0


def test_custom_loss_by_name_and_callable():
    from slime_corr.registry import LOSS_FUNCTIONS

    lp, old, ro, adv, mask = _batch(6)
    ref = compute_policy_loss(lp, None, ro, adv, mask, C(use_rollout_logprobs=True, loss_type="reinforce"))
    out = compute_policy_loss(lp, old, ro, adv, mask, C(), loss_fn="reinforce")
    assert out.loss.item() == pytest.approx(ref.loss.item())
    assert "ppo" in LOSS_FUNCTIONS.names()
    sq = compute_policy_loss(lp, old, ro, adv, mask, C(), loss_fn=lambda inputs, config: inputs.advantages**2)
    assert sq.loss.item() == pytest.approx((adv**2)[mask].mean().item())


def test_custom_loss_by_path(tmp_path):
    f = tmp_path / "my_loss.py"
    f.write_text("def abs_adv(inputs, config):\n    return inputs.advantages.abs() + 0 * inputs.log_probs\n")
    lp, old, ro, adv, mask = _batch(7)
    x = lp.clone().requires_grad_()
    out = compute_policy_loss(x, old, ro, adv, mask, C(), loss_fn=f"{f}:abs_adv")
    assert out.loss.item() == pytest.approx(adv.abs()[mask].mean().item())
    out.loss.backward()
    assert (x.grad == 0).all()
    from slime_corr.config import ConfigError

    with pytest.raises(ConfigError):
        compute_policy_loss(lp, old, ro, adv, mask, C(), loss_fn="no_such_loss")


@pytest.mark.parametrize("preset", ("decoupled_token_is", "decoupled_seq_is_rs"))
def test_prepass_finished_by_normalize_weights_equals_the_training_pass(preset):
    """Decoupled mode with --tis-batch-normalize over several micro-batches: the pre-pass's corrections, finished by
    `normalize_weights` with the step's mean, are what the training pass would compute (so it need not redo them)."""
    from slime_corr.correction import normalize_weights

    lp, old, ro, adv, mask = _batch(11, B=8, S=10)
    cfg = C.preset(preset, tis_batch_normalize=True, **({"rs_upper_bound": 1.5} if "rs" in preset else {}))
    rows = [slice(0, 3), slice(3, 8)]
    pre = [compute_rollout_correction(old[r], ro[r], mask[r], cfg, normalize=False) for r in rows]
    mean = weight_mean(merge_stats([p.stats for p in pre]))
    for r, p in zip(rows, pre, strict=True):
        want = compute_policy_loss(lp[r].clone().requires_grad_(), old[r], ro[r], adv[r], mask[r], cfg,
                                   batch_norm_mean=mean)
        x = lp[r].clone().requires_grad_()
        got = compute_policy_loss(x, old[r], ro[r], adv[r], mask[r], cfg, correction=normalize_weights(p, cfg, mean))
        assert torch.equal(got.correction.weights, want.correction.weights)
        assert torch.equal(got.loss, want.loss)
        assert metrics_to_host(got.metrics) == metrics_to_host(want.metrics)
    skipped = compute_rollout_correction(old, ro, mask, cfg, finalize_metrics=False)
    assert skipped.metrics == {} and metrics_to_host(correction_metrics(skipped.stats, cfg)) == metrics_to_host(
        compute_rollout_correction(old, ro, mask, cfg).metrics)
    lean = compute_policy_loss(lp, old, ro, adv, mask, cfg, finalize_metrics=False)
    assert "mismatch_kl" not in lean.metrics and "pg_clipfrac" in lean.metrics and lean.correction.stats
