"""`compute_rollout_correction`: IS weights, rejection, veto, batch normalization and metrics for one micro-batch.

Order of operations (docs/theory.md, docs/metrics.md), one function per stage (their records: `stage_records.py`):
1. `log_ratio_stage`: lr = lp_train - lp_rollout on valid tokens; per-sequence sums (count, Σlr, Σlp_train, veto
   and token-RS counts) in ONE CP all_reduce. A sequence is a row of the [B, S] inputs, or a segment of a packed
   [1, T] row (`slime_corr.layout.segments`): every per-sequence sum, maximum and broadcast goes through a
   `Segments`, the rest is per token and layout-free. `sequence_stage`: a sequence with a non-finite lr at a valid position is rejected.
2. `rejection_stage`: the weighting function ("default" = `builtin_weights.default_weights`, or
   `--custom-tis-function-path`) gives the RS mask; the veto (`lr < log C` at any valid token) then rejects whole
   sequences. `weight_stage.weight_stage`: the IS weights of what stays.
3. `batch_statistics`: all batch statistics (metric numerators/denominators, normalization mean, counts) in ONE SUM
   and ONE MAX all_reduce per group (CP, DP); with IS weights, the exact weight quantiles take two more small SUMs
   (`quantiles.py`). `normalization_stage`: batch normalization divides the weights by the mean over contributing
   units. The metrics: `correction_metrics`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from slime_corr.config import KernelBackend, RolloutCorrectionConfig
from slime_corr.correction import cuda_graphs, divergence, quantiles
from slime_corr.correction.budget import StepBounds
from slime_corr.correction.builtin_weights import default_weights, in_log_bounds, rs_keep
from slime_corr.correction.checks import (
    CUSTOM_NEGATIVE,
    CUSTOM_NONFINITE,
    INPUT_VALUE_COUNTS,
    check_correction_inputs,
    input_value_counts,
)
from slime_corr.correction.compiling import maybe_compiled
from slime_corr.correction.metrics import (
    mismatch_metrics,
    raw_metrics,
    seq_terms,
    token_pass,
    weight_metrics,
)
from slime_corr.correction.public_types import CorrectionResult, WeightInputs
from slime_corr.correction.reductions import (
    ProcessGroup,
    compute_dtype,
    count_greater_,
    cp_sum_,
    device_constant,
    float_not,
    indicator,
    safe_divide,
    valid_float,
)
from slime_corr.correction.reporting import OPTIONAL_RATIOS
from slime_corr.correction.stage_records import (
    VETO_COLUMN,
    BatchColumns,
    CorrectionPlan,
    Kept,
    Layout,
    LogRatios,
    SequenceCounts,
    Sequences,
    Weighted,
)
from slime_corr.correction.statistics import SEQ_SUMS, TOKEN_SUMS, BatchStatistics
from slime_corr.correction.weight_stage import custom_rejection, ess_bounded_config, weight_stage
from slime_corr.layout.segments import Segments
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


def correction_plan(config: RolloutCorrectionConfig) -> CorrectionPlan:
    """What `config` decides once per call: correction or metrics only, the veto, the weighting function."""
    correct = config.use_rollout_correction
    veto = correct and config.rs_veto_threshold is not None
    fn = weight_function(config) if correct else None
    builtin = fn is default_weights
    token_rs = builtin and config.use_rs and config.rs_level == "token"
    return CorrectionPlan(correct, math.log(config.rs_veto_threshold) if veto else None, fn, builtin,
                          config.rs_bounds if token_rs else None)


def _zero_where(cond: Tensor, x: Tensor) -> Tensor:
    return x.masked_fill(cond, 0.0)


def _bad_rows(frame: Tensor) -> Tensor:
    """[n] bool: a sequence with a non-finite token (count > 0) or a non-finite sum, from the frame columns
    [Σlr, Σlp_train, Σlp_rollout, non-finite tokens]: count + 0·(sums), NaN when a sum is not finite (one matvec)."""
    count = device_constant("bad_rows", frame.device, lambda device: torch.tensor(
        [0.0, 0.0, 0.0, 1.0], dtype=torch.float64, device=device))
    return frame @ count != 0


class OutputMasks(NamedTuple):
    """The masks the loss uses (`CorrectionResult.loss_mask`, `.denominator_mask`, `.seq_token_count`)."""

    loss_mask: Tensor  # float32 [B, S]: the final mask
    denominator_mask: Tensor  # float32 [B, S]: the final mask, or the valid one with --rs-keep-loss-denominator
    seq_token_count: Tensor  # [n] Σ denominator_mask over the whole sequence


class Normalized(NamedTuple):
    """The weights after `--tis-batch-normalize` and what they were divided by (None: nothing)."""

    weights: Tensor | None
    divisor: Tensor | None


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
    step_bounds: StepBounds | None = None,
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
    With `--rollout-correction-cuda-graph` (CUDA) the call is replayed from a CUDA graph (`cuda_graphs`).
    """
    check_correction_inputs(log_probs, rollout_log_probs, loss_mask, config, batch_norm_mean, cp_group, dp_group,
                            segments)
    options = dict(cp_group=cp_group, dp_group=dp_group, batch_norm_mean=batch_norm_mean, normalize=normalize,
                   finalize_metrics=finalize_metrics, segments=segments, step_bounds=step_bounds)
    if config.rollout_correction_cuda_graph and config.computes_metrics:
        return cuda_graphs.run(_correction, [log_probs, rollout_log_probs, loss_mask], config, **options)
    return _correction(log_probs, rollout_log_probs, loss_mask, config, **options)


