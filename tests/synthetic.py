"""Synthetic log-prob batches for the correction and loss tests: [rows, seq] tensors drawn from one seeded generator.

`policy_batch`: the current policy's, the old policy's and the rollout's log-probs, advantages and a loss mask
(`compute_policy_loss`'s inputs); `correction_batch`: the trainer's and the rollout's log-probs and a loss mask
(`compute_rollout_correction`'s). The mask is either responses of given lengths (`response_mask`: padding, empty and
one-token rows) or positions dropped at random. A test sets its own special values (NaN, catastrophic tokens, holes)
on the tensors it gets: they draw nothing from the generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

# full rows, an empty row, a one-token row and padded rows: 8 rows for seq >= 16
UNEVEN_LENGTHS = (16, 3, 0, 9, 1, 12, 16, 5)


class PolicyBatch(NamedTuple):
    log_probs: Tensor  # the current policy's, lp
    old_log_probs: Tensor  # lp_old
    rollout_log_probs: Tensor  # lp_rollout
    advantages: Tensor  # [rows, seq], or [rows] with `sequence_advantages`
    loss_mask: Tensor  # bool


class CorrectionBatch(NamedTuple):
    train_log_probs: Tensor  # lp_train
    rollout_log_probs: Tensor  # lp_rollout
    loss_mask: Tensor  # bool


def response_mask(lengths: Sequence[int] | Tensor, seq: int) -> Tensor:
    """[rows, seq] bool: the first `lengths[i]` positions of row i."""
    return torch.arange(seq)[None, :] < torch.as_tensor(lengths)[:, None]


def policy_batch(seed: int, rows: int, seq: int, *, rollout_noise: float | Tensor = 0.3, row_scale: Tensor | None = None,
                 policy_noise: float | Tensor = 0.2, sequence_advantages: bool = False,
                 lengths: Sequence[int] | Tensor | None = None, dropped: float = 0.3,
                 dtype: torch.dtype = torch.float64) -> PolicyBatch:
    """lp_old = -2 U(0, 1); lp_rollout = lp_old + rollout_noise * N(0, 1) (times `row_scale`, e.g. a noise growing
    over the rows); lp = lp_old + policy_noise * N(0, 1); advantages N(0, 1) per token, or one per sequence; the mask
    of responses of `lengths`, else each position dropped with probability `dropped`. Drawn in this order."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, seq, generator=g, dtype=dtype) * 2
    if row_scale is None:
        rollout = old + rollout_noise * torch.randn(rows, seq, generator=g, dtype=dtype)
    else:
        rollout = old + rollout_noise * torch.randn(rows, seq, generator=g, dtype=dtype) * row_scale
    current = old + policy_noise * torch.randn(rows, seq, generator=g, dtype=dtype)
    shape = (rows,) if sequence_advantages else (rows, seq)
    advantages = torch.randn(*shape, generator=g, dtype=dtype)
    mask = response_mask(lengths, seq) if lengths is not None else torch.rand(rows, seq, generator=g) > dropped
    return PolicyBatch(current, old, rollout, advantages, mask)


def correction_batch(seed: int, rows: int, seq: int, *, spread: float = 2.0, noise: float = 0.2, dropped: float = 0.3,
                     dtype: torch.dtype = torch.float64) -> CorrectionBatch:
    """lp_rollout = -spread U(0, 1); lp_train = lp_rollout + noise * N(0, 1); each position dropped from the mask
    with probability `dropped`. Drawn in this order."""
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(rows, seq, generator=g, dtype=dtype) * spread
    train = rollout + noise * torch.randn(rows, seq, generator=g, dtype=dtype)
    mask = torch.rand(rows, seq, generator=g) > dropped
    return CorrectionBatch(train, rollout, mask)
