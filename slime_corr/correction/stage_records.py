"""The records the stages of `compute_rollout_correction` pass each other (`core.py`, `weight_stage.py`).

log-ratios (`LogRatios`, per token and per sequence) -> rejection (`Kept`) -> weights (`Weighted`) -> batch
statistics (`BatchColumns`, reduced once) -> normalization and metrics. `CorrectionPlan` holds what the config
decides once per call, `Layout` where the call's sequences live (rows or a packed row, the process groups).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch
from torch import Tensor

from slime_corr.correction import quantiles
from slime_corr.correction.divergence import TokenStage
from slime_corr.correction.metrics import LOCAL
from slime_corr.correction.reductions import BatchStats, ProcessGroup, active_groups, cp_first, group_size
from slime_corr.layout.segments import Segments

VETO_COLUMN = len(LOCAL)  # in `LogRatios.seq_sums`: the tokens under the veto threshold, when the veto is on


class CorrectionPlan(NamedTuple):
    """What the config decides once per call."""

    correct: bool  # IS / RS / veto change the loss (else the metrics only)
    veto_log_threshold: float | None  # log C of --rs-veto-threshold
    weight_fn: Callable | None  # the weighting function (None: no correction)
    builtin: bool  # it is the built-in one (`builtin_weights.default_weights`), run at the shapes of its level
    token_rs_bounds: tuple[float, float] | None  # built-in token-level RS: decided in the token pass


class Layout(NamedTuple):
    """Where the call's sequences live: rows of [B, S] or segments of a packed row, and the process groups."""

    segments: Segments
    cp_group: ProcessGroup
    dp_group: ProcessGroup
    groups: list  # the groups of size > 1 (`active_groups`)
    cp_first: float  # 1.0 on CP rank 0 (or without CP), else 0.0: sequence-level terms are counted once

    @classmethod
    def of(cls, shape: torch.Size, segments: Segments | None, cp_group: ProcessGroup,
           dp_group: ProcessGroup) -> Layout:
        return cls(segments or Segments.rows(*shape), cp_group, dp_group, active_groups(cp_group, dp_group),
                   cp_first(cp_group))


class LogRatios(NamedTuple):
    """The log-ratio stage: lr per token and the per-sequence sums over the whole sequence (after the CP sum)."""

    log_ratio: Tensor  # lr = lp_train - lp_rollout at valid tokens, 0 elsewhere (non-finite -> ±max)
    valid: Tensor  # the loss mask as 0/1 floats of the compute dtype
    seq_sums: Tensor  # [n, k] whole-sequence sums: `LOCAL`, the veto count, the token-RS kept count, divergence
    token_rows: Tensor  # [n, len(TOKEN_SUMS)] local sums of the token mismatch terms
    max_prob_diff: Tensor  # [n] local max |p_train - p_rollout|
    token_rs_keep: Tensor | None  # built-in token-level RS: 0/1 keep of the valid tokens
    divergence: TokenStage | None  # the divergence filter's token stage
    divergence_column: int  # the first column of `seq_sums` the divergence filter adds (after the others)
    value_counts: Tensor  # `checks.input_value_counts`

    @property
    def dtype(self) -> torch.dtype:
        return self.valid.dtype


class Sequences(NamedTuple):
    """Per sequence [n], from `LogRatios.seq_sums`."""

    frame: Tensor  # float64 [n, 5]: valid tokens, Σlr, Σlp_train, Σlp_rollout, non-finite tokens
    nonfinite: Tensor  # bool: a non-finite token, or a whole-sequence sum that overflowed
    has_tokens: Tensor  # bool: at least one valid token
    unusable: Tensor  # bool: no valid token, or non-finite
    usable: Tensor  # bool: the finite sequences with a valid token
    token_count: Tensor  # valid tokens, 0 in a non-finite sequence
    log_ratio_sum: Tensor  # Σlr, 0 in a non-finite sequence