def _correction(log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor, config: RolloutCorrectionConfig, *,
                cp_group: ProcessGroup, dp_group: ProcessGroup, batch_norm_mean: Tensor | None, normalize: bool,
                finalize_metrics: bool, segments: Segments | None, step_bounds: StepBounds | None
                ) -> CorrectionResult:
    """`compute_rollout_correction` after its input checks, in stages."""
    if not config.computes_metrics:
        orig_mask = valid_float(loss_mask, torch.float32)
        return CorrectionResult(weights=None, loss_mask=orig_mask, denominator_mask=orig_mask, metrics={})
    plan = correction_plan(config)
    layout = Layout.of(log_probs.shape, segments, cp_group, dp_group)
    ratios = log_ratio_stage(log_probs, rollout_log_probs, loss_mask, config, plan, layout, step_bounds)
    seqs = sequence_stage(ratios.seq_sums)
    batch = start_batch_columns(ratios, seqs)
    weighted = Weighted(ratios.valid, seqs.token_count, None, None)  # metrics only: the valid tokens, no weights
    if plan.correct:
        inputs = None
        if plan.builtin:  # at the shapes of their level ([n, 1] for sequence/geometric): no [B, S] copies
            inputs = WeightInputs(log_ratio=ratios.log_ratio, loss_mask=ratios.valid,
                                  seq_log_ratio_sum=seqs.log_ratio_sum, seq_token_count=seqs.token_count,
                                  cp_group=cp_group, dp_group=dp_group)
        seq_keep = float_not(seqs.nonfinite, ratios.dtype)  # [n] 0/1; RS, divergence and veto follow
        if plan.builtin and config.tis_ess_target is not None:  # this call's U from the ESS target (one SUM)
            config = ess_bounded_config(inputs, config, seq_keep, seqs, layout, step_bounds, batch)
        kept = rejection_stage(inputs, ratios, seqs, seq_keep, config, plan, layout, step_bounds, batch)
        weighted = weight_stage(inputs, kept, config, plan, layout, batch)
    masks = output_masks(ratios, weighted, config, plan, batch)
    r = batch_statistics(batch, ratios, seqs, layout)
    normalized = normalization_stage(r, weighted, config, normalize, batch_norm_mean, layout.segments, ratios.dtype)
    metrics = correction_metrics(r, config, normalized.divisor) if finalize_metrics else {}
    metrics.update(batch.function_metrics)
    return CorrectionResult(
        weights=normalized.weights,
        loss_mask=masks.loss_mask,
        denominator_mask=masks.denominator_mask,
        metrics=metrics,
        seq_token_count=masks.seq_token_count,
        global_token_count=r.denominator_token_count,
        global_seq_count=r.denominator_seq_count,
        stats=r,
        function_metrics=batch.function_metrics,
        divisor=normalized.divisor,
    )


# ------------------------------------------------------------------------------------------ 1. log-ratios
class TokenSums(NamedTuple):
    """The per-token work before the sequence sums (`token_sums`)."""

    log_ratio: Tensor  # lr [B, S]
    local_sums: Tensor  # [n, k] local per-sequence sums: `LOCAL`, then the veto count and the token-RS kept count
    token_rows: Tensor  # [n, len(TOKEN_SUMS)] the token mismatch terms' sums
    max_prob_diff: Tensor  # [n] max |p_t - p_r|
    token_rs_keep: Tensor | None  # built-in token-level RS: 0/1 keep of the valid tokens


