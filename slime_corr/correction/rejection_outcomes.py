"""Reward-aware rejection diagnostics: on whom the correction's rejection fell.

Rejection (RS, veto, non-finite log-probs) removes tokens and whole sequences from the loss. When it falls mostly on
samples the policy should learn from (positive advantage, high reward), the correction is also steering training,
not only de-biasing it (NeMo-RL and prime-rl log the same split). Per micro-batch, with `valid` the loss mask before
the correction, `kept` the mask after it, A the advantage and r the reward of a sequence (a sequence's advantage
is the mean of its valid tokens' advantages, so per-token advantages are allowed):

    rejected sequence   = it had valid tokens and none is kept
    mis_rejected_seq_pos_adv_fraction   = #rejected with A > 0 / #rejected        (… _neg_: A < 0)
    mis_rejected_seq_reward_mean        = Σ r over rejected / #rejected
    mis_kept_seq_reward_mean            = Σ r over sequences with a kept token / their number
    mis_rejected_pos_adv_token_fraction = valid tokens with A > 0 not kept / valid tokens with A > 0   (… _neg_)

Each is returned as a `[numerator, denominator]` pair of THIS rank's share (sequence terms from CP rank 0 only, after
one all-reduce of three per-sequence sums over CP), so that summing the pairs over micro-batches and DP×CP, as
Megatron-LM's `train_step` does with the loss report, gives the step's exact ratios.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from slime_corr.correction.reductions import cp_first, seq_sums
from slime_corr.correction.reporting import ratio_pair
from slime_corr.layout.segments import Segments

REJECTION_OUTCOME_METRICS = (
    "mis_rejected_seq_pos_adv_fraction",
    "mis_rejected_seq_neg_adv_fraction",
    "mis_rejected_seq_reward_mean",
    "mis_kept_seq_reward_mean",
    "mis_rejected_pos_adv_token_fraction",
    "mis_rejected_neg_adv_token_fraction",
)


def rejection_outcome_pairs(valid: Tensor, kept: Tensor, advantages: Tensor, rewards: Tensor | None,
                            segments: Segments | None = None, cp_group: ProcessGroup = None) -> dict[str, Tensor]:
    """{metric: [numerator, denominator]} of one micro-batch (see the module doc). `valid`, `kept`: [B, S] 0/1
    masks (any dtype); `advantages`: per token [B, S] (this rank's CP slice) or per sequence [n] / [n, 1];
    `rewards`: [n] per sequence, or None (the reward means are then left out); `segments`: the sequences of the rows
    (default: one per row)."""
    seg = segments or Segments.rows(*valid.shape)
    valid = valid.to(torch.float64)
    kept = kept.to(torch.float64) * valid
    if advantages.shape != valid.shape:  # per sequence: broadcast along its tokens
        advantages = seg.expand(advantages.reshape(-1))
    adv = torch.where(valid > 0, advantages.to(torch.float64), 0.0)
    per_seq = seq_sums([seg.sum(valid), seg.sum(kept), seg.sum(adv)], cp_group)  # [n, 3], whole sequences
    had, rejected = per_seq[:, 0] > 0, (per_seq[:, 0] > 0) & (per_seq[:, 1] == 0)
    first = cp_first(cp_group)  # a sequence counted once across CP
    n_rejected = rejected.sum().to(torch.float64) * first
    pairs = {
        "mis_rejected_seq_pos_adv_fraction": ratio_pair((rejected & (per_seq[:, 2] > 0)).sum() * first, n_rejected),
        "mis_rejected_seq_neg_adv_fraction": ratio_pair((rejected & (per_seq[:, 2] < 0)).sum() * first, n_rejected),
    }
    if rewards is not None:
        r = rewards.to(torch.float64).reshape(-1)
        kept_seq = had & ~rejected
        pairs["mis_rejected_seq_reward_mean"] = ratio_pair(torch.where(rejected, r, 0.0).sum() * first, n_rejected)
        pairs["mis_kept_seq_reward_mean"] = ratio_pair(torch.where(kept_seq, r, 0.0).sum() * first,
                                                       kept_seq.sum() * first)
    removed = valid - kept
    for sign, name in ((adv > 0, "pos"), (adv < 0, "neg")):
        side = sign.to(torch.float64)
        pairs[f"mis_rejected_{name}_adv_token_fraction"] = ratio_pair((removed * side).sum(), (valid * side).sum())
    return pairs


__all__ = ["REJECTION_OUTCOME_METRICS", "rejection_outcome_pairs"]
