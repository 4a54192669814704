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
| mis_invalid_mask_count | loss-mask values outside {0, 1} or NaN (an error when read, `--warn-invalid-inputs`) |
| mis_positive_logprob_count / mis_nan_logprob_count | valid tokens with lp_train or lp_rollout > 1e-4 / NaN (same) |
With IS (`--use-tis`); a "unit" is a token (token level) or a sequence (sequence/geometric level, each once):
| mis_mean_is_weight_before_clip | mean of w_raw = exp(clamp(ℓ, ±20)) over finite valid units |
| mis_truncate_fraction | truncate mode: fraction of finite valid units with w_raw > U |
| mis_clip_fraction_low / _high | clip mode: fraction with w_raw < L / w_raw > U |
| mis_mask_fraction_low / _high | mask mode: fraction with w_raw < L / w_raw > U (weight 0) |
| mis_ratio_mean_after_mis | mean of the final weight (bounded, normalized) over contributing units |
| mis_weight_std / mis_weight_min / mis_weight_max | std and true min/max of the final weight over contributing units |
| mis_weight_p10 / _p50 / _p90 / _p99 | quantiles of the final weight: exact, by radix select (`quantiles.py`) |
| mis_ess | normalized effective sample size (Σw)² / (N·Σw²) over contributing units |
| mis_batch_norm_factor | the batch mean the weights were divided by (`--tis-batch-normalize`) |
With correction on (IS, RS or veto):
| mis_rs_rejected_token_fraction / _seq_fraction | finite valid tokens / sequences dropped by RS (sequences: all tokens) |
| mis_catastrophic_token_fraction / _seq_fraction | veto: tokens with lr < log C / sequences vetoed |
| mis_rejected_token_fraction / _seq_fraction | valid tokens / sequences dropped for any reason (RS, veto, non-finite) |
| mis_contributing_token_count | tokens left in the loss mask |
| mis_all_rejected | 1.0 when no token is left in the loss mask of the whole batch |
| mis_custom_nonfinite_weight_count | a custom weighting function's NaN/inf weights: tokens rejected for them |
| mis_custom_negative_weight_count | a custom weighting function's negative weights (an error when read) |
With divergence rejection (`--rs-metric k2|k3`, `divergence.py`) and budgets (`budget.py`):
| mis_div_rejected_token_fraction / _seq_fraction | finite valid tokens / sequences the divergence filter rejects |
| mis_rs_divergence_bound | `--rs-divergence-budget`: the step's bound (`StepBounds`; a call without one: its own, mean over calls) |
| mis_tis_ess_bound | `--tis-ess-target`: the step's truncation bound U (likewise) |
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import quantiles as Q
from slime_corr.correction.checks import check_host_metrics
from slime_corr.correction.reductions import BatchStats, count_greater_, row_products
from slime_corr.correction.segments import Segments
from slime_corr.correction.weights import LOG_RATIO_CLAMP

PPL_EXP_CLAMP = 80.0
LOG_PROB_CLAMP = 20.0
MAX_ABS_LOG_RATIO = 1e30  # |lr| above this (or non-finite) rejects the sequence
_NOT_COUNTED = 2.0**120  # what a weight that is not counted is raised by, for its minimum


EXTREMA = {"tok_d_max": torch.maximum, "w_max": torch.maximum, "w_min": torch.minimum}


