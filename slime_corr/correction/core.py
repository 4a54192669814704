"""`compute_rollout_correction`: IS weights, rejection, veto, batch normalization and metrics for one micro-batch.

Order of operations (docs/theory.md, docs/metrics.md):
1. lr = lp_train - lp_rollout on valid tokens; a sequence with a non-finite lr at a valid position is rejected.
2. Per-sequence sums (count, Σlr, Σlp_train, veto and token-RS counts) in ONE CP all_reduce. A sequence is a row
   of the [B, S] inputs, or a segment of a packed [1, T] row (`segments.py`): every per-sequence sum, maximum and
   broadcast goes through a `Segments`, the rest is per token and layout-free.
3. The weighting function ("default" = `weights.default_weights`, or `--custom-tis-function-path`) gives IS
   weights and the RS mask; the veto (`lr < log C` at any valid token) then rejects whole sequences.
4. All batch statistics (metric numerators/denominators, normalization mean, counts) in ONE SUM and ONE MAX
   all_reduce per group (CP, DP); batch normalization divides the weights by the mean over contributing units.
   With IS weights, the exact weight quantiles take two more small SUMs (`quantiles.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import budget as BG
from slime_corr.correction import divergence as D
from slime_corr.correction import metrics as M
from slime_corr.correction import quantiles as Q
from slime_corr.correction.checks import (
    CUSTOM_NEGATIVE,
    CUSTOM_NONFINITE,
    INPUT_VALUE_COUNTS,
    check_correction_inputs,
    check_weight_outputs,
    custom_weight_counts,
    input_value_counts,
)
from slime_corr.correction.reductions import (
    BatchStats,
    ProcessGroup,
    active_groups,
    compute_dtype,
    count_greater_,
    cp_first,
    group_size,
    seq_sums,
    valid_float,
)
from slime_corr.correction.reporting import OPTIONAL_RATIOS
from slime_corr.correction.segments import Segments
from slime_corr.correction.types import CorrectionResult, WeightInputs
from slime_corr.correction.weights import (
    LOG_RATIO_CLAMP,
    default_weight_parts,
    default_weights,
    in_log_bounds,
    rs_keep,
)
from slime_corr.registry import WEIGHT_FUNCTIONS

BATCH_NORM_MIN_MEAN = 1e-8
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
    """Σ over sequences (dim 0) of a [B] or [B, k] per-sequence (CP-reduced) quantity, counted once across CP
    ranks."""
    return x.to(torch.float64).sum(0) * cp0


def _zero_where(cond: Tensor, x: Tensor) -> Tensor:
    return torch.where(cond, torch.zeros_like(x), x)


def maybe_compiled(fn: Callable, config: RolloutCorrectionConfig) -> Callable:
    """`fn` itself, or its torch.compile'd form with `--rollout-correction-compile` (compiled once per function)."""
    return _compiled(fn) if config.rollout_correction_compile else fn


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=None)


def _token_stage(log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor, dtype: torch.dtype,
                 veto_log: float | None, rs_bounds: tuple[float, float] | None, seg: Segments) -> tuple[Tensor, ...]:
    """The per-token work before the sequence sums: (valid mask, lr, per-sequence local sums [n, k], token
    mismatch rows, per-sequence max |p_t - p_r|, token-RS keep mask or None). Columns of the sums: valid tokens,
    non-finite tokens, Σlr, Σlp_train, then the veto count (lr < log C) and the token-RS kept count if asked."""
    valid = valid_float(loss_mask, dtype)  # float 0/1; in good sequences also the mask of finite tokens
    tok = M.token_pass(log_probs.detach().to(dtype), rollout_log_probs.detach().to(dtype), valid, seg)
    columns = [tok.seq]
    if veto_log is not None:  # lr < log C, as -lr > -log C (lr is 0 outside the mask and log C < 0)
        columns.append(count_greater_(tok.lr.neg(), -veto_log, seg)[:, None])
    keep_tok = None
    if rs_bounds is not None:
        keep_tok = in_log_bounds(tok.lr, *rs_bounds).mul_(valid)
        columns.append(seg.sum(keep_tok)[:, None])
    return valid, tok.lr, torch.cat(columns, -1), tok.rows, tok.d_max, keep_tok


