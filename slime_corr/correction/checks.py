"""Input checks of the correction core's public entry points, one function per entry point.

Only types, shapes, dtypes and devices are checked at the call: they are free (no kernel, no device->host sync).
Values are never read on the hot path: non-finite log-probs and advantages are handled by the math (the sequence or
token is rejected and counted); impossible values are counted on the device with the step's statistics and
`check_host_metrics` raises when the metrics reach the host (see the end of this module). Every error names the
argument, what it got and what it expects.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction.public_types import CorrectionResult, WeightInputs, WeightOutputs
from slime_corr.layout.segments import Segments


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
        raise TypeError(f"{where}: segments must be a slime_corr.layout.segments.Segments (e.g. "
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


class CustomFunctionError(TypeError, ValueError):
    """A custom weighting function (`--custom-tis-function-path`) raised, or returned something else than
    `WeightOutputs` of the batch's shapes; the message names the function. When it raised, its own exception is the
    `__cause__` (the main job prints that traceback with `--custom-function-traceback`)."""


def call_weight_function(fn: Any, inputs: WeightInputs, config: RolloutCorrectionConfig) -> WeightOutputs:
    """`fn(inputs, config)`, checked (`check_weight_outputs`); an exception it raises becomes a CustomFunctionError
    naming it."""
    try:
        out = fn(inputs, config)
    except Exception as e:
        raise CustomFunctionError(f"--custom-tis-function-path {config.custom_tis_function_path} raised "
                                  f"{type(e).__name__}: {e}") from e
    return check_weight_outputs(out, inputs, config)


def check_weight_outputs(out: Any, inputs: WeightInputs, config: RolloutCorrectionConfig) -> WeightOutputs:
    """What a custom weighting function returned: a `WeightOutputs` with [B, S] tensors (weights and raw weights may
    also be [B, 1], one per sequence) and a dict of 0-dim metrics. Checked at every call: types and shapes here, the
    weights' values on the device (`custom_weight_counts`), raised when the metrics are read (`check_host_metrics`)."""
    label = f"--custom-tis-function-path {config.custom_tis_function_path}"
    if not isinstance(out, WeightOutputs):
        raise CustomFunctionError(f"{label} returned {_describe(out)}; it must return slime_corr.correction.WeightOutputs("
                        "weights=..., loss_mask=...) (see examples/custom_tis.py).")
    shape = tuple(inputs.log_ratio.shape)
    for name in ("weights", "raw_weights"):
        value = getattr(out, name)
        if value is None:
            continue
        if not isinstance(value, Tensor) or not value.is_floating_point() or tuple(value.shape) not in (
                shape, (shape[0], 1)):
            raise CustomFunctionError(f"{label} returned WeightOutputs.{name} = {_describe(value)}; expected a float tensor "
                             f"of shape {shape} (or ({shape[0]}, 1)), or None.")
    mask = out.loss_mask
    if not isinstance(mask, Tensor) or mask.is_complex() or tuple(mask.shape) != shape:
        raise CustomFunctionError(f"{label} returned WeightOutputs.loss_mask = {_describe(mask)}; expected a bool or 0/1 "
                         f"tensor of shape {shape}.")
    if not isinstance(out.metrics, dict) or not all(
            isinstance(k, str) and isinstance(v, Tensor) and v.numel() == 1 for k, v in out.metrics.items()):
        raise CustomFunctionError(f"{label} returned WeightOutputs.metrics = {out.metrics!r}; expected a dict of "
                         "name -> one-element tensor.")
    if out.weights is not None and out.weights.shape != shape:
        out.weights = out.weights.expand(shape)
    if out.raw_weights is not None and out.raw_weights.shape != shape:
        out.raw_weights = out.raw_weights.expand(shape)
    return out


# ------------------------------------------------------------------------------------------ values, read on the host
# Impossible input values and a custom function's bad weights are counted on the device into the batch statistics
# (the one SUM all_reduce that already runs), so nothing waits for the device; `check_host_metrics` reads the
# counts when the metrics reach the host (`metrics_to_host`, the one device->host transfer of a step) and raises.

POSITIVE_LOG_PROB_TOLERANCE = 1e-4  # a log-prob above it is a probability above 1.0001: impossible, not rounding
# statistic -> (metric, what it counts)
INPUT_VALUE_COUNTS = {
    "invalid_mask_count": ("mis_invalid_mask_count", "loss-mask value(s) outside {0, 1} or NaN"),
    "positive_logprob_count": ("mis_positive_logprob_count",
                 f"log-prob(s) > {POSITIVE_LOG_PROB_TOLERANCE:g} (a probability above 1) at tokens in the loss mask"),
    "nan_logprob_count": ("mis_nan_logprob_count", "NaN log-prob(s) at tokens in the loss mask"),
}
# the policy loss's own impossible inputs (`compute_policy_loss`), counted there on the device: metric -> what
LOSS_VALUE_COUNTS = {
    "pg_nonfinite_advantage_count": "NaN/inf advantage(s) at tokens in the loss mask",
}
CUSTOM_NONFINITE = "mis_custom_nonfinite_weight_count"
CUSTOM_NEGATIVE = "mis_custom_negative_weight_count"
# metrics that are means over the measured (finite, valid) tokens or sequences: undefined for an empty batch
UNMEASURED_PREFIXES = ("mismatch_", "train_rollout_", "rollout_probs_", "rollout_actor_", "mis_weight_", "mis_ess",
                       "mis_ratio_mean_after_mis", "mis_mean_is_weight_before_clip", "mis_truncate_fraction",
                       "mis_clip_fraction_", "mis_mask_fraction_", "mis_batch_norm_factor", "mis_rs_rejected_",
                       "mis_catastrophic_")
