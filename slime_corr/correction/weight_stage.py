"""The weight stage of `compute_rollout_correction` (`core.py`): IS weights of the kept tokens and their statistics.

- built-in token-level IS: per-token weights after rejection (`token_weights`, compiled with
  --rollout-correction-compile); built-in sequence/geometric IS: one bounded weight per sequence at the shape of its
  level ([n]: no [B, S] copies of per-sequence quantities), its statistics on [n], each sequence counted once;
- a custom weighting function (`custom_rejection`): the rejection stage calls it, as its mask comes with its weights;
- `--tis-ess-target`: the bound U of this call, or of its optimizer step (`ess_bounded_config`).
The weights' statistics: Σ unit, Σ unit·w, Σ unit·w² (`statistics.WeightSums`), the extremes and the first level of
the exact quantile sketch (`quantiles.py`); the raw weights' Σ w_raw, # w_raw > U, # w_raw < L
(`statistics.RawWeightSums`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import budget, quantiles
from slime_corr.correction.budget import StepBounds
from slime_corr.correction.builtin_weights import LOG_RATIO_CLAMP, default_weight_parts
from slime_corr.correction.checks import call_weight_function, custom_weight_counts
from slime_corr.correction.compiling import maybe_compiled
from slime_corr.correction.metrics import raw_weight_columns, weight_extremes, weight_sums
from slime_corr.correction.public_types import WeightInputs
from slime_corr.correction.reductions import count_greater_, indicator, row_products, seq_sums, valid_float
from slime_corr.correction.stage_records import (
    BatchColumns,
    CorrectionPlan,
    Kept,
    Layout,
    Sequences,
    Weighted,
)
from slime_corr.correction.statistics import RAW_SUMS, WEIGHT_SUMS
from slime_corr.layout.segments import Segments


class TokenWeights(NamedTuple):
    """Built-in token-level IS after rejection (`token_weights`)."""

    final_mask: Tensor  # [B, S] 0/1 after rejection
    weights: Tensor  # [B, S], 0 outside final_mask
    raw_columns: Tensor  # [n, 2|3] `RAW_SUMS[1:]`: Σ w_raw, # w_raw > U, # w_raw < L (not in truncate mode)
    weight_columns: Tensor  # [n, 2] Σw, Σw²
    max: Tensor  # the weights' max and min over final_mask
    min: Tensor


class CustomRejection(NamedTuple):
    """What a custom weighting function keeps (`custom_rejection`)."""

    token_keep: Tensor  # [B, S] 0/1: its mask on the good sequences, less its NaN/inf weights
    weights: Tensor | None  # [B, S] its weights, or None
    kept_tokens: Tensor  # [n] Σ token_keep over the whole sequence


def ess_bounded_config(inputs: WeightInputs, config: RolloutCorrectionConfig, seq_keep: Tensor, seqs: Sequences,
                       layout: Layout, step_bounds: StepBounds | None, batch: BatchColumns) -> RolloutCorrectionConfig:
    """`--tis-ess-target`: `config` with U = this call's (or its step's) largest bound whose truncated weights keep
    ESS = (Σw)² / (N Σw²) >= the target, over the kept units (tokens, or sequences counted once), from one SUM."""
    if config.tis_level == "token":
        unit = inputs.loss_mask * layout.segments.expand(seq_keep)
    else:
        unit = seqs.usable.to(inputs.loss_mask.dtype) * layout.cp_first
    bound = budget.ess_target_bound(inputs, config, unit, layout.groups, step_bounds)
    batch.add_call_value("tis_ess_bound", bound, layout.groups)
    return config.replace(tis_upper_bound=float(bound), tis_ess_target=None)  # one device->host read


def weight_stage(inputs: WeightInputs | None, kept: Kept, config: RolloutCorrectionConfig, plan: CorrectionPlan,
                 layout: Layout, batch: BatchColumns) -> Weighted:
    """The final mask (token keep x sequence keep) and the IS weights before batch normalization: built-in
    token-level (per token), sequence/geometric (per sequence, expanded once normalized) or a custom function's;
    their statistics go to `batch`. `inputs`: the built-in function's (None for a custom one)."""
    seg = layout.segments
    token_is = plan.builtin and config.use_tis and config.tis_level == "token"
    seq_weights = sequence_weights(inputs, config, batch) if plan.builtin and config.use_tis and not token_is else None
    weights = kept.custom_weights
    if token_is:  # the per-token weights, their statistics and the sketch's first digit
        tw = maybe_compiled(token_weights, config)(inputs, config, kept.token_keep, seg.expand(kept.seq_keep), seg)
        final_mask, weights = tw.final_mask, tw.weights
        batch.token_columns[RAW_SUMS[1:1 + tw.raw_columns.shape[-1]]] = tw.raw_columns
        batch.token_columns[WEIGHT_SUMS[1:]] = tw.weight_columns
        batch.aliases.update(raw_weight_units="finite_token_count", weight_units="final_token_count")
        add_weight_stats(batch, weights, final_mask, tw.max, tw.min, binary=True)
    else:
        final_mask = kept.token_keep * seg.expand(kept.seq_keep)
    if seq_weights is not None:  # constant along each sequence: statistics on [n], each sequence counted once
        unit = kept.kept_seqs.to(inputs.loss_mask.dtype)
        unit = unit if layout.cp_first == 1.0 else unit * layout.cp_first
        counted = seq_weights * unit
        batch.seq_columns[WEIGHT_SUMS[1:]] = torch.stack([counted, counted * counted], -1)
        batch.aliases["weight_units"] = "final_seq_count"
        add_weight_stats(batch, counted, unit, *weight_extremes(counted, unit), binary=True)
    elif weights is not None and not plan.builtin:
        weights = torch.where(final_mask > 0, weights, final_mask.new_zeros(()))  # its NaN stays out
        unit = final_mask.double()
        if config.tis_level != "token":
            unit = unit / seg.expand(kept.kept_tokens.clamp_min(1).double(), fill=1.0)
        batch.stats.add_sums(WEIGHT_SUMS, weight_sums(weights, unit).sum(0))
        add_weight_stats(batch, weights, unit, *weight_extremes(weights, final_mask, shifted_max=True))
    return Weighted(final_mask, kept.kept_tokens, weights, seq_weights)


