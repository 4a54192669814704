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
    call_weight_function,
    check_correction_inputs,
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
    cp_sum_,
    device_constant,
    group_size,
    indicator,
    row_products,
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


def _zero_where(cond: Tensor, x: Tensor) -> Tensor:
    return x.masked_fill(cond, 0.0)


def _bad_rows(frame: Tensor) -> Tensor:
    """[n] bool: a sequence with a non-finite token (count > 0) or a non-finite sum, from the frame columns
    [Σlr, Σlp_train, Σlp_rollout, non-finite tokens]: count + 0·(sums), NaN when a sum is not finite (one matvec)."""
    count = device_constant("bad_rows", frame.device, lambda device: torch.tensor(
        [0.0, 0.0, 0.0, 1.0], dtype=torch.float64, device=device))
    return frame @ count != 0


def maybe_compiled(fn: Callable, config: RolloutCorrectionConfig) -> Callable:
    """`fn` itself, or its torch.compile'd form with `--rollout-correction-compile` (compiled once per function)."""
    return _compiled(fn) if config.rollout_correction_compile else fn


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=None)


def _token_stage(log_probs: Tensor, rollout_log_probs: Tensor, valid: Tensor, dtype: torch.dtype,
                 veto_log: float | None, rs_bounds: tuple[float, float] | None, seg: Segments) -> tuple[Tensor, ...]:
    """The per-token work before the sequence sums: (lr, per-sequence local sums [n, k], token mismatch rows,
    per-sequence max |p_t - p_r|, token-RS keep mask or None). Columns of the sums: `M.LOCAL` (valid tokens, Σlr,
    Σlp_train, non-finite tokens), then the veto count (lr < log C) and the token-RS kept count if asked."""
    tok = M.token_pass(log_probs.detach().to(dtype), rollout_log_probs.detach().to(dtype), valid, seg)
    columns = [tok.seq]
    if veto_log is not None:  # lr < log C, as -lr > -log C (lr is 0 outside the mask and log C < 0)
        columns.append(count_greater_(tok.lr.neg(), -veto_log, seg)[:, None])
    keep_tok = None
    if rs_bounds is not None:
        keep_tok = in_log_bounds(tok.lr, *rs_bounds).mul_(valid)
        columns.append(seg.sum(keep_tok)[:, None])
    local = torch.cat(columns, -1) if len(columns) > 1 else tok.seq
    return tok.lr, local, tok.rows, tok.d_max, keep_tok


