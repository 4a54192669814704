"""Megatron's mixed precision for the trainer: `--bf16` / `--fp16` with fp32 main weights and gradients.

How Megatron-LM trains in bf16 / fp16 (`megatron.training.training.get_model` + `setup_model_and_optimizer`,
megatron-core 0.19.2), and how this module does it:
- the model is built with `TransformerConfig(bf16=True | fp16=True, params_dtype=bfloat16 | float16)`, wrapped in
  `Float16Module` (casts float inputs to the model's dtype on the first pipeline stage and the logits back to fp32
  on the last), then in Megatron DDP; gradients accumulate and are all-reduced in fp32 (`main_grad`,
  Megatron's `--accumulate-allreduce-grads-in-fp32`, which Megatron-LM forces for bf16 and which the project's
  DDP always uses): `wrap_for_training`, `build_mixed_precision_gpt`;
- the optimizer is `get_megatron_optimizer(OptimizerConfig(...))`: with bf16/fp16 `Float16OptimizerWithFloat16Params`
  keeps an fp32 copy of every bf16/fp16 parameter (the main params), steps Adam on them with the fp32 main
  gradients, and copies them back rounded to the model's dtype; without, `FP32Optimizer`: `build_optimizer`;
- fp16 scales the loss: Megatron's schedule multiplies each micro-batch's loss by `config.grad_scale_func`
  (= `optimizer.scale_loss`: loss × S) before its backward, so `main_grad` = S × gradient; the step divides the
  main gradients by S and, when one is inf/nan, skips the update. The scale S is `--loss-scale` when given
  (`ConstantGradScaler`), else dynamic (`DynamicGradScaler`): starts at `--initial-loss-scale`; after `--hysteresis`
  overflowing steps (counted since the last growth) S ← max(S / 2, `--min-loss-scale`); after `--loss-scale-window`
  consecutive good steps S ← 2 S. bf16 has no scaler unless `--loss-scale` is given;
- `step_optimizer` runs the step: clip by the global norm of the unscaled gradients (`--clip-grad`), Adam, copy
  back; it says whether the update was applied.

On CPU, `slime_corr.mcore.cpu_compat.apply_cpu_compat()` adapts Megatron's optimizer (it hard-codes CUDA).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slime_corr.errors import ConfigError
from slime_corr.fields import flag
from slime_corr.mcore.model import TinyGPTArgs, build_tiny_gpt


@dataclass(frozen=True)
class PrecisionConfig:
    """Megatron-LM's mixed-precision flags, under their names and with their defaults (megatron-core 0.19.2's
    `megatron/training/arguments.py`). Validated on construction (`ConfigError` naming the flags)."""

    bf16: bool = flag(False, help="Train the model in bfloat16 (Megatron's flag): bf16 weights and activations, fp32 "
                      "main weights and gradients in Megatron's mixed-precision optimizer. The engines get the bf16 "
                      "weights.")
    fp16: bool = flag(False, help="Train the model in float16 (Megatron's flag), as --bf16, with loss scaling "
                      "(dynamic unless --loss-scale): a step whose gradients overflow is skipped.")
    loss_scale: float | None = flag(None, help="A constant loss scale (Megatron's flag; a power of 2 is exact). "
                                    "Default: dynamic loss scaling under --fp16, none under --bf16.")
    initial_loss_scale: float = flag(2.0**32, help="The first loss scale of dynamic loss scaling.")
    min_loss_scale: float = flag(1.0, help="The lowest loss scale of dynamic loss scaling.")
    loss_scale_window: float = flag(1000, help="Steps without an overflow before dynamic loss scaling doubles the "
                                    "scale.")
    hysteresis: int = flag(2, help="Overflowing steps (since the last growth) before dynamic loss scaling halves the "
                           "scale.")

    def __post_init__(self) -> None:
        for name in ("bf16", "fp16"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"--{name}: expected true or false, got {getattr(self, name)!r}.")
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 are exclusive: pass one of them (bf16 needs no loss scaling; "
                              "fp16 scales the loss).")
        if self.loss_scale is not None:
            if not self.mixed:
                raise ConfigError(f"--loss-scale {self.loss_scale}: loss scaling applies to --fp16 or --bf16 "
                                  "training only: add one of them, or drop --loss-scale.")
            if not _positive(self.loss_scale):
                raise ConfigError(f"--loss-scale {self.loss_scale}: must be > 0 (a power of 2 is exact), or "
                                  "omitted for dynamic loss scaling.")
        for option, value in (("--initial-loss-scale", self.initial_loss_scale),
                            ("--min-loss-scale", self.min_loss_scale),
                            ("--loss-scale-window", self.loss_scale_window)):
            if not _positive(value):
                raise ConfigError(f"{option} {value}: must be > 0.")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(f"--min-loss-scale {self.min_loss_scale} > --initial-loss-scale "
                              f"{self.initial_loss_scale}: the minimum must not exceed the initial scale.")
        if isinstance(self.hysteresis, bool) or not isinstance(self.hysteresis, int) or self.hysteresis < 1:
            raise ConfigError(f"--hysteresis {self.hysteresis!r}: must be an integer >= 1 (overflowing steps "
                              "before the loss scale halves).")

    @property
    def mixed(self) -> bool:
        """bf16 or fp16: the model in 16 bits, fp32 main params in the optimizer."""
        return self.bf16 or self.fp16

    @property
    def params_dtype(self) -> torch.dtype:
        """The model's dtype: bfloat16 (--bf16), float16 (--fp16), else float32."""
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    @property
    def option(self) -> str | None:
        """The flag that trains in 16 bits: "--bf16" / "--fp16", else None."""
        return "--bf16" if self.bf16 else "--fp16" if self.fp16 else None

    @property
    def dtype_name(self) -> str | None:
        """"bfloat16" / "float16" under --bf16 / --fp16, else None (the trainer's --params-dtype)."""
        return str(self.params_dtype).removeprefix("torch.") if self.mixed else None

    @property
    def dynamic_loss_scale(self) -> bool:
        """fp16 without --loss-scale: Megatron's DynamicGradScaler."""
        return self.fp16 and self.loss_scale is None


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def is_megatron_optimizer(optimizer: Any) -> bool:
    """Megatron's optimizer (`build_optimizer`, --bf16 / --fp16), not a `torch.optim` one."""
    from megatron.core.optimizer import MegatronOptimizer

    return isinstance(optimizer, MegatronOptimizer)


