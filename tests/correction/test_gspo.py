"""GSPO's sequence-level PPO ratio (--policy-ratio-level sequence) against plain full-tensor references: the
GSPO-token straight-through form (loss and gradient), the sequence-level GSPO objective under seq-mean-token-mean,
IS weights on top in decoupled mode, bypass mode, dual clip, packed rows, NaN outside the mask, empty sequences."""

from __future__ import annotations

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.losses import compute_policy_loss
from tests.correction.test_packed import _data, _pack, _segments, _unpack, _within
from tests.synthetic import response_mask

B, S = 6, 10
EPS = (3e-4, 4e-4)  # the GSPO paper's clip range: the ratio is a per-token geometric mean, close to 1


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, S, generator=g, dtype=torch.float64) * 2
    shift = torch.tensor([1e-3, 1e-4, -1e-3, 0.0, 1e-5, 1e-3], dtype=torch.float64)[:, None]  # clipped or not
    lp = old + shift + 2e-4 * torch.randn(B, S, generator=g, dtype=torch.float64)
    ro = old + 0.2 * torch.randn(B, S, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, 1.0], dtype=torch.float64)
    mask = response_mask([10, 7, 3, 0, 9, 1], S)
    mask[0, 4] = False
    lp = torch.where(mask, lp, torch.full_like(lp, float("nan")))  # NaN outside the mask never leaks
    return lp, old, ro, adv, mask


def ref_gspo_token(lp, old, adv, mask, weights, clip, agg, eps_c=None):
    """GSPO-token, written directly: s_i,t = sg(s_i)·exp(lp_t − sg(lp_t)), s_i = exp(mean_t(lp − lp_old))."""
    m = mask.double()
    lp0 = torch.where(mask, lp, torch.zeros_like(lp))
    s = (((lp0 - old) * m).sum(-1) / m.sum(-1).clamp_min(1)).detach().exp()
    r = s[:, None] * torch.exp(lp0 - lp0.detach())
    a = adv[:, None]
    loss = torch.maximum(-a * r, -a * r.clamp(*clip))
    if eps_c is not None:
        loss = torch.where(a < 0, torch.minimum(loss, -a * eps_c), loss)
    if weights is not None:
        loss = loss * weights
    loss = loss * m
    if agg == "token-mean":
        return loss.sum() / m.sum()
    n = m.sum(-1)
    return (loss.sum(-1) / n.clamp_min(1))[n > 0].mean()


def ref_gspo_sequence(lp, old, adv, mask, clip):
    """GSPO's sequence objective: mean_i max(−A_i·s_i, −A_i·clip(s_i)), s_i = exp(mean_t(lp − lp_old)) with its
    gradient through the mean."""
    m = mask.double()
    lp0 = torch.where(mask, lp, torch.zeros_like(lp))
    n = m.sum(-1)
    s = (((lp0 - old) * m).sum(-1) / n.clamp_min(1)).exp()
    loss = torch.maximum(-adv * s, -adv * s.clamp(*clip))
    return loss[n > 0].mean()


def _ours(lp, old, ro, adv, mask, cfg, **kw):
    x = lp.clone().requires_grad_()
    out = compute_policy_loss(x, old, ro, adv, mask, cfg, **kw)
    out.loss.backward()
    return out, x.grad


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("eps_c", [None, 3.0])
def test_gspo_token_equals_its_formula(agg, eps_c):
    lp, old, ro, adv, mask = _inputs()
    clip = (1 - EPS[0], 1 + EPS[1])
    cfg = C(policy_ratio_level="sequence", eps_clip=EPS[0], eps_clip_high=EPS[1], eps_clip_c=eps_c,
            loss_agg_mode=agg)
    out, grad = _ours(lp, old, ro, adv, mask, cfg)
    x = lp.clone().requires_grad_()
    want = ref_gspo_token(x, old, adv, mask, None, clip, agg, eps_c)
    want.backward()
    torch.testing.assert_close(out.loss, want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, torch.nan_to_num(x.grad), rtol=1e-12, atol=1e-15)
    assert 0 < out.metrics["pg_clipfrac"] < 1  # some sequences clip, some do not
    assert grad.isfinite().all() and grad[~mask].abs().sum() == 0