def _token_is_stage(inputs: WeightInputs, config: RolloutCorrectionConfig, tok_f: Tensor, row_f: Tensor,
                    seg: Segments) -> tuple[Tensor, ...]:
    """Built-in token-level IS after rejection: (final mask, weights (0 outside it), per-sequence raw-weight sums
    [n, 2|3] (`RAW_SUMS[1:]`: Σ w_raw, # w_raw > U, # w_raw < L but in truncate mode) and weight sums [n, 2]
    (Σw, Σw²), then the weights' max and min). Raw weights are counted over the valid tokens (the caller keeps the
    good sequences)."""
    w, w_raw, _ = default_weight_parts(inputs, config, rs=False)
    lower, upper = config.tis_bounds
    raw = [seg.sum(w_raw)]
    if config.effective_tis_mode != "truncate":  # w_raw is 0 outside the mask: count w_raw < L there only
        raw.append(seg.sum(indicator(torch.lt, w_raw, lower).mul_(inputs.loss_mask)))
    raw.insert(1, count_greater_(w_raw, upper, seg))  # overwrites w_raw
    final_f = tok_f * row_f
    weights = w.mul_(final_f)
    square = seg.sum(weights * weights) if seg.packed else row_products(weights[:, None]).view(-1)
    return (final_f, weights, torch.stack(raw, -1), torch.stack([seg.sum(weights), square], -1),
            *M.weight_extremes(weights, final_f))


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
    valid = valid_float(loss_mask, dtype)  # float 0/1; in good sequences also the mask of finite tokens
    value_counts = input_value_counts(log_probs, rollout_log_probs, loss_mask, valid)
    lr, local, tok_rows, tok_d_max, keep_tok = maybe_compiled(_token_stage, config)(
        log_probs, rollout_log_probs, valid, dtype, math.log(config.rs_veto_threshold) if veto else None,
        config.rs_bounds if token_rs else None, seg)
    groups = active_groups(cp_group, dp_group)
    k0 = local.shape[-1]  # the divergence filter's columns follow
    div = D.token_stage(lr, valid, keep_tok, config, seg, groups, step_bounds) if correct and \
        config.rejects_divergence else None
    if div is not None:
        local = torch.cat([local, div.columns.to(local.dtype)], -1)
    seq = cp_sum_(local, cp_group)  # the one CP collective for sequence sums

    # per sequence, float64: [valid tokens, Σlr, Σlp_train, Σlp_rollout, non-finite tokens]; Σlp_rollout in the
    # compute dtype, from the sums (a non-finite token, or whole-sequence sums that overflowed, make it bad)
    frame = torch.cat([seq[:, :3], (seq[:, 2] - seq[:, 1])[:, None], seq[:, 3:4]], -1).to(torch.float64)
    bad = _bad_rows(frame[:, 1:5])
    has = seq[:, 0] > 0
    not_ok = has <= bad  # no valid token, or bad
    seq_ok = ~not_ok
    n_seq, s_lr = _zero_where(bad[:, None], seq[:, :2]).unbind(-1)
    cp0 = cp_first(cp_group)
    stats = BatchStats()
    # batch sums: counts (finite, any sequence) and values (masked to the finite valid sequences), token level
    # (local sums, added over CP) and sequence level (whole-sequence values, counted on CP rank 0)
    counts: dict[str, Tensor] = dict(n_tok=n_seq, n_seq=seq_ok, n_valid_tok=seq[:, 0], n_valid_seq=has,
                                     n_bad_tok=seq[:, 3])
    tok_cols: dict[tuple[str, ...], Tensor] = {M.TOKEN_SUMS: tok_rows}
    seq_cols: dict[tuple[str, ...], Tensor] = {M.SEQ_SUMS: M.seq_terms(frame[:, 0], frame[:, 1:4])}
    aliases: dict[str, str] = {}  # statistics that equal others

    weights: Tensor | None = None
    final_f = valid  # float 0/1 mask after rejection and veto
    n_final = n_seq
    w_seq: Tensor | None = None  # built-in sequence/geometric IS: the bounded weight of each sequence [B]
    sketch: Q.Counts | None = None  # the weights prepared for `Q.refine`
    fn_metrics: dict[str, Tensor] = {}
    if correct:
        tok_f, row_f = valid, (~bad).to(dtype)  # token keep, [n] sequence keep (non-finite, RS, veto)
        if is_default and config.tis_ess_target is not None:  # this call's U from the ESS target (one SUM)
            ess_unit = valid * seg.expand(row_f) if config.tis_level == "token" else seq_ok.to(dtype) * cp0
            ess_in = WeightInputs(log_ratio=lr, loss_mask=valid, seq_log_ratio_sum=s_lr, seq_token_count=n_seq)
            u_bound = BG.ess_target_bound(ess_in, config, ess_unit, groups, step_bounds)
            _add_call_value(stats, "tis_bound", u_bound, groups)
            config = config.replace(tis_upper_bound=float(u_bound), tis_ess_target=None)  # one device->host read
        lower, upper = config.tis_bounds
        mode = config.effective_tis_mode
        token_is = False
        if is_default:
            # built-in weights at the shapes of their level ([B, 1] for sequence/geometric): no [B, S] copies of
            # per-sequence quantities; the token-RS decision was made before the sequence sums, to count it there
            inputs = WeightInputs(log_ratio=lr, loss_mask=valid, seq_log_ratio_sum=s_lr, seq_token_count=n_seq,
                                  cp_group=cp_group, dp_group=dp_group)
            token_is = config.use_tis and config.tis_level == "token"
            if config.use_tis and not token_is:
                w_out, raw_out, _ = default_weight_parts(inputs, config, rs=False)
                w_seq, raw_out = w_out.squeeze(-1), raw_out.squeeze(-1)
                raw = [raw_out, raw_out > upper] + ([raw_out < lower] if mode != "truncate" else [])
                seq_cols[M.RAW_SUMS[1:len(raw) + 1]] = torch.stack(raw, -1)
                aliases["raw_u"] = "n_seq"
            n_fn = _zero_where(bad, seq[:, k0 - 1]) if token_rs else n_seq
            if token_rs:
                tok_f = keep_tok
            elif config.use_rs:
                keep = rs_keep(inputs, config).squeeze(-1)
                row_f = row_f * keep
                n_fn = n_fn * keep
            if div is not None and div.keep is not None:  # token-level divergence filter (and token RS)
                tok_f = div.keep
                n_fn = _zero_where(bad, seq[:, k0 + 1]) * (n_fn > 0)
        else:  # a custom mask is arbitrary: one extra CP collective for its per-sequence counts
            tok_f, weights, n_fn = _custom(fn, stats, fn_metrics, lr, valid if div is None or div.keep is None
                                           else div.keep, row_f, s_lr, n_seq, seg, cp_group, dp_group, config, dtype)
        if div is not None:
            row_f, n_fn = _divergence_rows(div, seq[:, k0:], n_seq, seq_ok, row_f, n_fn, config, cp0, groups, stats,
                                           counts, step_bounds)
        n_final = n_fn
        if veto:
            vetoed = seq[:, 4] > 0
            row_f = _zero_where(vetoed, row_f)
            n_final = _zero_where(vetoed, n_fn)
            counts.update(n_cat_tok=seq_ok * seq[:, 4], n_cat_seq=vetoed & seq_ok)
        kept = torch.stack([n_fn, n_final], -1) > 0  # n_fn > 0 only in finite valid sequences
        counts.update(n_fn_tok=n_fn, n_fn_seq=kept[:, 0], n_final_tok=n_final, n_final_seq=kept[:, 1])
        if token_is:  # the per-token weights, their statistics and the sketch's first digit
            final_f, weights, raw_rows, w_rows, w_max, w_min = maybe_compiled(_token_is_stage, config)(
                inputs, config, tok_f, seg.expand(row_f), seg)
            tok_cols[M.RAW_SUMS[1:1 + raw_rows.shape[-1]]] = raw_rows
            tok_cols[M.WEIGHT_SUMS[1:]] = w_rows
            aliases.update(raw_u="n_tok", w_u="n_final_tok")
            sketch = _add_weight_stats(stats, weights, final_f, w_max, w_min, binary=True)
        else:
            final_f = tok_f * seg.expand(row_f)
        if w_seq is not None:  # constant along each sequence: statistics on [B], each sequence counted once
            unit = kept[:, 1].to(dtype)
            unit = unit if cp0 == 1.0 else unit * cp0
            w_counted = w_seq * unit
            seq_cols[M.WEIGHT_SUMS[1:]] = torch.stack([w_counted, w_counted * w_counted], -1)
            aliases["w_u"] = "n_final_seq"
            sketch = _add_weight_stats(stats, w_counted, unit, *M.weight_extremes(w_counted, unit), binary=True)
        elif weights is not None and not is_default:
            weights = torch.where(final_f > 0, weights, final_f.new_zeros(()))  # its NaN stays out
            unit = final_f.double()
            if config.tis_level != "token":
                unit = unit / seg.expand(n_final.clamp_min(1).double(), fill=1.0)
            stats.add_sums(M.WEIGHT_SUMS, M.weight_sums(weights, unit).sum(0))
            sketch = _add_weight_stats(stats, weights, unit, *M.weight_extremes(weights, final_f, shifted_max=True))

    keep_den = not correct or config.rs_keep_loss_denominator
    final_mask = final_f.to(torch.float32)
    den_mask = valid.to(torch.float32) if keep_den else final_mask
    n_den = seq[:, 0] if keep_den else n_final
    den = "valid" if keep_den else "final"
    aliases.update(g_tok=f"n_{den}_tok", g_seq=f"n_{den}_seq")
    _add_batch_sums(stats, counts, tok_cols, seq_cols, tok_d_max, not_ok, cp0)
    stats.add_sums(tuple(INPUT_VALUE_COUNTS), value_counts)

    r = stats.reduce(cp_group, dp_group)  # the one batch collective (SUM + MAX per group)
    r.update({alias: r[name] for alias, name in aliases.items()})
    if sketch is not None:  # two more small SUMs: the exact quantiles
        r.update(Q.refine(sketch, r[Q.LEVEL1_KEY], groups))

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


