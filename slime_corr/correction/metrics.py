"""Mismatch and IS/RS metrics, computed in vectorized passes and reduced in one batch collective.

Keys (logged without a step prefix). "Token mean" = over valid finite tokens of the ORIGINAL mask; "sequence
mean" = over valid sequences (≥ 1 valid token) without a non-finite log-prob; exponents of ppl metrics are
clamped to ±80 so they stay finite. lr = lp_train - lp_rollout, x = clamp(lr, -20, 20).

| key | definition |
| --- | --- |
| mismatch_kl | token mean of lp_rollout - lp_train |
| mismatch_k3_kl | token mean of exp(x) - x - 1 |
| mismatch_training_log_ppl / mismatch_rollout_log_ppl | sequence mean of -(mean log-prob) |
| mismatch_training_ppl / mismatch_rollout_ppl | sequence mean of exp(-(mean log-prob)) |
| mismatch_log_ppl_diff / mismatch_log_ppl_abs_diff | sequence mean of (mean lp_rollout - mean lp_train), of its abs |
| mismatch_ppl_ratio | sequence mean of exp(mean lp_rollout - mean lp_train) |
| mismatch_chi2_token | token mean of exp(2x) - 1 |
| mismatch_chi2_seq | sequence mean of exp(2·clamp(Σ m·lr, ±20)) - 1 |
| train_rollout_logprob_abs_diff | token mean of abs(lr) |
| rollout_probs_diff_max / _mean / _std | max / mean / std of abs(exp(lp_train) - exp(lp_rollout)) over tokens |
| rollout_actor_probs_pearson_corr | Pearson correlation of exp(lp_train) and exp(lp_rollout) over tokens |
| mis_nonfinite_token_count / mis_nonfinite_seq_count | valid tokens / sequences with a non-finite log-prob (dropped) |
| mis_nonfinite_seq_fraction | mis_nonfinite_seq_count / valid sequences |
| mis_valid_token_count / mis_valid_seq_count | valid tokens / sequences of the original mask |
With IS (`--use-tis`); a "unit" is a token (token level) or a sequence (sequence/geometric level, each once):
| mis_mean_is_weight_before_clip | mean of w_raw = exp(clamp(ℓ, ±20)) over finite valid units |
| mis_truncate_fraction | truncate mode: fraction of finite valid units with w_raw > U |
| mis_clip_fraction_low / _high | clip mode: fraction with w_raw < L / w_raw > U |
| mis_mask_fraction_low / _high | mask mode: fraction with w_raw < L / w_raw > U (weight 0) |
| mis_ratio_mean_after_mis | mean of the final weight (bounded, normalized) over contributing units |
| mis_weight_std / mis_weight_min / mis_weight_max | std and true min/max of the final weight over contributing units |
| mis_weight_p10 / _p50 / _p90 / _p99 | quantiles of the final weight (log-space histogram, ~0.5% resolution) |
| mis_ess | normalized effective sample size (Σw)² / (N·Σw²) over contributing units |
| mis_batch_norm_factor | the batch mean the weights were divided by (`--tis-batch-normalize`) |
With correction on (IS, RS or veto):
| mis_rs_rejected_token_fraction / _seq_fraction | finite valid tokens / sequences dropped by RS (sequences: all tokens) |
| mis_catastrophic_token_fraction / _seq_fraction | veto: tokens with lr < log C / sequences vetoed |
| mis_rejected_token_fraction / _seq_fraction | valid tokens / sequences dropped for any reason (RS, veto, non-finite) |
| mis_contributing_token_count | tokens left in the loss mask |
| mis_all_rejected | 1.0 when no token is left in the loss mask of the whole batch |
| mis_custom_nonfinite_weight_count | a custom weighting function's NaN/inf weights: tokens rejected for them |
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from slime_corr.correction.reductions import BatchStats

HIST_BINS = 4096
HIST_LOG_RANGE = 20.0
QUANTILES = {"p10": 0.10, "p50": 0.50, "p90": 0.90, "p99": 0.99}
PPL_EXP_CLAMP = 80.0
LOG_PROB_CLAMP = 20.0


EXTREMA = {"tok_d_max": torch.maximum, "w_max": torch.maximum, "w_min": torch.minimum}


def merge_stats(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The reduced statistics of a whole step from its micro-batches': sums add, extremes take the max/min."""
    merged: dict[str, Tensor] = {}
    for stats in parts:
        for key, value in stats.items():
            combine = EXTREMA.get(key, torch.add)
            merged[key] = value if key not in merged else combine(merged[key], value)
    return merged