def test_gspo_equals_the_sequence_objective_under_seq_mean_token_mean():
    lp, old, ro, adv, mask = _inputs(seed=1)
    clip = (1 - EPS[0], 1 + EPS[1])
    cfg = C(policy_ratio_level="sequence", eps_clip=EPS[0], eps_clip_high=EPS[1], loss_agg_mode="seq-mean-token-mean")
    out, grad = _ours(lp, old, ro, adv, mask, cfg)
    x = lp.clone().requires_grad_()
    want = ref_gspo_sequence(x, old, adv, mask, clip)
    want.backward()
    torch.testing.assert_close(out.loss, want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, torch.nan_to_num(x.grad), rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gspo_with_is_weights_on_top_in_decoupled_mode(level):
    lp, old, ro, adv, mask = _inputs(seed=2)
    clip = (1 - EPS[0], 1 + EPS[1])
    cfg = C(policy_ratio_level="sequence", eps_clip=EPS[0], eps_clip_high=EPS[1], use_tis=True, tis_level=level,
            tis_upper_bound=1.5)
    out, grad = _ours(lp, old, ro, adv, mask, cfg)
    m = mask.double()
    if level == "token":
        w = torch.exp(old - ro).clamp(max=1.5) * m
    else:
        w = torch.exp(((old - ro) * m).sum(-1, keepdim=True)).clamp(max=1.5) * m
    torch.testing.assert_close(out.correction.weights, w)
    x = lp.clone().requires_grad_()
    want = ref_gspo_token(x, old, adv, mask, w, clip, "token-mean")
    want.backward()
    torch.testing.assert_close(out.loss, want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, torch.nan_to_num(x.grad), rtol=1e-12, atol=1e-15)


def test_gspo_bypass_uses_the_rollout_log_probs_and_token_level_is_unchanged():
    lp, old, ro, adv, mask = _inputs(seed=3)
    ro = old + 1e-4 * torch.randn(B, S, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    clip = (1 - EPS[0], 1 + EPS[1])
    cfg = C(policy_ratio_level="sequence", eps_clip=EPS[0], eps_clip_high=EPS[1], use_rollout_logprobs=True)
    out, grad = _ours(lp, None, ro, adv, mask, cfg)
    x = lp.clone().requires_grad_()
    want = ref_gspo_token(x, ro, adv, mask, None, clip, "token-mean")
    want.backward()
    torch.testing.assert_close(out.loss, want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, torch.nan_to_num(x.grad), rtol=1e-12, atol=1e-15)
    # a sequence of one token: the sequence ratio is the token ratio
    one = mask.clone()
    one[:, 1:] = False
    tok = C(eps_clip=EPS[0], eps_clip_high=EPS[1], use_rollout_logprobs=True)
    a, ga = _ours(lp, None, ro, adv, one, cfg)
    b, gb = _ours(lp, None, ro, adv, one, tok)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-15)


def test_gspo_packed_equals_padded():
    lp, old, ro, adv, mask = _data()
    for cfg in (C(policy_ratio_level="sequence", eps_clip=0.01, loss_agg_mode="seq-mean-token-mean"),
                C.preset("decoupled_token_is", policy_ratio_level="sequence", eps_clip=0.01, use_rs=True,
                         rs_level="token", rs_upper_bound=1.3)):
        x_pad, x_pack = lp.clone().requires_grad_(), _pack(lp).requires_grad_()
        padded = compute_policy_loss(x_pad, old, ro, adv, mask, cfg)
        packed = compute_policy_loss(x_pack, _pack(old), _pack(ro), adv, _pack(mask), cfg, segments=_segments())
        padded.loss.backward()
        packed.loss.backward()
        torch.testing.assert_close(packed.loss, padded.loss, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(_unpack(x_pack.grad), x_pad.grad * _within(), rtol=1e-12, atol=1e-15)
        for k in ("pg_clipfrac", "ppo_kl", "ois"):
            torch.testing.assert_close(packed.metrics[k], padded.metrics[k], rtol=1e-12, atol=1e-15)
