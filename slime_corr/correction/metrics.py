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

from slime_corr.config import KernelBackend, RolloutCorrectionConfig
from slime_corr.correction import quantiles
from slime_corr.correction.builtin_weights import LOG_RATIO_CLAMP
from slime_corr.correction.checks import check_host_metrics
from slime_corr.correction.reductions import count_greater_, device_constant, row_products, safe_divide
from slime_corr.correction.statistics import (
    SEQ_SUMS,
    TOKEN_SUMS,
    BatchStatistics,
    SequenceTermSums,
    TokenTermSums,
)
from slime_corr.kernel_fallback import KernelFallback
from slime_corr.layout.segments import Segments

PPL_EXP_CLAMP = 80.0
LOG_PROB_CLAMP = 20.0
MAX_ABS_LOG_RATIO = 1e30  # |lr| above this (or non-finite) rejects the sequence
_NOT_COUNTED = 2.0**120  # what a weight that is not counted is raised by, for its minimum


def metrics_to_host(metrics: dict[str, Tensor], config: RolloutCorrectionConfig | None = None) -> dict[str, float]:
    """All metrics to Python floats in ONE device->host transfer. The means over measured tokens of a batch that
    has none are left out (no value rather than 0). With `config` (the loss hook always passes it), the value checks
    of `check_host_metrics` run on the counts: impossible inputs and a custom function's bad weights raise
    `InputValueError` (inputs: a warning with `--warn-invalid-inputs`)."""
    if not metrics:
        return {}
    with torch.no_grad():
        scalars = [v.reshape(()) if v.dim() else v for v in metrics.values()]  # most are 0-dim already: no op
        if any(v.dtype != torch.float64 for v in scalars):  # a stack that converts dtypes copies input by input
            scalars = [v.to(torch.float64) for v in scalars]
        values = torch.stack(scalars).tolist()
    return check_host_metrics(dict(zip(metrics.keys(), values, strict=True)), config)


# per-sequence local sums of the token pass (the first columns of the core's `seq_sums`), in this order
LOCAL = ("valid_token_count", "log_ratio_sum", "train_log_prob_sum", "nonfinite_token_count")


class TokenPass(NamedTuple):
    """What one pass over the [B, S] tokens gives the core (`token_pass`)."""

    lr: Tensor  # lp_train - lp_rollout at valid tokens, 0 elsewhere; non-finite -> ±max (rejects the sequence)
    seq: Tensor  # [n, 4] per-sequence local sums (`LOCAL`): valid tokens, Σ lr, Σ lp_train, tokens with |lr| > 1e30
    rows: Tensor  # [n, len(TOKEN_SUMS)] float64 per-sequence sums of the token mismatch terms (`TokenTermSums`)
    d_max: Tensor  # [n] max |p_train - p_rollout|


_RAW = 16  # columns of the eager pass: Σ [x, k3, lr, |lr|], Σ [p_t, p_r, d], [x, k3] x [x, k3], [p_t, p_r]^2, d²
_RAW_TO_SUMS = ((2, 0, -1), (1, 1, 1), (7, 2, 1), (8, 2, 2), (10, 2, 1), (1, 2, 2), (0, 2, 2), (3, 3, 1), (6, 4, 1),
                (4, 5, 1), (5, 6, 1), (15, 7, 1), (11, 8, 1), (14, 9, 1), (12, 10, 1))  # (raw, TOKEN_SUMS, coefficient)


def _raw_to_sums(device: torch.device) -> Tensor:
    """[_RAW, 11] float64: the eager pass's raw sums -> `TokenTermSums` (chi2 = Σ e² + 2e with e = k3 + x)."""
    m = [[0.0] * len(TOKEN_SUMS) for _ in range(_RAW)]
    for raw, col, coef in _RAW_TO_SUMS:
        m[raw][col] = float(coef)
    return torch.tensor(m, dtype=torch.float64, device=device)


TRITON = KernelFallback("--rollout-correction-backend triton")  # the token-pass kernel's state in this process


