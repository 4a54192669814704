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
    with torch.no_grad():
        values = torch.stack([v.reshape(()) for v in metrics.values()]).to(torch.float64).tolist()
    return dict(zip(metrics.keys(), values, strict=True))


def _total(x: Tensor) -> Tensor:
    """Σ over [B, S]: row sums in the input precision, then float64 across rows."""
    return x.sum(-1).to(torch.float64).sum()


def _div(num: Tensor, den: Tensor) -> Tensor:
    """num / den for float64 batch statistics; 0 / 0 = 0."""
    return num / den.clamp_min(1e-30)


def _ratios(r: dict[str, Tensor], keys: tuple[str, ...], den: Tensor) -> dict[str, Tensor]:
    """{key: r[key] / den} for several keys in three tensor ops."""
    return dict(zip(keys, _div(torch.stack([r[k] for k in keys]), den).unbind(), strict=True))


TOKEN_SUMS = ("tok_neg_lr", "tok_k3", "tok_chi2", "tok_abs_lr", "tok_d", "tok_d2", "tok_pt", "tok_pr", "tok_pt2",
              "tok_pr2", "tok_ptr")


def token_mismatch_rows(lr: Tensor, lp_train: Tensor, lp_rollout: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sequence sums of the token-level mismatch terms ([B, len(TOKEN_SUMS)], in TOKEN_SUMS order) and the
    per-sequence max of |p_train - p_rollout| ([B]).

    `lr`, `lp_*` must be finite at the float 0/1 `mask` and 0 outside it. k3 = exp(x) - x - 1 and
    chi2 = exp(2x) - 1 use expm1 (no cancellation for small x). Written as a stream of passes that each free
    their temporaries: on CPU, touching fresh memory costs more than the arithmetic.
    """
    x = lr.clamp(-20.0, 20.0)
    e1 = x.expm1()
    k3 = x.neg_().add_(e1).sum(-1)  # x is not needed after this
    del x
    chi2 = torch.linalg.vecdot(e1, e1) + 2.0 * e1.sum(-1)  # e1·(e1 + 2) = exp(2x) - 1
    del e1
    abs_lr = lr.abs().sum(-1)
    # the clamp only touches invalid log-probs (> 20) so that squares stay finite; x mask: 0 outside it
    p_t = lp_train.clamp(max=LOG_PROB_CLAMP).exp_().mul_(mask)
    p_r = lp_rollout.clamp(max=LOG_PROB_CLAMP).exp_().mul_(mask)
    products = [torch.linalg.vecdot(a, b) for a, b in ((p_t, p_t), (p_r, p_r), (p_t, p_r))]
    sum_t, sum_r = p_t.sum(-1), p_r.sum(-1)
    d = p_t.sub_(p_r)  # p_t is not needed after this
    del p_r
    d2 = torch.linalg.vecdot(d, d)
    d = d.abs_()
    rows = torch.stack([-lr.sum(-1), k3, chi2, abs_lr, d.sum(-1), d2, sum_t, sum_r, *products], dim=-1)
    return rows, d.amax(-1) if d.numel() else torch.zeros(d.shape[:-1], dtype=d.dtype, device=d.device)


def add_token_mismatch(stats: BatchStats, rows: Tensor, row_max_d: Tensor, use_row: Tensor) -> None:
    """Batch token sums of `token_mismatch_rows` over the sequences with `use_row` [B] (bool) true."""
    # a rejected sequence may hold inf/NaN: `where`, not a product, keeps it out
    zero = torch.zeros((), dtype=torch.float64, device=rows.device)
    stats.add_sums(TOKEN_SUMS, torch.where(use_row[:, None], rows.to(torch.float64), zero).sum(0))
    stats.add_max("tok_d_max", torch.where(use_row, row_max_d.to(torch.float64), zero).amax() if use_row.numel() else zero)


SEQ_SUMS = ("seq_train_log_ppl", "seq_rollout_log_ppl", "seq_train_ppl", "seq_rollout_ppl", "seq_log_ppl_diff",
            "seq_log_ppl_abs_diff", "seq_ppl_ratio", "seq_chi2")


def add_seq_mismatch(
    stats: BatchStats, seq_ok: Tensor, n: Tensor, s_lpt: Tensor, s_lpr: Tensor, s_lr: Tensor, cp0: float
) -> None:
    """Sequence-level sums from whole-sequence (CP-reduced) sums; counted on CP rank 0 only."""
    n = n.to(torch.float64).clamp_min(1)
    mt = s_lpt.to(torch.float64) / n
    mr = s_lpr.to(torch.float64) / n
    diff = mr - mt
    ppl_t, ppl_r, ppl_ratio = torch.stack([-mt, -mr, diff]).clamp(-PPL_EXP_CLAMP, PPL_EXP_CLAMP).exp().unbind()
    chi2 = (2.0 * s_lr.to(torch.float64).clamp(-20.0, 20.0)).exp() - 1.0
    columns = torch.stack([-mt, -mr, ppl_t, ppl_r, diff, diff.abs(), ppl_ratio, chi2], dim=-1)  # SEQ_SUMS order
    # a rejected sequence may hold inf/NaN: `where`, not a product, keeps it out
    columns = torch.where(seq_ok[:, None], columns, torch.zeros((), dtype=torch.float64, device=columns.device))
    stats.add_sums(SEQ_SUMS, cp0 * columns.sum(0))


def finalize_mismatch(r: dict[str, Tensor]) -> dict[str, Tensor]:
    n_tok, n_seq = r["n_tok"], r["n_seq"]
    tok = _ratios(r, TOKEN_SUMS, n_tok)
    seq = _ratios(r, SEQ_SUMS, n_seq)
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
    # scatter_add_ into a fixed size: faster than bincount on CPU, and traceable by torch.compile
    hist = torch.zeros(HIST_BINS + 1, dtype=torch.float64, device=w.device)
    hist.scatter_add_(0, idx.reshape(-1), unit.reshape(-1).to(torch.float64))
    stats.add_sum("w_hist", hist)


def histogram_quantiles(hist: Tensor, qs: tuple[float, ...]) -> Tensor:
    """The weights at quantiles `qs` from the log-space histogram (bin centers; 0 for the zero bin)."""
    cum = hist.cumsum(0)
    target = (torch.tensor(qs, dtype=cum.dtype, device=cum.device) - 1e-9) * cum[-1]
    i = torch.searchsorted(cum, target).clamp_max(hist.numel() - 1)
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
    quantiles = torch.minimum(torch.maximum(histogram_quantiles(r["w_hist"], tuple(QUANTILES.values())), wmin), wmax)
    out.update(zip((f"mis_weight_{name}" for name in QUANTILES), quantiles.unbind(), strict=True))
    if factor is not None:
        out = dict(zip(out, (torch.stack(list(out.values())) / factor).unbind(), strict=True))
        out["mis_batch_norm_factor"] = factor
    out["mis_ess"] = torch.where(uw2 > 0, uw**2 / (u * uw2).clamp_min(1e-300), zero)
    return out