def token_sums(log_probs: Tensor, rollout_log_probs: Tensor, valid: Tensor, dtype: torch.dtype,
               veto_log: float | None, rs_bounds: tuple[float, float] | None, seg: Segments,
               backend: KernelBackend = "torch") -> TokenSums:
    """lr, the token metrics' sums and the per-sequence local sums: `LOCAL` (valid tokens, Σlr, Σlp_train,
    non-finite tokens), then the veto count (lr < log C) and the token-RS kept count if asked."""
    tok = token_pass(log_probs.detach().to(dtype), rollout_log_probs.detach().to(dtype), valid, seg, backend)
    columns = [tok.seq]
    if veto_log is not None:  # lr < log C, as -lr > -log C (lr is 0 outside the mask and log C < 0)
        columns.append(count_greater_(tok.lr.neg(), -veto_log, seg)[:, None])
    keep_tok = None
    if rs_bounds is not None:
        keep_tok = in_log_bounds(tok.lr, *rs_bounds).mul_(valid)
        columns.append(seg.sum(keep_tok)[:, None])
    local = torch.cat(columns, -1) if len(columns) > 1 else tok.seq
    return TokenSums(tok.lr, local, tok.rows, tok.d_max, keep_tok)


def log_ratio_stage(log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor, config: RolloutCorrectionConfig,
                    plan: CorrectionPlan, layout: Layout, step_bounds: StepBounds | None) -> LogRatios:
    """lr = lp_train - lp_rollout per token and the whole-sequence sums of `token_sums` and of the divergence
    filter's token stage, in ONE CP all_reduce (compiled with --rollout-correction-compile)."""
    dtype = compute_dtype(log_probs, rollout_log_probs)
    valid = valid_float(loss_mask, dtype)  # float 0/1; in good sequences also the mask of finite tokens
    value_counts = input_value_counts(log_probs, rollout_log_probs, loss_mask, valid)
    tok = maybe_compiled(token_sums, config)(log_probs, rollout_log_probs, valid, dtype, plan.veto_log_threshold,
                                             plan.token_rs_bounds, layout.segments, config.rollout_correction_backend)
    local = tok.local_sums
    first_divergence = local.shape[-1]  # the divergence filter's columns follow
    div = None
    if plan.correct and config.rejects_divergence:
        div = divergence.token_stage(tok.log_ratio, valid, tok.token_rs_keep, config, layout.segments, layout.groups,
                            step_bounds, rollout_log_probs)
        local = torch.cat([local, div.columns.to(local.dtype)], -1)
    seq = cp_sum_(local, layout.cp_group)  # the one CP collective for sequence sums
    return LogRatios(tok.log_ratio, valid, seq, tok.token_rows, tok.max_prob_diff, tok.token_rs_keep, div,
                     first_divergence, value_counts)


def sequence_stage(seq: Tensor) -> Sequences:
    """Per sequence, from the whole-sequence sums: which sequences are finite and have a valid token."""
    # float64: [valid tokens, Σlr, Σlp_train, Σlp_rollout, non-finite tokens]; Σlp_rollout in the compute dtype,
    # from the sums (a non-finite token, or whole-sequence sums that overflowed, make it bad)
    frame = torch.cat([seq[:, :3], (seq[:, 2] - seq[:, 1])[:, None], seq[:, 3:4]], -1).to(torch.float64)
    bad = _bad_rows(frame[:, 1:5])
    has = seq[:, 0] > 0
    unusable = has <= bad  # no valid token, or bad
    usable = ~unusable
    token_count, log_ratio_sum = _zero_where(bad[:, None], seq[:, :2]).unbind(-1)
    return Sequences(frame, bad, has, unusable, usable, token_count, log_ratio_sum)


def start_batch_columns(ratios: LogRatios, seqs: Sequences) -> BatchColumns:
    """The batch sums every call has: counts (finite, any sequence) and values (masked to the finite valid
    sequences), token level (local sums, added over CP) and sequence level (whole-sequence values, counted on CP
    rank 0)."""
    seq = ratios.seq_sums
    counts = SequenceCounts(finite_token_count=seqs.token_count, finite_seq_count=seqs.usable,
                            valid_token_count=seq[:, 0], valid_seq_count=seqs.has_tokens,
                            nonfinite_token_count=seq[:, 3])
    return BatchColumns(counts=counts, token_columns={TOKEN_SUMS: ratios.token_rows},
                        seq_columns={SEQ_SUMS: seq_terms(seqs.frame[:, 0], seqs.frame[:, 1:4])})


