"""The per-token-loss requirement: Megatron must divide the summed gradients by the GLOBAL token count.

`loss_func` returns Megatron's triple (loss_sum, count, report). With `calculate_per_token_loss=True` the schedule
leaves loss_sum alone and divides the gradients by Σ count over micro-batches and DP×CP: exact for any layout. With
`False` (Megatron-LM's default) it divides loss_sum IN PLACE by this rank's count and by the number of
micro-batches: a per-rank mean, wrong whenever ranks hold different token counts (47% off at DP=2 in a measured
case). Two checks, so that no path trains silently on wrong gradients:

- eager (`check_per_token_loss`): wherever the setting is reachable — the model's config (the hook's
  `forward_step`, `train_step`, `loss_func(..., model=model)`) or Megatron-LM's parsed args — at the first call;
- exact (`guard_loss`): the returned loss remembers its version counter; the first backward through it fails,
  before any gradient reaches a parameter, if the schedule divided it in place.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

HOW_TO_SET = (
    "set it with --calculate-per-token-loss (Megatron-LM) or TransformerConfig(calculate_per_token_loss=True) "
    "(Megatron-Core): the rollout-correction loss is returned as (loss_sum, count) and Megatron must divide the "
    "gradients by the global DP×CP count; a per-rank mean gives wrong gradients when ranks hold different "
    "token counts."
)


class PerTokenLossError(ValueError):
    """calculate_per_token_loss is off where the rollout-correction loss runs."""


def check_per_token_loss(setting: Any, where: str) -> None:
    """Raise `PerTokenLossError` when `setting` (a config's calculate_per_token_loss) is not True."""
    if setting is not True:
        raise PerTokenLossError(f"calculate_per_token_loss={setting!r} in {where}; {HOW_TO_SET}")


def check_model_config(model: Any) -> None:
    """Check the config of a Megatron model (a chunk, a list of chunks, DDP-wrapped or not) or a config."""
    from megatron.core.utils import get_model_config

    if isinstance(model, list | tuple):
        model = model[0]
    config = model if hasattr(model, "calculate_per_token_loss") else get_model_config(model)
    check_per_token_loss(getattr(config, "calculate_per_token_loss", None), "the model's TransformerConfig")


class _InPlaceDivisionGuard(torch.autograd.Function):
    """Identity; its backward fails if the forward's output was modified in place in between."""

    @staticmethod
    def forward(ctx: Any, loss: Tensor) -> Tensor:  # type: ignore[override]
        out = loss.clone()
        ctx.out = weakref.ref(out)
        ctx.version = out._version
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        out = ctx.out()
        if out is not None and out._version != ctx.version:
            raise PerTokenLossError(
                "Megatron's schedule divided the rollout-correction loss in place (calculate_per_token_loss="
                f"False), so this step's gradients would be wrong; {HOW_TO_SET}"
            )
        return grad


def guard_loss(loss: Tensor) -> Tensor:
    """`loss` (same value and gradient) whose backward fails if the schedule divided it in place."""
    return _InPlaceDivisionGuard.apply(loss) if loss.requires_grad else loss


__all__ = ["PerTokenLossError", "check_model_config", "check_per_token_loss", "guard_loss"]
