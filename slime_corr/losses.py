"""Policy losses: standard/decoupled/bypass PPO (asymmetric and dual clip), REINFORCE (pg_is, pg_rs), aggregation.

Per-token losses (registered in `slime_corr.registry.LOSS_FUNCTIONS`, signature `fn(inputs: LossInputs, config)
-> [B, S] tensor`):
- "ppo": r = exp(clamp(lp - lp_old, -20, 20)); l = max(-A·r, -A·clip(r, 1-ε, 1+ε_high)); with dual clip
  (`eps_clip_c` = c) l = min(l, -A·c) where A < 0; times w when IS weights are present (decoupled).
  `--policy-ratio-level sequence` (GSPO-token): r_t = sg(s_i)·π_θ(y_t)/sg(π_θ(y_t)) with
  s_i = exp(clamp(Σ_t m·(lp - lp_old) / Σ_t m, ±20)) over the whole sequence: the value is s_i at every token, the
  gradient dr_t/dlp_t = s_i (GSPO's sequence gradient under seq-mean-token-mean aggregation).
- "reinforce": l = -A·lp·w (pg_is) or -A·lp (pg_rs / no IS).
- the peers' losses ("cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov"): slime_corr.policy_losses.
Masks after the correction: `--m2-threshold` (M2PO) and `--seq-logprob-error-threshold` (NeMo-RL) take tokens out
of the loss's numerator and denominators (recounted then: one more SUM), slime_corr.mismatch_masks; OPSM after them.
The two built-in losses are autograd Functions whose forward also computes dl/dlp in closed form, so the backward is
one multiply (on CPU, autograd's bool masks for clamp/minimum/where cost more than the loss itself).

Global-denominator contract: `.loss_sum` is this rank's Σ of the aggregated numerator and `.denominator` its
local count (tokens for token-mean, sequences for seq-mean-*; each sequence counted once across CP). `.loss`
= loss_sum / max(global denominator, 1) with the denominator summed over DP x CP, so summing `.loss` (and its
gradients) over ranks gives the single-rank full-batch value. Across micro-batches: Σ loss_sum / Σ denominator.

Advantages may be per token [B, S] or per sequence [B] / [B, 1]; a per-sequence advantage applies to every token of
its sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

import slime_corr.policy_losses  # noqa: F401  (registers the peers' losses: cispo, sapo, geo_mean, dppo_*, *_cov)
from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import CorrectionResult, compute_rollout_correction
from slime_corr.correction.budget import StepBounds
from slime_corr.correction.checks import check_policy_loss_inputs
from slime_corr.correction.compiling import maybe_compiled
from slime_corr.correction.reductions import (
    ProcessGroup,
    at_most_,
    cp_first,
    finite_indicator_,
    global_sum,
    group_size,
    indicator,
    seq_sums,
    valid_float,
)
from slime_corr.layout.segments import Segments
from slime_corr.loss_inputs import LOG_RATIO_CLAMP, LossInputs
from slime_corr.loss_terms import LossTermsConfig
from slime_corr.mismatch_masks import m2po_masked, seq_logprob_error_masked
from slime_corr.opsm import opsm_masked
from slime_corr.registry import LOSS_FUNCTIONS, Registry


def _detached_log_probs(inputs: LossInputs) -> Tensor:
    """lp, sanitized like `inputs.log_probs` but without autograd (the built-in losses give their own gradient)."""
    return torch.nan_to_num(inputs.raw_log_probs.detach(), 0.0, 0.0, 0.0).mul_(inputs.token_mask)


def ppo_terms(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, weights: Tensor | None, mask: Tensor,
              clip: tuple[float, float], eps_clip_c: float | None) -> tuple[Tensor, ...]:
    """Per-token clipped PPO and its gradient in closed form, for sanitized inputs (finite, 0 outside `mask`):
    (loss, dl/dlp, Σ -log r, Σ (r - 1) in float64, # clipped). dl/dlp = -A·r·w where the unclipped surrogate is
    the one trained (r in [1-ε, 1+ε_high], or the clipped one is larger), the dual clip does not cap and
    |lp - lp_old| <= 20; 0 elsewhere (at an exact tie with the dual-clip cap the whole gradient is kept)."""
    adv = advantages
    diff = torch.nan_to_num(log_probs, 0.0, 0.0, 0.0).mul_(mask).sub_(old_log_probs)  # 0 outside: r = 1, l = 0
    log_ratio = diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    kl_sum = -log_ratio.sum()
    in_range = at_most_(diff.abs_(), LOG_RATIO_CLAMP)  # the clamp passes grad
    ratio = log_ratio.exp_()
    ois_sum = ratio.sum(dtype=torch.float64) - ratio.numel()
    surr1 = adv * ratio
    surr2 = ratio.clamp(*clip).mul_(adv)
    clipped = indicator(torch.gt, surr1, surr2)  # the clipped surrogate is the smaller one: it is trained
    clip_sum = clipped.sum()
    loss = torch.minimum(surr1, surr2).neg_()
    grad = surr1.neg_().mul_(clipped.neg_().add_(1.0)).mul_(in_range)  # -A·r on trained tokens
    if eps_clip_c is not None:  # A < 0: l = min(l, -A·c); capped tokens get no gradient
        cap = adv * -eps_clip_c
        capped = indicator(torch.gt, loss, cap).mul_(indicator(torch.lt, adv, 0.0))
        loss = loss.mul_(1.0 - capped).add_(cap.mul_(capped))  # an exact select: x·1 + y·0
        grad = grad.mul_(capped.neg_().add_(1.0))
    if weights is not None:
        loss = loss.mul_(weights)
        grad = grad.mul_(weights)
    return loss, grad, kl_sum, ois_sum, clip_sum


def sequence_log_ratio(log_probs: Tensor, inputs: LossInputs) -> Tensor:
    """GSPO's log s_i = Σ_t m·(lp - lp_old) / Σ_t m over the whole sequence (ONE CP all_reduce), at each of its
    tokens (0 outside the token mask); `log_probs` detached and sanitized like `inputs.log_probs`."""
    mask = inputs.token_mask
    seg = inputs.segments or Segments.rows(*mask.shape)
    diff = torch.nan_to_num(log_probs, 0.0, 0.0, 0.0).mul(mask).sub_(inputs.old_log_probs)
    sums = seq_sums([seg.sum(diff), seg.sum(mask)], inputs.cp_group)
    mean = sums[:, 0] / sums[:, 1].clamp_min(1)
    return seg.expand(mean.to(diff.dtype)) * mask


class _PPO(torch.autograd.Function):
    """Per-token clipped PPO (`ppo_terms`); the backward is one multiply by the saved gradient."""

    @staticmethod
    def forward(ctx: Any, log_probs: Tensor, inputs: LossInputs, config: RolloutCorrectionConfig) -> Tensor:
        lp, old = log_probs.detach(), inputs.old_log_probs
        if config.policy_ratio_level == "sequence":  # GSPO: ppo_terms sees lp - lp_old = log s_i exactly
            lp, old = sequence_log_ratio(lp, inputs), torch.zeros_like(old)
        loss, grad, kl_sum, ois_sum, clip_sum = maybe_compiled(ppo_terms, config)(
            lp, old, inputs.advantages, inputs.weights, inputs.token_mask, config.clip_range, config.eps_clip_c)
        n = inputs.count.clamp_min(1)
        decoupled = not config.use_rollout_logprobs  # the on-policy ratio pi_theta / pi_old ("ois") is logged
        sums = [kl_sum, clip_sum, ois_sum.to(n.dtype)] if decoupled else [kl_sum, clip_sum]
        means = (torch.stack(sums) / n).unbind()  # the token means, divided in one op
        inputs.metrics["ppo_kl"] = means[0]
        if decoupled:
            inputs.metrics["ois"] = means[2] + 1.0
        inputs.metrics["pg_clipfrac"] = means[1]
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor, None, None]:
        (grad,) = ctx.saved_tensors
        return grad_loss * grad, None, None


class _Reinforce(torch.autograd.Function):
    """Per-token REINFORCE -A·lp·w with its gradient -A·w."""

    @staticmethod
    def forward(ctx: Any, log_probs: Tensor, inputs: LossInputs) -> Tensor:
        adv, w = inputs.advantages, inputs.weights
        ctx.save_for_backward(-adv if w is None else adv * w.neg())
        loss = _detached_log_probs(inputs).mul_(adv).neg_()  # (-A·lp)·w, in that order
        return loss if w is None else loss.mul_(w)

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor, None]:
        (grad,) = ctx.saved_tensors
        return grad_loss * grad, None


@LOSS_FUNCTIONS.register("ppo")
def ppo_loss(inputs: LossInputs, config: RolloutCorrectionConfig) -> Tensor:
    """Clipped PPO (asymmetric ε, optional dual clip), times the IS weight when given: -min(A·r, A·clip(r))."""
    if inputs.count is None:
        inputs.count = inputs.token_mask.sum()
    return _PPO.apply(inputs.raw_log_probs, inputs, config)


@LOSS_FUNCTIONS.register("reinforce")
def reinforce_loss(inputs: LossInputs, config: RolloutCorrectionConfig) -> Tensor:
    """REINFORCE: -A·lp·w (pg_is) or -A·lp (pg_rs)."""
    return _Reinforce.apply(inputs.raw_log_probs, inputs)


BUILTIN_LOSSES = (ppo_loss, reinforce_loss)  # per-token losses known to be 0 outside the token mask


class SanitizedInputs(NamedTuple):
    """The loss inputs made finite and 0 outside the token mask (`sanitized_inputs`)."""

    token_mask: Tensor  # the tokens that count: in the mask, with finite lp, lp_old and A
    old_log_probs: Tensor
    advantages: Tensor
    weights: Tensor | None
    count: Tensor  # Σ token_mask


def sanitized_inputs(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
                     weights: Tensor | None) -> SanitizedInputs:
    """(token mask, lp_old, A, w, Σ mask): a NaN/inf in lp, lp_old or A (or an overflow of lp - lp_old + A) drops
    the token, found in one pass for all three; the inputs are then made finite and 0 outside the mask BEFORE the
    loss math (nan_to_num x mask), so neither the value nor the gradient sees a NaN/inf."""
    token_mask = finite_indicator_((log_probs - old_log_probs).add_(advantages)).mul_(mask)
    old = torch.nan_to_num(old_log_probs, 0.0, 0.0, 0.0).mul_(token_mask)
    adv = torch.nan_to_num(advantages, 0.0, 0.0, 0.0).mul(token_mask)
    w = None if weights is None else weights * token_mask
    count = token_mask.sum(dtype=torch.promote_types(token_mask.dtype, torch.float32))  # bf16 counts to 256
    return SanitizedInputs(token_mask, old, adv, w, count)


def nonfinite_count(values: Tensor, mask: Tensor) -> Tensor:
    """Σ mask · [value is NaN or ±inf], float64, on the device (no host sync): 4 ops."""
    nonfinite = values.detach().mul(0.0).nan_to_num_(nan=1.0)  # x·0 is 0 for a finite x, NaN for NaN/±inf
    return (nonfinite * mask).sum(dtype=torch.float64)  # per-sequence values ([B, 1]) broadcast along the tokens


@dataclass
class PolicyLossOutput:
    loss: Tensor
    loss_sum: Tensor
    denominator: Tensor
    metrics: dict[str, Tensor]
    correction: CorrectionResult | None


class AnchoredInputs(NamedTuple):
    """Which log-probs the loss's ratio and the correction use (`anchor_stage`), and A per token."""

    old_log_probs: Tensor  # lp_old of the ratio: lp_rollout in bypass
    train_log_probs: Tensor  # lp_train the correction compares with lp_rollout: lp_old, or lp.detach() in bypass
    advantages: Tensor  # [B, S]: a per-sequence advantage broadcast along its tokens


class LossMasks(NamedTuple):
    """The masks and weights the loss uses (`loss_masks`), as floats of lp's dtype but the denominator's."""

    valid: Tensor  # the loss mask as 0/1
    token_mask: Tensor  # after the correction's rejection (the valid mask without correction)
    denominator_mask: Tensor  # the correction's denominator mask (the valid mask without correction)
    weights: Tensor | None  # the correction's IS weights


class AggregatedLoss(NamedTuple):
    """`PolicyLossOutput`'s loss, loss_sum and denominator (`aggregate_loss`)."""

    loss: Tensor
    loss_sum: Tensor
    denominator: Tensor


def compute_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor | None,
    rollout_log_probs: Tensor | None,
    advantages: Tensor,
    loss_mask: Tensor,
    config: RolloutCorrectionConfig,
    *,
    cp_group: ProcessGroup = None,
    dp_group: ProcessGroup = None,
    seq_length_for_norm: int | None = None,
    batch_norm_mean: Tensor | None = None,
    loss_fn: str | Callable | None = None,
    correction: CorrectionResult | None = None,
    finalize_metrics: bool = True,
    segments: Segments | None = None,
    loss_terms: LossTermsConfig | None = None,
    ref_log_probs: Tensor | None = None,
    entropy: Tensor | None = None,
    step_bounds: StepBounds | None = None,
    kl_log_probs: Tensor | None = None,
) -> PolicyLossOutput:
    """The policy loss of one micro-batch ([B, S] local slices, one sequence per row; or one packed row [1, T]
    whose sequences `segments` gives, `Segments.packed_row`) under `config`.

    Bypass (`use_rollout_logprobs`): lp_old := lp_rollout, lp_train := lp.detach(); decoupled:
    lp_train := lp_old. Aggregation (`config.loss_agg_mode`, m = loss mask, n_i / valid sequences from the
    denominator mask): token-mean Σ l·m / Σ m; seq-mean-token-sum mean_i Σ_t l·m; seq-mean-token-mean
    mean_i Σ_t l·m / n_i; seq-mean-token-sum-norm mean_i Σ_t l·m / T (T = seq_length_for_norm, the run's maximum
    response length; padded rows default to S·cp_size, packed rows must pass it).
    `advantages`: per token, or one per sequence ([B] / [B, 1]; [n] / [n, 1] packed), broadcast along it.
    `loss_fn` overrides `config.loss_type` with a registered name, an import path, or a callable.
    `batch_norm_mean`: the step's IS-weight mean for `--tis-batch-normalize`, `step_bounds` the step's budgeted
    bounds (see `compute_rollout_correction`).
    `correction`: this micro-batch's correction computed beforehand from the same lp_train (e.g. a decoupled
    pre-pass, finished by `normalize_weights`); it is used instead of computing it again.
    `finalize_metrics=False`: the correction's metrics are not finalized (its `.stats` are complete), for callers
    that finalize a step's merged statistics once; the loss metrics stay.
    `loss_terms` with `ref_log_probs` / `entropy` (shaped like `log_probs`): the KL and entropy terms
    (`loss_term_tokens`), added per token before the aggregation; `pg_loss` is then the whole loss.
    `kl_log_probs`: the policy's log-probs the KL term compares with `ref_log_probs`, when they are not
    `log_probs` (the engine's kept sets replayed: `log_probs` under them, the KL over the full distribution).
    """
    check_policy_loss_inputs(log_probs, old_log_probs, rollout_log_probs, advantages, loss_mask, config,
                             seq_length_for_norm, batch_norm_mean, loss_fn, cp_group, dp_group, correction, segments)
    seg = segments or Segments.rows(*log_probs.shape)
    anchored = anchor_stage(log_probs, old_log_probs, rollout_log_probs, advantages, config, seg)
    if correction is not None and batch_norm_mean is not None:
        raise ValueError("compute_policy_loss: pass either a precomputed correction (already normalized) or "
                         "batch_norm_mean, not both.")
    if correction is None and config.computes_metrics:
        correction = compute_rollout_correction(
            anchored.train_log_probs, rollout_log_probs, loss_mask, config, cp_group=cp_group, dp_group=dp_group,
            batch_norm_mean=batch_norm_mean, finalize_metrics=finalize_metrics, segments=segments,
            step_bounds=step_bounds,
        )
    masks = loss_masks(loss_mask, correction, config, log_probs.dtype)
    masks, mismatch_counts = mismatch_mask_stage(rollout_log_probs, anchored, masks, config, seg, cp_group)
    masks, opsm_count = opsm_stage(log_probs, anchored, masks, config, seg, cp_group)
    inputs = loss_inputs(log_probs, rollout_log_probs, anchored, masks, config, seg, cp_group)
    masked = token_losses(inputs, config, loss_fn, loss_terms, ref_log_probs, entropy, kl_log_probs)
    norm_length = seq_length_for_norm or log_probs.shape[-1] * group_size(cp_group)
    counted = None if config.uses_mismatch_masks else correction  # the masks changed the correction's denominators
    aggregated = aggregate_loss(masked, masks.denominator_mask, counted, config, seg, cp_group, dp_group,
                                norm_length, log_probs.dtype)
    metrics = loss_metrics(aggregated.loss, inputs, masks, correction, anchored.advantages)
    metrics.update(mismatch_counts)
    if opsm_count is not None:
        metrics[OPSM_COUNT] = opsm_count
    return PolicyLossOutput(loss=aggregated.loss, loss_sum=aggregated.loss_sum, denominator=aggregated.denominator,
                            metrics=metrics, correction=correction)


