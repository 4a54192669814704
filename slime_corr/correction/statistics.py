"""The batch statistics of a correction call: the record the stages fill, `CorrectionResult.stats` holds,
`merge_stats` adds up over a step's micro-batches and `correction_metrics` / `metric_pairs` read.

`BatchStatistics` fields are 0-dim float64 tensors reduced over DP x CP (sums, or true extremes), None where the
config does not compute them. The column groups (`TokenTermSums`, `SequenceTermSums`, `RawWeightSums`,
`WeightSums`) fix the order in which the stages write their per-sequence columns (the token pass and its Triton
kernel write `TokenTermSums` by position); their field names are those of `BatchStatistics`. A sum is over the
finite valid tokens or sequences unless its comment says otherwise; "unit": a token (token level) or a sequence
(sequence/geometric level, counted once).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from slime_corr.correction import quantiles


class TokenTermSums(NamedTuple):
    """Σ of each token term over the finite valid tokens, in the token pass's column order (`metrics.token_pass`;
    `metrics.mismatch_metrics` holds their means in the same record). x = clamp(lr, ±20), p = exp(lp)."""

    negative_log_ratio: Tensor  # Σ lp_rollout - lp_train
    k3: Tensor  # Σ exp(x) - x - 1
    chi2_token: Tensor  # Σ exp(2x) - 1
    abs_log_ratio: Tensor  # Σ |lr|
    prob_diff: Tensor  # Σ |p_train - p_rollout|
    train_prob: Tensor  # Σ p_train
    rollout_prob: Tensor  # Σ p_rollout
    prob_diff_square: Tensor  # Σ |p_train - p_rollout|²
    train_prob_square: Tensor  # Σ p_train²
    rollout_prob_square: Tensor  # Σ p_rollout²
    train_rollout_prob_product: Tensor  # Σ p_train·p_rollout


class SequenceTermSums(NamedTuple):
    """Σ of each sequence term over the finite valid sequences (`metrics.seq_terms`), m = Σlp / tokens."""

    train_log_ppl: Tensor  # Σ -m_train
    rollout_log_ppl: Tensor  # Σ -m_rollout
    log_ppl_diff: Tensor  # Σ m_rollout - m_train
    log_ppl_abs_diff: Tensor  # Σ |m_rollout - m_train|
    train_ppl: Tensor  # Σ exp(-m_train)
    rollout_ppl: Tensor  # Σ exp(-m_rollout)
    ppl_ratio: Tensor  # Σ exp(m_rollout - m_train)
    chi2_seq: Tensor  # Σ exp(2·clamp(Σ lr, ±20)) - 1


class RawWeightSums(NamedTuple):
    """The raw IS weights w_raw = exp(clamp(ℓ, ±20)) before bounding, over the finite valid units."""

    raw_weight_units: Tensor  # Σ unit
    raw_weight_sum: Tensor  # Σ unit·w_raw
    raw_above_upper: Tensor  # Σ unit·[w_raw > U]
    raw_below_lower: Tensor  # Σ unit·[w_raw < L] (not in truncate mode)


class WeightSums(NamedTuple):
    """The final (bounded) IS weights w over the contributing units."""

    weight_units: Tensor  # Σ unit
    weight_sum: Tensor  # Σ unit·w
    weight_square_sum: Tensor  # Σ unit·w²


TOKEN_SUMS = TokenTermSums._fields
SEQ_SUMS = SequenceTermSums._fields
RAW_SUMS = RawWeightSums._fields
WEIGHT_SUMS = WeightSums._fields
EXTREMA = {"prob_diff_max": torch.maximum, "weight_max": torch.maximum, "weight_min": torch.minimum}
SKETCH = "weight_sketch"


@dataclass
class BatchStatistics:
    """The reduced statistics of one call or, merged, of a step (see the module doc)."""

    # counts: tokens and sequences, each sequence once across CP
    valid_token_count: Tensor | None = None  # tokens of the original loss mask
    valid_seq_count: Tensor | None = None  # sequences with ≥ 1 valid token
    finite_token_count: Tensor | None = None  # valid tokens of the sequences without a non-finite log-prob
    finite_seq_count: Tensor | None = None  # valid sequences without a non-finite log-prob
    nonfinite_token_count: Tensor | None = None  # valid tokens with a non-finite log-prob
    function_kept_token_count: Tensor | None = None  # tokens the weighting function (RS) and divergence filter keep
    function_kept_seq_count: Tensor | None = None  # sequences with ≥ 1 such token
    final_token_count: Tensor | None = None  # tokens left in the loss mask (after the veto too)
    final_seq_count: Tensor | None = None  # sequences with ≥ 1 such token
    vetoed_token_count: Tensor | None = None  # veto: finite valid tokens with lr < log C
    vetoed_seq_count: Tensor | None = None  # veto: finite valid sequences vetoed
    divergence_rejected_token_count: Tensor | None = None  # finite valid tokens the divergence filter rejects
    divergence_rejected_seq_count: Tensor | None = None  # finite valid sequences it rejects whole
    denominator_token_count: Tensor | None = None  # Σ of the loss denominators' mask (final or valid tokens)
    denominator_seq_count: Tensor | None = None  # sequences with ≥ 1 denominator token
    # the mismatch terms (`TokenTermSums`, `SequenceTermSums`) and max |p_train - p_rollout|
    negative_log_ratio: Tensor | None = None
    k3: Tensor | None = None
    chi2_token: Tensor | None = None
    abs_log_ratio: Tensor | None = None
    prob_diff: Tensor | None = None
    train_prob: Tensor | None = None
    rollout_prob: Tensor | None = None
    prob_diff_square: Tensor | None = None
    train_prob_square: Tensor | None = None
    rollout_prob_square: Tensor | None = None
    train_rollout_prob_product: Tensor | None = None
    train_log_ppl: Tensor | None = None
    rollout_log_ppl: Tensor | None = None
    log_ppl_diff: Tensor | None = None
    log_ppl_abs_diff: Tensor | None = None
    train_ppl: Tensor | None = None
    rollout_ppl: Tensor | None = None
    ppl_ratio: Tensor | None = None
    chi2_seq: Tensor | None = None
    prob_diff_max: Tensor | None = None  # max |p_train - p_rollout| over the finite valid tokens (0 without one)
    # IS weights (`RawWeightSums`, `WeightSums`), their extremes and their quantile sketch
    raw_weight_units: Tensor | None = None
    raw_weight_sum: Tensor | None = None
    raw_above_upper: Tensor | None = None
    raw_below_lower: Tensor | None = None
    weight_units: Tensor | None = None
    weight_sum: Tensor | None = None
    weight_square_sum: Tensor | None = None
    weight_max: Tensor | None = None  # true max of the final weights over the contributing units
    weight_min: Tensor | None = None  # true min of them
    weight_sketch: dict[str, Tensor] = field(default_factory=dict)  # the exact quantiles' histograms (`quantiles`)
    # a custom weighting function's bad weights, impossible input values (`checks.INPUT_VALUE_COUNTS`)
    custom_nonfinite_weight_count: Tensor | None = None  # NaN/inf weights (their tokens rejected)
    custom_negative_weight_count: Tensor | None = None  # negative weights (an error when read)
    invalid_mask_count: Tensor | None = None  # loss-mask values outside {0, 1} or NaN
    positive_logprob_count: Tensor | None = None  # valid tokens with a log-prob > tolerance
    nan_logprob_count: Tensor | None = None  # valid tokens with a NaN log-prob
    # budgeted bounds: (calls, Σ bound) per call, so a merged step gives their mean (`BatchColumns.add_call_value`)
    divergence_bound_calls: Tensor | None = None
    divergence_bound_sum: Tensor | None = None  # `--rs-divergence-budget`
    tis_ess_bound_calls: Tensor | None = None
    tis_ess_bound_sum: Tensor | None = None  # `--tis-ess-target`

    @classmethod
    def from_reduced(cls, reduced: dict[str, Tensor], aliases: dict[str, str]) -> BatchStatistics:
        """The record of `BatchStats.reduce()` (keyed by field name; the sketch's histograms by `quantiles`'
        keys), with each alias field set to the statistic it equals."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {name: value for name, value in reduced.items() if name in names}
        values.update({alias: reduced[name] for alias, name in aliases.items()})
        sketch = {key: value for key, value in reduced.items() if key not in names}
        return cls(**values, weight_sketch=sketch)

    def token_terms(self) -> TokenTermSums:
        return TokenTermSums(*(getattr(self, name) for name in TOKEN_SUMS))

    def sequence_terms(self) -> SequenceTermSums:
        return SequenceTermSums(*(getattr(self, name) for name in SEQ_SUMS))

    @property
    def has_raw_weights(self) -> bool:
        return self.raw_weight_units is not None

    @property
    def has_weights(self) -> bool:
        return self.weight_units is not None


def merge_stats(parts: list[BatchStatistics]) -> BatchStatistics:
    """The reduced statistics of a whole step from its micro-batches': sums add, extremes take the max/min, and the
    quantile sketch's refined histograms are added by bin id (a call's own exact quantiles are not merged)."""
    merged: dict[str, Tensor] = {}
    for f in dataclasses.fields(BatchStatistics):
        if f.name == SKETCH:
            continue
        combine = EXTREMA.get(f.name, torch.add)
        for stats in parts:
            value = getattr(stats, f.name)
            if value is not None:
                merged[f.name] = value if f.name not in merged else combine(merged[f.name], value)
    return BatchStatistics(**merged, weight_sketch=quantiles.merge_sketches([p.weight_sketch for p in parts]))


__all__ = ["RAW_SUMS", "SEQ_SUMS", "TOKEN_SUMS", "WEIGHT_SUMS", "BatchStatistics", "RawWeightSums",
           "SequenceTermSums", "TokenTermSums", "WeightSums", "merge_stats"]
