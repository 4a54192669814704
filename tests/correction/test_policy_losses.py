"""The peers' losses (slime_corr/policy_losses.py) and masks (slime_corr/mismatch_masks.py) against the peers' own
code on the same inputs: verl 0.9.1's registered policy losses (`core_algos.register_policy_loss`: cispo, sapo,
geo_mean, dppo_tv, dppo_kl, clip_cov, kl_cov; its wheel, as bench/vs_verl.py loads it), AReaL 1.0.4's
`_apply_m2po_masking` (its wheel, bench/vs_areal.py), and, for NeMo-RL (not installable: PyPI's nemo-rl is an empty
0.0.0 placeholder), a float64 reference written from its `compute_and_apply_seq_logprob_error_masking`
(NVIDIA-NeMo/RL, nemo_rl/algorithms/grpo.py: seq_mult_prob_error = Σ_t m·exp(|lp_gen − lp_prev|·m) / max(Σ_t m, 1),
a sequence above the threshold leaves the sample mask). Equal losses and gradients with uneven masks, an empty and a
one-token sequence, IS weights, rejection, OPSM, every aggregation mode, packed rows; extreme ratios and NaN/inf
inputs handled as the rest of the project handles them (a non-finite token leaves the loss, nothing NaN leaks)."""

from __future__ import annotations

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.errors import ConfigError
from slime_corr.layout.segments import Segments
from slime_corr.losses import M2PO_COUNT, SEQ_ERROR_COUNT, compute_policy_loss
from slime_corr.mismatch_masks import m2po_masked, seq_mult_prob_error
from slime_corr.opsm import opsm_masked
from tests.bench_modules import bench_module
from tests.correction.test_packed import _data as packed_data
from tests.correction.test_packed import _pack, _segments, _unpack, _within
from tests.synthetic import response_mask

B, S = 8, 12
LENGTHS = (12, 7, 0, 1, 10, 5, 12, 3)  # an empty and a one-token sequence
AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
TOL = dict(rtol=1e-7, atol=1e-12)  # verl divides some means by n + 1e-8: equal to ~1e-9 relative


@pytest.fixture(scope="module")
def verl_losses():
    return bench_module("vs_verl").load_verl().algos  # verl's wheel, downloaded once into bench/.cache/verl


class VerlPolicyLoss:
    """verl's `ActorConfig.policy_loss` fields its Clip-Cov / KL-Cov read."""

    def __init__(self, **fields: float) -> None:
        self.clip_cov_ratio = self.clip_cov_lb = self.clip_cov_ub = self.kl_cov_ratio = self.ppo_kl_coef = None
        self.__dict__.update(fields)


def verl_config(algos, loss_type: str, cfg: C) -> dict:
    """verl's ActorConfig as its policy losses read it, from our config: clip_ratio(_low/_high), clip_ratio_c,
    tau_pos/tau_neg, policy_loss.*, global_batch_info {} (this micro-batch's own denominators). cispo and sapo assert
    an ActorConfig instance (a stand-in class under vs_verl's stubs), the others assert none of AlgoConfig: the
    stubs make both the same class, so only those two get it."""
    base = (algos.ActorConfig, dict) if loss_type in ("cispo", "sapo") else (dict,)
    config = type("VerlActorConfig", base, {})()
    if cfg.eps_clip_c is not None:
        config["clip_ratio_c"] = cfg.eps_clip_c
    config.clip_ratio, config.clip_ratio_low, config.clip_ratio_high = cfg.eps_clip, None, cfg.eps_clip_high
    config.tau_pos, config.tau_neg = cfg.sapo_taus
    ratio, lower, upper = cfg.clip_cov_settings
    kl_ratio, kl_coef = cfg.kl_cov_settings
    config.policy_loss = VerlPolicyLoss(clip_cov_ratio=ratio, clip_cov_lb=lower, clip_cov_ub=upper,
                                        kl_cov_ratio=kl_ratio, ppo_kl_coef=kl_coef)
    config.global_batch_info = {}
    return config