def anchor_stage(log_probs: Tensor, old_log_probs: Tensor | None, rollout_log_probs: Tensor | None,
                 advantages: Tensor, config: RolloutCorrectionConfig, seg: Segments) -> AnchoredInputs:
    """Bypass (`use_rollout_logprobs`): lp_old := lp_rollout, lp_train := lp.detach(); decoupled: lp_train :=
    lp_old. Per-sequence advantages ([n] / [n, 1]) are broadcast along the tokens."""
    if config.use_rollout_logprobs:
        old_log_probs = rollout_log_probs
        train_log_probs = log_probs.detach()
    else:
        train_log_probs = old_log_probs
    if advantages.dim() == 1 or advantages.shape != log_probs.shape:
        advantages = seg.expand(advantages.reshape(-1))
    return AnchoredInputs(old_log_probs, train_log_probs, advantages)


def loss_masks(loss_mask: Tensor, correction: CorrectionResult | None, config: RolloutCorrectionConfig,
               dtype: torch.dtype) -> LossMasks:
    """The correction's final mask, denominator mask and weights when it applies (`use_rollout_correction`),
    else the loss mask for both and no weights."""
    valid = valid_float(loss_mask, dtype)
    if correction is not None and config.use_rollout_correction:
        return LossMasks(valid, correction.loss_mask.to(dtype), correction.denominator_mask, correction.weights)
    return LossMasks(valid, valid, valid, None)