def sequence_weights(inputs: WeightInputs, config: RolloutCorrectionConfig, batch: BatchColumns) -> Tensor:
    """Built-in sequence/geometric IS: the bounded weight w = bound(exp(clamp(ℓ, ±20))) of each sequence [n]; the
    raw weights' columns (Σ w_raw, # w_raw > U, # w_raw < L) go to `batch`, one unit per sequence."""
    lower, upper = config.tis_bounds
    weight, raw, _ = default_weight_parts(inputs, config, rs=False)
    weight, raw = weight.squeeze(-1), raw.squeeze(-1)
    columns = [raw, raw > upper] + ([raw < lower] if config.effective_tis_mode != "truncate" else [])
    batch.seq_columns[RAW_SUMS[1:len(columns) + 1]] = torch.stack(columns, -1)
    batch.aliases["raw_weight_units"] = "finite_seq_count"
    return weight


def token_weights(inputs: WeightInputs, config: RolloutCorrectionConfig, token_keep: Tensor, seq_keep: Tensor,
                  seg: Segments) -> TokenWeights:
    """Built-in token-level IS after rejection: final mask = token keep x sequence keep ([B, S] each), the weights
    (0 outside it), per-sequence raw-weight and weight sums, the weights' extremes. Raw weights are counted over the
    valid tokens (the caller keeps the good sequences)."""
    w, w_raw, _ = default_weight_parts(inputs, config, rs=False)
    lower, upper = config.tis_bounds
    raw = [seg.sum(w_raw)]
    if config.effective_tis_mode != "truncate":  # w_raw is 0 outside the mask: count w_raw < L there only
        raw.append(seg.sum(indicator(torch.lt, w_raw, lower).mul_(inputs.loss_mask)))
    raw.insert(1, count_greater_(w_raw, upper, seg))  # overwrites w_raw
    final_mask = token_keep * seq_keep
    weights = w.mul_(final_mask)
    square = seg.sum(weights * weights) if seg.packed else row_products(weights[:, None]).view(-1)
    return TokenWeights(final_mask, weights, torch.stack(raw, -1), torch.stack([seg.sum(weights), square], -1),
                        *weight_extremes(weights, final_mask))


def add_weight_stats(batch: BatchColumns, weights: Tensor, unit: Tensor, w_max: Tensor, w_min: Tensor,
                     binary: bool = False) -> None:
    """The weights' extremes and the sketch's level-1 histogram (`unit`: 0/1 with `binary`); `batch.sketch`
    keeps what `quantiles.refine` needs."""
    batch.stats.add_max("weight_max", w_max)
    batch.stats.add_min("weight_min", w_min)
    hist, batch.sketch = quantiles.level1(weights, unit, binary)
    batch.stats.add_sum(quantiles.LEVEL1_KEY, hist)


def custom_rejection(fn: Callable, log_ratio: Tensor, valid: Tensor, good: Tensor, seqs: Sequences, layout: Layout,
                     config: RolloutCorrectionConfig, batch: BatchColumns) -> CustomRejection:
    """A custom weighting function on the `good` sequences ([n] 0/1) and `valid` tokens (0/1). Its raw weights feed
    the raw-weight metrics (+inf counts as exp(20)); a NaN/inf weight rejects its token (counted, warned); negative
    weights are counted (an error when the metrics are read). The function sees one sequence per row (a packed row
    is unpacked for it); its per-sequence counts take one extra CP collective (the mask is arbitrary)."""
    seg, dtype = layout.segments, log_ratio.dtype
    good_tok = seg.expand(good)
    mask_in = valid * good_tok
    inputs = WeightInputs(log_ratio=seg.to_rows(log_ratio * good_tok), loss_mask=seg.to_rows(mask_in > 0),
                          seq_log_ratio_sum=seqs.log_ratio_sum, seq_token_count=seqs.token_count,
                          cp_group=layout.cp_group, dp_group=layout.dp_group)
    out = call_weight_function(fn, inputs, config)
    batch.function_metrics.update(out.metrics)
    fn_mask = valid_float(seg.from_rows(out.loss_mask), dtype) * mask_in
    weights = None if out.weights is None else seg.from_rows(out.weights.detach().to(dtype))
    if out.raw_weights is not None:  # an overflowed raw weight counts as the built-in ceiling exp(20)
        raw = seg.from_rows(out.raw_weights.detach().to(dtype)).nan_to_num(0.0, math.exp(LOG_RATIO_CLAMP), 0.0)
        unit = mask_in if config.tis_level == "token" else mask_in / seg.expand(seqs.token_count.clamp_min(1),
                                                                                 fill=1.0)
        columns = raw_weight_columns(raw, unit, *config.tis_bounds)
        batch.stats.add_sums(RAW_SUMS, columns.sum(0, dtype=torch.float64))
    if weights is not None:  # a NaN/inf weight rejects its token (counted), like a non-finite log-prob
        finite, bad = custom_weight_counts(weights, fn_mask)
        batch.stats.add_sums(("custom_nonfinite_weight_count", "custom_negative_weight_count"), bad)
        fn_mask = fn_mask * finite
    return CustomRejection(fn_mask, weights, seq_sums([seg.sum(fn_mask)], layout.cp_group)[:, 0])
