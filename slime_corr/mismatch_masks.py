"""Masks the peers put on the loss against the train/rollout mismatch, with lr = lp_train − lp_rollout per token:

- M2PO (AReaL's `actor.m2_threshold`, `--m2-threshold τ`): over the micro-batch's tokens in the loss (the whole
  micro-batch across its CP ranks), the tokens of the largest second moment lr² leave the loss until the mean lr² of
  the rest is below τ; at least the tokens of the smallest lr² stay. As a value cut: keep the tokens with lr² ≤ c*,
  c* the largest lr² of the micro-batch whose {lr² ≤ c*} has a mean < τ (else c* = the smallest lr²). AReaL sorts and
  cuts by count, so where tokens tie at the cut it may keep some of them; this keeps all or none of a tie (at the
  smallest value: all of them). Equal to AReaL's `_apply_m2po_masking` on tie-free data (tests/correction/
  test_policy_losses.py runs AReaL's code). Exact over CP without a gather: a bisection over the float64 bits of c
  (63 rounds, each one SUM all_reduce of two numbers, no host sync); per DP rank's micro-batch, as AReaL computes it.
  The step-wide, DP-invariant budget of the same quantity is `--rs-metric k2 --rs-agg token --rs-divergence-budget
  τ/2` (slime_corr/correction/budget.py: within one ~3 % bin of the exact cut, and `≤` where AReaL has `<`).
- NeMo-RL's `grpo.seq_logprob_error_threshold` (`--seq-logprob-error-threshold θ`): a sequence whose
  multiplicative error Σ_t m·exp(|lr|) / max(Σ_t m, 1) is above θ leaves the loss whole, as NeMo-RL's
  `compute_and_apply_seq_logprob_error_masking` zeroes its sample mask (its denominators too). One SUM over CP.

Both return bool [B, S] masks of the tokens they take out of the loss; a token with a non-finite lr counts in
neither (the correction rejects its sequence). Torch only; nothing here takes a gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from slime_corr.correction.reductions import ProcessGroup, group_size, seq_sums
from slime_corr.layout.segments import Segments

ABOVE_INF_BITS = 0x7FF0000000000001  # the float64 bit pattern just above +inf: no m2 reaches it
BISECTION_ROUNDS = 63  # the bits between 0 and ABOVE_INF_BITS


def seq_mult_prob_error(train_log_probs: Tensor, rollout_log_probs: Tensor, valid: Tensor, segments: Segments,
                        cp_group: ProcessGroup = None) -> Tensor:
    """NeMo-RL's per-sequence error [n]: Σ_t m·exp(|lp_train − lp_rollout|) / max(Σ_t m, 1) over the whole sequence
    (1 without mismatch), m the valid tokens with a finite difference."""
    diff = (train_log_probs.detach() - rollout_log_probs.detach()).abs()
    counted = (valid > 0) & torch.isfinite(diff)
    errors = torch.where(counted, diff, 0.0).exp() * counted
    sums = seq_sums([segments.sum(errors), segments.sum(counted.to(errors.dtype))], cp_group)
    return sums[:, 0] / sums[:, 1].clamp_min(1)


def seq_logprob_error_masked(train_log_probs: Tensor, rollout_log_probs: Tensor, valid: Tensor, threshold: float,
                             segments: Segments, cp_group: ProcessGroup = None) -> Tensor:
    """Bool [B, S]: the valid tokens of the sequences whose `seq_mult_prob_error` is above `threshold`."""
    error = seq_mult_prob_error(train_log_probs, rollout_log_probs, valid, segments, cp_group)
    return segments.expand(error > threshold) & (valid > 0)


def m2po_masked(train_log_probs: Tensor, rollout_log_probs: Tensor, valid: Tensor, threshold: float,
                cp_group: ProcessGroup = None) -> Tensor:
    """Bool [B, S]: the valid tokens M2PO takes out of the loss (see the module doc): lr² > c*, c* the largest lr²
    whose tokens {lr² ≤ c*} have a mean below `threshold`, or the smallest lr² when none has."""
    lr = train_log_probs.detach().to(torch.float64) - rollout_log_probs.detach().to(torch.float64)
    counted = (valid > 0) & torch.isfinite(lr)
    m2 = torch.where(counted, lr, 0.0).square()
    bits = m2.view(torch.int64)  # m2 >= +0: its bit pattern orders it
    lowest = torch.where(counted, bits, ABOVE_INF_BITS).min().reshape(1)
    if group_size(cp_group) > 1:
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=cp_group)
    kept_bits, above = lowest, torch.full_like(lowest, ABOVE_INF_BITS)  # {m2 <= kept_bits} qualifies; above: not
    for _ in range(BISECTION_ROUNDS):
        middle = kept_bits + (above - kept_bits) // 2
        within = counted & (bits <= middle)
        sums = torch.stack([torch.where(within, m2, 0.0).sum(), within.sum(dtype=torch.float64)])
        if group_size(cp_group) > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=cp_group)
        qualifies = (sums[1] > 0) & (sums[0] < threshold * sums[1])  # mean < threshold, as a product: no division
        kept_bits = torch.where(qualifies, middle, kept_bits)
        above = torch.where(qualifies, above, middle)
    return counted & (bits > kept_bits)


__all__ = ["m2po_masked", "seq_logprob_error_masked", "seq_mult_prob_error"]