OPSM_COUNT = "pg_opsm_masked_token_count"  # tokens OPSM took out of the loss (of those the correction kept)
M2PO_COUNT = "pg_m2po_masked_token_count"  # tokens --m2-threshold took out of the loss (local)
SEQ_ERROR_COUNT = "pg_seq_logprob_error_masked_token_count"  # tokens --seq-logprob-error-threshold took out (local)


def mismatch_mask_stage(rollout_log_probs: Tensor | None, anchored: AnchoredInputs, masks: LossMasks,
                        config: RolloutCorrectionConfig, seg: Segments, cp_group: ProcessGroup
                        ) -> tuple[LossMasks, dict[str, Tensor]]:
    """`--seq-logprob-error-threshold` (NeMo-RL, on the loss mask's sequences) then `--m2-threshold` (M2PO, on the
    tokens still in the loss): the token and denominator masks less the tokens they take out, and how many each
    took of those still in the loss (`slime_corr.mismatch_masks`); unchanged and {} when neither is on."""
    if not config.uses_mismatch_masks:
        return masks, {}
    if rollout_log_probs is None:
        raise ValueError("--m2-threshold / --seq-logprob-error-threshold compare lp_train with lp_rollout: pass "
                         "rollout_log_probs to compute_policy_loss.")
    train, kept = anchored.train_log_probs, masks.token_mask > 0
    off = torch.zeros_like(kept)
    counts: dict[str, Tensor] = {}
    if config.seq_logprob_error_threshold is not None:
        off = seq_logprob_error_masked(train, rollout_log_probs, masks.valid, config.seq_logprob_error_threshold, seg,
                                       cp_group)
        counts[SEQ_ERROR_COUNT] = (off & kept).sum().to(torch.float64)
    if config.m2_threshold is not None:
        m2_off = m2po_masked(train, rollout_log_probs, kept & ~off, config.m2_threshold, cp_group)
        counts[M2PO_COUNT] = m2_off.sum().to(torch.float64)
        off = off | m2_off
    return masks._replace(token_mask=torch.where(off, 0, masks.token_mask),
                          denominator_mask=torch.where(off, 0, masks.denominator_mask)), counts