def _token_is_stage(inputs: WeightInputs, config: RolloutCorrectionConfig, tok_f: Tensor, row_f: Tensor,
                    n_valid: Tensor, seg: Segments) -> tuple[Tensor, ...]:
    """Built-in token-level IS after rejection: (final mask, weights (0 outside it), raw-weight sums per sequence
    [n, 4], then `weight_stat_tensors`). Raw weights are counted over the valid tokens (the caller keeps good
    sequences; `n_valid`: the local valid-token count per sequence, from the token stage)."""
    w, w_raw, _ = default_weight_parts(inputs, config, rs=False)
    raw_rows = _token_raw_rows(w_raw, n_valid, config, seg)
    final_f = tok_f * row_f
    weights = w.mul_(final_f)
    return (final_f, weights, raw_rows, *M.weight_stat_tensors(weights, final_f))


def _token_raw_rows(w_raw: Tensor, n: Tensor, config: RolloutCorrectionConfig, seg: Segments) -> Tensor:
    """Per-sequence [valid tokens (`n`, given), Σ w_raw, # w_raw > U, # w_raw < L] of built-in token-level IS;
    `w_raw` is 0 outside the mask (so never above U, and counted below L: those are subtracted). Destroys
    `w_raw`."""
    lower, upper = config.tis_bounds
    s_raw = seg.sum(w_raw)
    if config.effective_tis_mode == "truncate":
        low = torch.zeros_like(s_raw)
    else:
        low = count_greater_(torch.sub(lower, w_raw), 0.0, seg) - (seg.sizes() - n)
    high = count_greater_(w_raw, upper, seg)
    return torch.stack([n, s_raw, high, low], -1)


