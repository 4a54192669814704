"""Input checks of the correction core's public entry points, one function per entry point.

Only types, shapes, dtypes and devices are checked: they are free (no kernel, no device->host sync). Values are
never read here: non-finite log-probs and advantages are handled by the math (the sequence or token is rejected and
counted), so nothing on the hot path waits for the device. Every error names the argument, what it got and what it
expects.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction.segments import Segments
from slime_corr.correction.types import CorrectionResult, WeightInputs, WeightOutputs


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    kind = type(x)
    shape = getattr(x, "shape", None)
    name = f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__
    return f"{name}" + (f" of shape {tuple(shape)}" if shape is not None else "")


def check_config(config: Any, where: str) -> None:
    if not isinstance(config, RolloutCorrectionConfig):
        hint = " (build it with RolloutCorrectionConfig.from_dict(...))" if isinstance(config, dict) else ""
        raise TypeError(f"{where}: config must be a RolloutCorrectionConfig, got {_describe(config)}{hint}.")


def check_tensor(x: Any, name: str, where: str, *, kind: str = "float", shape: tuple[int, ...] | None = None,
                 like: Tensor | None = None) -> None:
    """`x` must be a tensor of `kind` ("float": a floating dtype; "mask": bool, integer or floating), with `shape`
    (default: 2-D [batch, seq]) on `like`'s device."""
    if not isinstance(x, Tensor):
        hint = "; convert it with torch.as_tensor(...)" if hasattr(x, "__array__") or isinstance(x, list | tuple) else ""
        raise TypeError(f"{where}: {name} must be a torch.Tensor [batch, seq], got {_describe(x)}{hint}.")
    if kind == "float" and not x.is_floating_point():
        raise TypeError(f"{where}: {name} must hold floating-point log-probs/values, got {_describe(x)}.")
    if kind == "mask" and x.is_complex():
        raise TypeError(f"{where}: {name} must be a bool, integer or float mask, got {_describe(x)}.")
    if shape is None and x.dim() != 2:
        raise ValueError(f"{where}: {name} must be 2-D [batch, seq] (this rank's slice under context "
                         f"parallelism), got {_describe(x)}.")
    if shape is not None and tuple(x.shape) != shape:
        raise ValueError(f"{where}: {name} must have shape {shape} like log_probs, got {_describe(x)}.")
    if like is not None and x.device != like.device:
        raise ValueError(f"{where}: {name} is on {x.device} but log_probs is on {like.device}; put both on one device.")


def check_group(group: Any, name: str, where: str) -> None:
    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"{where}: {name} must be a torch.distributed ProcessGroup or None, got {_describe(group)}.")


def check_batch_norm_mean(mean: Any, config: RolloutCorrectionConfig, where: str) -> None:
    if mean is None:
        return
    if not (config.use_tis and config.tis_batch_normalize):
        raise ValueError(f"{where}: batch_norm_mean is given but --tis-batch-normalize is off, so it would be "
                         "ignored; pass None or turn the flag on.")
    if not isinstance(mean, Tensor) or mean.numel() != 1 or not mean.is_floating_point():
        raise TypeError(f"{where}: batch_norm_mean must be a one-element float tensor (e.g. weight_mean(...)), got "
                        f"{_describe(mean)}.")


def check_segments(segments: Any, shape: tuple[int, ...], where: str) -> None:
    """`segments` must be None (one sequence per row) or a `Segments` of the inputs' [B, S] / [1, T] shape."""
    if segments is None:
        return
    if not isinstance(segments, Segments):
        raise TypeError(f"{where}: segments must be a slime_corr.correction.segments.Segments (e.g. "
                        f"Segments.packed_row(cu_seqlens, T)) or None, got {_describe(segments)}.")
    if segments.shape() != shape:
        raise ValueError(f"{where}: segments describe tokens of shape {segments.shape()}, but log_probs has shape "
                         f"{shape}; a packed micro-batch is one row [1, T] with T = its packed length.")


def check_correction_inputs(log_probs: Any, rollout_log_probs: Any, loss_mask: Any, config: Any,
                            batch_norm_mean: Any = None, cp_group: Any = None, dp_group: Any = None,
                            segments: Any = None, where: str = "compute_rollout_correction") -> None:
    """The checks of `compute_rollout_correction`."""
    check_config(config, where)
    check_tensor(log_probs, "log_probs", where)
    shape = tuple(log_probs.shape)
    check_tensor(rollout_log_probs, "rollout_log_probs", where, shape=shape, like=log_probs)
    check_tensor(loss_mask, "loss_mask", where, kind="mask", shape=shape, like=log_probs)
    check_batch_norm_mean(batch_norm_mean, config, where)
    check_group(cp_group, "cp_group", where)
    check_group(dp_group, "dp_group", where)
    check_segments(segments, shape, where)