# ------------------------------------------------------------------------------------------ 2. rejection
def rejection_stage(inputs: WeightInputs | None, ratios: LogRatios, seqs: Sequences, seq_keep: Tensor,
                    config: RolloutCorrectionConfig, plan: CorrectionPlan, layout: Layout,
                    step_bounds: StepBounds | None, batch: BatchColumns) -> Kept:
    """What stays: `seq_keep` (the finite sequences) less the weighting function's RS (built-in) or mask (custom),
    the divergence filter and the veto; each rejection's counts go to `batch`."""
    div = ratios.divergence
    custom_weights = None
    if plan.builtin:
        token_keep, seq_keep, rs_kept = _builtin_rejection(inputs, ratios, seqs, seq_keep, config, plan)
    else:  # a custom mask is arbitrary: one extra CP collective for its per-sequence counts
        valid = ratios.valid if div is None or div.keep is None else div.keep
        token_keep, custom_weights, rs_kept = custom_rejection(plan.weight_fn, ratios.log_ratio, valid, seq_keep,
                                                                 seqs, layout, config, batch)
    if div is not None:
        seq_keep, rs_kept = _divergence_rows(div, ratios.seq_sums[:, ratios.divergence_column:], seqs, seq_keep,
                                             rs_kept, config, layout, step_bounds, batch)
    kept_tokens = rs_kept
    if plan.veto_log_threshold is not None:
        below = ratios.seq_sums[:, VETO_COLUMN]  # tokens with lr < log C
        vetoed = below > 0
        seq_keep = _zero_where(vetoed, seq_keep)
        kept_tokens = _zero_where(vetoed, rs_kept)
        batch.counts.vetoed_token_count = seqs.usable * below
        batch.counts.vetoed_seq_count = vetoed & seqs.usable
    kept = indicator(torch.gt, torch.stack([rs_kept, kept_tokens], -1), 0.0)  # > 0 only in finite valid sequences
    counts = batch.counts
    counts.function_kept_token_count, counts.function_kept_seq_count = rs_kept, kept[:, 0]
    counts.final_token_count, counts.final_seq_count = kept_tokens, kept[:, 1]
    return Kept(token_keep, seq_keep, rs_kept, kept_tokens, kept[:, 1], custom_weights)


def _builtin_rejection(inputs: WeightInputs, ratios: LogRatios, seqs: Sequences, seq_keep: Tensor,
                       config: RolloutCorrectionConfig, plan: CorrectionPlan) -> tuple[Tensor, Tensor, Tensor]:
    """The built-in function's RS: (token keep, sequence keep, kept tokens per sequence). The token-RS decision
    was made before the sequence sums, to count it there; the token-level divergence filter's keep includes it."""
    seq, first_divergence = ratios.seq_sums, ratios.divergence_column
    token_keep, kept_tokens = ratios.valid, seqs.token_count
    if plan.token_rs_bounds is not None:  # its count is the last column before the divergence filter's
        token_keep, kept_tokens = ratios.token_rs_keep, _zero_where(seqs.nonfinite, seq[:, first_divergence - 1])
    elif config.use_rs:
        keep = rs_keep(inputs, config).squeeze(-1)
        seq_keep = seq_keep * keep
        kept_tokens = kept_tokens * keep
    div = ratios.divergence
    if div is not None and div.keep is not None:  # token-level divergence filter (and token RS)
        token_keep = div.keep
        kept_tokens = _zero_where(seqs.nonfinite, seq[:, first_divergence + 1]) * (kept_tokens > 0)
    return token_keep, seq_keep, kept_tokens