def compute_rollout_correction(
    log_probs: Tensor,
    rollout_log_probs: Tensor,
    loss_mask: Tensor,
    config: RolloutCorrectionConfig,
    *,
    cp_group: ProcessGroup = None,
    dp_group: ProcessGroup = None,
    batch_norm_mean: Tensor | None = None,
    normalize: bool = True,
    finalize_metrics: bool = True,
    segments: Segments | None = None,
    step_bounds: BG.StepBounds | None = None,
) -> CorrectionResult:
    """Weights, masks and metrics for [B, S] local slices (one sequence per row), or for one packed row [1, T]
    whose sequences `segments` gives (`Segments.packed_row`; per-sequence results are then [n]).

    `log_probs` is lp_train (lp_old in decoupled mode, lp in bypass; detached here). `loss_mask` may be bool
    or float (valid = mask > 0). Without `config.use_rollout_correction` the weights are None and the mask is
    returned unchanged; metrics are computed when `config.computes_metrics`.
    `batch_norm_mean`: with `--tis-batch-normalize`, the mean to divide the weights by; default this call's own
    batch mean. A step of several micro-batches passes the step's mean (`weight_mean(merge_stats(...))` of a
    pre-pass), so the normalization is over the whole step as docs/theory.md describes.
    `normalize=False` leaves the weights unnormalized (a pre-pass that `normalize_weights` finishes once the step's
    mean is known, so the training pass need not redo the correction); `finalize_metrics=False` skips the metrics
    (`.metrics` is empty; `.stats` is complete) for callers that finalize a step's merged statistics once.
    `step_bounds`: with `--rs-divergence-budget` / `--tis-ess-target`, the bounds of the call's optimizer step
    (`budget.StepBounds`: a collecting pass over the step's micro-batches, then each uses the step's bound); None:
    the bound of this call's own statistics.
    With `--rollout-correction-compile` the per-token stages run torch.compile'd (same results).
    """
    check_correction_inputs(log_probs, rollout_log_probs, loss_mask, config, batch_norm_mean, cp_group, dp_group,
                            segments)
    if not config.computes_metrics:
        orig_mask = valid_float(loss_mask, torch.float32)
        return CorrectionResult(weights=None, loss_mask=orig_mask, denominator_mask=orig_mask, metrics={})
    correct = config.use_rollout_correction
    dtype = compute_dtype(log_probs, rollout_log_probs)
    veto = correct and config.rs_veto_threshold is not None
    fn = weight_function(config) if correct else None
    is_default = fn is default_weights
    token_rs = is_default and config.use_rs and config.rs_level == "token"
    seg = segments or Segments.rows(*log_probs.shape)
    valid, lr, local, tok_rows, tok_d_max, keep_tok = maybe_compiled(_token_stage, config)(
        log_probs, rollout_log_probs, loss_mask, dtype, math.log(config.rs_veto_threshold) if veto else None,
        config.rs_bounds if token_rs else None, seg)
    groups = active_groups(cp_group, dp_group)
    k0 = local.shape[-1]  # the divergence filter's columns follow
    div = D.token_stage(lr, valid, keep_tok, config, seg, groups, step_bounds) if correct and \
        config.rejects_divergence else None
    if div is not None:
        local = torch.cat([local, div.columns.to(local.dtype)], -1)
    seq = seq_sums(list(local.unbind(-1)), cp_group)  # the one CP collective for sequence sums

    n_orig, n_bad, s_lr, s_lpt = seq[:, :4].unbind(-1)
    s_lpr = s_lpt - s_lr
    n_ok = n_orig - n_bad
    # a non-finite token, or whole-sequence sums that overflowed
    seq_bad = (n_bad > 0) | ~(s_lr.isfinite() & s_lpt.isfinite() & s_lpr.isfinite())
    seq_ok = (n_orig > 0) & ~seq_bad
    good = (~seq_bad).to(dtype)  # [n]
    n_seq = _zero_where(seq_bad, n_ok)
    s_lr = _zero_where(seq_bad, s_lr)

    cp0 = cp_first(cp_group)
    stats = BatchStats()
    counts = torch.stack([n_seq, seq_ok, n_orig, n_orig > 0, torch.where(seq_bad, n_bad, torch.zeros_like(n_bad)),
                          seq_bad], dim=-1)
    stats.add_sums(("n_tok", "n_seq", "n_valid_tok", "n_valid_seq", "n_bad_tok", "n_bad_seq"), _count(counts, cp0))
    stats.add_sums(tuple(INPUT_VALUE_COUNTS), input_value_counts(log_probs, rollout_log_probs, loss_mask, valid))
    M.add_token_mismatch(stats, tok_rows, tok_d_max, ~seq_bad)
    M.add_seq_mismatch(stats, seq_ok, n_seq, s_lpt, s_lpr, s_lr, cp0)

    weights: Tensor | None = None
    final_f = valid  # float 0/1 mask after rejection and veto
    n_final = n_seq
    w_seq: Tensor | None = None  # built-in sequence/geometric IS: the bounded weight of each sequence [B]
    sketch: tuple[Tensor, Tensor, Tensor, bool] | None = None  # (weights, level-1 keys, units, 0/1 units): `Q.refine`
    fn_metrics: dict[str, Tensor] = {}
    step_counts: dict[str, Tensor] = {}  # [n] per-sequence counts, summed into batch statistics at once below
    if correct:
        tok_f, row_f = valid, good  # token keep, [n] sequence keep (non-finite, RS, veto)
        if is_default and config.tis_ess_target is not None:  # this call's U from the ESS target (one SUM)
            ess_unit = valid * seg.expand(good) if config.tis_level == "token" else seq_ok.to(dtype) * cp0
            ess_in = WeightInputs(log_ratio=lr, loss_mask=valid, seq_log_ratio_sum=s_lr, seq_token_count=n_seq)
            u_bound = BG.ess_target_bound(ess_in, config, ess_unit, groups, step_bounds)
            _add_call_value(stats, "tis_bound", u_bound, groups)
            config = config.replace(tis_upper_bound=float(u_bound), tis_ess_target=None)  # one device->host read
        lower, upper = config.tis_bounds
        token_is = False
        if is_default:
            # built-in weights at the shapes of their level ([B, 1] for sequence/geometric): no [B, S] copies of
            # per-sequence quantities; the token-RS decision was made before the sequence sums, to count it there
            inputs = WeightInputs(log_ratio=lr, loss_mask=valid, seq_log_ratio_sum=s_lr, seq_token_count=n_seq,
                                  cp_group=cp_group, dp_group=dp_group)
            token_is = config.use_tis and config.tis_level == "token"
            if config.use_tis and not token_is:
                w_out, raw_out, _ = default_weight_parts(inputs, config, rs=False)
                w_seq = w_out.squeeze(-1)
                M.add_raw_weight_stats(stats, raw_out.squeeze(-1), seq_ok.to(dtype) * cp0, lower, upper)
            n_fn = _zero_where(seq_bad, seq[:, k0 - 1]) if token_rs else n_seq
            if token_rs:
                tok_f = keep_tok
            elif config.use_rs:
                keep = rs_keep(inputs, config).squeeze(-1)
                row_f = row_f * keep
                n_fn = n_fn * keep
            if div is not None and div.keep is not None:  # token-level divergence filter (and token RS)
                tok_f = div.keep
                n_fn = _zero_where(seq_bad, seq[:, k0 + 1]) * (n_fn > 0)
        else:  # a custom mask is arbitrary: one extra CP collective for its per-sequence counts
            tok_f, weights, n_fn = _custom(fn, stats, fn_metrics, lr, valid if div is None or div.keep is None
                                           else div.keep, good, s_lr, n_seq, seg, cp_group, dp_group, config, dtype)
        if div is not None:
            row_f, n_fn = _divergence_rows(div, seq[:, k0:], n_seq, seq_ok, row_f, n_fn, config, cp0, groups, stats,
                                           step_counts, step_bounds)
        n_final = n_fn
        if veto:
            vetoed = seq[:, 4] > 0
            row_f = row_f * (~vetoed).to(dtype)
            n_final = _zero_where(vetoed, n_fn)
            step_counts.update(n_cat_tok=torch.where(seq_ok, seq[:, 4], torch.zeros_like(n_fn)),
                               n_cat_seq=vetoed & seq_ok)
        step_counts.update(n_fn_tok=n_fn, n_fn_seq_rej=seq_ok & (n_fn == 0), n_final_tok=n_final,
                           n_final_seq_rej=(n_orig > 0) & (n_final == 0))
        if token_is:  # the per-token weights, their statistics and the sketch's first digit in one stage
            final_f, weights, raw_rows, *parts = maybe_compiled(_token_is_stage, config)(
                inputs, config, tok_f, seg.expand(row_f), local[:, 0], seg)
            zero = torch.zeros((), dtype=torch.float64, device=raw_rows.device)
            M.add_raw_weight_sums(stats, *torch.where(seq_bad[:, None], zero, raw_rows.to(torch.float64)).sum(0).unbind())
            sketch = (weights, M.add_weight_stats(stats, parts, final_f, binary=True), final_f, True)
        else:
            final_f = tok_f * seg.expand(row_f)
        if w_seq is not None:  # constant along each sequence: statistics on [B], each sequence counted once
            counted = (n_final > 0).to(dtype) * cp0
            w_counted = w_seq * counted
            parts = M.weight_stat_tensors(w_counted, counted)
            sketch = (w_counted, M.add_weight_stats(stats, parts, counted, binary=True), counted, True)
        elif weights is not None and not is_default:
            weights = torch.where(final_f > 0, weights, final_f.new_zeros(()))  # its NaN stays out
            unit = final_f.double()
            if config.tis_level != "token":
                unit = unit / seg.expand(n_final.clamp_min(1).double(), fill=1.0)
            sketch = (weights, M.add_weight_stats(stats, M.weight_stat_tensors(weights, final_f, unit), unit), unit,
                      False)

    keep_den = not correct or config.rs_keep_loss_denominator
    final_mask = final_f.to(torch.float32)
    den_mask = valid.to(torch.float32) if keep_den else final_mask
    n_den = n_orig if keep_den else n_final
    step_counts.update(g_tok=n_den, g_seq=n_den > 0)
    stats.add_sums(tuple(step_counts), _count(torch.stack([c.to(dtype) for c in step_counts.values()], -1), cp0))

    r = stats.reduce(cp_group, dp_group)  # the one batch collective (SUM + MAX per group)
    if sketch is not None:  # two more small SUMs: the exact quantiles
        r.update(Q.refine(*sketch[:3], r[Q.LEVEL1_KEY], active_groups(cp_group, dp_group), binary=sketch[3]))

    divisor = None
    if "w_u" in r and config.tis_batch_normalize and normalize:
        divisor = normalization_divisor(weight_mean(r) if batch_norm_mean is None else batch_norm_mean)
    if w_seq is not None:  # one pass over the tokens: per-sequence weight (normalized) x final mask
        weights = seg.expand(w_seq if divisor is None else w_seq / divisor.to(dtype)) * final_f
    elif divisor is not None:
        weights = weights.div_(divisor.to(dtype))
    metrics = correction_metrics(r, config, divisor) if finalize_metrics else {}
    metrics.update(fn_metrics)
    return CorrectionResult(
        weights=weights,
        loss_mask=final_mask,
        denominator_mask=den_mask,
        metrics=metrics,
        seq_token_count=n_den,
        global_token_count=r["g_tok"],
        global_seq_count=r["g_seq"],
        stats=r,
        function_metrics=fn_metrics,
        divisor=divisor,
    )


