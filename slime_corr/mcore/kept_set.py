"""Log-probs of sampled tokens over the engine's replayed kept set, from vocab-parallel logits, with no [T, V] mask:
one autograd function.

Under top-k / top-p the engine samples y_t from its kept set N_t (SGLang 0.5.23's `return_sampling_mask`:
`meta_info.output_token_sampling_mask`, the ids its filter kept) renormalized. The kept sets travel ragged: `counts`
[T] (|N_t|; 0 where a token has none) and `ids` [Σ counts] (N_0's ids, then N_1's, ... in the tokens' row-major
order; `slime_corr.layout.kept_sets`). With z = logits / T (divided as `logprobs.scaled_logits` divides):

    lse_N(t)            = log Σ_{v ∈ N_t} e^{z_v}           (MAX then SUM over the TP group, once each)
    log π_trunc(y_t)    = z_{y_t} − lse_N(t)                (y_t ∈ N_t is required: refused by name otherwise)
    log π_trunc(v)      = z_v − lse_N(t)  for every kept v  (detached; the engine-comparison metric)
    ∂ log π_trunc(y_t) / ∂z_v = 1[v = y_t] − π_trunc(v) on N_t, 0 elsewhere

Each TP rank gathers the logits of the kept ids in its vocabulary shard (Megatron's layout: rank r owns ids
[r·V/TP, (r+1)·V/TP); the others count as −inf there, at fixed shapes), then one MAX all-reduce of [T] and one SUM
all-reduce of [T, 3] (Σ e^{z − max}, z_y, whether y was found), so every rank computes the same values from the
same reduced sums (bitwise equal on every TP rank). Backward writes the gradient at the kept positions of its shard
in a zero [T, V/TP] gradient, with no collective: gradient only into the kept logits; beyond the logits' gradient,
memory O(Σ kept ids). Tokens without a kept set
(count 0) get 0 with no gradient (`KeptLogProbs.has_kept_set`): the caller takes the full distribution's log-prob
there (`slime_corr.mcore.policy_log_probs`). The full distribution's entropy and log-probs (the KL and entropy
terms) are `logprobs.token_log_softmax`'s, not this function's. Host syncs per call: two, the checks that refuse a
bad batch by name (ids and counts; the labels' membership); none in backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from slime_corr.layout.kept_sets import KEPT_IDS_KEY
from slime_corr.mcore.logprobs import ProcessGroup, compute_dtype, scaled_logits, tp_size, vocab_start


class KeptLogProbs(NamedTuple):
    """Per token (shaped like the labels): log π_trunc(y) over the kept set (differentiable; 0 where
    `has_kept_set` is False) and whether the token has a kept set. Per kept id (the batch's `ids`):
    `kept_log_probs` (z_v − lse_N, detached; −inf where `kept_on_rank` is False) and `kept_on_rank`, whether the id
    lies in this TP rank's vocabulary shard (every id without TP)."""

    log_probs: Tensor
    has_kept_set: Tensor
    kept_log_probs: Tensor
    kept_on_rank: Tensor


class _KeptLogSoftmax(torch.autograd.Function):
    """The function of the module doc over flattened [N, V_local] logits, [N] global labels, [N] counts, [K] ids."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, counts: Tensor, ids: Tensor,  # type: ignore[override]
                group: ProcessGroup, temperature: float):
        n, width = labels.numel(), logits.size(-1)
        start, tp = vocab_start(logits, group), tp_size(group)
        dtype = compute_dtype(logits)
        row = torch.repeat_interleave(torch.arange(n, device=logits.device), counts, output_size=ids.numel())
        local = ids - start
        mine = (local >= 0) & (local < width)  # this shard's kept ids; the others at a clamped column, then −inf
        col = local.clamp(0, max(width - 1, 0))
        z = scaled_logits(logits[row, col], temperature)  # [K], bitwise the full path's z
        z = torch.where(mine, z, -torch.inf)
        is_label = mine & (ids == labels[row])
        has_kept_set = counts > 0
        zmax = torch.full((n,), -torch.inf, dtype=dtype, device=logits.device)
        zmax.scatter_reduce_(0, row, z, "amax")
        if tp > 1:
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        shift = torch.where(zmax.isfinite(), zmax, 0.0)  # a set with no finite logit (or no set): no shift
        sums = torch.zeros(n, 3, dtype=dtype, device=logits.device)
        sums[:, 0].index_add_(0, row, torch.exp(z - shift[row]))
        sums[:, 1].index_add_(0, row, torch.where(is_label, z, 0.0))
        sums[:, 2].index_add_(0, row, is_label.to(dtype))
        if tp > 1:
            dist.all_reduce(sums, group=group)
        lse = shift + sums[:, 0].log()
        missing = has_kept_set & (sums[:, 2] != 1)
        if bool(missing.any()):
            t = int(missing.nonzero()[0, 0])
            raise ValueError(f"{KEPT_IDS_KEY}: token {t} (label {int(labels[t])}) is not exactly once in its kept set "
                             f"of {int(counts[t])} ids: the engine samples only from that set, so the batch's kept "
                             "ids are misaligned with its labels (or the label is not the sampled token)")
        log_probs = torch.where(has_kept_set, sums[:, 1] - lse, 0.0)
        kept_log_probs = z - lse[row]
        ctx.save_for_backward(row, col, is_label, kept_log_probs)
        ctx.shape, ctx.dtype, ctx.temperature = logits.shape, logits.dtype, temperature
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(has_kept_set, kept_log_probs, mine)
        return log_probs, has_kept_set, kept_log_probs, mine

    @staticmethod
    def backward(ctx, grad_lp, _grad_has, _grad_kept, _grad_entries):  # type: ignore[override]
        row, col, is_label, kept_log_probs = ctx.saved_tensors
        grad_logits = torch.zeros(ctx.shape, dtype=ctx.dtype, device=row.device)
        if grad_lp is not None:
            g = grad_lp.to(kept_log_probs.dtype)[row] / ctx.temperature  # ∂z/∂logits = 1/T
            grad_z = g * (is_label.to(g.dtype) - kept_log_probs.exp())  # 0 off this shard (exp(−inf))
            grad_logits.index_put_((row, col), grad_z.to(ctx.dtype), accumulate=True)
        return grad_logits, None, None, None, None, None


def kept_token_log_softmax(logits: Tensor, labels: Tensor, counts: Tensor, ids: Tensor, *,
                           tp_group: ProcessGroup = None, temperature: float = 1.0) -> KeptLogProbs:
    """`KeptLogProbs` (module doc) of `labels` [...] (GLOBAL vocabulary ids) from `logits` [..., V/TP] split over
    `tp_group`, with the kept sets `counts` (shaped like `labels`) and `ids` [Σ counts] (global ids, the tokens'
    row-major order). fp32 (fp64 for fp64 logits); identical on every TP rank. Refuses, naming the batch key, ids
    outside the vocabulary, counts that do not add up to the ids, and a label not in its kept set."""
    if logits.shape[:-1] != labels.shape or counts.shape != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)}, labels {tuple(labels.shape)} and the kept sets' counts "
                         f"{tuple(counts.shape)} disagree: one count per label")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    ids, counts = ids.reshape(-1).long(), counts.reshape(-1).long()
    vocab = logits.size(-1) * tp_size(tp_group)
    low, high, total, negative = torch.stack([
        ids.min() if ids.numel() else ids.new_zeros(()), ids.max() if ids.numel() else ids.new_zeros(()),
        counts.sum(), (counts < 0).sum()]).tolist()
    if negative or total != ids.numel():
        raise ValueError(f"{KEPT_IDS_KEY}: {ids.numel()} ids, but the counts add up to {total}"
                         f"{' and some are negative' if negative else ''}: one count per token, Σ counts ids")
    if low < 0 or high >= vocab:
        raise ValueError(f"{KEPT_IDS_KEY}: ids in [{low}, {high}] outside the vocabulary [0, {vocab})")
    out = _KeptLogSoftmax.apply(logits.reshape(-1, logits.size(-1)), labels.reshape(-1).long(), counts, ids,
                                tp_group, float(temperature))
    log_probs, has_kept_set, kept_log_probs, kept_on_rank = out
    return KeptLogProbs(log_probs.reshape(labels.shape), has_kept_set.reshape(labels.shape), kept_log_probs,
                        kept_on_rank)


__all__ = ["KeptLogProbs", "kept_token_log_softmax"]
