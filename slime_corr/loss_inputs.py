"""The inputs of a per-token policy loss (`LossInputs`): what `compute_policy_loss` (slime_corr.losses) hands to the
loss registered under `--policy-loss-type`, the built-in ones (slime_corr.losses) and the peers'
(slime_corr.policy_losses) alike. Torch only."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from slime_corr.correction.reductions import ProcessGroup
from slime_corr.layout.segments import Segments

LOG_RATIO_CLAMP = 20.0  # |lp - lp_old| is clamped to this before exp: a ratio is never inf


@dataclass
class LossInputs:
    """Inputs of a per-token loss function; [B, S], finite and 0 outside `token_mask` (float 0/1, the tokens that
    count: in the loss mask and with finite lp, lp_old and A).

    `log_probs` carries the gradient (made on first use from `raw_log_probs`, the caller's tensor, which may hold
    NaN outside the mask); `weights` (detached) is None when no IS weight applies; `loss_mask` is `token_mask` as
    bool. A function may add 0-dim local metrics to `metrics`.
    """

    raw_log_probs: Tensor
    old_log_probs: Tensor
    rollout_log_probs: Tensor | None
    advantages: Tensor
    token_mask: Tensor
    weights: Tensor | None
    count: Tensor | None = None  # Σ token_mask (local)
    metrics: dict[str, Tensor] = field(default_factory=dict)
    segments: Segments | None = None  # the sequences of the tokens (None: one per row)
    cp_group: ProcessGroup = None  # for whole-sequence sums (the GSPO ratio)

    @cached_property
    def log_probs(self) -> Tensor:
        return torch.nan_to_num(self.raw_log_probs, 0.0, 0.0, 0.0) * self.token_mask

    @cached_property
    def loss_mask(self) -> Tensor:
        return self.token_mask > 0


__all__ = ["LOG_RATIO_CLAMP", "LossInputs"]