_WARNED: set[str] = set()


class InputValueError(ValueError):
    """Impossible values in the correction's inputs, or a custom weighting function's impossible weights."""


def input_value_counts(log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor, valid: Tensor) -> Tensor:
    """[3] float64 local counts (`INPUT_VALUE_COUNTS` order), on the device: mask values that differ from their
    0/1 reading `valid` (`valid_float`: > 0 is 1, NaN is 0; so anything but 0/1, NaN included; a bool mask has
    none), and at valid tokens the log-probs max(lp_train, lp_rollout) > tolerance and NaN (max propagates NaN).
    Each test is a compare written as floats into one [3, ...] buffer (no bool tensor: on CPU a float compare costs
    a third of a bool one), masked and summed at once: 7 ops."""
    hits = valid.new_empty((3, *valid.shape))
    if loss_mask.dtype == torch.bool:
        hits[0].zero_()
    else:
        torch.ne(loss_mask, valid, out=hits[0])
    in_place = log_probs.dtype == rollout_log_probs.dtype == hits.dtype  # else compared in the inputs' dtype
    lp = torch.maximum(log_probs.detach(), rollout_log_probs.detach(), out=hits[1] if in_place else None)
    torch.ne(lp, lp, out=hits[2])  # NaN
    if in_place:
        lp.gt_(POSITIVE_LOG_PROB_TOLERANCE)
    else:
        torch.gt(lp, POSITIVE_LOG_PROB_TOLERANCE, out=hits[1])
    hits[1:].mul_(valid)
    return hits.sum(-1).sum(tuple(range(1, hits.dim() - 1)), dtype=torch.float64)  # exact: rows < 2^24 tokens


def custom_weight_counts(weights: Tensor, kept: Tensor) -> tuple[Tensor, Tensor]:
    """A custom function's weights at the tokens it kept (`kept`, float 0/1): (finite indicator, [2] counts of
    non-finite and of negative finite weights there), on the device."""
    finite = weights.isfinite().to(kept.dtype)
    ok = kept * finite
    counts = torch.stack([(kept - ok).sum(), (ok * (weights < 0).to(kept.dtype)).sum()])
    return finite, counts.to(torch.float64)


def check_host_metrics(metrics: dict[str, float], config: RolloutCorrectionConfig | None = None) -> dict[str, float]:
    """The host side of the value checks, on a step's (or one call's) metrics once they are floats. A batch without
    a measured token (no valid sequence without a non-finite log-prob): the metrics that are means over measured
    tokens are removed (no value, rather than 0). With `config`:

    - impossible inputs (`INPUT_VALUE_COUNTS`): `InputValueError`, or a warning (once per kind) with
      `--warn-invalid-inputs`;
    - a custom weighting function's negative weights: `InputValueError` naming the function; its non-finite weights:
      a warning (once per function), and `InputValueError` when every weight it gave was non-finite.
    Returns `metrics`.
    """
    if metrics.get("mis_valid_seq_count", 1.0) - metrics.get("mis_nonfinite_seq_count", 0.0) <= 0:
        for key in [k for k in metrics if k.startswith(UNMEASURED_PREFIXES)]:
            del metrics[key]
    if config is None:
        return metrics
    described = dict(INPUT_VALUE_COUNTS.values()) | LOSS_VALUE_COUNTS
    counts = {key: metrics.get(key, 0.0) for key in described}
    found = [f"{counts[key]:.0f} {what} ({key})" for key, what in described.items() if counts[key] > 0]
    if found:
        message = ("impossible input values in the rollout correction or the policy loss: " + "; ".join(found) + ". A loss mask "
                   "holds 0/1 (or bool), log-probs are <= 0 and never NaN, advantages are finite where the mask "
                   "is 1: check how they were built (a probability or a negated log-prob passed as a log-prob, "
                   "padding marked -1, a reward or a group's std that was NaN, ...). ")
        if not config.warn_invalid_inputs:
            raise InputValueError(message + "--warn-invalid-inputs logs them and goes on instead (a NaN rejects "
                                            "its sequence or token, a mask value counts as valid when > 0).")
        _warn_once("inputs:" + ",".join(k for k in counts if counts[k] > 0), message + "(--warn-invalid-inputs: "
                   "the run goes on; the counts are logged.)")
    _check_custom_weights(metrics, config)
    return metrics


def _check_custom_weights(metrics: dict[str, float], config: RolloutCorrectionConfig) -> None:
    path = config.custom_tis_function_path
    label = f"--custom-tis-function-path {path}" if path else "the custom weighting function"
    negative, nonfinite = metrics.get(CUSTOM_NEGATIVE, 0.0), metrics.get(CUSTOM_NONFINITE, 0.0)
    if negative > 0:
        raise InputValueError(f"{label} returned {negative:.0f} negative weight(s) at tokens it kept: a negative IS "
                              "weight flips the sign of that token's gradient. Return weights >= 0 (e.g. "
                              "w.clamp_min(0)), and drop a token through WeightOutputs.loss_mask instead.")
    if nonfinite <= 0:
        return
    if metrics.get("mis_rs_rejected_token_fraction", 0.0) >= 1.0:  # nothing it kept had a finite weight
        raise InputValueError(f"{label} returned only NaN/inf weights in this step ({nonfinite:.0f} tokens): "
                              "every token was rejected, nothing trains. Check the function's arithmetic (e.g. "
                              "exp of an unclamped log-ratio sum, 0/0).")
    _warn_once(f"custom:{path}", f"{label} returned {nonfinite:.0f} NaN/inf weight(s): their tokens are rejected "
               f"and counted in {CUSTOM_NONFINITE} (warned once).")


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