def merge_stats(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The reduced statistics of a whole step from its micro-batches': sums add, extremes take the max/min, and the
    quantile sketch's refined histograms are added by bin id."""
    merged: dict[str, Tensor] = {}
    for stats in parts:
        for key, value in stats.items():
            if key in Q.REFINED or key in Q.REFINED.values():
                continue
            combine = EXTREMA.get(key, torch.add)
            merged[key] = value if key not in merged else combine(merged[key], value)
    for key, ids_key in Q.REFINED.items():
        with_key = [p for p in parts if key in p]
        if with_key:
            merged[key], merged[ids_key] = Q.merge(with_key, key)
    return merged


def metrics_to_host(metrics: dict[str, Tensor], config: RolloutCorrectionConfig | None = None) -> dict[str, float]:
    """All metrics to Python floats in ONE device->host transfer. The means over measured tokens of a batch that
    has none are left out (no value rather than 0). With `config` (the loss hook always passes it), the value checks
    of `check_host_metrics` run on the counts: impossible inputs and a custom function's bad weights raise
    `InputValueError` (inputs: a warning with `--warn-invalid-inputs`)."""
    if not metrics:
        return {}
    with torch.no_grad():
        values = torch.stack([v.reshape(()) for v in metrics.values()]).to(torch.float64).tolist()
    return check_host_metrics(dict(zip(metrics.keys(), values, strict=True)), config)


def _total(x: Tensor) -> Tensor:
    """Σ over [B, S] (or [B]): row sums in the input precision, then float64 across rows."""
    return (x.sum(-1) if x.dim() > 1 else x).to(torch.float64).sum()


def _div(num: Tensor, den: Tensor) -> Tensor:
    """num / den for float64 batch statistics; 0 / 0 = 0."""
    return num / den.clamp_min(1e-30)


def _ratios(r: dict[str, Tensor], keys: tuple[str, ...], den: Tensor) -> dict[str, Tensor]:
    """{key: r[key] / den} for several keys in three tensor ops."""
    return dict(zip(keys, _div(torch.stack([r[k] for k in keys]), den).unbind(), strict=True))


TOKEN_SUMS = ("tok_neg_lr", "tok_k3", "tok_chi2", "tok_abs_lr", "tok_d", "tok_d2", "tok_pt", "tok_pr", "tok_pt2",
              "tok_pr2", "tok_ptr")


class TokenPass(NamedTuple):
    """What one pass over the [B, S] tokens gives the core (`token_pass`)."""

    lr: Tensor  # lp_train - lp_rollout at valid tokens, 0 elsewhere; non-finite -> ±max (rejects the sequence)
    seq: Tensor  # [B, 4] per-sequence local sums: valid tokens, tokens with |lr| > 1e30, Σ lr, Σ lp_train
    rows: Tensor  # [B, len(TOKEN_SUMS)] float64 per-sequence sums of the token mismatch terms
    d_max: Tensor  # [B] max |p_train - p_rollout|


class _Stack:
    """k [B, S] columns stacked as [B, k, S]. Eager: the columns are written straight into the stack's slots
    (`out=`), so stacking copies nothing; under torch.compile they are plain tensors that `stack` joins (the
    compiler fuses that away)."""

    def __init__(self, like: Tensor, k: int) -> None:
        b, s = like.shape
        self.data = None if torch.compiler.is_compiling() else like.new_empty(b, k, s)
        self.slots = [None] * k if self.data is None else list(self.data.unbind(1))

    def stack(self, *columns: Tensor) -> Tensor:
        return torch.stack(columns, 1) if self.data is None else self.data


def token_pass(lp_train: Tensor, lp_rollout: Tensor, valid: Tensor, segments: Segments | None = None) -> TokenPass:
    """lr, the per-sequence sums the core needs and the token mismatch terms, for a float 0/1 `valid` mask;
    sequences are the rows, or the `segments` of a packed row.

    Terms (x = clamp(lr, ±20), p = exp(min(lp, 20)), 0 outside the mask): k3 = expm1(x) - x; chi2 = e(e + 2) with
    e = k3 + x (= exp(2x) - 1, no cancellation for small x); |lr|; d = |p_train - p_rollout|, d²; p, p², p_t·p_r.
    Rows: two stacked blocks [x, k3] and [p_t, p_r, d] whose row sums and row products (`row_products`: one
    batched matmul) give every sum at once: on CPU, passes over fresh memory cost more than the arithmetic.
    Packed: every term written out, then one index addition per stack (`_token_pass_terms`).
    """
    big = torch.finfo(lp_train.dtype).max
    lr = torch.sub(lp_train, lp_rollout).nan_to_num_(big, big, -big).mul_(valid)
    seg = segments or Segments.rows(*lr.shape)
    if torch.compiler.is_compiling() or seg.packed:
        return _token_pass_terms(lp_train, lp_rollout, valid, lr, seg)
    xk = _Stack(lr, 2)
    x = torch.clamp(lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP, out=xk.slots[0])
    k3 = torch.expm1(x, out=xk.slots[1]).sub_(x)
    p = _Stack(lr, 3)
    # NaN/inf outside the mask become 0 (x·0 = NaN there, then nan_to_num_); inside, the sequence is rejected anyway
    p_t = torch.mul(lp_train, valid, out=p.slots[0]).nan_to_num_(0.0, 0.0, 0.0)
    s_lpt = p_t.sum(-1)
    p_t = p_t.clamp_(max=LOG_PROB_CLAMP).exp_().mul_(valid)  # the clamp only bounds invalid log-probs
    p_r = torch.mul(lp_rollout, valid, out=p.slots[1]).nan_to_num_(0.0, 0.0, 0.0)
    p_r = p_r.clamp_(max=LOG_PROB_CLAMP).exp_().mul_(valid)
    d = torch.sub(p_t, p_r, out=p.slots[2]).abs_()
    d_max = seg.amax(d)
    p_block = p.stack(p_t, p_r, d)
    g_p, s_p = row_products(p_block).to(torch.float64), p_block.sum(-1).to(torch.float64)
    del p, p_block, p_t, p_r, d
    xk_block = xk.stack(x, k3)
    g_x, s_x = row_products(xk_block).to(torch.float64), xk_block.sum(-1).to(torch.float64)
    del xk, xk_block, x, k3
    abs_lr = lr.abs()
    s_abs = abs_lr.sum(-1)
    n_bad = count_greater_(abs_lr, MAX_ABS_LOG_RATIO)
    s_lr = lr.sum(-1)
    chi2 = g_x[:, 1, 1] + 2 * g_x[:, 0, 1] + g_x[:, 0, 0] + 2 * (s_x[:, 1] + s_x[:, 0])  # Σ (e² + 2e), e = k3 + x
    rows = torch.stack([-s_lr.to(torch.float64), s_x[:, 1], chi2, s_abs.to(torch.float64), s_p[:, 2], g_p[:, 2, 2],
                        s_p[:, 0], s_p[:, 1], g_p[:, 0, 0], g_p[:, 1, 1], g_p[:, 0, 1]], dim=-1)  # TOKEN_SUMS order
    seq = torch.stack([valid.sum(-1), n_bad.to(lr.dtype), s_lr, s_lpt], dim=-1)
    return TokenPass(lr, seq, rows, d_max)


def _token_pass_terms(lp_train: Tensor, lp_rollout: Tensor, valid: Tensor, lr: Tensor, seg: Segments) -> TokenPass:
    """`token_pass` with every term and its per-sequence sum written out: one loop as torch.compile fuses it
    best, and two index additions for a packed row."""
    keep = valid > 0
    x = lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    e = torch.expm1(x)
    p_t = torch.where(keep, lp_train.clamp(max=LOG_PROB_CLAMP).exp(), 0.0)
    p_r = torch.where(keep, lp_rollout.clamp(max=LOG_PROB_CLAMP).exp(), 0.0)
    d = (p_t - p_r).abs()
    abs_lr = lr.abs()
    terms = (-lr, e - x, e * (e + 2.0), abs_lr, d, d * d, p_t, p_r, p_t * p_t, p_r * p_r, p_t * p_r)
    seq_terms = (valid, (abs_lr > MAX_ABS_LOG_RATIO).to(lr.dtype), lr, torch.where(keep, lp_train, 0.0))
    rows = _sums(seg, terms).to(torch.float64)  # TOKEN_SUMS order
    return TokenPass(lr, _sums(seg, seq_terms), rows, seg.amax(d))


def _sums(seg: Segments, terms: tuple[Tensor, ...]) -> Tensor:
    """[n, k] per-sequence sums of k token terms: one index addition of their stack for a packed row."""
    if seg.packed:
        return seg.sum(torch.stack(terms, 1))
    return torch.stack([t.sum(-1) for t in terms], -1)


def add_token_mismatch(stats: BatchStats, rows: Tensor, row_max_d: Tensor, use_row: Tensor) -> None:
    """Batch token sums of `token_pass` over the sequences with `use_row` [B] (bool) true."""
    # a rejected sequence may hold inf/NaN: `where`, not a product, keeps it out
    zero = torch.zeros((), dtype=torch.float64, device=rows.device)
    stats.add_sums(TOKEN_SUMS, torch.where(use_row[:, None], rows, zero).sum(0))
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
    zero = torch.zeros_like(unit)
    add_raw_weight_sums(stats, _total(unit), _total(torch.linalg.vecdot(unit, w_raw)),
                        _total(torch.where(w_raw > upper, unit, zero)), _total(torch.where(w_raw < lower, unit, zero)))


def add_raw_weight_sums(stats: BatchStats, units: Tensor, weighted: Tensor, high: Tensor, low: Tensor) -> None:
    """Σ unit, Σ unit·w_raw, Σ unit·[w_raw > U], Σ unit·[w_raw < L] over the finite valid units."""
    stats.add_sums(("raw_u", "raw_uw", "raw_high", "raw_low"), torch.stack([units, weighted, high, low]))


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


def weight_stat_tensors(w: Tensor, counted: Tensor, unit: Tensor | None = None) -> tuple[Tensor, ...]:
    """Final (pre-normalization) weights `w` >= 0, zero where the float 0/1 `counted` is 0: (Σu, Σuw, Σuw² [3],
    true max, true min, the quantile sketch's level-1 keys). `unit`: the unit of each weight when it is not
    `counted` (1/n_i per token of a sequence, float64)."""
    if unit is None:  # w is 0 where not counted: Σ counted·w = Σ w
        sums = torch.stack([_total(counted), _total(w), _total(torch.linalg.vector_norm(w, dim=-1).square())])
    else:
        uw = unit * w
        sums = torch.stack([_total(unit), _total(uw), _total(uw * w)])
    if w.numel():
        # extremes over the counted weights: w -/+ (1 - counted)·2^120 in one fused pass each (no bool tensor;
        # w + 0 is exact); w >= 0 and 0 where not counted, so the maximum needs no shift unless units are given
        # (a custom function's w)
        off = torch.sub(counted, 1.0)
        w_max = w.amax() if unit is None else torch.add(w, off, alpha=_NOT_COUNTED).amax()
        w_min = torch.sub(w, off, alpha=_NOT_COUNTED).amin()
    else:
        w_max, w_min = w.new_full((), -math.inf), w.new_full((), math.inf)
    return sums, w_max, w_min, Q.level1_keys(w)


def add_weight_stats(stats: BatchStats, parts: tuple[Tensor, ...], unit: Tensor, binary: bool = False) -> Tensor:
    """Adds `weight_stat_tensors` output (and the level-1 histogram of its keys, weighted by `unit`) to `stats`;
    returns the level-1 keys for `quantiles.refine` (`binary`: units are 0/1, see `quantiles.level1_histogram`)."""
    sums, w_max, w_min, key = parts
    stats.add_sums(("w_u", "w_uw", "w_uw2"), sums)
    stats.add_max("w_max", w_max)
    stats.add_min("w_min", w_min)
    stats.add_sum(Q.LEVEL1_KEY, Q.level1_histogram(key, unit, binary))
    return key


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
    quantiles = torch.minimum(torch.maximum(Q.quantiles(r), wmin), wmax)
    out.update(zip((f"mis_weight_{name}" for name in Q.QUANTILES), quantiles.unbind(), strict=True))
    if factor is not None:
        out = dict(zip(out, (torch.stack(list(out.values())) / factor).unbind(), strict=True))
        out["mis_batch_norm_factor"] = factor
    out["mis_ess"] = torch.where(uw2 > 0, uw**2 / (u * uw2).clamp_min(1e-300), zero)
    return out