def check_policy_loss_inputs(log_probs: Any, old_log_probs: Any, rollout_log_probs: Any, advantages: Any,
                             loss_mask: Any, config: Any, seq_length_for_norm: Any, batch_norm_mean: Any,
                             loss_fn: Any, cp_group: Any = None, dp_group: Any = None, correction: Any = None,
                             segments: Any = None) -> None:
    """The checks of `compute_policy_loss`. Advantages may be per token [B, S] or per sequence [B] / [B, 1]
    (broadcast along the sequence; [n] / [n, 1] for the n sequences of a packed row)."""
    where = "compute_policy_loss"
    check_config(config, where)
    check_tensor(log_probs, "log_probs", where)
    shape = tuple(log_probs.shape)
    check_segments(segments, shape, where)
    num_seqs = segments.num if segments is not None else shape[0]
    if config.use_rollout_logprobs:
        if rollout_log_probs is None:
            raise ValueError(f"{where}: --use-rollout-logprobs (bypass) takes pi_old from rollout_log_probs, "
                             "which is None; pass the rollout engine's log-probs.")
    elif old_log_probs is None:
        raise ValueError(f"{where}: old_log_probs (pi_old) is None; decoupled mode needs it (recompute it "
                         "before the update), or set --use-rollout-logprobs (bypass).")
    else:
        check_tensor(old_log_probs, "old_log_probs", where, shape=shape, like=log_probs)
    if rollout_log_probs is None and config.computes_metrics:
        raise ValueError(f"{where}: rollout_log_probs is None, but rollout correction / mismatch metrics are on; "
                         "pass the rollout engine's log-probs.")
    if rollout_log_probs is not None:
        check_tensor(rollout_log_probs, "rollout_log_probs", where, shape=shape, like=log_probs)
    adv_shape = tuple(advantages.shape) if isinstance(advantages, Tensor) else None
    if adv_shape not in (shape, (num_seqs,), (num_seqs, 1)):
        expected = f"{shape} per token, or ({num_seqs},) / ({num_seqs}, 1) per sequence"
        error = ValueError if adv_shape is not None else TypeError
        what = "have shape" if adv_shape is not None else "be a torch.Tensor of shape"
        raise error(f"{where}: advantages must {what} {expected}, got {_describe(advantages)}.")
    check_tensor(advantages, "advantages", where, shape=adv_shape, like=log_probs)
    check_tensor(loss_mask, "loss_mask", where, kind="mask", shape=shape, like=log_probs)
    if seq_length_for_norm is not None and (isinstance(seq_length_for_norm, bool)
                                            or not isinstance(seq_length_for_norm, int) or seq_length_for_norm <= 0):
        raise ValueError(f"{where}: seq_length_for_norm must be a positive int (the maximum response length), got "
                         f"{seq_length_for_norm!r}.")
    if (seq_length_for_norm is None and segments is not None and segments.packed
            and config.loss_agg_mode == "seq-mean-token-sum-norm"):
        raise ValueError(f"{where}: --loss-agg-mode seq-mean-token-sum-norm divides by a constant of the run (the "
                         "maximum response length); a packed row has no padded length to default to: pass "
                         "seq_length_for_norm.")
    check_batch_norm_mean(batch_norm_mean, config, where)
    if loss_fn is not None and not (isinstance(loss_fn, str) or callable(loss_fn)):
        raise TypeError(f"{where}: loss_fn must be a registered name, an import path or a callable, got "
                        f"{_describe(loss_fn)}.")
    check_group(cp_group, "cp_group", where)
    check_group(dp_group, "dp_group", where)
    if correction is not None and not (isinstance(correction, CorrectionResult)
                                       and tuple(correction.loss_mask.shape) == shape):
        raise TypeError(f"{where}: correction must be the CorrectionResult of this micro-batch (loss_mask of shape "
                        f"{shape}), got {_describe(correction)}.")


def check_weight_outputs(out: Any, inputs: WeightInputs, config: RolloutCorrectionConfig) -> WeightOutputs:
    """What a custom weighting function returned: a `WeightOutputs` with [B, S] tensors (weights and raw weights may
    also be [B, 1], one per sequence) and a dict of 0-dim metrics. Checked at every call (types and shapes only)."""
    label = f"--custom-tis-function-path {config.custom_tis_function_path}"
    if not isinstance(out, WeightOutputs):
        raise TypeError(f"{label} returned {_describe(out)}; it must return slime_corr.correction.WeightOutputs("
                        "weights=..., loss_mask=...) (see examples/custom_tis.py).")
    shape = tuple(inputs.log_ratio.shape)
    for name in ("weights", "raw_weights"):
        value = getattr(out, name)
        if value is None:
            continue
        if not isinstance(value, Tensor) or not value.is_floating_point() or tuple(value.shape) not in (
                shape, (shape[0], 1)):
            raise ValueError(f"{label} returned WeightOutputs.{name} = {_describe(value)}; expected a float tensor "
                             f"of shape {shape} (or ({shape[0]}, 1)), or None.")
    mask = out.loss_mask
    if not isinstance(mask, Tensor) or mask.is_complex() or tuple(mask.shape) != shape:
        raise ValueError(f"{label} returned WeightOutputs.loss_mask = {_describe(mask)}; expected a bool or 0/1 "
                         f"tensor of shape {shape}.")
    if not isinstance(out.metrics, dict) or not all(
            isinstance(k, str) and isinstance(v, Tensor) and v.numel() == 1 for k, v in out.metrics.items()):
        raise ValueError(f"{label} returned WeightOutputs.metrics = {out.metrics!r}; expected a dict of "
                         "name -> one-element tensor.")
    if out.weights is not None and out.weights.shape != shape:
        out.weights = out.weights.expand(shape)
    if out.raw_weights is not None and out.raw_weights.shape != shape:
        out.raw_weights = out.raw_weights.expand(shape)
    return out
