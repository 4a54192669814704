"""`--rollout-correction-compile`: the per-token stages of the correction and the losses, torch.compile'd."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from slime_corr.config import RolloutCorrectionConfig


def maybe_compiled(fn: Callable, config: RolloutCorrectionConfig) -> Callable:
    """`fn` itself, or its torch.compile'd form with `--rollout-correction-compile` (compiled once per function)."""
    return _compiled(fn) if config.rollout_correction_compile else fn


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=None)