def inputs(seed: int = 0, spread: float = 0.3, per_sequence: bool = True):
    """float64 [B, S]: lp NaN outside the mask (it must never leak), lp_rollout near lp_old, A per sequence (the
    GRPO shape; GMPO's verl code assumes it) or per token."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, S, generator=g, dtype=torch.float64) * 3
    lp = old + spread * torch.randn(B, S, generator=g, dtype=torch.float64)
    ro = old + 0.15 * torch.randn(B, S, generator=g, dtype=torch.float64)
    adv = 2 * torch.randn(B, 1 if per_sequence else S, generator=g, dtype=torch.float64).expand(B, S).clone()
    mask = response_mask(LENGTHS, S)
    mask[0, 3] = mask[6, ::4] = False  # holes inside sequences
    lp = torch.where(mask, lp, torch.full_like(lp, float("nan")))
    return lp, old, ro, adv, mask


def ours(lp, old, ro, adv, mask, cfg, **kw):
    x = lp.clone().requires_grad_()
    out = compute_policy_loss(x, old, ro, adv, mask, cfg, **kw)
    out.loss.backward()
    return out, x.grad


def verls(algos, loss_type, lp, old, adv, mask, cfg, weights=None, agg=None):
    """verl's registered loss on the same tokens: lp finite outside the mask (verl multiplies NaN by the mask)."""
    x = torch.where(mask, lp, torch.zeros_like(lp)).requires_grad_()
    fn = algos.get_policy_loss_fn(loss_type)
    loss, metrics = fn(old, x, adv, mask.to(torch.float64), agg or cfg.loss_agg_mode, verl_config(algos, loss_type, cfg),
                       rollout_is_weights=weights)
    loss.backward()
    return loss.detach(), x.grad, metrics


def settings(loss_type: str, **kw) -> dict:
    """A setting of each loss that clips, cuts or penalizes some tokens and keeps others."""
    own = {"cispo": dict(eps_clip=0.2, eps_clip_high=0.28), "sapo": dict(tau_pos=1.0, tau_neg=1.05),
           "geo_mean": dict(eps_clip=0.4), "dppo_tv": dict(eps_clip=0.1, eps_clip_high=0.12),
           "dppo_kl": dict(eps_clip=0.02, eps_clip_c=5.0),
           "clip_cov": dict(clip_cov_ratio=0.1, clip_cov_lb=0.3, clip_cov_ub=6.0),
           "kl_cov": dict(kl_cov_ratio=0.1, ppo_kl_coef=0.5)}[loss_type]
    return dict(loss_type=loss_type, **own, **kw)


LOSSES = ("cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov")
VERL_AGG = {"sapo": ("seq-mean-token-mean",), "geo_mean": ("seq-mean-token-mean",)}  # verl fixes theirs


def verl_scale(loss_type: str, mask) -> float:
    """verl's geo_mean averages over every row, the empty ones too; this project over the sequences with a token."""
    return B / mask.any(-1).sum().item() if loss_type == "geo_mean" else 1.0


def check_equal(loss_type, lp, old, ro, adv, mask, cfg, verl_losses, weights_from_ours=False, scale=1.0):
    torch.manual_seed(7)  # Clip-Cov draws its tokens from the default generator, as verl's does
    out, grad = ours(lp, old, ro, adv, mask, cfg)
    weights = out.correction.weights if weights_from_ours and out.correction is not None else None
    final = out.correction.loss_mask > 0 if out.correction is not None and cfg.use_rollout_correction else mask
    kept = final & torch.isfinite(lp) & torch.isfinite(old) & torch.isfinite(adv)
    clean = [torch.where(kept, t, torch.zeros_like(t)) for t in (old, adv)]
    torch.manual_seed(7)
    want, want_grad, metrics = verls(verl_losses, loss_type, lp, clean[0], clean[1], kept, cfg, weights)
    scale *= verl_scale(loss_type, kept)
    torch.testing.assert_close(out.loss.detach(), want * scale, **TOL)
    torch.testing.assert_close(grad, want_grad * scale, **TOL)
    assert torch.isfinite(grad).all() and (grad[~kept] == 0).all()
    return out, metrics


@pytest.mark.parametrize("loss_type", LOSSES)
@pytest.mark.parametrize("agg", AGG)
def test_each_loss_equals_verls(loss_type, agg, verl_losses):
    if agg not in VERL_AGG.get(loss_type, AGG):
        pytest.skip(f"verl's {loss_type} aggregates {VERL_AGG[loss_type][0]} whatever loss_agg_mode says")
    lp, old, ro, adv, mask = inputs(seed=1, per_sequence=loss_type == "geo_mean")
    cfg = C(**settings(loss_type, loss_agg_mode=agg))
    out, metrics = check_equal(loss_type, lp, old, ro, adv, mask, cfg, verl_losses)
    if "actor/pg_clipfrac" in metrics and loss_type != "sapo":
        assert out.metrics["pg_clipfrac"].item() == pytest.approx(metrics["actor/pg_clipfrac"], rel=1e-6)
        assert 0 < metrics["actor/pg_clipfrac"] < 1  # the setting bites on some tokens, not all
    if loss_type != "kl_cov":  # verl's kl_cov logs mean |lp - lp_old| as its ppo_kl
        assert out.metrics["ppo_kl"].item() == pytest.approx(metrics["actor/ppo_kl"], rel=1e-6)


