"""The peers' policy losses, each registered for `--policy-loss-type` under its name in verl 0.9.1
(`core_algos.register_policy_loss`), equal to the peer's code on the same inputs (tests/correction/
test_policy_losses.py runs verl's). Per token, with r = exp(clamp(lp − lp_old, ±20)), w the IS weight when one
applies (decoupled mode), ε / ε_high = `--eps-clip` / `--eps-clip-high`:

- "cispo" (MiniMax-M1's CISPO; slime `--advantage-estimator cispo`, NeMo-RL `use_cispo`):
  l = −sg(clip(r, 1−ε, 1+ε_high))·A·lp·w. A clipped token keeps its gradient −clip(r)·A·w.
- "sapo" (SAPO; AReaL `use_sapo_loss`): l = −(4/τ)·σ(τ·(r − 1))·A·w, τ = `--tau-pos` where A > 0, else `--tau-neg`:
  a soft gate in place of the hard clip. verl always aggregates it seq-mean-token-mean; here `--loss-agg-mode` says.
- "geo_mean" (GMPO): the sequence loss L_i = −Ā_i·exp(mean_t c_t)·W_i with c_t = sign(A_t)·min(sign(A_t)·x_t,
  sign(A_t)·clamp(x_t, −ε, ε_high)), x = lp − lp_old (the clip in log space), Ā_i the sequence's mean advantage and
  W_i = exp(mean_t log(w_t + 1e-10)) the geometric mean of its IS weights. Every token of sequence i carries L_i,
  with the gradient L_i·∂c_t/∂lp_t (straight-through), so any aggregation is the exact gradient of its own value
  and `seq-mean-token-mean` is GMPO's mean over sequences (verl's `geo_mean`, except that verl's mean also counts
  sequences without a token). One CP all_reduce.
- "dppo_tv" / "dppo_kl" (DPPO Binary-TV / Binary-KL; prime-rl's default loss): l = −A·sg(min(r, C))·lp·v·w, v = 1 where
  the token's probability moved less than the bound in the direction its advantage pushes it: TV: p − p_old ≤ ε_high
  (A > 0) / p − p_old ≥ −ε (A ≤ 0); KL: the binary KL p_old·log(p_old/p) + (1−p_old)·log((1−p_old)/(1−p)) ≤ ε_high or
  p ≤ p_old (A > 0) / ≤ ε or p ≥ p_old (A ≤ 0). C = `--eps-clip-c` (default 3.0, verl's clip_ratio_c).
- "clip_cov" (Clip-Cov, against entropy collapse): PPO's max(−A·r, −A·clip(r)) (no dual clip), with the gradient
  cut (l = 0) at min(⌊ρ·N⌋ ∨ 1, K) tokens picked at random (`torch.randperm` on the default generator, as verl) among
  the K unclipped tokens whose cov = (A − mean A)·(lp − mean lp) lies in (lb, ub); ρ, lb, ub = `--clip-cov-ratio`,
  `--clip-cov-lb`, `--clip-cov-ub`, N the micro-batch's tokens.
- "kl_cov" (KL-Cov): −A·r, plus κ·|lp − lp_old| at the max(⌊ρ·N⌋, 1) tokens of the largest cov; ρ, κ =
  `--kl-cov-ratio`, `--ppo-kl-coef`.

The means of Clip-Cov and KL-Cov are the micro-batch's, on each DP rank (as verl's), and they read the micro-batch's
token count on the host (one sync, as verl's): a sequence split over context-parallel ranks is refused. Each adds
`ppo_kl` (token mean of lp_old − lp, clamped) and, where verl defines it, `pg_clipfrac` to the loss metrics.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction.reductions import group_size, seq_sums
from slime_corr.layout.segments import Segments
from slime_corr.loss_inputs import LOG_RATIO_CLAMP, LossInputs
from slime_corr.registry import LOSS_FUNCTIONS

DPPO_TRUNCATION = 3.0  # C without --eps-clip-c: verl's clip_ratio_c default, which its DPPO losses read
GEO_MEAN_WEIGHT_FLOOR = 1e-10  # verl's geo_mean: log(w + 1e-10), so a zero weight is finite
BINARY_KL_FLOOR = 1e-8  # verl's dppo_kl: log((1 - p_old + 1e-8) / (1 - p + 1e-8))


def token_mean(values: Tensor, inputs: LossInputs) -> Tensor:
    """Σ values·m / max(Σ m, 1) over the token mask (a local metric)."""
    count = inputs.count if inputs.count is not None else inputs.token_mask.sum()
    return (values * inputs.token_mask).sum() / count.clamp_min(1)


def clamped_log_ratio(inputs: LossInputs) -> Tensor:
    """clamp(lp − lp_old, ±20), detached (0 outside the mask); logs its token mean as `ppo_kl` (of lp_old − lp)."""
    log_ratio = (inputs.log_probs.detach() - inputs.old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    inputs.metrics["ppo_kl"] = -token_mean(log_ratio, inputs)
    return log_ratio


def weighted(loss: Tensor, inputs: LossInputs) -> Tensor:
    """The per-token loss times the IS weight, when one applies."""
    return loss if inputs.weights is None else loss * inputs.weights


@LOSS_FUNCTIONS.register("cispo")
def cispo_loss(inputs: LossInputs, config: RolloutCorrectionConfig) -> Tensor:
    """CISPO: l = −sg(clip(r, 1−ε, 1+ε_high))·A·lp·w."""
    ratio = clamped_log_ratio(inputs).exp()
    clipped = ratio.clamp(*config.clip_range)
    inputs.metrics["pg_clipfrac"] = token_mean((ratio != clipped).to(ratio.dtype), inputs)
    return weighted(-clipped * inputs.advantages * inputs.log_probs, inputs)


@LOSS_FUNCTIONS.register("sapo")
def sapo_loss(inputs: LossInputs, config: RolloutCorrectionConfig) -> Tensor:
    """SAPO: l = −(4/τ)·σ(τ·(r − 1))·A·w, τ = tau_pos where A > 0, else tau_neg."""
    clamped_log_ratio(inputs)
    advantages = inputs.advantages
    ratio = (inputs.log_probs - inputs.old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    tau_pos, tau_neg = (advantages.new_tensor(t) for t in config.sapo_taus)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return weighted(-gate * advantages, inputs)


@LOSS_FUNCTIONS.register("geo_mean")
def geo_mean_loss(inputs: LossInputs, config: RolloutCorrectionConfig) -> Tensor:
    """GMPO: every token of sequence i carries L_i = −Ā_i·exp(mean_t c_t)·W_i, with the gradient L_i·∂c_t/∂lp_t
    (see the module doc)."""
    mask, advantages = inputs.token_mask, inputs.advantages
    seg = inputs.segments or Segments.rows(*mask.shape)
    high = config.eps_clip_high if config.eps_clip_high is not None else config.eps_clip
    log_ratio = inputs.log_probs - inputs.old_log_probs
    bounded = log_ratio.clamp(-config.eps_clip, high)
    sign = torch.sign(advantages)
    clipped = sign * torch.minimum(sign * log_ratio, sign * bounded)  # the clip on A's side only
    was_clipped = (log_ratio != bounded).to(mask.dtype).detach()
    inputs.metrics["pg_clipfrac"] = token_mean(was_clipped * (advantages > 0), inputs)
    inputs.metrics["ppo_kl"] = -token_mean(log_ratio.detach(), inputs)
    columns = [seg.sum(clipped.detach() * mask), seg.sum(mask), seg.sum(advantages * mask)]
    if inputs.weights is not None:
        columns.append(seg.sum(torch.log(inputs.weights + GEO_MEAN_WEIGHT_FLOOR) * mask))
    sums = seq_sums(columns, inputs.cp_group)
    count = sums[:, 1].clamp_min(1)
    mean_log_ratio = sums[:, 0] / count
    in_range = (mean_log_ratio.abs() <= LOG_RATIO_CLAMP).to(mask.dtype)
    seq_loss = -(sums[:, 2] / count) * mean_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if inputs.weights is not None:
        seq_loss = seq_loss * (sums[:, 3] / count).exp()
    carrier = (clipped - clipped.detach()) * seg.expand(in_range.to(clipped.dtype))  # value 0, gradient ∂c_t/∂lp_t
    return seg.expand(seq_loss.to(clipped.dtype)) * (1.0 + carrier)


def dppo_loss(inputs: LossInputs, config: RolloutCorrectionConfig, divergence: str) -> Tensor:
    """DPPO Binary-TV (`divergence` "tv") or Binary-KL ("kl"): l = −A·sg(min(r, C))·lp·v·w (see the module doc)."""
    lp, old, advantages = inputs.log_probs.detach(), inputs.old_log_probs, inputs.advantages
    truncation = config.eps_clip_c if config.eps_clip_c is not None else DPPO_TRUNCATION
    ratio = clamped_log_ratio(inputs).exp().clamp(max=truncation)
    prob, old_prob = lp.exp(), old.exp()
    low = config.eps_clip
    high = config.eps_clip_high if config.eps_clip_high is not None else low
    if divergence == "tv":
        rise_ok, fall_ok = prob - old_prob <= high, prob - old_prob >= -low
    else:
        binary_kl = old_prob * (old - lp) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + BINARY_KL_FLOOR) / (1.0 - prob + BINARY_KL_FLOOR))
        rise_ok, fall_ok = (binary_kl <= high) | (prob <= old_prob), (binary_kl <= low) | (prob >= old_prob)
    trusted = torch.where(advantages > 0, rise_ok, fall_ok).to(lp.dtype)
    inputs.metrics["pg_clipfrac"] = token_mean(1.0 - trusted, inputs)
    return weighted(-advantages * ratio * inputs.log_probs * trusted, inputs)


@LOSS_FUNCTIONS.register("dppo_tv")
def dppo_tv_loss(inputs: LossInputs, config: RolloutCorrectionConfig) -> Tensor:
    """DPPO Binary-TV: the token's probability change p − p_old bounded on its advantage's side."""
    return dppo_loss(inputs, config, "tv")


@LOSS_FUNCTIONS.register("dppo_kl")
def dppo_kl_loss(inputs: LossInputs, config: RolloutCorrectionConfig) -> Tensor:
    """DPPO Binary-KL: the binary KL of {token, rest} bounded where the probability moves the advantage's way."""
    return dppo_loss(inputs, config, "kl")