def opsm_stage(log_probs: Tensor, anchored: AnchoredInputs, masks: LossMasks, config: RolloutCorrectionConfig,
               seg: Segments, cp_group: ProcessGroup) -> tuple[LossMasks, Tensor | None]:
    """`--use-opsm`: the token mask less the tokens OPSM takes out (`slime_corr.opsm`; the denominator mask keeps
    them), and how many it took; else the masks unchanged and None."""
    if not config.use_opsm:
        return masks, None
    off = opsm_masked(log_probs, anchored.old_log_probs, anchored.advantages, masks.valid, config.opsm_delta, seg,
                      cp_group)
    removed = (off & (masks.token_mask > 0)).sum().to(torch.float64)
    return masks._replace(token_mask=torch.where(off, 0, masks.token_mask)), removed


def loss_inputs(log_probs: Tensor, rollout_log_probs: Tensor | None, anchored: AnchoredInputs, masks: LossMasks,
                config: RolloutCorrectionConfig, seg: Segments, cp_group: ProcessGroup) -> LossInputs:
    """The per-token loss function's inputs: sanitized (`sanitized_inputs`), the token mask less the tokens with
    a non-finite lp, lp_old or A."""
    weights = None if masks.weights is None else masks.weights.detach().to(log_probs.dtype)
    clean = maybe_compiled(sanitized_inputs, config)(
        log_probs.detach(), anchored.old_log_probs.detach(), anchored.advantages.detach(), masks.token_mask, weights)
    return LossInputs(raw_log_probs=log_probs, old_log_probs=clean.old_log_probs, rollout_log_probs=rollout_log_probs,
                      advantages=clean.advantages, token_mask=clean.token_mask, weights=clean.weights,
                      count=clean.count, segments=seg, cp_group=cp_group)