class Kept(NamedTuple):
    """The rejection stage: what stays after non-finite rejection, the weighting function's RS or mask, the
    divergence filter and the veto."""

    token_keep: Tensor  # [B, S] 0/1: token-level rejection (token RS, token divergence, a custom mask)
    seq_keep: Tensor  # [n] 0/1: sequence-level rejection (non-finite, sequence RS, divergence, veto)
    rs_kept_tokens: Tensor  # [n] tokens kept before the veto (the weighting function, RS and divergence)
    kept_tokens: Tensor  # [n] tokens kept after the veto too
    kept_seqs: Tensor  # [n] 0/1 floats (the compute dtype): kept_tokens > 0
    custom_weights: Tensor | None  # a custom function's weights (they come with its mask)


class Weighted(NamedTuple):
    """The weight stage: the final mask and the IS weights before batch normalization."""

    final_mask: Tensor  # [B, S] 0/1 after rejection and veto
    kept_tokens: Tensor  # [n] Σ final_mask over the whole sequence
    weights: Tensor | None  # [B, S] per-token weights, 0 outside final_mask (None: sequence weights or no IS)
    seq_weights: Tensor | None  # [n] built-in sequence/geometric IS: the bounded weight of each sequence


@dataclass
class SequenceCounts:
    """The per-sequence counts [n] the stages collect (finite; bool or 0/1 floats), summed into the
    `BatchStatistics` fields of the same names (see there); None where the config does not count them."""

    finite_token_count: Tensor  # valid tokens of the finite sequences (0 in a non-finite one)
    finite_seq_count: Tensor  # the finite sequences with a valid token
    valid_token_count: Tensor  # valid tokens
    valid_seq_count: Tensor  # sequences with a valid token
    nonfinite_token_count: Tensor  # valid tokens with a non-finite log-prob
    function_kept_token_count: Tensor | None = None  # rejection stage: tokens kept before the veto
    function_kept_seq_count: Tensor | None = None
    final_token_count: Tensor | None = None  # rejection stage: tokens kept after the veto too
    final_seq_count: Tensor | None = None
    vetoed_token_count: Tensor | None = None  # the veto: finite valid tokens with lr < log C in the vetoed sequences
    vetoed_seq_count: Tensor | None = None
    divergence_rejected_token_count: Tensor | None = None  # the divergence filter's rejections
    divergence_rejected_seq_count: Tensor | None = None

    def present(self) -> dict[str, Tensor]:
        """{field name: counts} of the counts collected, in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass
class BatchColumns:
    """The batch statistics collected by the stages, summed and reduced at once (`core.batch_statistics`).

    `counts` [n] each (finite), `token_columns` / `seq_columns` [n, k] values under the `BatchStatistics` field
    names of their columns (zeroed in the unusable sequences; the sequence-level ones counted once across CP),
    `stats` what a stage adds directly, `aliases` the `BatchStatistics` fields that equal others ({alias: field}),
    `sketch` the weights prepared for the exact quantiles (`quantiles.refine`).
    """

    counts: SequenceCounts
    token_columns: dict[tuple[str, ...], Tensor]
    seq_columns: dict[tuple[str, ...], Tensor]
    stats: BatchStats = field(default_factory=BatchStats)
    aliases: dict[str, str] = field(default_factory=dict)
    function_metrics: dict[str, Tensor] = field(default_factory=dict)  # a custom weighting function's metrics
    sketch: quantiles.Counts | None = None

    def add_call_value(self, name: str, value: Tensor, groups: list) -> None:
        """Logs a value every rank of the call holds (a budgeted bound) as (calls, Σ value) sums (the
        `BatchStatistics` fields `{name}_calls`, `{name}_sum`), divided by the ranks so the batch SUM gives
        (1, value) per call and merged micro-batches their mean."""
        share = 1.0
        for g in groups:
            share /= group_size(g)
        self.stats.add_sums((f"{name}_calls", f"{name}_sum"),
                            torch.stack([torch.ones_like(value), value]).double() * share)
