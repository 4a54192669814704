"""Policy losses: standard/decoupled/bypass PPO (asymmetric and dual clip), REINFORCE (pg_is, pg_rs), aggregation.

Per-token losses (registered in `slime_corr.registry.LOSS_FUNCTIONS`, signature `fn(inputs: LossInputs, config)
-> [B, S] tensor`):
- "ppo": r = exp(clamp(lp - lp_old, -20, 20)); l = max(-A·r, -A·clip(r, 1-ε, 1+ε_high)); with dual clip
  (`eps_clip_c` = c) l = min(l, -A·c) where A < 0; times w when IS weights are present (decoupled).
- "reinforce": l = -A·lp·w (pg_is) or -A·lp (pg_rs / no IS).

Global-denominator contract: `.loss_sum` is this rank's Σ of the aggregated numerator and `.denominator` its
local count (tokens for token-mean, sequences for seq-mean-*; each sequence counted once across CP). `.loss`
= loss_sum / max(global denominator, 1) with the denominator summed over DP x CP, so summing `.loss` (and its
gradients) over ranks gives the single-rank full-batch value. Across micro-batches: Σ loss_sum / Σ denominator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import CorrectionResult, compute_rollout_correction
from slime_corr.correction.reductions import (
    ProcessGroup,
    count_greater_,
    cp_first,
    finite_indicator_,
    float_mask,
    global_sum,
    group_size,
    seq_sums,
    valid_mask,
)
from slime_corr.loss_terms import LossTermsConfig
from slime_corr.registry import LOSS_FUNCTIONS, Registry

LOG_RATIO_CLAMP = 20.0


@dataclass
class LossInputs:
    """Inputs of a per-token loss function; all [B, S], finite, 0 outside the mask.

    `token_mask` is the mask as float 0/1 and `loss_mask` the same as bool (made on first use). `log_probs`
    carries the gradient; `weights` (detached) is None when no IS weight applies. A function may add 0-dim local
    metrics to `metrics`.
    """

    log_probs: Tensor
    old_log_probs: Tensor
    rollout_log_probs: Tensor | None
    advantages: Tensor
    token_mask: Tensor
    weights: Tensor | None
    count: Tensor | None = None  # Σ token_mask (local)
    metrics: dict[str, Tensor] = field(default_factory=dict)

    @cached_property
    def loss_mask(self) -> Tensor:
        return self.token_mask > 0


@dataclass
class PolicyLossOutput:
    loss: Tensor
    loss_sum: Tensor
    denominator: Tensor
    metrics: dict[str, Tensor]
    correction: CorrectionResult | None


@LOSS_FUNCTIONS.register("ppo")
def ppo_loss(inputs: LossInputs, config: RolloutCorrectionConfig) -> Tensor:
    """Clipped PPO (asymmetric ε, optional dual clip), times the IS weight when given.

    max(-A·r, -A·clip(r)) is computed as -min(A·r, A·clip(r)). The in-place steps only touch results that autograd
    does not keep (exp_ keeps its own result), so the peak memory stays a few [B, S] buffers.
    """
    adv = inputs.advantages
    n = inputs.count if inputs.count is not None else inputs.token_mask.sum()
    n = n.clamp_min(1)
    # inputs are 0 outside the mask, so there log_ratio = 0, ratio = 1 and both surrogates are 0: plain sums suffice
    log_ratio = (inputs.log_probs - inputs.old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    inputs.metrics["ppo_kl"] = -log_ratio.detach().sum() / n
    ratio = log_ratio.exp_()
    del log_ratio
    if not config.use_rollout_logprobs:  # decoupled: the on-policy ratio pi_theta / pi_old ("ois" of the references)
        inputs.metrics["ois"] = (ratio.detach() - 1.0).sum() / n + 1.0
    low, high = config.clip_range
    surr1 = adv * ratio
    surr2 = ratio.clamp(low, high).mul_(adv)
    del ratio
    # clipped fraction: tokens where the clipped surrogate is the smaller one (it is the one trained)
    inputs.metrics["pg_clipfrac"] = count_greater_(surr1.detach() - surr2.detach(), 0.0).sum() / n
    loss = torch.minimum(surr1, surr2).neg_()
    del surr1, surr2
    if config.eps_clip_c is not None:
        neg_a = -adv
        loss = torch.where(neg_a > 0, torch.minimum(loss, neg_a * config.eps_clip_c), loss)
    return loss if inputs.weights is None else loss.mul_(inputs.weights)


@LOSS_FUNCTIONS.register("reinforce")
def reinforce_loss(inputs: LossInputs, config: RolloutCorrectionConfig) -> Tensor:
    """REINFORCE: -A·lp·w (pg_is) or -A·lp (pg_rs)."""
    loss = -inputs.advantages * inputs.log_probs
    return loss if inputs.weights is None else loss * inputs.weights


BUILTIN_LOSSES = (ppo_loss, reinforce_loss)  # per-token losses known to be 0 outside the (sanitized) mask


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
    loss_terms: LossTermsConfig | None = None,
    ref_log_probs: Tensor | None = None,
    entropy: Tensor | None = None,
) -> PolicyLossOutput:
    """The policy loss of one micro-batch ([B, S] local slices) under `config`.

    Bypass (`use_rollout_logprobs`): lp_old := lp_rollout, lp_train := lp.detach(); decoupled:
    lp_train := lp_old. Aggregation (`config.loss_agg_mode`, m = loss mask, n_i / valid sequences from the
    denominator mask): token-mean Σ l·m / Σ m; seq-mean-token-sum mean_i Σ_t l·m; seq-mean-token-mean
    mean_i Σ_t l·m / n_i; seq-mean-token-sum-norm mean_i Σ_t l·m / T (T = seq_length_for_norm or S·cp_size).
    `loss_fn` overrides `config.loss_type` with a registered name, an import path, or a callable.
    `batch_norm_mean`: the step's IS-weight mean for `--tis-batch-normalize` (see `compute_rollout_correction`).
    `loss_terms` with `ref_log_probs` / `entropy` ([B, S]): the KL and entropy terms (`loss_term_tokens`), added per
    token before the aggregation; `pg_loss` is then the whole loss.
    """
    if config.use_rollout_logprobs:
        if rollout_log_probs is None:
            raise ValueError("--use-rollout-logprobs needs rollout_log_probs")
        old_log_probs = rollout_log_probs
        lp_train = log_probs.detach()
    else:
        if old_log_probs is None:
            raise ValueError("old_log_probs is required unless --use-rollout-logprobs is set")
        lp_train = old_log_probs

    correction: CorrectionResult | None = None
    if config.computes_metrics:
        if rollout_log_probs is None:
            raise ValueError("rollout correction / mismatch metrics need rollout_log_probs")
        correction = compute_rollout_correction(
            lp_train, rollout_log_probs, loss_mask, config, cp_group=cp_group, dp_group=dp_group,
            batch_norm_mean=batch_norm_mean,
        )
    dtype = log_probs.dtype
    if correction is not None and config.use_rollout_correction:
        mask_f = correction.loss_mask.to(dtype)
        den_mask = correction.denominator_mask
        weights = correction.weights
    else:
        den_mask = valid_mask(loss_mask)
        mask_f = float_mask(den_mask, dtype)
        weights = None

    old = old_log_probs.detach()
    adv = advantages.detach()
    # a NaN/inf in lp, lp_old or A (or an overflow of lp - lp_old + A) drops the token: one pass for all three
    okf = finite_indicator_((log_probs.detach() - old).add_(adv)).mul_(mask_f)
    # Sanitize BEFORE the loss math (nan_to_num x mask) so neither the value nor the gradient sees a NaN/inf;
    # every input is then finite and 0 outside the mask, so the built-in per-token losses are 0 there too.
    inputs = LossInputs(
        log_probs=torch.nan_to_num(log_probs, 0.0, 0.0, 0.0).mul_(okf),
        old_log_probs=torch.nan_to_num(old, 0.0, 0.0, 0.0).mul_(okf),
        rollout_log_probs=rollout_log_probs,
        advantages=torch.nan_to_num(adv, 0.0, 0.0, 0.0).mul_(okf),
        token_mask=okf,
        weights=None if weights is None else weights.detach().to(dtype) * okf,
        count=okf.sum(dtype=torch.promote_types(dtype, torch.float32)),  # bf16 cannot count above 256
    )
    fn = loss_fn if callable(loss_fn) else LOSS_FUNCTIONS.get(loss_fn or config.loss_type, flag="--loss-type")
    token_loss = fn(inputs, config)
    zero = torch.zeros((), dtype=dtype, device=log_probs.device)
    masked = token_loss if fn in BUILTIN_LOSSES else torch.where(inputs.loss_mask, token_loss, zero)
    if loss_terms is not None and loss_terms.active:
        masked = masked + loss_term_tokens(inputs, loss_terms, ref_log_probs, entropy)

    mode = config.loss_agg_mode
    has_groups = group_size(cp_group) > 1 or group_size(dp_group) > 1
    if mode == "token-mean":
        loss_sum = masked.sum()
        denominator = den_mask.sum().to(torch.float64)
        global_den = correction.global_token_count if correction is not None else None
    else:
        if mode == "seq-mean-token-mean":
            if correction is not None:
                n_i = correction.seq_token_count
            else:
                n_i = seq_sums([den_mask], cp_group)[:, 0]
            loss_sum = (masked.sum(-1) / n_i.clamp_min(1).to(dtype)).sum()
        elif mode == "seq-mean-token-sum-norm":
            norm = seq_length_for_norm or log_probs.shape[-1] * group_size(cp_group)
            loss_sum = masked.sum() / norm
        else:
            loss_sum = masked.sum()
        if correction is not None:
            n_i = correction.seq_token_count
        elif mode != "seq-mean-token-mean":
            n_i = seq_sums([den_mask], cp_group)[:, 0]
        denominator = (n_i > 0).to(torch.float64).sum() * cp_first(cp_group)
        global_den = correction.global_seq_count if correction is not None else None
    if global_den is None:
        global_den = global_sum(denominator, cp_group, dp_group) if has_groups else denominator
    loss = loss_sum / global_den.clamp_min(1).to(dtype)

    metrics: dict[str, Tensor] = dict(correction.metrics) if correction is not None else {}
    metrics.update(inputs.metrics)
    metrics["pg_loss"] = loss.detach()
    metrics["pg_nonfinite_token_count"] = (mask_f.sum() - inputs.count).to(torch.float64)
    return PolicyLossOutput(
        loss=loss, loss_sum=loss_sum, denominator=denominator, metrics=metrics, correction=correction
    )


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


def loss_term_tokens(inputs: LossInputs, terms: LossTermsConfig, ref_log_probs: Tensor | None,
                     entropy: Tensor | None) -> Tensor:
    """Per-token KL and entropy terms: kl_loss_coef · KL(lp, lp_ref) − entropy_coef · H, 0 outside the token mask.

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
        log_ratio = torch.where(ok, inputs.log_probs - torch.where(ok, ref, 0.0), 0.0)
        kl = torch.where(ok, KL_ESTIMATORS.get(terms.kl_loss_type, flag="--kl-loss-type")(log_ratio), 0.0)
        inputs.metrics["kl_loss"] = kl.detach().sum() / n
        if terms.kl_loss_coef:
            out = out + terms.kl_loss_coef * kl
    if terms.uses_entropy:
        if entropy is None:
            raise ValueError("--entropy-coef needs the policy's per-token entropy")
        ok = torch.isfinite(entropy) & (mask > 0)
        out = out - terms.entropy_coef * torch.where(ok, entropy.to(mask.dtype), 0.0)
    return out