def token_losses(inputs: LossInputs, config: RolloutCorrectionConfig, loss_fn: str | Callable | None,
                 loss_terms: LossTermsConfig | None, ref_log_probs: Tensor | None,
                 entropy: Tensor | None, kl_log_probs: Tensor | None = None) -> Tensor:
    """l·m per token: the per-token loss (`loss_fn`, default `config.loss_type`), 0 outside the token mask, plus
    the KL and entropy terms (`loss_term_tokens`)."""
    fn = loss_fn if callable(loss_fn) else LOSS_FUNCTIONS.get(loss_fn or config.loss_type, flag="--policy-loss-type")
    token_loss = fn(inputs, config)
    masked = token_loss
    if fn not in BUILTIN_LOSSES:  # the built-in ones are 0 outside the token mask already
        lp = inputs.raw_log_probs
        masked = torch.where(inputs.loss_mask, token_loss, torch.zeros((), dtype=lp.dtype, device=lp.device))
    if loss_terms is not None and loss_terms.active:
        masked = masked + loss_term_tokens(inputs, loss_terms, ref_log_probs, entropy, kl_log_probs)
    return masked


def aggregate_loss(masked: Tensor, den_mask: Tensor, correction: CorrectionResult | None,
                   config: RolloutCorrectionConfig, seg: Segments, cp_group: ProcessGroup, dp_group: ProcessGroup,
                   norm_length: int, dtype: torch.dtype) -> AggregatedLoss:
    """`config.loss_agg_mode` of the masked per-token losses (see `compute_policy_loss`): this rank's numerator and
    denominator, and loss = numerator / max(global denominator, 1). The global denominator is the correction's
    count when there is one, else one SUM over DP x CP. `norm_length`: T of seq-mean-token-sum-norm."""
    mode = config.loss_agg_mode
    has_groups = group_size(cp_group) > 1 or group_size(dp_group) > 1
    if mode == "token-mean":
        loss_sum = masked.sum()
        denominator = den_mask.sum().to(torch.float64)
        global_den = correction.global_token_count if correction is not None else None
    else:
        if correction is not None:
            n_i = correction.seq_token_count
        else:
            n_i = seq_sums([seg.sum(den_mask)], cp_group)[:, 0]
        if mode == "seq-mean-token-mean":
            loss_sum = (seg.sum(masked) / n_i.clamp_min(1).to(dtype)).sum()
        elif mode == "seq-mean-token-sum-norm":
            loss_sum = masked.sum() / norm_length
        else:
            loss_sum = masked.sum()
        denominator = (n_i > 0).to(torch.float64).sum() * cp_first(cp_group)
        global_den = correction.global_seq_count if correction is not None else None
    if global_den is None:
        global_den = global_sum(denominator, cp_group, dp_group) if has_groups else denominator
    return AggregatedLoss(loss_sum / global_den.clamp_min(1).to(dtype), loss_sum, denominator)