def _add_weight_stats(stats: BatchStats, weights: Tensor, unit: Tensor, w_max: Tensor, w_min: Tensor,
                      binary: bool = False) -> Q.Counts:
    """The weights' extremes and the sketch's level-1 histogram (`unit`: 0/1 with `binary`); returns what
    `Q.refine` needs."""
    stats.add_max("w_max", w_max)
    stats.add_min("w_min", w_min)
    hist, sketch = Q.level1(weights, unit, binary)
    stats.add_sum(Q.LEVEL1_KEY, hist)
    return sketch


def _add_batch_sums(stats: BatchStats, counts: dict[str, Tensor], tok_cols: dict[tuple[str, ...], Tensor],
                    seq_cols: dict[tuple[str, ...], Tensor], d_max: Tensor, not_ok: Tensor, cp0: float) -> None:
    """Sums over the sequences: `counts` ([n] each, finite) as they are; the value columns ([n, k] each, a rejected
    sequence may hold inf/NaN: zeroed, not multiplied) over the finite valid sequences, with the maximum of
    `d_max`; sequence-level ones (counts, `seq_cols`) counted once across CP (`cp0`). Two sums and one max."""
    total = torch.stack(list(counts.values()), -1).sum(0, dtype=torch.float64)
    names = [name for names in (*tok_cols, *seq_cols) for name in names]
    values = _zero_where(not_ok[:, None], torch.cat([*tok_cols.values(), *seq_cols.values(), d_max[:, None]], -1))
    sums = values.sum(0)
    n_tok = sum(c.shape[-1] for c in tok_cols.values())
    if cp0 != 1.0:
        total = total * cp0
        sums = torch.cat([sums[:n_tok], sums[n_tok:] * cp0])
    stats.add_sums(tuple(counts), total)
    stats.add_sums(tuple(names), sums[:-1])
    stats.add_max("tok_d_max", values[:, -1].amax() if values.shape[0] else values.new_zeros(()))