def _add_call_value(stats: BatchStats, name: str, value: Tensor, groups: list) -> None:
    """Logs a value every rank of the call holds (a budgeted bound) as (calls, Σ value) sums, divided by the ranks
    so the batch SUM gives (1, value) per call and merged micro-batches their mean."""
    share = 1.0
    for g in groups:
        share /= group_size(g)
    stats.add_sums((f"{name}_calls", f"{name}_sum"), torch.stack([torch.ones_like(value), value]).double() * share)


def _divergence_rows(div: D.TokenStage, columns: Tensor, n_seq: Tensor, seq_ok: Tensor, row_f: Tensor, n_fn: Tensor,
                     config: RolloutCorrectionConfig, cp0: float, groups: list, stats: BatchStats,
                     step_counts: dict[str, Tensor], step_bounds: BG.StepBounds | None) -> tuple[Tensor, Tensor]:
    """The divergence filter after the sequence sums (`divergence.py`): the sequence-level decision applied to
    (row_f, n_fn), its own rejection counts in `step_counts` and the budgeted bound in `stats`."""
    bound = div.bound
    if div.keep is None:  # mean / max: whole sequences
        keep, bound = D.sequence_keep(columns, n_seq, seq_ok, config, cp0, groups, step_bounds)
        row_f, n_fn = row_f * keep, n_fn * keep
        step_counts.update(n_div_tok=n_seq * (1.0 - keep), n_div_seq=seq_ok & (keep == 0))
    else:
        kept = torch.where(seq_ok, columns[:, 0], torch.zeros_like(n_seq))
        step_counts.update(n_div_tok=n_seq - kept, n_div_seq=seq_ok & (kept == 0))
    if bound is not None:
        _add_call_value(stats, "div_bound", bound, groups)
    return row_f, n_fn


