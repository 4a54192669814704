"""`compute_rollout_correction`: IS weights, rejection, veto, batch normalization and metrics for one micro-batch.

Order of operations (SPEC.md):
1. lr = lp_train - lp_rollout on valid tokens; a sequence with a non-finite lr at a valid position is rejected.
2. Per-sequence sums (count, Σlr, Σlp_train, Σlp_rollout, veto and token-RS counts) in ONE CP all_reduce.
3. The weighting function ("default" = `weights.default_weights`, or `--custom-tis-function-path`) gives IS
   weights and the RS mask; the veto (`lr < log C` at any valid token) then rejects whole sequences.
4. All batch statistics (metric numerators/denominators, normalization mean, counts) in ONE SUM and ONE MAX
   all_reduce per group (CP, DP); batch normalization divides the weights by the mean over contributing units.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import metrics as M
from slime_corr.correction.reductions import (
    BatchStats,
    ProcessGroup,
    compute_dtype,
    cp_first,
    seq_sums,
    valid_mask,
)
from slime_corr.correction.types import CorrectionResult, WeightInputs
from slime_corr.correction.weights import (
    bound_weights,
    default_weights,
    in_log_bounds,
    raw_is_weights,
    rs_keep,
)
from slime_corr.registry import WEIGHT_FUNCTIONS

BATCH_NORM_MIN_MEAN = 1e-8
MAX_ABS_LOG_RATIO = 1e30
_WEIGHT_FN_CACHE: dict[str, Callable] = {}


def weight_function(config: RolloutCorrectionConfig) -> Callable:
    """The weighting function of `config` (the built-in "default" unless --custom-tis-function-path), cached."""
    path = config.custom_tis_function_path
    if not path:
        return default_weights
    if path not in _WEIGHT_FN_CACHE:
        _WEIGHT_FN_CACHE[path] = WEIGHT_FUNCTIONS.get(path, flag="--custom-tis-function-path")
    return _WEIGHT_FN_CACHE[path]


def _count(x: Tensor, cp0: float) -> Tensor:
    """Σ over sequences of a [B] per-sequence (CP-reduced) quantity, counted once across CP ranks."""
    return x.to(torch.float64).sum() * cp0


def compute_rollout_correction(
    log_probs: Tensor,
    rollout_log_probs: Tensor,
    loss_mask: Tensor,
    config: RolloutCorrectionConfig,
    *,
    cp_group: ProcessGroup = None,
    dp_group: ProcessGroup = None,
) -> CorrectionResult:
    """Weights, masks and metrics for [B, S] local slices.

    `log_probs` is lp_train (lp_old in decoupled mode, lp in bypass; detached here). `loss_mask` may be bool
    or float (valid = mask > 0). Without `config.use_rollout_correction` the weights are None and the mask is
    returned unchanged; metrics are computed when `config.computes_metrics`.
    """
    valid = valid_mask(loss_mask)
    if not config.computes_metrics:
        orig_mask = valid.to(torch.float32)
        return CorrectionResult(
            weights=None, loss_mask=orig_mask, denominator_mask=orig_mask, metrics={}, mask_bool=valid
        )
    correct = config.use_rollout_correction
    dtype = compute_dtype(log_probs, rollout_log_probs)
    lp_t = log_probs.detach().to(dtype)
    lp_r = rollout_log_probs.detach().to(dtype)
    zero = torch.zeros((), dtype=dtype, device=lp_t.device)

    diff = lp_t - lp_r
    # NaN/inf in either input or in the difference; |lr| >= 1e30 also counts (row sums must not overflow)
    ok_tok = valid & (diff.abs() < MAX_ABS_LOG_RATIO)
    lr = torch.where(ok_tok, diff, zero)
    columns = [valid, ok_tok, lr, torch.where(ok_tok, lp_t, zero), torch.where(ok_tok, lp_r, zero)]
    veto = correct and config.rs_veto_threshold is not None
    if veto:
        columns.append(ok_tok & (lr < math.log(config.rs_veto_threshold)))
    fn = weight_function(config) if correct else None
    is_default = fn is default_weights
    token_rs = is_default and config.use_rs and config.rs_level == "token"
    if token_rs:
        columns.append(ok_tok & in_log_bounds(lr, *config.rs_bounds))
    seq = seq_sums(columns, cp_group)  # the one CP collective for sequence sums

    n_orig, n_ok, s_lr, s_lpt, s_lpr = seq[:, :5].unbind(-1)
    # a non-finite token, or whole-sequence sums that overflowed
    seq_bad = (n_ok < n_orig) | ~(s_lr.isfinite() & s_lpt.isfinite() & s_lpr.isfinite())
    seq_ok = (n_orig > 0) & ~seq_bad
    n_seq = torch.where(seq_bad, torch.zeros_like(n_ok), n_ok)
    s_lr = torch.where(seq_bad, torch.zeros_like(s_lr), s_lr)
    mask_ok = ok_tok & ~seq_bad.unsqueeze(-1)
    lr = lr * (~seq_bad).unsqueeze(-1).to(dtype)  # lr is finite everywhere, so multiplying is safe

    cp0 = cp_first(cp_group)
    stats = BatchStats()
    stats.add_sum("n_tok", _count(n_seq, cp0))
    stats.add_sum("n_seq", _count(seq_ok, cp0))
    stats.add_sum("n_valid_tok", _count(n_orig, cp0))
    stats.add_sum("n_valid_seq", _count(n_orig > 0, cp0))
    stats.add_sum("n_bad_tok", _count(torch.where(seq_bad, n_orig - n_ok, torch.zeros_like(n_ok)), cp0))
    stats.add_sum("n_bad_seq", _count(seq_bad, cp0))
    M.add_token_mismatch(stats, lr, lp_t, lp_r, mask_ok)
    M.add_seq_mismatch(stats, seq_ok, n_seq, s_lpt, s_lpr, s_lr, cp0)

    weights: Tensor | None = None
    final = mask_ok
    n_final = n_seq
    fn_metrics: dict[str, Tensor] = {}
    if correct:
        inputs = WeightInputs(
            log_ratio=lr,
            loss_mask=mask_ok,
            seq_log_ratio_sum=s_lr,
            seq_token_count=n_seq,
            cp_group=cp_group,
            dp_group=dp_group,
        )
        out = fn(inputs, config)
        fn_metrics = dict(out.metrics)
        fn_mask = valid_mask(out.loss_mask) & mask_ok
        if is_default:  # whole-sequence counts of the RS mask follow from the sums already reduced
            n_fn = torch.where(seq_bad, torch.zeros_like(n_seq), seq[:, -1]) if token_rs else n_seq
            if config.use_rs and config.rs_level != "token":
                n_fn = torch.where(rs_keep(inputs, config).squeeze(-1), n_fn, torch.zeros_like(n_fn))
        else:  # a custom mask is arbitrary: one extra CP collective for its per-sequence counts
            n_fn = seq_sums([fn_mask], cp_group)[:, 0]
        final = fn_mask
        n_final = n_fn
        if veto:
            vetoed = seq[:, 5] > 0
            final = fn_mask & ~vetoed.unsqueeze(-1)
            n_final = torch.where(vetoed, torch.zeros_like(n_fn), n_fn)
            stats.add_sum("n_cat_tok", _count(torch.where(seq_ok, seq[:, 5], torch.zeros_like(n_fn)), cp0))
            stats.add_sum("n_cat_seq", _count(vetoed & seq_ok, cp0))
        stats.add_sum("n_fn_tok", _count(n_fn, cp0))
        stats.add_sum("n_fn_seq_rej", _count(seq_ok & (n_fn == 0), cp0))
        stats.add_sum("n_final_tok", _count(n_final, cp0))
        stats.add_sum("n_final_seq_rej", _count((n_orig > 0) & (n_final == 0), cp0))

        if out.weights is not None:
            w = out.weights.detach().to(dtype)
            final_w = final if is_default else final & w.isfinite()  # built-in weights are finite
            weights = torch.where(final_w, w, zero)
            lower, upper = config.tis_bounds
            if is_default and config.tis_level != "token":
                # constant along each sequence: statistics on [B], each sequence counted once
                w_raw = raw_is_weights(inputs, config).squeeze(-1)
                w_seq = bound_weights(w_raw, config.effective_tis_mode, lower, upper)
                M.add_weight_stats(stats, w_seq, (n_final > 0).to(dtype) * cp0, n_final > 0)
                M.add_raw_weight_stats(stats, w_raw, seq_ok.to(dtype) * cp0, lower, upper)
            else:
                unit = final_w.to(dtype)
                if config.tis_level != "token":
                    unit = unit / n_final.clamp_min(1).unsqueeze(-1)
                M.add_weight_stats(stats, weights, unit, final_w)
                if out.raw_weights is not None:
                    raw = torch.where(mask_ok, out.raw_weights.detach().to(dtype), zero)
                    unit0 = mask_ok.to(dtype)
                    if config.tis_level != "token":
                        unit0 = unit0 / n_seq.clamp_min(1).unsqueeze(-1)
                    M.add_raw_weight_stats(stats, raw, unit0, lower, upper)

    keep_den = not correct or config.rs_keep_loss_denominator
    loss_bool = final if correct else valid
    den_bool = valid if keep_den else final
    final_mask = loss_bool.to(torch.float32)
    den_mask = final_mask if den_bool is loss_bool else den_bool.to(torch.float32)
    n_den = n_orig if keep_den else n_final
    stats.add_sum("g_tok", _count(n_den, cp0))
    stats.add_sum("g_seq", _count(n_den > 0, cp0))

    r = stats.reduce(cp_group, dp_group)  # the one batch collective (SUM + MAX per group)

    metrics = M.finalize_mismatch(r)
    metrics["mis_valid_token_count"] = r["n_valid_tok"]
    metrics["mis_valid_seq_count"] = r["n_valid_seq"]
    metrics["mis_nonfinite_token_count"] = r["n_bad_tok"]
    metrics["mis_nonfinite_seq_count"] = r["n_bad_seq"]
    metrics["mis_nonfinite_seq_fraction"] = M._div(r["n_bad_seq"], r["n_valid_seq"])
    if correct:
        n_tok, n_seqs = r["n_tok"], r["n_seq"]
        metrics["mis_rs_rejected_token_fraction"] = M._div(n_tok - r["n_fn_tok"], n_tok)
        metrics["mis_rs_rejected_seq_fraction"] = M._div(r["n_fn_seq_rej"], n_seqs)
        if veto:
            metrics["mis_catastrophic_token_fraction"] = M._div(r["n_cat_tok"], n_tok)
            metrics["mis_catastrophic_seq_fraction"] = M._div(r["n_cat_seq"], n_seqs)
        metrics["mis_rejected_token_fraction"] = M._div(r["n_valid_tok"] - r["n_final_tok"], r["n_valid_tok"])
        metrics["mis_rejected_seq_fraction"] = M._div(r["n_final_seq_rej"], r["n_valid_seq"])
        metrics["mis_contributing_token_count"] = r["n_final_tok"]
        metrics["mis_all_rejected"] = (r["n_final_tok"] == 0).to(torch.float64)
        if "raw_u" in r:
            metrics.update(M.finalize_raw_weight(r, config.effective_tis_mode))
        if weights is not None:
            factor = None
            if config.tis_batch_normalize:
                mean = M._div(r["w_uw"], r["w_u"])
                factor = torch.where(mean > BATCH_NORM_MIN_MEAN, mean, torch.ones_like(mean))
                weights = weights / factor.to(dtype)
            metrics.update(M.finalize_weight(r, factor))
    metrics.update(fn_metrics)
    return CorrectionResult(
        weights=weights,
        loss_mask=final_mask,
        denominator_mask=den_mask,
        mask_bool=loss_bool,
        denominator_mask_bool=den_bool,
        metrics=metrics,
        seq_token_count=n_den,
        global_token_count=r["g_tok"],
        global_seq_count=r["g_seq"],
    )