def test_kl_cov_penalizes_some_tokens_and_clip_cov_cuts_some(verl_losses):
    """The comparison above is not vacuous: the covariance selections change the loss."""
    lp, old, ro, adv, mask = inputs(seed=1, per_sequence=False)
    for loss_type, off in (("kl_cov", dict(ppo_kl_coef=0.0)), ("clip_cov", dict(clip_cov_lb=50.0, clip_cov_ub=60.0))):
        torch.manual_seed(7)
        on = ours(lp, old, ro, adv, mask, C(**settings(loss_type)))[0].loss
        torch.manual_seed(7)
        none = ours(lp, old, ro, adv, mask, C(**settings(loss_type) | off))[0].loss
        assert abs(on.item() - none.item()) > 1e-6, loss_type


@pytest.mark.parametrize("loss_type", LOSSES)
def test_per_token_advantages(loss_type, verl_losses):
    lp, old, ro, adv, mask = inputs(seed=2, per_sequence=False)
    check_equal(loss_type, lp, old, ro, adv, mask, C(**settings(loss_type, loss_agg_mode=VERL_AGG.get(
        loss_type, AGG)[0])), verl_losses)


@pytest.mark.parametrize("loss_type", LOSSES)
@pytest.mark.parametrize("correction", ["token_tis", "seq_tis_rs_veto", "mask_mode"])
def test_with_is_weights_and_rejection_in_decoupled_mode(loss_type, correction, verl_losses):
    """verl's `rollout_is_weights` and its response mask are our correction's weights and final loss mask."""
    lp, old, ro, adv, mask = inputs(seed=3, per_sequence=loss_type == "geo_mean")
    extra = {"token_tis": dict(use_tis=True, tis_upper_bound=1.2),
             "seq_tis_rs_veto": dict(use_tis=True, tis_level="sequence", tis_upper_bound=1.5, use_rs=True,
                                     rs_level="token", rs_upper_bound=1.25, rs_veto_threshold=0.3),
             "mask_mode": dict(use_tis=True, tis_mode="mask", tis_upper_bound=1.2)}[correction]
    cfg = C(**settings(loss_type, loss_agg_mode=VERL_AGG.get(loss_type, ("token-mean",))[0], **extra))
    out, _ = check_equal(loss_type, lp, old, ro, adv, mask, cfg, verl_losses, weights_from_ours=True)
    assert out.correction.weights is not None and not torch.all(out.correction.weights[mask] == 1)
    if correction == "seq_tis_rs_veto":
        assert 0 < (out.correction.loss_mask > 0).sum() < mask.sum()  # something rejected, something kept


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "dppo_tv", "dppo_kl"])
def test_with_opsm_the_masked_tokens_leave_the_numerator_only(loss_type, verl_losses):
    """OPSM takes its tokens out of the numerator and keeps them in the denominator: verl's loss with a 0/1 weight
    (its `rollout_is_weights`) on the same tokens is exactly that. Not comparable so: GMPO (its weights are
    geometric), Clip-Cov and KL-Cov (their covariance statistics leave OPSM's tokens out in ours, not in verl's)."""
    lp, old, ro, adv, mask = inputs(seed=4, per_sequence=False)
    cfg = C(**settings(loss_type, loss_agg_mode=VERL_AGG.get(loss_type, ("token-mean",))[0], use_opsm=True,
                       opsm_delta=0.0))
    out, grad = ours(lp, old, ro, adv, mask, cfg)
    off = opsm_masked(torch.where(mask, lp, 0.0), old, adv, mask, 0.0, Segments.rows(B, S))
    assert 0 < off.sum() < mask.sum()
    want, want_grad, _ = verls(verl_losses, loss_type, lp, torch.where(mask, old, 0.0), torch.where(mask, adv, 0.0),
                               mask, cfg, weights=(~off).to(torch.float64))
    torch.testing.assert_close(out.loss.detach(), want, **TOL)
    torch.testing.assert_close(grad, want_grad, **TOL)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "dppo_tv", "dppo_kl", "geo_mean"])