def _divergence_rows(div: divergence.TokenStage, columns: Tensor, seqs: Sequences, seq_keep: Tensor, kept_tokens: Tensor,
                     config: RolloutCorrectionConfig, layout: Layout, step_bounds: StepBounds | None,
                     batch: BatchColumns) -> tuple[Tensor, Tensor]:
    """The divergence filter after the sequence sums (`divergence.py`): the sequence-level decision applied to
    (seq_keep, kept_tokens), its own rejection counts and the budgeted bound in `batch`."""
    bound = div.bound
    n_seq, usable = seqs.token_count, seqs.usable
    if div.keep is None:  # mean / max: whole sequences
        keep, bound = divergence.sequence_keep(columns, n_seq, usable, config, layout.cp_first, layout.groups, step_bounds)
        seq_keep, kept_tokens = seq_keep * keep, kept_tokens * keep
        rejected_tokens, rejected_seqs = n_seq * (1.0 - keep), usable & (keep == 0)
    else:
        kept = torch.where(usable, columns[:, 0], torch.zeros_like(n_seq))
        rejected_tokens, rejected_seqs = n_seq - kept, usable & (kept == 0)
    batch.counts.divergence_rejected_token_count = rejected_tokens
    batch.counts.divergence_rejected_seq_count = rejected_seqs
    if bound is not None:
        batch.add_call_value("divergence_bound", bound, layout.groups)
    return seq_keep, kept_tokens


# ------------------------------------------------------------------------------------------ 3. statistics, normalization
def output_masks(ratios: LogRatios, weighted: Weighted, config: RolloutCorrectionConfig, plan: CorrectionPlan,
                 batch: BatchColumns) -> OutputMasks:
    """The final mask and the loss denominators' (with --rs-keep-loss-denominator rejected tokens still count);
    `denominator_token_count` / `_seq_count` in the statistics are the denominators' global counts."""
    keep_den = not plan.correct or config.rs_keep_loss_denominator
    final_mask = weighted.final_mask.to(torch.float32)
    den_mask = ratios.valid.to(torch.float32) if keep_den else final_mask
    den = "valid" if keep_den else "final"
    batch.aliases.update(denominator_token_count=f"{den}_token_count", denominator_seq_count=f"{den}_seq_count")
    return OutputMasks(final_mask, den_mask, ratios.seq_sums[:, 0] if keep_den else weighted.kept_tokens)


def batch_statistics(batch: BatchColumns, ratios: LogRatios, seqs: Sequences, layout: Layout) -> BatchStatistics:
    """The reduced batch statistics: everything in `batch` and the input value counts in the one batch collective
    (SUM + MAX per group), the aliases, and with weights their exact quantiles (two more small SUMs)."""
    _add_batch_sums(batch, ratios.max_prob_diff, seqs.unusable, layout.cp_first)
    batch.stats.add_sums(tuple(INPUT_VALUE_COUNTS), ratios.value_counts)
    reduced = batch.stats.reduce(layout.cp_group, layout.dp_group)
    if batch.sketch is not None:
        reduced.update(quantiles.refine(batch.sketch, reduced[quantiles.LEVEL1_KEY], layout.groups))
    return BatchStatistics.from_reduced(reduced, batch.aliases)


def _add_batch_sums(batch: BatchColumns, d_max: Tensor, unusable: Tensor, cp0: float) -> None:
    """Sums over the sequences: `counts` ([n] each, finite) as they are; the value columns ([n, k] each, a rejected
    sequence may hold inf/NaN: zeroed, not multiplied) over the finite valid sequences, with the maximum of
    `d_max`; sequence-level ones (counts, `seq_columns`) counted once across CP (`cp0`). Two sums and one max."""
    stats, counts, tok_cols, seq_cols = batch.stats, batch.counts, batch.token_columns, batch.seq_columns
    count_columns = counts.present()
    total = torch.stack(list(count_columns.values()), -1).sum(0, dtype=torch.float64)
    names = [name for names in (*tok_cols, *seq_cols) for name in names]
    values = _zero_where(unusable[:, None], torch.cat([*tok_cols.values(), *seq_cols.values(), d_max[:, None]], -1))
    sums = values.sum(0)
    n_tok = sum(c.shape[-1] for c in tok_cols.values())
    if cp0 != 1.0:
        total = total * cp0
        sums = torch.cat([sums[:n_tok], sums[n_tok:] * cp0])
    stats.add_sums(tuple(count_columns), total)
    stats.add_sums(tuple(names), sums[:-1])
    stats.add_max("prob_diff_max", values[:, -1].amax() if values.shape[0] else values.new_zeros(()))