def loss_metrics(loss: Tensor, inputs: LossInputs, masks: LossMasks, correction: CorrectionResult | None,
                 advantages: Tensor) -> dict[str, Tensor]:
    """The correction's metrics, the loss function's, the loss and the tokens it dropped for a non-finite lp,
    lp_old or A (`pg_nonfinite_token_count`) or advantage (`pg_nonfinite_advantage_count`)."""
    metrics: dict[str, Tensor] = dict(correction.metrics) if correction is not None else {}
    own = {**inputs.metrics, "pg_loss": loss.detach(), "pg_nonfinite_token_count": masks.token_mask.sum() - inputs.count}
    metrics.update(zip(own, float64_scalars(own.values()), strict=True))
    metrics["pg_nonfinite_advantage_count"] = nonfinite_count(advantages, masks.valid)  # raised on by check_host_metrics
    return metrics


def float64_scalars(values: Iterable[Tensor]) -> tuple[Tensor, ...]:
    """One-element tensors (lp's dtype, float32, ...) as 0-dim float64 ones, detached, in one conversion: every
    metric then has the dtype `metrics_to_host` stacks them in without converting them one by one."""
    return torch.stack([v.reshape(()) if v.dim() else v for v in values]).detach().to(torch.float64).unbind()


# ------------------------------------------------------------------------------------------ KL and entropy terms
# KL estimators of KL(π_θ ‖ π_ref) per token, from x = lp − lp_ref (Schulman's k1/k2/k3, as slime and verl name them):
# fn(log_ratio) -> [B, S]. The log-ratio is clamped to ±20 before exp (k3, low_var_kl): never an inf.
KL_ESTIMATORS = Registry("KL estimator", ("log_ratio",))


