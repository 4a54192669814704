"""IS weights and rejection sampling of docs/theory.md: the built-in weighting function ("default").

With lr = lp_train - lp_rollout and m the (finite, valid) loss mask:
- aggregate ℓ: token `lr[t]`; sequence `Σ_t m·lr`; geometric `Σ_t m·lr / Σ_t m` (broadcast to the tokens);
- IS: `w_raw = exp(clamp(ℓ, -20, 20))`, then truncate `min(w_raw, U)`, clip `clamp(w_raw, L, U)`, or
  mask `w_raw if L ≤ w_raw ≤ U else 0` (mask mode leaves the loss mask alone); 0 at padding;
- RS: keep a token/sequence iff `log L ≤ ℓ ≤ log U` (unclamped, compared in log space).
Masks and decisions are 0/1 floats: on CPU, compares, `where` and bool tensors cost several times more.
Veto, non-finite rejection and batch normalization apply to every weighting function and live in `core.py`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction.public_types import WeightInputs, WeightOutputs
from slime_corr.correction.reductions import float_mask, indicator
from slime_corr.registry import WEIGHT_FUNCTIONS

LOG_RATIO_CLAMP = 20.0


def _as_float(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as 0/1 floats; a float mask (0/1, as the core passes it) as it is."""
    return float_mask(mask, dtype) if mask.dtype == torch.bool else mask


def aggregate_log_ratio(inputs: WeightInputs, level: str) -> Tensor:
    """ℓ per token ([B, S]) or per sequence ([B, 1], broadcastable)."""
    if level == "token":
        return inputs.log_ratio
    if level == "sequence":
        return inputs.seq_log_ratio_sum.unsqueeze(-1)
    if level == "geometric":
        return (inputs.seq_log_ratio_sum / inputs.seq_token_count.clamp_min(1)).unsqueeze(-1)
    raise ValueError(f"unknown level {level!r}")


def bound_weights(w_raw: Tensor, mode: str, lower: float, upper: float) -> Tensor:
    """truncate: min(w, U); clip: clamp(w, L, U); mask: w where L ≤ w ≤ U else 0 (float indicators, no bool)."""
    if mode == "truncate":
        return w_raw.clamp(max=upper)
    if mode == "clip":
        return w_raw.clamp(min=lower, max=upper)
    if mode == "mask":
        return indicator(torch.le, w_raw, upper).mul_(indicator(torch.ge, w_raw, lower)).mul_(w_raw)
    raise ValueError(f"unknown tis mode {mode!r}")


def in_log_bounds(log_value: Tensor, lower: float, upper: float) -> Tensor:
    """`L ≤ exp(x) ≤ U` as 0/1 floats, evaluated as `log L ≤ x ≤ log U` (no overflow; x must be NaN-free)."""
    keep = indicator(torch.le, log_value, math.log(upper))
    return keep.mul_(indicator(torch.ge, log_value, math.log(lower))) if lower > 0 else keep


def rs_keep(inputs: WeightInputs, config: RolloutCorrectionConfig) -> Tensor:
    """RS keep decision as 0/1 floats: [B, S] (token level) or [B, 1] (sequence/geometric level)."""
    lower, upper = config.rs_bounds
    return in_log_bounds(aggregate_log_ratio(inputs, config.rs_level), lower, upper)


def raw_is_weights(inputs: WeightInputs, config: RolloutCorrectionConfig) -> Tensor:
    """w_raw = exp(clamp(ℓ, -20, 20)) at the configured IS level ([B, S] or [B, 1])."""
    return aggregate_log_ratio(inputs, config.tis_level).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp_()


def default_weight_parts(
    inputs: WeightInputs, config: RolloutCorrectionConfig, *, rs: bool = True
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(w, w_raw, keep) of the built-in function at the shape of their level: [B, S] (token level, 0 outside the
    mask, except w in clip mode, which is L there) or [B, 1] (sequence/geometric, broadcastable, unmasked).
    w = bounded IS weight, w_raw = exp(clamp(ℓ, ±20)), keep = RS decision (0/1 floats); None when `--use-tis` /
    `--use-rs` is off (or `rs` is False: the caller has the RS decision). The core uses these shapes directly."""
    w = w_raw = keep = None
    mask = inputs.loss_mask
    if config.use_tis:
        w_raw = raw_is_weights(inputs, config)
        if config.tis_level == "token":
            w_raw = w_raw.mul_(_as_float(mask, w_raw.dtype))
        w = bound_weights(w_raw, config.effective_tis_mode, *config.tis_bounds)
    if config.use_rs and rs:
        keep = rs_keep(inputs, config)
        if config.rs_level == "token":
            keep = keep.mul_(_as_float(mask, keep.dtype))
    return w, w_raw, keep


@WEIGHT_FUNCTIONS.register("default")
def default_weights(inputs: WeightInputs, config: RolloutCorrectionConfig) -> WeightOutputs:
    """The IS weights (`--use-tis`) and RS mask (`--use-rs`) of docs/theory.md, as [B, S] tensors zero outside the mask."""
    w, w_raw, keep = default_weight_parts(inputs, config)
    mask_f = _as_float(inputs.loss_mask, w_raw.dtype if w_raw is not None else inputs.log_ratio.dtype)
    weights = raw = None
    if w is not None:
        weights, raw = w * mask_f, w_raw * mask_f
    if keep is not None:
        mask_f = keep * mask_f
    return WeightOutputs(weights=weights, loss_mask=mask_f > 0, raw_weights=raw)