def mark_model_precision(module: torch.nn.Module, precision: PrecisionConfig) -> None:
    """Make a built model's config say what `TransformerConfig(bf16=..., fp16=...)` would have at construction:
    `config.bf16` / `config.fp16`, and the core attention's softmax told its input is 16-bit (it then runs in
    fp32 under the default `attention_softmax_in_fp32`), as Megatron-LM's model has them. A no-op on a model
    built with those flags."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax

    module.config.bf16, module.config.fp16 = precision.bf16, precision.fp16
    for layer in module.modules():
        if isinstance(layer, FusedScaleMaskSoftmax):
            layer.input_in_bf16, layer.input_in_fp16 = precision.bf16, precision.fp16
            layer.input_in_float16 = precision.mixed


def float16_module(module: torch.nn.Module, precision: PrecisionConfig) -> torch.nn.Module:
    """Under --bf16 / --fp16 the built model marked (`mark_model_precision`) in Megatron's `Float16Module` (16-bit
    weights, fp32 logits); the model itself otherwise. For a model that is not trained too (the reference)."""
    from megatron.core.transformer.module import Float16Module

    if not precision.mixed:
        return module
    mark_model_precision(module, precision)
    return Float16Module(module.config, module)


def wrap_for_training(module: torch.nn.Module, precision: PrecisionConfig) -> torch.nn.Module:
    """A built (not DDP-wrapped) Megatron model made ready for Megatron's optimizer, as `get_model` does it:
    TP attributes on every parameter, `Float16Module` (bf16 / fp16; it casts the weights), Megatron DDP with fp32
    gradient buffers (float64 models keep float64 ones). The model's config is the wrappers' config."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = module.config
    for param in module.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    module = float16_module(module, precision)
    dtype = next(module.parameters()).dtype
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=dtype != torch.float64)
    return DistributedDataParallel(config, ddp_config, module=module)