def test_bypass_mode_anchors_on_the_rollout_log_probs(loss_type, verl_losses):
    lp, old, ro, adv, mask = inputs(seed=5, per_sequence=loss_type == "geo_mean")
    cfg = C(**settings(loss_type, use_rollout_logprobs=True, loss_agg_mode=VERL_AGG.get(loss_type, AGG)[0]))
    out, grad = ours(lp, None, ro, adv, mask, cfg)
    want, want_grad, _ = verls(verl_losses, loss_type, lp, torch.where(mask, ro, 0.0), adv * mask, mask, cfg)
    scale = verl_scale(loss_type, mask)
    torch.testing.assert_close(out.loss.detach(), want * scale, **TOL)
    torch.testing.assert_close(grad, want_grad * scale, **TOL)


@pytest.mark.parametrize("loss_type", LOSSES)
def test_nonfinite_inputs_drop_their_token_and_extreme_ratios_stay_finite(loss_type, verl_losses):
    """A NaN lp, a -inf lp_old at tokens in the mask: those tokens leave the loss's numerator (counted) and stay in
    its denominator, as everywhere in this project: verl's token mean over the tokens left, times N_left / N (sapo
    and geo_mean, which verl averages per sequence, are checked for finiteness and the count). |lp − lp_old| = 30 > 20
    at two tokens: the ratio is clamped at exp(±20) as verl clamps it (cispo, sapo, dppo_*); verl's clip_cov / kl_cov
    do not clamp (exp(30) in float64), and geo_mean clips in log space: larger ones are checked for finiteness."""
    lp, old, ro, adv, mask = inputs(seed=6, per_sequence=loss_type == "geo_mean")
    lp[1, 2] = float("nan")
    old[4, 5] = -float("inf")
    clamped = loss_type in ("cispo", "sapo", "dppo_tv", "dppo_kl")
    if clamped:
        lp[0, 1], lp[5, 0] = old[0, 1] + 30.0, old[5, 0] - 30.0
    cfg = C(**settings(loss_type, loss_agg_mode=VERL_AGG.get(loss_type, AGG)[0]))
    if loss_type not in VERL_AGG:
        kept = mask & torch.isfinite(lp) & torch.isfinite(old)
        check_equal(loss_type, lp, old, ro, adv, mask, cfg, verl_losses, scale=(kept.sum() / mask.sum()).item())
    out, grad = ours(lp, old, ro, adv, mask, cfg)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all() and grad[1, 2] == 0 and grad[4, 5] == 0
    assert out.metrics["pg_nonfinite_token_count"].item() == 2
    x = torch.where(mask, lp, 0.0)
    x[0, 1], x[5, 0], x[7, 2] = old[0, 1] + 40.0, old[5, 0] - 60.0, old[7, 2] + 1e4  # extreme, in ours only
    out, grad = ours(x, old, ro, 1e3 * adv, mask, cfg)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("loss_type", LOSSES)
@pytest.mark.parametrize("agg", AGG)
def test_all_rejected_and_all_padding_give_zero(loss_type, agg):
    lp, old, ro, adv, mask = inputs(seed=7, per_sequence=loss_type == "geo_mean")
    for cfg, m in ((C(**settings(loss_type, loss_agg_mode=agg, use_rs=True, rs_level="geometric",
                                 rs_upper_bound=1.000001)), mask),
                   (C(**settings(loss_type, loss_agg_mode=agg)), torch.zeros_like(mask))):
        out, grad = ours(lp, old, ro, adv, m, cfg)
        assert out.loss.item() == 0.0 and (grad == 0).all()