@KL_ESTIMATORS.register("k1")
def kl_k1(log_ratio: Tensor) -> Tensor:
    """k1 = x (unbiased, high variance; may be negative per token)."""
    return log_ratio


@KL_ESTIMATORS.register("k2")
def kl_k2(log_ratio: Tensor) -> Tensor:
    """k2 = x² / 2."""
    return log_ratio.square() / 2


@KL_ESTIMATORS.register("k3")
def kl_k3(log_ratio: Tensor) -> Tensor:
    """k3 = exp(−x) − 1 + x (unbiased, ≥ 0), computed as expm1(−x) + x."""
    x = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(-x) + x


@KL_ESTIMATORS.register("low_var_kl")
def kl_low_var(log_ratio: Tensor) -> Tensor:
    """k3 clamped to [−10, 10] (verl's / slime's low_var_kl)."""
    return kl_k3(log_ratio).clamp(-10.0, 10.0)


def unbiased_kl(inputs: LossInputs, log_ratio: Tensor, kl_type: str) -> Tensor:
    """`--use-unbiased-kl`: ρ · k per token with ρ = exp(lp − lp_old) (the gradient flows through ρ too), as slime
    computes it; low_var_kl clamps ρ · k3 to [−10, 10], after the product."""
    rho = (inputs.log_probs - inputs.old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if kl_type == "low_var_kl":
        return (rho * kl_k3(log_ratio)).clamp(-10.0, 10.0)
    return rho * KL_ESTIMATORS.get(kl_type, flag="--kl-loss-type")(log_ratio)


def loss_term_tokens(inputs: LossInputs, terms: LossTermsConfig, ref_log_probs: Tensor | None,
                     entropy: Tensor | None, kl_log_probs: Tensor | None = None) -> Tensor:
    """Per-token KL and entropy terms: kl_loss_coef · KL(lp, lp_ref) − entropy_coef · H, 0 outside the token mask;
    lp is `kl_log_probs` when given (the full distribution's, while the policy term takes the kept set's).

    Adds the token mean `kl_loss` (over the mask) to `inputs.metrics` (the entropy is reported by the caller, which
    computed it). A non-finite reference log-prob or entropy contributes 0 (the token's policy term is unaffected).
    """
    mask = inputs.token_mask
    n = (inputs.count if inputs.count is not None else mask.sum()).clamp_min(1)
    out = torch.zeros_like(mask)
    if terms.uses_reference:
        if ref_log_probs is None:
            raise ValueError("--use-kl-loss / --kl-loss-coef need ref_log_probs (the reference policy's log-probs)")
        ref = ref_log_probs.detach().to(mask.dtype)
        ok = torch.isfinite(ref) & (mask > 0)
        policy = inputs.log_probs if kl_log_probs is None else kl_log_probs.to(mask.dtype)
        log_ratio = torch.where(ok, policy - torch.where(ok, ref, 0.0), 0.0)
        kl = torch.where(ok, unbiased_kl(inputs, log_ratio, terms.kl_loss_type) if terms.use_unbiased_kl else
                         KL_ESTIMATORS.get(terms.kl_loss_type, flag="--kl-loss-type")(log_ratio), 0.0)
        inputs.metrics["kl_loss"] = kl.detach().sum() / n
        if terms.kl_loss_coef:
            out = out + terms.kl_loss_coef * kl
    if terms.uses_entropy:
        if entropy is None:
            raise ValueError("--entropy-coef needs the policy's per-token entropy")
        ok = torch.isfinite(entropy) & (mask > 0)
        out = out - terms.entropy_coef * torch.where(ok, entropy.to(mask.dtype), 0.0)
    return out