def _add_call_value(stats: BatchStats, name: str, value: Tensor, groups: list) -> None:
    """Logs a value every rank of the call holds (a budgeted bound) as (calls, Σ value) sums, divided by the ranks
    so the batch SUM gives (1, value) per call and merged micro-batches their mean."""
    share = 1.0
    for g in groups:
        share /= group_size(g)
    stats.add_sums((f"{name}_calls", f"{name}_sum"), torch.stack([torch.ones_like(value), value]).double() * share)


def _divergence_rows(div: D.TokenStage, columns: Tensor, n_seq: Tensor, seq_ok: Tensor, row_f: Tensor, n_fn: Tensor,
                     config: RolloutCorrectionConfig, cp0: float, groups: list, stats: BatchStats,
                     counts: dict[str, Tensor], step_bounds: BG.StepBounds | None) -> tuple[Tensor, Tensor]:
    """The divergence filter after the sequence sums (`divergence.py`): the sequence-level decision applied to
    (row_f, n_fn), its own rejection counts in `counts` and the budgeted bound in `stats`."""
    bound = div.bound
    if div.keep is None:  # mean / max: whole sequences
        keep, bound = D.sequence_keep(columns, n_seq, seq_ok, config, cp0, groups, step_bounds)
        row_f, n_fn = row_f * keep, n_fn * keep
        counts.update(n_div_tok=n_seq * (1.0 - keep), n_div_seq=seq_ok & (keep == 0))
    else:
        kept = torch.where(seq_ok, columns[:, 0], torch.zeros_like(n_seq))
        counts.update(n_div_tok=n_seq - kept, n_div_seq=seq_ok & (kept == 0))
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
    out = call_weight_function(fn, inputs, config)
    fn_metrics.update(out.metrics)
    fn_mask = valid_float(seg.from_rows(out.loss_mask), dtype) * mask_in
    weights = None if out.weights is None else seg.from_rows(out.weights.detach().to(dtype))
    if out.raw_weights is not None:  # an overflowed raw weight counts as the built-in ceiling exp(20)
        raw = seg.from_rows(out.raw_weights.detach().to(dtype)).nan_to_num(0.0, math.exp(LOG_RATIO_CLAMP), 0.0)
        unit0 = mask_in if config.tis_level == "token" else mask_in / seg.expand(n_seq.clamp_min(1), fill=1.0)
        stats.add_sums(M.RAW_SUMS, M.raw_weight_columns(raw, unit0, *config.tis_bounds).sum(0, dtype=torch.float64))
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
    return mean.masked_fill(mean <= BATCH_NORM_MIN_MEAN, 1.0)