def metrics_to_host(metrics: dict[str, Tensor]) -> dict[str, float]:
    """All metrics to Python floats in ONE device->host transfer."""
    if not metrics:
        return {}
    values = torch.stack([v.detach().reshape(()).to(torch.float64) for v in metrics.values()]).tolist()
    return dict(zip(metrics.keys(), values, strict=True))


def _total(x: Tensor) -> Tensor:
    """Σ over [B, S]: row sums in the input precision, then float64 across rows."""
    return x.sum(-1).to(torch.float64).sum()


def _div(num: Tensor, den: Tensor) -> Tensor:
    return num / den.clamp_min(1e-30) if den.dtype.is_floating_point else num / den.clamp_min(1)


def add_token_mismatch(
    stats: BatchStats, lr: Tensor, lp_train: Tensor, lp_rollout: Tensor, mask: Tensor, row_weight: Tensor
) -> None:
    """Token-level sums over the float 0/1 `mask` of finite tokens (`lr`, `lp_*` finite and 0 outside it), of the
    rows with `row_weight` [B] = 1 (0 excludes a sequence; applied to row sums, not to [B, S] tensors).

    k3 = exp(x) - x - 1 and chi2 = exp(2x) - 1 use expm1 (no cancellation for small x); both vanish at x = 0.
    """
    rw = row_weight.to(torch.float64)

    def total(v: Tensor) -> Tensor:
        return (v.to(torch.float64) * rw).sum()

    x = lr.clamp(-20.0, 20.0)
    e1 = x.expm1()
    stats.add_sum("tok_neg_lr", -total(lr.sum(-1)))
    stats.add_sum("tok_k3", total((e1 - x).sum(-1)))
    stats.add_sum("tok_chi2", total(torch.linalg.vecdot(e1, e1 + 2.0)))  # e1·(e1 + 2) = exp(2x) - 1
    stats.add_sum("tok_abs_lr", total(lr.abs().sum(-1)))
    # the clamp only touches invalid log-probs (> 20) so that squares stay finite; x mask: 0 outside it
    p_t = lp_train.clamp(max=LOG_PROB_CLAMP).exp_().mul_(mask)
    p_r = lp_rollout.clamp(max=LOG_PROB_CLAMP).exp_().mul_(mask)
    d = (p_t - p_r).abs_()
    stats.add_sum("tok_d", total(d.sum(-1)))
    stats.add_sum("tok_d2", total(torch.linalg.vecdot(d, d)))
    stats.add_max("tok_d_max", (d.amax(-1) * rw).max() if d.numel() else torch.zeros(()))  # d >= 0
    for name, a, b in (("pt", p_t, None), ("pr", p_r, None), ("pt2", p_t, p_t), ("pr2", p_r, p_r), ("ptr", p_t, p_r)):
        stats.add_sum(f"tok_{name}", total(a.sum(-1) if b is None else torch.linalg.vecdot(a, b)))