def build_mixed_precision_gpt(args: TinyGPTArgs | argparse.Namespace | None, precision: PrecisionConfig
                              ) -> torch.nn.Module:
    """The tiny GPT (`build_tiny_gpt`) in `precision.params_dtype` (fp32 unless --bf16 / --fp16; the args'
    params_dtype is replaced), wrapped by `wrap_for_training`. Same initial weights as `build_tiny_gpt` for the
    seed, rounded to the 16-bit dtype."""
    args = args or TinyGPTArgs()
    dtype = precision.params_dtype if precision.mixed else getattr(args, "params_dtype", torch.float32)
    if isinstance(args, argparse.Namespace):
        args = argparse.Namespace(**{**vars(args), "params_dtype": dtype})
    else:
        args = dataclasses.replace(args, params_dtype=dtype)
    return wrap_for_training(build_tiny_gpt(args, ddp=False), precision)


def build_optimizer(model_chunks: Sequence[torch.nn.Module], precision: PrecisionConfig, *, lr: float,
                    clip_grad: float | None, weight_decay: float = 0.0,
                    adam_betas: tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8) -> Any:
    """Megatron's optimizer (`get_megatron_optimizer`, Adam; AdamW's decoupled weight decay, the same as Adam at
    weight_decay 0) for DDP-wrapped model chunks (`wrap_for_training`): fp32 main params with --bf16 / --fp16,
    the loss scaler of `precision`; clipping by the global gradient norm at `clip_grad` (0 / None: no clipping).
    Sets every chunk's `config.grad_scale_func = optimizer.scale_loss` (the schedule scales each loss by it).
    Without an LR scheduler every parameter gets `lr` and `weight_decay` (Megatron-LM's scheduler would exempt
    biases and norms from weight decay)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, adam_beta1=adam_betas[0],
        adam_beta2=adam_betas[1], adam_eps=adam_eps, clip_grad=float(clip_grad or 0.0),
        bf16=precision.bf16, fp16=precision.fp16, params_dtype=precision.params_dtype,
        loss_scale=precision.loss_scale, initial_loss_scale=precision.initial_loss_scale,
        min_loss_scale=precision.min_loss_scale, loss_scale_window=precision.loss_scale_window,
        hysteresis=precision.hysteresis, use_distributed_optimizer=False,
    )
    chunks = list(model_chunks)
    optimizer = get_megatron_optimizer(config, chunks)
    for chunk in chunks:
        chunk.config.grad_scale_func = optimizer.scale_loss
    return optimizer


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did."""

    applied: bool  # False: a gradient was inf/nan (fp16 overflow), the update was skipped
    grad_norm: float  # global L2 norm of the unscaled gradients before clipping; nan when skipped
    loss_scale: float  # the loss scale of the next step (1.0 without a scaler)
    scaled: bool = False  # the optimizer has a loss scaler (fp16): only then can a step be skipped


def step_optimizer(optimizer: Any) -> StepOutcome:
    """One step of Megatron's optimizer on the gradients in the model's `main_grad`s (the project's
    `params.optimizer_step` contract: the norm before clipping), after `zero_grad_buffer()` + `zero_grad()` and
    the forward/backward. Returns whether it was applied, the norm, and the next loss scale."""
    applied, norm, _ = optimizer.step()
    scaled = any(getattr(chained, "grad_scaler", None) is not None
                 for chained in getattr(optimizer, "chained_optimizers", [optimizer]))
    return StepOutcome(applied=bool(applied), grad_norm=math.nan if norm is None else float(norm),
                       loss_scale=float(optimizer.get_loss_scale()), scaled=scaled)


def main_params(optimizer: Any) -> dict[int, torch.Tensor]:
    """id(model parameter) -> the tensor the optimizer steps for it: its fp32 main param under bf16 / fp16,
    the parameter itself otherwise."""
    out: dict[int, torch.Tensor] = {}
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        for model_group, main_group in zip(getattr(chained, "float16_groups", []),
                                           getattr(chained, "fp32_from_float16_groups", []), strict=True):
            out.update({id(p): main for p, main in zip(model_group, main_group, strict=True)})
        for group in getattr(chained, "fp32_from_fp32_groups", []):
            out.update({id(p): p for p in group})
        if not hasattr(chained, "float16_groups"):  # FP32Optimizer
            out.update({id(p): p for group in chained.param_groups for p in group["params"]})
    return out


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside Megatron's DDP and Float16Module wrappers (the GPTModel)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(model, DistributedDataParallel | Float16Module):
        model = model.module
    return model


__all__ = ["PrecisionConfig", "StepOutcome", "build_mixed_precision_gpt", "build_optimizer", "float16_module",
           "main_params",
           "mark_model_precision", "step_optimizer", "unwrap_model", "wrap_for_training"]
