"""A custom weighting function for `--custom-tis-function-path examples/custom_tis.py:length_aware_geometric_is`.

Signature (checked at start-up): `fn(inputs: WeightInputs, config: RolloutCorrectionConfig) -> WeightOutputs`.
Its weights and mask only use the per-sequence quantities the core has already summed over the context-parallel
group (`seq_log_ratio_sum`, `seq_token_count`), so they are CP-correct without touching process groups; its one
metric is a batch fraction, counted over `inputs.dp_group`.
"""

from __future__ import annotations

import math

import torch

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import WeightInputs, WeightOutputs
from slime_corr.correction.reductions import global_sum


def length_aware_geometric_is(inputs: WeightInputs, config: RolloutCorrectionConfig) -> WeightOutputs:
    """Geometric-mean IS weight per sequence, truncated at U, and rejection of sequences whose
    geometric ratio leaves [1/U', U'] with U' = U ** (1 / sqrt(n)) (tighter for long sequences).

        g_i = exp(Σ_t m·lr / n_i),   w_i = min(g_i, U),   keep_i = |log g_i| ≤ log(U) / sqrt(n_i)
    """
    _, upper = config.tis_bounds
    count = inputs.seq_token_count.clamp(min=1)
    log_g = (inputs.seq_log_ratio_sum / count).clamp(-20.0, 20.0)
    keep = log_g.abs() <= math.log(upper) / count.sqrt()
    valid = inputs.loss_mask > 0
    weights = torch.where(valid, log_g.exp().clamp(max=upper)[:, None].expand_as(valid), 0.0)
    loss_mask = inputs.loss_mask & keep[:, None]
    has_tokens = inputs.seq_token_count > 0
    # Every CP rank holds the same sequences, so counting over the data-parallel group gives the batch fraction.
    counts = global_sum(torch.stack([(~keep & has_tokens).sum(), has_tokens.sum()]).double(), dp_group=inputs.dp_group)
    rejected = counts[0] / counts[1].clamp(min=1)
    return WeightOutputs(weights=weights, loss_mask=loss_mask, metrics={"custom_rejected_seq_fraction": rejected})