def token_pass(lp_train: Tensor, lp_rollout: Tensor, valid: Tensor, segments: Segments | None = None,
               backend: KernelBackend = "torch") -> TokenPass:
    """lr, the per-sequence sums the core needs and the token mismatch terms, for a float 0/1 `valid` mask;
    sequences are the rows, or the `segments` of a packed row. `backend` "triton": the same pass as one kernel
    (`token_pass_triton`) for padded float32 rows outside torch.compile; elsewhere, or once it failed, eager.

    Terms (x = clamp(lr, ±20), p = exp(min(lp, 20)), 0 outside the mask): k3 = expm1(x) - x; chi2 = e(e + 2) with
    e = k3 + x (= exp(2x) - 1, no cancellation for small x); |lr|; d = |p_train - p_rollout|, d²; p, p², p_t·p_r.
    Eager rows: two stacked blocks [x, k3, |lr|] and [p_t, p_r, d], written in place, whose row sums and row
    products (`row_products`: batched matmuls) give every sum at once: on CPU, passes over fresh memory cost more
    than the arithmetic, on an accelerator every op is a launch. Packed or compiled: every term written out
    (`_token_pass_terms`).
    """
    if backend == "triton" and TRITON.usable and (segments is None or not segments.packed) \
            and valid.dtype == torch.float32 and not torch.compiler.is_compiling():
        try:
            return _token_pass_kernel(lp_train, lp_rollout, valid)
        except Exception as error:  # noqa: BLE001 - compile or launch failures of any kind: the eager pass
            TRITON.failed(error)
    big = torch.finfo(lp_train.dtype).max
    lr = torch.sub(lp_train, lp_rollout).nan_to_num_(big, big, -big).mul_(valid)
    seg = segments or Segments.rows(*valid.shape)
    if torch.compiler.is_compiling() or seg.packed:
        return _token_pass_terms(lp_train, lp_rollout, valid, lr, seg)
    b, s = valid.shape
    s_lr = lr.sum(-1)
    xk = valid.new_empty(b, 3, s)  # x, k3, |lr|
    x = torch.clamp(lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP, out=xk[:, 0])
    torch.expm1(x, out=xk[:, 1]).sub_(x)
    torch.abs(lr, out=xk[:, 2])
    s_xk, g_x = xk.sum(-1), row_products(xk[:, :2])
    n_bad = count_greater_(xk[:, 2], MAX_ABS_LOG_RATIO)  # overwrites |lr|
    del xk, x  # freed before the next block
    p = valid.new_empty(b, 3, s)  # p_t, p_r, d
    # NaN/inf outside the mask become 0 (x·0 = NaN there, then nan_to_num_); inside, the sequence is rejected anyway
    torch.mul(lp_train, valid, out=p[:, 0])
    torch.mul(lp_rollout, valid, out=p[:, 1])
    s_lpt = p[:, :2].nan_to_num_(0.0, 0.0, 0.0)[:, 0].sum(-1)
    p[:, :2].clamp_(max=LOG_PROB_CLAMP).exp_().mul_(valid[:, None])  # the clamp only bounds invalid log-probs
    d_max = seg.amax(torch.sub(p[:, 0], p[:, 1], out=p[:, 2]).abs_())
    products = (g_x.view(b, 4), row_products(p[:, :2]).view(b, 4), row_products(p[:, 2:]).view(b, 1))  # d² alone
    raw = torch.cat([s_xk[:, :2], s_lr[:, None], s_xk[:, 2:], p.sum(-1), *products], -1)
    rows = raw.to(torch.float64) @ device_constant("raw_to_sums", raw.device, _raw_to_sums)
    seq = torch.stack([valid.sum(-1), s_lr, s_lpt, n_bad], dim=-1)
    return TokenPass(lr, seq, rows, d_max)


def _token_pass_kernel(lp_train: Tensor, lp_rollout: Tensor, valid: Tensor) -> TokenPass:
    """`token_pass` by the Triton kernel: one launch for lr and every per-sequence sum."""
    from slime_corr.correction import token_pass_triton  # lazily: triton is optional

    lr, sums = token_pass_triton.token_pass_sums(lp_train, lp_rollout, valid, log_ratio_clamp=LOG_RATIO_CLAMP,
                                                 log_prob_clamp=LOG_PROB_CLAMP, max_abs_log_ratio=MAX_ABS_LOG_RATIO)
    local = len(LOCAL)
    return TokenPass(lr, sums[:, :local], sums[:, local:local + len(TOKEN_SUMS)].to(torch.float64), sums[:, -1])


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
    terms = (-lr, e - x, e * (e + 2.0), abs_lr, d, p_t, p_r, d * d, p_t * p_t, p_r * p_r, p_t * p_r)
    seq_terms = (valid, lr, torch.where(keep, lp_train, 0.0), (abs_lr > MAX_ABS_LOG_RATIO).to(lr.dtype))
    rows = _sums(seg, terms).to(torch.float64)  # TOKEN_SUMS order
    return TokenPass(lr, _sums(seg, seq_terms), rows, seg.amax(d))