def add_seq_mismatch(
    stats: BatchStats, seq_ok: Tensor, n: Tensor, s_lpt: Tensor, s_lpr: Tensor, s_lr: Tensor, cp0: float
) -> None:
    """Sequence-level sums from whole-sequence (CP-reduced) sums; counted on CP rank 0 only."""
    sw = seq_ok.to(torch.float64) * cp0
    n = n.to(torch.float64).clamp_min(1)
    mt = s_lpt.to(torch.float64) / n
    mr = s_lpr.to(torch.float64) / n
    s_lr = s_lr.to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=sw.device)

    def add(name: str, v: Tensor) -> None:
        stats.add_sum(name, (torch.where(seq_ok, v, zero) * sw).sum())

    add("seq_train_log_ppl", -mt)
    add("seq_rollout_log_ppl", -mr)
    add("seq_train_ppl", (-mt).clamp(-PPL_EXP_CLAMP, PPL_EXP_CLAMP).exp())
    add("seq_rollout_ppl", (-mr).clamp(-PPL_EXP_CLAMP, PPL_EXP_CLAMP).exp())
    add("seq_log_ppl_diff", mr - mt)
    add("seq_log_ppl_abs_diff", (mr - mt).abs())
    add("seq_ppl_ratio", (mr - mt).clamp(-PPL_EXP_CLAMP, PPL_EXP_CLAMP).exp())
    add("seq_chi2", (2.0 * s_lr.clamp(-20.0, 20.0)).exp() - 1.0)


def finalize_mismatch(r: dict[str, Tensor]) -> dict[str, Tensor]:
    n_tok, n_seq = r["n_tok"], r["n_seq"]
    tok = {k: _div(r[k], n_tok) for k in ("tok_neg_lr", "tok_k3", "tok_chi2", "tok_abs_lr", "tok_d", "tok_d2")}
    tok.update({k: _div(r[k], n_tok) for k in ("tok_pt", "tok_pr", "tok_pt2", "tok_pr2", "tok_ptr")})
    seq = {k: _div(r[k], n_seq) for k in r if k.startswith("seq_")}
    var_t = (tok["tok_pt2"] - tok["tok_pt"] ** 2).clamp_min(0)
    var_r = (tok["tok_pr2"] - tok["tok_pr"] ** 2).clamp_min(0)
    cov = tok["tok_ptr"] - tok["tok_pt"] * tok["tok_pr"]
    denom = (var_t * var_r).sqrt()
    pearson = torch.where(denom > 1e-20, cov / denom.clamp_min(1e-20), torch.zeros_like(cov)).clamp(-1, 1)
    return {
        "mismatch_kl": tok["tok_neg_lr"],
        "mismatch_k3_kl": tok["tok_k3"],
        "mismatch_training_log_ppl": seq["seq_train_log_ppl"],
        "mismatch_rollout_log_ppl": seq["seq_rollout_log_ppl"],
        "mismatch_training_ppl": seq["seq_train_ppl"],
        "mismatch_rollout_ppl": seq["seq_rollout_ppl"],
        "mismatch_log_ppl_diff": seq["seq_log_ppl_diff"],
        "mismatch_log_ppl_abs_diff": seq["seq_log_ppl_abs_diff"],
        "mismatch_ppl_ratio": seq["seq_ppl_ratio"],
        "mismatch_chi2_token": tok["tok_chi2"],
        "mismatch_chi2_seq": seq["seq_chi2"],
        "train_rollout_logprob_abs_diff": tok["tok_abs_lr"],
        "rollout_probs_diff_max": torch.where(n_tok > 0, r["tok_d_max"], torch.zeros_like(r["tok_d_max"])),
        "rollout_probs_diff_mean": tok["tok_d"],
        "rollout_probs_diff_std": (tok["tok_d2"] - tok["tok_d"] ** 2).clamp_min(0).sqrt(),
        "rollout_actor_probs_pearson_corr": pearson,
    }


def add_raw_weight_stats(stats: BatchStats, w_raw: Tensor, unit: Tensor, lower: float, upper: float) -> None:
    """w_raw over the finite valid units (`unit` = 1 per token, or 1/n_i per token of sequence i)."""
    stats.add_sum("raw_u", _total(unit))
    stats.add_sum("raw_uw", _total(torch.linalg.vecdot(unit, w_raw)))
    stats.add_sum("raw_high", _total(torch.where(w_raw > upper, unit, torch.zeros_like(unit))))
    stats.add_sum("raw_low", _total(torch.where(w_raw < lower, unit, torch.zeros_like(unit))))