def _custom(fn: Callable, stats: BatchStats, fn_metrics: dict[str, Tensor], lr: Tensor, valid: Tensor, good: Tensor,
            s_lr: Tensor, n_seq: Tensor, seg: Segments, cp_group: ProcessGroup, dp_group: ProcessGroup,
            config: RolloutCorrectionConfig, dtype: torch.dtype) -> tuple[Tensor, Tensor | None, Tensor]:
    """A custom weighting function on the good sequences: (token keep mask, weights or None, per-sequence
    kept-token counts [n]). Its raw weights feed the raw-weight metrics (+inf counts as exp(20)); a NaN/inf weight
    rejects its token (counted, warned); negative weights are counted (an error when the metrics are read). The
    function sees one sequence per row (a packed row is unpacked for it)."""
    good_tok = seg.expand(good)
    mask_in = valid * good_tok
    inputs = WeightInputs(log_ratio=seg.to_rows(lr * good_tok), loss_mask=seg.to_rows(mask_in > 0),
                          seq_log_ratio_sum=s_lr, seq_token_count=n_seq, cp_group=cp_group, dp_group=dp_group)
    out = check_weight_outputs(fn(inputs, config), inputs, config)
    fn_metrics.update(out.metrics)
    fn_mask = valid_float(seg.from_rows(out.loss_mask), dtype) * mask_in
    weights = None if out.weights is None else seg.from_rows(out.weights.detach().to(dtype))
    if out.raw_weights is not None:  # an overflowed raw weight counts as the built-in ceiling exp(20)
        raw = seg.from_rows(out.raw_weights.detach().to(dtype)).nan_to_num(0.0, math.exp(LOG_RATIO_CLAMP), 0.0)
        unit0 = mask_in if config.tis_level == "token" else mask_in / seg.expand(n_seq.clamp_min(1), fill=1.0)
        M.add_raw_weight_stats(stats, raw, unit0, *config.tis_bounds)
    if weights is not None:  # a NaN/inf weight rejects its token (counted), like a non-finite log-prob
        finite, bad = custom_weight_counts(weights, fn_mask)
        stats.add_sums(("n_fn_bad_w", "n_fn_neg_w"), bad)
        fn_mask = fn_mask * finite
    n_fn = seq_sums([seg.sum(fn_mask)], cp_group)[:, 0]
    return fn_mask, weights, n_fn