def _sums(seg: Segments, terms: tuple[Tensor, ...]) -> Tensor:
    """[n, k] per-sequence sums of k token terms: one index addition of their stack for a packed row."""
    if seg.packed:
        return seg.sum(torch.stack(terms, 1))
    return torch.stack([t.sum(-1) for t in terms], -1)


def _seq_constants(device: torch.device) -> Tensor:
    """[5, 4]: rows 0-2 map [Σlr, Σlp_train, Σlp_rollout] -> [-Σlp_t, -Σlp_r, Σlp_r - Σlp_t, 2·Σlr]; rows 3-4 are
    the lower and upper clamps of their exponents."""
    hi = [PPL_EXP_CLAMP] * 3 + [2 * LOG_RATIO_CLAMP]
    return torch.tensor([[0.0, 0.0, 0.0, 2.0], [-1.0, 0.0, -1.0, 0.0], [0.0, -1.0, 1.0, 0.0], [-v for v in hi], hi],
                        dtype=torch.float64, device=device)


def seq_terms(n: Tensor, sums: Tensor) -> Tensor:
    """[n, 8] float64 per-sequence terms of `SequenceTermSums` from the whole-sequence (CP-reduced) valid-token count `n`
    [n] and the sums [Σlr, Σlp_train, Σlp_rollout] [n, 3]: with m = Σlp / n, -m_t, -m_r, m_r - m_t, |m_r - m_t|,
    exp(-m_t), exp(-m_r), exp(m_r - m_t) (exponents clamped to ±80) and exp(2·clamp(Σlr, ±20)) - 1."""
    m, lo, hi = device_constant("seq_terms", sums.device, _seq_constants).split([3, 1, 1])
    e = sums @ m
    e[:, :3].div_(n.clamp_min(1)[:, None])
    p = e.clamp(lo, hi).exp_()
    p[:, 3].sub_(1.0)
    return torch.cat([e[:, :3], e[:, 2:3].abs(), p], -1)


def mismatch_metrics(r: BatchStatistics, names: list[str], nums: list[Tensor], dens: list[Tensor]
                     ) -> dict[str, Tensor]:
    """The mismatch metrics of reduced statistics `r`, and every other ratio metric asked for in (`names`, `nums`,
    `dens`), divided in one go."""
    num = torch.stack([*r.token_terms(), *r.sequence_terms(), *nums])
    den = torch.stack([r.finite_token_count] * len(TOKEN_SUMS) + [r.finite_seq_count] * len(SEQ_SUMS) + dens)
    means = safe_divide(num, den)
    values = means.unbind()
    tok = TokenTermSums(*values[:len(TOKEN_SUMS)])  # their means
    seq = SequenceTermSums(*values[len(TOKEN_SUMS):len(TOKEN_SUMS) + len(SEQ_SUMS)])
    first, second = means[4:7], means[7:10]  # [d, p_t, p_r] and their second moments
    sd = torch.addcmul(second, first, first, value=-1.0).clamp_min_(0).sqrt_().unbind()
    cov = tok.train_rollout_prob_product - tok.train_prob * tok.rollout_prob
    denom = sd[1] * sd[2]
    pearson = (cov / denom).masked_fill_(denom <= 1e-20, 0.0).clamp_(-1, 1)
    out = {
        "mismatch_kl": tok.negative_log_ratio,
        "mismatch_k3_kl": tok.k3,
        "mismatch_training_log_ppl": seq.train_log_ppl,
        "mismatch_rollout_log_ppl": seq.rollout_log_ppl,
        "mismatch_training_ppl": seq.train_ppl,
        "mismatch_rollout_ppl": seq.rollout_ppl,
        "mismatch_log_ppl_diff": seq.log_ppl_diff,
        "mismatch_log_ppl_abs_diff": seq.log_ppl_abs_diff,
        "mismatch_ppl_ratio": seq.ppl_ratio,
        "mismatch_chi2_token": tok.chi2_token,
        "mismatch_chi2_seq": seq.chi2_seq,
        "train_rollout_logprob_abs_diff": tok.abs_log_ratio,
        "rollout_probs_diff_max": r.prob_diff_max,  # 0 without a measured token (every row's maximum is 0)
        "rollout_probs_diff_mean": tok.prob_diff,
        "rollout_probs_diff_std": sd[0],
        "rollout_actor_probs_pearson_corr": pearson,
    }
    out.update(zip(names, values[len(TOKEN_SUMS) + len(SEQ_SUMS):], strict=True))
    return out


