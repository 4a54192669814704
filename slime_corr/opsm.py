"""Off-policy sequence masking (OPSM; DeepSeek-V3.2, slime's `--use-opsm --opsm-delta`), per sequence.

A sequence i whose mean log-ratio of the loss's anchor over the current policy is past δ,

    KL_i = Σ_t (lp_old,t − lp_t)·m_t / max(Σ_t m_t, 1) > δ,

loses its tokens with a negative advantage (A_t < 0) from the loss's numerator; the loss's denominator keeps them,
as slime's does. lp_old is the PPO ratio's anchor (the recomputed π_old in decoupled mode, the rollout's log-probs
in bypass), m the valid tokens where both log-probs are finite. Decided per sequence over its whole length (one SUM
over CP), never per token. Torch only; nothing here takes a gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_corr.correction.reductions import ProcessGroup, seq_sums
from slime_corr.layout.segments import Segments


def opsm_masked(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, valid: Tensor, delta: float,
                segments: Segments, cp_group: ProcessGroup = None) -> Tensor:
    """Bool [B, S] (like `log_probs`): the tokens OPSM takes out of the loss (see the module doc). `advantages`
    per token, `valid` the loss mask (float or bool)."""
    lp, old = log_probs.detach(), old_log_probs.detach()
    diff = old - lp
    m = (valid > 0) & torch.isfinite(diff)
    sums = seq_sums([segments.sum(torch.where(m, diff, 0)), segments.sum(m.to(diff.dtype))], cp_group)
    kl = sums[:, 0] / sums[:, 1].clamp_min(1)
    return segments.expand(kl > delta) & (advantages.detach() < 0) & (valid > 0)


__all__ = ["opsm_masked"]