@pytest.mark.parametrize("loss_type", [t for t in LOSSES if t != "clip_cov"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_packed_rows_equal_padded(loss_type, agg):
    """One packed row [1, T] with per-sequence padding and trailing positions equals the padded batch (Clip-Cov's
    random draw numbers the candidates by position, so its packed draw picks others)."""
    lp, old, ro, adv, mask = packed_data()
    adv = adv[:, None].expand_as(lp).contiguous()
    cfg = C(**settings(loss_type, loss_agg_mode=agg))
    x_pad, x_pack = lp.clone().requires_grad_(), _pack(lp).requires_grad_()
    padded = compute_policy_loss(x_pad, old, ro, adv, mask, cfg)
    packed = compute_policy_loss(x_pack, _pack(old), _pack(ro), _pack(adv), _pack(mask), cfg, segments=_segments())
    padded.loss.backward()
    packed.loss.backward()
    torch.testing.assert_close(packed.loss, padded.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(_unpack(x_pack.grad), x_pad.grad * _within(), rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------------------------------------ the masks
@pytest.fixture(scope="module")
def areal_m2po():
    areal_functions = bench_module("vs_areal").areal_functions  # AReaL's wheel, downloaded once
    return areal_functions("areal/trainer/ppo/actor.py", ("_apply_m2po_masking", "_get_m2po_loss_mask"))


@pytest.mark.parametrize("threshold", [1e-4, 2e-3, 0.01, 0.02, 10.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_m2po_mask_equals_areals(threshold, seed, areal_m2po):
    """AReaL's `_apply_m2po_masking(old_logp = the behaviour (rollout) log-probs, prox_logp = the recomputed ones)`
    on the same tokens: the kept mask is identical (tie-free data; a threshold below every m2 keeps the one
    smallest)."""
    lp, old, ro, adv, mask = inputs(seed=seed)
    ro[2, 0] = old[2, 0] + 3.0  # a token far off
    keep = areal_m2po._apply_m2po_masking(ro, old, mask, threshold)
    off = m2po_masked(old, ro, mask, threshold)
    assert torch.equal(~off & mask, keep)
    if threshold < 0.02:
        assert 0 < keep.sum() < mask.sum()
    m2 = ((old - ro)[keep] ** 2)
    assert m2.mean() < threshold or keep.sum() == 1


def test_m2po_in_the_loss_and_the_budget_described_as_m2po(areal_m2po):
    """--m2-threshold takes AReaL's tokens out of the loss's numerator and denominator (loss = the same loss on
    AReaL's mask). The budget the docs call M2PO's (`--rs-metric k2 --rs-agg token --rs-divergence-budget τ/2`) is
    not AReaL's mask: it keeps a mean k2 ≤ τ/2 over the whole step, cutting at ~3 % bins, so its kept set is within a
    bin's tokens of AReaL's, not equal (measured here: the difference, and the contract each keeps)."""
    lp, old, ro, adv, mask = inputs(seed=8)
    threshold = 0.01
    keep = areal_m2po._apply_m2po_masking(ro, old, mask, threshold)
    out, grad = ours(lp, old, ro, adv, mask, C(m2_threshold=threshold, use_tis=True))
    want, want_grad = ours(lp, old, ro, adv, keep, C(use_tis=True))
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)
    assert out.metrics[M2PO_COUNT].item() == (mask & ~keep).sum().item() > 0
    budget = compute_policy_loss(lp, old, ro, adv, mask, C(rs_metric="k2", rs_agg="token",
                                                           rs_divergence_budget=threshold / 2)).correction.loss_mask > 0
    k2 = (old - ro) ** 2 / 2
    assert k2[budget].mean() <= threshold / 2  # the budget's contract
    assert abs(int(budget.sum()) - int(keep.sum())) <= 0.1 * mask.sum()  # close to AReaL's, not the same code


def nemo_rl_reference(prev, gen, token_mask, threshold):
    """NeMo-RL's compute_and_apply_seq_logprob_error_masking, written from its source (float64; NVIDIA-NeMo/RL
    nemo_rl/algorithms/grpo.py): the kept sample mask."""
    m = token_mask.to(torch.float64)
    error = (torch.exp((gen - prev).abs() * m) * m).sum(-1) / m.sum(-1).clamp(min=1)
    return error <= threshold, error


@pytest.mark.parametrize("threshold", [1.12, 1.15, 1.3])
def test_seq_logprob_error_threshold_equals_nemo_rls(threshold):
    lp, old, ro, adv, mask = inputs(seed=9)
    ro[3] += 1.0  # the one-token sequence's engine is off
    kept, error = nemo_rl_reference(old * mask, ro * mask, mask, threshold)
    torch.testing.assert_close(seq_mult_prob_error(old, ro, mask, Segments.rows(B, S)), error, rtol=1e-14, atol=0)
    out, grad = ours(lp, old, ro, adv, mask, C(seq_logprob_error_threshold=threshold))
    nemo_mask = mask & kept[:, None]
    want, want_grad = ours(lp, old, ro, adv, nemo_mask, C())
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)
    assert out.metrics[SEQ_ERROR_COUNT].item() == (mask & ~nemo_mask).sum().item()
    assert 0 < nemo_mask.any(-1).sum() < mask.any(-1).sum()


def test_the_masks_compose_with_every_aggregation_and_a_peer_loss():
    lp, old, ro, adv, mask = inputs(seed=10)
    for agg in AGG:
        for loss_type in ("ppo", "cispo", "geo_mean"):
            cfg = C(loss_type=loss_type, loss_agg_mode=agg, m2_threshold=0.01, seq_logprob_error_threshold=1.2,
                    use_tis=True)
            out, grad = ours(lp, old, ro, adv, mask, cfg)
            kept, _ = nemo_rl_reference(old * mask, ro * mask, mask, 1.2)
            m = mask & kept[:, None]
            m = m & ~m2po_masked(old, ro, m, 0.01)
            want, want_grad = ours(lp, old, ro, adv, m, cfg.replace(m2_threshold=None,
                                                                    seq_logprob_error_threshold=None))
            torch.testing.assert_close(out.loss, want.loss, rtol=1e-12, atol=1e-15)
            torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------------------------------------ the flags
REFUSED = [
    (dict(tau_pos=2.0), "--tau-pos set but --policy-loss-type is ppo"),
    (dict(loss_type="kl_cov", clip_cov_ratio=0.1), "--clip-cov-ratio set but --policy-loss-type is kl_cov"),
    (dict(loss_type="cispo", eps_clip_c=3.0), "--eps-clip-c (dual clip) applies to the PPO loss only"),
    (dict(loss_type="geo_mean", use_rollout_logprobs=True, use_tis=True), "--policy-loss-type geo_mean corrects twice"),
    (dict(loss_type="sapo", policy_ratio_level="sequence"), "--policy-ratio-level sequence (GSPO) is a PPO ratio"),
    (dict(loss_type="sapo", tau_neg=-1.0), "--tau-neg=-1.0 must be a finite number > 0"),
    (dict(loss_type="clip_cov", clip_cov_lb=6.0), "--clip-cov-lb 6.0 must be below --clip-cov-ub 5.0"),
    (dict(loss_type="kl_cov", kl_cov_ratio=1.5), "--kl-cov-ratio=1.5 must be in (0, 1]"),
    (dict(loss_type="kl_cov", ppo_kl_coef=-1.0), "--ppo-kl-coef=-1.0 must be >= 0"),
    (dict(m2_threshold=0.0), "--m2-threshold=0.0 must be a finite number > 0"),
    (dict(seq_logprob_error_threshold=0.9), "--seq-logprob-error-threshold=0.9 must be a finite number >= 1"),
    (dict(max_train_rollout_logprob_abs_diff=float("nan")), "--max-train-rollout-logprob-abs-diff=nan must be"),
]


@pytest.mark.parametrize("kw, message", REFUSED, ids=[m for _, m in REFUSED])
def test_what_the_math_does_not_allow_is_refused_naming_the_flag(kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        C(**kw)


def test_the_flags_parse_and_a_gate_turns_the_metrics_on():
    import argparse

    from slime_corr.arguments import add_rollout_correction_args, parse_rollout_correction_config

    parser = add_rollout_correction_args(argparse.ArgumentParser())
    _, cfg = parse_rollout_correction_config(parser, ["--policy-loss-type", "sapo", "--tau-pos", "1.5",
                                                      "--m2-threshold", "0.04", "--seq-logprob-error-threshold", "2",
                                                      "--max-mismatch-k3-kl", "0.1"])
    assert (cfg.loss_type, cfg.sapo_taus, cfg.m2_threshold, cfg.seq_logprob_error_threshold) == ("sapo", (1.5, 1.05),
                                                                                                  0.04, 2.0)
    assert cfg.mismatch_gates == {"mismatch_k3_kl": 0.1} and cfg.computes_metrics and not cfg.use_rollout_correction


def test_clip_and_kl_cov_refuse_context_parallel_groups(monkeypatch):
    import slime_corr.policy_losses as policy_losses

    monkeypatch.setattr(policy_losses, "group_size", lambda group: 2)
    lp, old, ro, adv, mask = inputs(seed=11)
    for loss_type in ("clip_cov", "kl_cov"):
        with pytest.raises(ValueError, match=f"--policy-loss-type {loss_type} picks tokens by the micro-batch's"):
            compute_policy_loss(lp, old, ro, adv, mask, C(loss_type=loss_type))