def raw_weight_columns(w_raw: Tensor, unit: Tensor, lower: float, upper: float) -> Tensor:
    """[n, 4] per-row `RawWeightSums` of raw weights `w_raw` [n, S] with units `unit` (a custom function's; the built-in
    ones count theirs in the core); the caller sums the rows."""
    cols = (unit, unit * w_raw, (w_raw > upper) * unit, (w_raw < lower) * unit)
    return torch.stack([c.sum(-1) for c in cols], -1)


def raw_metrics(r: BatchStatistics, mode: str) -> list[tuple[str, Tensor]]:
    """(metric, numerator) of the raw-weight ratios over `raw_weight_units` for `mode`."""
    out = [("mis_mean_is_weight_before_clip", r.raw_weight_sum)]
    if mode == "truncate":
        out.append(("mis_truncate_fraction", r.raw_above_upper))
    elif mode in ("clip", "mask"):
        out += [(f"mis_{mode}_fraction_low", r.raw_below_lower), (f"mis_{mode}_fraction_high", r.raw_above_upper)]
    return out


def weight_sums(w: Tensor, unit: Tensor) -> Tensor:
    """[n, 3] per-row Σu, Σu·w, Σu·w² of weights `w` [n, S] with units `unit` (float64 for other than 0/1)."""
    uw = unit * w
    return torch.stack([unit.sum(-1), uw.sum(-1), (uw * w).sum(-1)], -1)


def weight_extremes(w: Tensor, counted: Tensor, shifted_max: bool = False) -> tuple[Tensor, Tensor]:
    """True max and min of the weights `w` >= 0 where the float 0/1 `counted` is 1 (w is 0 elsewhere): w -/+
    (1 - counted)·2^120 in one fused pass each (no bool tensor; w + 0 is exact). `shifted_max`: `w` may be nonzero
    where not counted (a custom function's weights)."""
    if not w.numel():
        return w.new_full((), -math.inf), w.new_full((), math.inf)
    off = torch.sub(counted, 1.0)
    w_max = torch.add(w, off, alpha=_NOT_COUNTED).amax() if shifted_max else w.amax()
    return w_max, torch.sub(w, off, alpha=_NOT_COUNTED).amin()


def weight_metrics(r: BatchStatistics, mean: Tensor, mean2: Tensor, factor: Tensor | None) -> dict[str, Tensor]:
    """Stats of the final weights from the reduced statistics `r`, their mean Σuw/Σu and second moment `mean2`
    Σuw²/Σu; `factor` (batch-normalization divisor) rescales all but the ESS."""
    msq = mean * mean
    w_min, w_max = torch.stack([r.weight_min, r.weight_max]).masked_fill_(r.weight_units <= 0, 0.0).unbind()
    q = torch.clamp(quantiles.quantiles(r.weight_sketch), w_min, w_max)
    values = torch.stack([mean, (mean2 - msq).clamp_min(0).sqrt(), w_min, w_max, *q.unbind()])
    if factor is not None:
        values = values / factor
    names = ["mis_ratio_mean_after_mis", "mis_weight_std", "mis_weight_min", "mis_weight_max"] + [
        f"mis_weight_{name}" for name in quantiles.QUANTILES]
    out = dict(zip(names, values.unbind(), strict=True))
    if factor is not None:
        out["mis_batch_norm_factor"] = factor
    out["mis_ess"] = msq / mean2.clamp_min(1e-300)  # 0 without a weight (mean 0)
    return out