def finalize_raw_weight(r: dict[str, Tensor], mode: str) -> dict[str, Tensor]:
    u = r["raw_u"]
    out = {"mis_mean_is_weight_before_clip": _div(r["raw_uw"], u)}
    low, high = _div(r["raw_low"], u), _div(r["raw_high"], u)
    if mode == "truncate":
        out["mis_truncate_fraction"] = high
    elif mode == "clip":
        out["mis_clip_fraction_low"], out["mis_clip_fraction_high"] = low, high
    elif mode == "mask":
        out["mis_mask_fraction_low"], out["mis_mask_fraction_high"] = low, high
    return out


def add_weight_stats(stats: BatchStats, w: Tensor, unit: Tensor, contributing: Tensor) -> None:
    """Final (pre-normalization) weights over contributing units: Σu, Σuw, Σuw², min, max, histogram."""
    stats.add_sum("w_u", _total(unit))
    stats.add_sum("w_uw", _total(torch.linalg.vecdot(unit, w)))
    stats.add_sum("w_uw2", _total(torch.linalg.vecdot(unit * w, w)))
    inf = torch.tensor(math.inf, dtype=w.dtype, device=w.device)
    if w.numel():
        stats.add_max("w_max", torch.where(contributing, w, -inf).max())
        stats.add_min("w_min", torch.where(contributing, w, inf).min())
    else:
        stats.add_max("w_max", -inf)
        stats.add_min("w_min", inf)
    # Bin 0 holds w == 0; bins 1..HIST_BINS split log w in [-20, 20] evenly.
    scale = HIST_BINS / (2 * HIST_LOG_RANGE)
    idx = ((w.log() + HIST_LOG_RANGE) * scale).nan_to_num(0.0, 0.0, 0.0).clamp_(0, HIST_BINS - 1).long() + 1
    idx = torch.where(w > 0, idx, torch.zeros_like(idx))
    hist = torch.bincount(idx.reshape(-1), weights=unit.reshape(-1).to(torch.float64), minlength=HIST_BINS + 1)
    stats.add_sum("w_hist", hist)


def histogram_quantile(hist: Tensor, q: float) -> Tensor:
    """The weight at quantile q from the log-space histogram (bin center; 0 for the zero bin)."""
    cum = hist.cumsum(0)
    total = cum[-1]
    target = (q * total - 1e-9 * total).reshape(1)
    i = torch.searchsorted(cum, target).clamp_max(hist.numel() - 1)[0]
    width = 2 * HIST_LOG_RANGE / HIST_BINS
    center = (-HIST_LOG_RANGE + (i.to(torch.float64) - 0.5) * width).exp()
    return torch.where(i > 0, center, torch.zeros_like(center))


def finalize_weight(r: dict[str, Tensor], factor: Tensor | None) -> dict[str, Tensor]:
    """Stats of the final weights; `factor` (batch-normalization divisor) rescales all but the ESS."""
    u, uw, uw2 = r["w_u"], r["w_uw"], r["w_uw2"]
    has = u > 0
    zero = torch.zeros_like(u)
    mean = _div(uw, u)
    wmin = torch.where(has, r["w_min"], zero)
    wmax = torch.where(has, r["w_max"], zero)
    out = {
        "mis_ratio_mean_after_mis": mean,
        "mis_weight_std": (_div(uw2, u) - mean**2).clamp_min(0).sqrt(),
        "mis_weight_min": wmin,
        "mis_weight_max": wmax,
    }
    for name, q in QUANTILES.items():
        out[f"mis_weight_{name}"] = torch.minimum(torch.maximum(histogram_quantile(r["w_hist"], q), wmin), wmax)
    if factor is not None:
        out = {k: v / factor for k, v in out.items()}
        out["mis_batch_norm_factor"] = factor
    out["mis_ess"] = torch.where(uw2 > 0, uw**2 / (u * uw2).clamp_min(1e-300), zero)
    return out