def refuse_context_parallel(inputs: LossInputs, loss_type: str) -> None:
    """Clip-Cov and KL-Cov pick tokens of the micro-batch on one rank: a sequence split over CP ranks is refused."""
    if group_size(inputs.cp_group) > 1:
        raise ValueError(f"--policy-loss-type {loss_type} picks tokens by the micro-batch's covariance, which it "
                         "computes on one rank, as verl does: it does not run with context parallelism (a sequence "
                         "split over ranks); use --context-parallel-size 1 or another loss.")


def micro_batch_covariance(inputs: LossInputs) -> Tensor:
    """cov = (A − mean A)·(lp − mean lp) per token, the means over the micro-batch's token mask."""
    mask, advantages, lp = inputs.token_mask, inputs.advantages, inputs.log_probs.detach()
    count = mask.sum().clamp_min(1)
    return (advantages - (advantages * mask).sum() / count) * (lp - (lp * mask).sum() / count)


@LOSS_FUNCTIONS.register("clip_cov")
def clip_cov_loss(inputs: LossInputs, config: RolloutCorrectionConfig) -> Tensor:
    """Clip-Cov: max(−A·r, −A·clip(r))·w, 0 at a random few unclipped tokens of covariance in (lb, ub)."""
    share, lower, upper = config.clip_cov_settings
    clamped_log_ratio(inputs)
    mask, advantages = inputs.token_mask, inputs.advantages
    ratio = (inputs.log_probs - inputs.old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(*config.clip_range)
    refuse_context_parallel(inputs, "clip_cov")
    counted = mask > 0
    cov = micro_batch_covariance(inputs)
    candidates = counted & ~(clipped_loss > unclipped_loss) & (cov > lower) & (cov < upper)
    cut_count = max(int(share * mask.sum().item()), 1)  # the host reads the count, as verl does
    positions = torch.nonzero(candidates)
    kept = torch.ones_like(mask)
    if len(positions) > 0:  # verl draws only then: the default generator advances as in verl
        chosen = positions[torch.randperm(len(positions))[:min(cut_count, len(positions))]]
        kept[chosen[:, 0], chosen[:, 1]] = 0
    inputs.metrics["pg_clipfrac"] = token_mean(1.0 - kept, inputs)
    return weighted(torch.maximum(unclipped_loss, clipped_loss) * kept, inputs)


@LOSS_FUNCTIONS.register("kl_cov")
def kl_cov_loss(inputs: LossInputs, config: RolloutCorrectionConfig) -> Tensor:
    """KL-Cov: −A·r·w, plus κ·|lp − lp_old|·w at the tokens of the largest covariance."""
    share, coef = config.kl_cov_settings
    refuse_context_parallel(inputs, "kl_cov")
    clamped_log_ratio(inputs)
    mask, advantages = inputs.token_mask, inputs.advantages
    log_ratio = inputs.log_probs - inputs.old_log_probs
    loss = -advantages * log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    counted = (mask > 0).reshape(-1)
    positions = torch.nonzero(counted).reshape(-1)
    if len(positions) > 0:
        adv, lp = advantages.reshape(-1)[positions], inputs.log_probs.detach().reshape(-1)[positions]
        cov = (adv - adv.mean()) * (lp - lp.mean())  # verl's means: over the counted tokens
        top = torch.topk(cov, max(1, int(len(positions) * share)), largest=True).indices
        penalized = torch.zeros_like(counted)
        penalized[positions[top]] = True
        loss = torch.where(penalized.reshape(mask.shape), loss + coef * log_ratio.abs(), loss)
    return weighted(loss, inputs)


__all__ = ["DPPO_TRUNCATION", "cispo_loss", "clip_cov_loss", "dppo_kl_loss", "dppo_tv_loss", "geo_mean_loss",
           "kl_cov_loss", "sapo_loss"]
