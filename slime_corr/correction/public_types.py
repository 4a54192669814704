"""The public records of the correction core: what a weighting function receives and returns, and the result of
`compute_rollout_correction` (the records its stages pass each other are in `stage_records.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import Tensor

from slime_corr.correction.statistics import BatchStatistics


@dataclass
class WeightInputs:
    """What a weighting function receives: `fn(inputs: WeightInputs, config) -> WeightOutputs`.

    All tensors are detached. `[B, S]` tensors are the caller's local slice (zig-zag slice under CP), one sequence
    per row: a packed micro-batch's sequences are given as rows too (`Segments.to_rows`, padded with zeros /
    False), and what the function returns is packed back; `[B]` tensors are already summed over the WHOLE
    sequence (reduced over `cp_group`), so a function that only uses them is CP-correct without touching process
    groups.

    - `log_ratio` [B, S]: lr = lp_train - lp_rollout, 0 outside `loss_mask`.
    - `loss_mask` [B, S] bool: the original mask restricted to finite data (sequences with a non-finite
      log-prob at a valid position are already removed). (The built-in function also takes it as 0/1 floats.)
    - `seq_log_ratio_sum` [B]: Σ_t m·lr over the whole sequence; `seq_token_count` [B]: Σ_t m.
    - `cp_group`, `dp_group`: for functions that need further reductions.
    """

    log_ratio: Tensor
    loss_mask: Tensor
    seq_log_ratio_sum: Tensor
    seq_token_count: Tensor
    cp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None


@dataclass
class WeightOutputs:
    """What a weighting function returns.

    - `weights` [B, S] or None (no IS): detached and zeroed outside the final loss mask by the caller.
    - `loss_mask` [B, S] (bool or float): the mask after the function's rejection; intersected with the input mask.
    - `metrics`: extra 0-dim tensors, logged as given (the function reduces them itself if needed).
    - `raw_weights` [B, S] or None: weights before bounding (e.g. exp(clamp(ℓ, -20, 20))); when given, the
      `mis_mean_is_weight_before_clip` and truncate/clip/mask fractions are computed from it (+inf counts as
      exp(20), the built-in ceiling; NaN or -inf as 0).
    """

    weights: Tensor | None
    loss_mask: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    raw_weights: Tensor | None = None


@dataclass
class CorrectionResult:
    """Result of `compute_rollout_correction`.

    - `weights` [B, S] float (detached, 0 outside `loss_mask`) or None when IS is off.
    - `loss_mask` [B, S] float32 (0/1): the mask after non-finite rejection, RS and veto.
    - `denominator_mask` [B, S] float32: the mask loss denominators use; `loss_mask` by default, the original
      mask with `rs_keep_loss_denominator`.
    - `metrics`: {key: 0-dim tensor}; see `slime_corr.correction.metrics` for the table.
    - `seq_token_count` [B]: Σ_t denominator_mask over the whole sequence (CP-reduced).
    - `global_token_count`, `global_seq_count`: 0-dim float64, Σ denominator_mask and the number of sequences
      with ≥ 1 denominator token, over DP x CP (each sequence counted once).
    - `stats`: the reduced batch statistics (`statistics.BatchStatistics`: sums over DP x CP, true extremes)
      `metrics` are computed from (None when no metric is computed); `merge_stats` of a step's micro-batches then
      `correction_metrics` gives the exact metrics of the step.
    - `function_metrics`: the part of `metrics` a custom weighting function returned (not in `stats`).
    - `divisor`: 0-dim float64, what `--tis-batch-normalize` divided the weights by (None when nothing was divided).
    """

    weights: Tensor | None
    loss_mask: Tensor
    denominator_mask: Tensor
    metrics: dict[str, Tensor]
    seq_token_count: Tensor | None = None
    global_token_count: Tensor | None = None
    global_seq_count: Tensor | None = None
    stats: BatchStatistics | None = field(default=None, repr=False)
    function_metrics: dict[str, Tensor] = field(default_factory=dict)
    divisor: Tensor | None = None