def normalization_stage(r: BatchStatistics, weighted: Weighted, config: RolloutCorrectionConfig, normalize: bool,
                        batch_norm_mean: Tensor | None, seg: Segments, dtype: torch.dtype) -> Normalized:
    """`--tis-batch-normalize`: w / mean(w) over the contributing units (`batch_norm_mean`, default this call's);
    per-sequence weights are expanded to the tokens in the same pass (x final mask)."""
    divisor = None
    if r.has_weights and config.tis_batch_normalize and normalize:
        divisor = normalization_divisor(weight_mean(r) if batch_norm_mean is None else batch_norm_mean)
    weights = weighted.weights
    if weighted.seq_weights is not None:
        seq_weights = weighted.seq_weights if divisor is None else weighted.seq_weights / divisor.to(dtype)
        weights = seg.expand(seq_weights) * weighted.final_mask
    elif divisor is not None:
        weights = weights.div_(divisor.to(dtype))
    return Normalized(weights, divisor)


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


def weight_mean(stats: BatchStatistics) -> Tensor:
    """Mean of the bounded IS weights over contributing units (tokens, or sequences counted once)."""
    return safe_divide(stats.weight_sum, stats.weight_units)


def normalization_divisor(mean: Tensor) -> Tensor:
    """What `--tis-batch-normalize` divides the weights by: the batch mean, or 1 when the mean is ≤ 1e-8."""
    mean = mean.to(torch.float64)
    return mean.masked_fill(mean <= BATCH_NORM_MIN_MEAN, 1.0)


def correction_metrics(
    stats: BatchStatistics, config: RolloutCorrectionConfig, divisor: Tensor | None = None
) -> dict[str, Tensor]:
    """The metrics of reduced statistics: one call's `CorrectionResult.stats`, or a step's (`merge_stats`).

    `divisor`: the `--tis-batch-normalize` divisor that was applied (default: the weight mean of `stats`).
    Every ratio metric is divided in one go (`mismatch_metrics`).
    """
    r = stats
    correct = config.use_rollout_correction
    # differences of counts: non-finite sequences; with correction, rejected tokens and sequences
    pairs = [(r.valid_seq_count, r.finite_seq_count)]
    if correct:
        pairs += [(r.finite_token_count, r.function_kept_token_count), (r.finite_seq_count, r.function_kept_seq_count),
                  (r.valid_token_count, r.final_token_count), (r.valid_seq_count, r.final_seq_count)]
    a, b = zip(*pairs, strict=True)
    diff = (torch.stack(a) - torch.stack(b)).unbind()
    names, nums, dens = ["mis_nonfinite_seq_fraction"], [diff[0]], [r.valid_seq_count]
    if correct:
        names += ["mis_rs_rejected_token_fraction", "mis_rs_rejected_seq_fraction", "mis_rejected_token_fraction",
                  "mis_rejected_seq_fraction"]
        nums += list(diff[1:])
        dens += [r.finite_token_count, r.finite_seq_count, r.valid_token_count, r.valid_seq_count]
        for name, ratio in OPTIONAL_RATIOS.items():
            num, den = ratio(r)
            if num is not None:
                names.append(name)
                nums.append(num)
                dens.append(den)
        if r.has_raw_weights:
            for name, num in raw_metrics(r, config.effective_tis_mode):
                names.append(name)
                nums.append(num)
                dens.append(r.raw_weight_units)
        if r.has_weights:
            names += ["w_mean", "w_mean2"]
            nums += [r.weight_sum, r.weight_square_sum]
            dens += [r.weight_units, r.weight_units]
    metrics = mismatch_metrics(r, names, nums, dens)
    metrics["mis_valid_token_count"] = r.valid_token_count
    metrics["mis_valid_seq_count"] = r.valid_seq_count
    metrics["mis_nonfinite_token_count"] = r.nonfinite_token_count
    metrics["mis_nonfinite_seq_count"] = diff[0]
    metrics.update({key: getattr(r, stat) for stat, (key, _) in INPUT_VALUE_COUNTS.items()})
    if not correct:
        return metrics
    metrics["mis_contributing_token_count"] = r.final_token_count
    metrics["mis_all_rejected"] = indicator(torch.eq, r.final_token_count, 0.0, torch.float64)
    if r.custom_nonfinite_weight_count is not None:
        metrics[CUSTOM_NONFINITE], metrics[CUSTOM_NEGATIVE] = (r.custom_nonfinite_weight_count,
                                                               r.custom_negative_weight_count)
    if r.has_weights:
        mean, mean2 = metrics.pop("w_mean"), metrics.pop("w_mean2")
        if divisor is None and config.tis_batch_normalize:
            divisor = normalization_divisor(mean)
        metrics.update(weight_metrics(r, mean, mean2, divisor))
    return metrics