def normalize_weights(result: CorrectionResult, config: RolloutCorrectionConfig, mean: Tensor,
                      finalize_metrics: bool = True) -> CorrectionResult:
    """A `compute_rollout_correction(..., normalize=False)` result divided by the `--tis-batch-normalize` divisor of
    the step's `mean` (`weight_mean(merge_stats(...))`): the same weights and metrics as computing it with
    `batch_norm_mean=mean`, without redoing the correction. Only the step divisor is applied."""
    if not config.tis_batch_normalize or result.weights is None:
        return result
    divisor = normalization_divisor(mean)
    metrics = correction_metrics(result.stats, config, divisor) if finalize_metrics else {}
    metrics.update(result.function_metrics)
    return dataclasses.replace(result, weights=result.weights / divisor.to(result.weights.dtype), metrics=metrics,
                               divisor=divisor)


def weight_mean(stats: dict[str, Tensor]) -> Tensor:
    """Mean of the bounded IS weights over contributing units (tokens, or sequences counted once)."""
    return M._div(stats["w_uw"], stats["w_u"])


def normalization_divisor(mean: Tensor) -> Tensor:
    """What `--tis-batch-normalize` divides the weights by: the batch mean, or 1 when the mean is ≤ 1e-8."""
    mean = mean.to(torch.float64)
    return torch.where(mean > BATCH_NORM_MIN_MEAN, mean, torch.ones_like(mean))


def correction_metrics(
    stats: dict[str, Tensor], config: RolloutCorrectionConfig, divisor: Tensor | None = None
) -> dict[str, Tensor]:
    """The metrics of reduced statistics: one call's `CorrectionResult.stats`, or a step's (`merge_stats`).

    `divisor`: the `--tis-batch-normalize` divisor that was applied (default: the weight mean of `stats`).
    """
    r = stats
    metrics = M.finalize_mismatch(r)
    metrics["mis_valid_token_count"] = r["n_valid_tok"]
    metrics["mis_valid_seq_count"] = r["n_valid_seq"]
    metrics["mis_nonfinite_token_count"] = r["n_bad_tok"]
    metrics["mis_nonfinite_seq_count"] = r["n_bad_seq"]
    metrics["mis_nonfinite_seq_fraction"] = M._div(r["n_bad_seq"], r["n_valid_seq"])
    metrics.update({key: r[stat] for stat, (key, _) in INPUT_VALUE_COUNTS.items()})
    if not config.use_rollout_correction:
        return metrics
    n_tok, n_seqs = r["n_tok"], r["n_seq"]
    metrics["mis_rs_rejected_token_fraction"] = M._div(n_tok - r["n_fn_tok"], n_tok)
    metrics["mis_rs_rejected_seq_fraction"] = M._div(r["n_fn_seq_rej"], n_seqs)
    metrics.update({name: M._div(r[num], r[den]) for name, (num, den) in OPTIONAL_RATIOS.items() if num in r})
    metrics["mis_rejected_token_fraction"] = M._div(r["n_valid_tok"] - r["n_final_tok"], r["n_valid_tok"])
    metrics["mis_rejected_seq_fraction"] = M._div(r["n_final_seq_rej"], r["n_valid_seq"])
    metrics["mis_contributing_token_count"] = r["n_final_tok"]
    metrics["mis_all_rejected"] = (r["n_final_tok"] == 0).to(torch.float64)
    if "n_fn_bad_w" in r:
        metrics[CUSTOM_NONFINITE], metrics[CUSTOM_NEGATIVE] = r["n_fn_bad_w"], r["n_fn_neg_w"]
    if "raw_u" in r:
        metrics.update(M.finalize_raw_weight(r, config.effective_tis_mode))
    if "w_u" in r:
        if divisor is None and config.tis_batch_normalize:
            divisor = normalization_divisor(weight_mean(r))
        metrics.update(M.finalize_weight(r, divisor))
    return metrics