def correction_metrics(
    stats: dict[str, Tensor], config: RolloutCorrectionConfig, divisor: Tensor | None = None
) -> dict[str, Tensor]:
    """The metrics of reduced statistics: one call's `CorrectionResult.stats`, or a step's (`merge_stats`).

    `divisor`: the `--tis-batch-normalize` divisor that was applied (default: the weight mean of `stats`).
    Every ratio metric is divided in one go (`M.mismatch_metrics`).
    """
    r = stats
    correct = config.use_rollout_correction
    # differences of counts: non-finite sequences; with correction, rejected tokens and sequences
    pairs = [("n_valid_seq", "n_seq")]
    if correct:
        pairs += [("n_tok", "n_fn_tok"), ("n_seq", "n_fn_seq"), ("n_valid_tok", "n_final_tok"),
                  ("n_valid_seq", "n_final_seq")]
    a, b = zip(*pairs, strict=True)
    diff = (torch.stack([r[k] for k in a]) - torch.stack([r[k] for k in b])).unbind()
    names, nums, dens = ["mis_nonfinite_seq_fraction"], [diff[0]], [r["n_valid_seq"]]
    if correct:
        names += ["mis_rs_rejected_token_fraction", "mis_rs_rejected_seq_fraction", "mis_rejected_token_fraction",
                  "mis_rejected_seq_fraction"]
        nums += list(diff[1:])
        dens += [r["n_tok"], r["n_seq"], r["n_valid_tok"], r["n_valid_seq"]]
        for name, (num, den) in OPTIONAL_RATIOS.items():
            if num in r:
                names.append(name)
                nums.append(r[num])
                dens.append(r[den])
        if "raw_u" in r:
            for name, num in M.raw_metrics(config.effective_tis_mode):
                names.append(name)
                nums.append(r[num])
                dens.append(r["raw_u"])
        if "w_u" in r:
            names += ["w_mean", "w_mean2"]
            nums += [r["w_uw"], r["w_uw2"]]
            dens += [r["w_u"], r["w_u"]]
    metrics = M.mismatch_metrics(r, names, nums, dens)
    metrics["mis_valid_token_count"] = r["n_valid_tok"]
    metrics["mis_valid_seq_count"] = r["n_valid_seq"]
    metrics["mis_nonfinite_token_count"] = r["n_bad_tok"]
    metrics["mis_nonfinite_seq_count"] = diff[0]
    metrics.update({key: r[stat] for stat, (key, _) in INPUT_VALUE_COUNTS.items()})
    if not correct:
        return metrics
    metrics["mis_contributing_token_count"] = r["n_final_tok"]
    metrics["mis_all_rejected"] = (r["n_final_tok"] == 0).to(torch.float64)
    if "n_fn_bad_w" in r:
        metrics[CUSTOM_NONFINITE], metrics[CUSTOM_NEGATIVE] = r["n_fn_bad_w"], r["n_fn_neg_w"]
    if "w_u" in r:
        means = {k: metrics.pop(k) for k in ("w_mean", "w_mean2")}
        if divisor is None and config.tis_batch_normalize:
            divisor = normalization_divisor(means["w_mean"])
        metrics.update(M.weight_metrics(r, means, divisor))
    return metrics
