"""Log-probs of sampled tokens under the top-k / top-p truncated, renormalized distribution, from vocab-parallel
logits (the math; `slime_corr.mcore.nucleus` puts the trainer under it).

SGLang 0.5 samples from z = logits / T with its "joint" top-k / top-p filter (the torch sampler and flashinfer's
`filter_apply_order="joint"`, as the embedded engine): a token stays when it ranks among the top k AND the
probability mass of the tokens ranked before it, under the FULL distribution, is ≤ top_p; then it renormalizes. Here,
with ties kept together (the sets differ from a sort-based cut only at exact ties of logits):

    K = {v : z_v ≥ τ_k},  τ_k = the k-th largest z                     (all tokens when top_k ≤ 0)
    N = {v ∈ K : Σ_{u : z_u > z_v} e^{z_u} ≤ top_p · Σ_u e^{z_u}}  = {v ∈ K : z_v ≥ τ_p}
    lp_trunc(y) = z_y − log Σ_{v ∈ N} e^{z_v}   if y ∈ N,  −inf otherwise

τ_k and τ_p are found exactly by binary search on the float32 bit patterns of z (order-preserving integer keys):
each rank sorts its keys once, then 32 steps each, a `searchsorted` per row and one small SUM all_reduce over the
tensor-parallel group per step ([chunk] counts or masses, in float64), so every TP rank gets the same thresholds
without gathering the vocabulary. The thresholds become one float per token, the smallest kept z (`nucleus_floor`:
N = {v : z_v ≥ floor}), and the log-softmax over N is `logprobs.token_log_softmax`'s, the one function of every
log-prob of the trainer: in the same pass the full distribution's entropy and log M, chunked, backward recomputing
the softmax chunk by chunk from the floor it kept; gradients flow to the logits of N only (the sets are piecewise
constant).

`in_nucleus` says whether the sampled token lies in the trainer's N. Tokens the engine sampled outside it have
lp_trunc = −inf: the caller decides (drop them from the loss mask, or let the correction core reject their
sequence, which it does for any non-finite log-prob). `nucleus_disagreement` is their share of the valid tokens.
Cost: one sort of each [chunk, V/TP] key block, then 32 (or 64 with both) cheap search steps, each a collective.
Whether a GIVEN token is in N needs no threshold (`label_in_nucleus`, the replay's metric): y ∈ N iff
#{u : z_u > z_y} < k and Σ_{u : z_u > z_y} e^{z_u} ≤ top_p · Σ_u e^{z_u}, one pass with no sort.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from slime_corr.config import KernelBackend
from slime_corr.mcore.logprobs import (
    DEFAULT_CHUNK_SIZE,
    LogSoftmaxSpec,
    ProcessGroup,
    TokenLogProbs,
    scaled_logits,
    token_log_softmax,
    tp_size,
    vocab_start,
)

_KEY_LOW, _KEY_HIGH = -(2**31), 2**31 - 1


def float_keys(z: Tensor) -> Tensor:
    """Order-preserving int64 keys of the float32 values of `z` (equal floats, −0.0 and 0.0 too, get equal keys;
    NaN-free input): the bits for z ≥ 0, minus the magnitude bits for z < 0."""
    bits = z.to(torch.float32).view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


def _sum(x: Tensor, group: ProcessGroup) -> Tensor:
    if tp_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _search(pred, rows: int, device: torch.device) -> Tensor:
    """The smallest int key t per row with `pred(t)` true (monotone: false ... false true ... true), over the int32
    range, in 32 steps; `pred` maps [rows] keys to [rows] bools identical on every TP rank."""
    lo = torch.full((rows,), _KEY_LOW, dtype=torch.int64, device=device)
    hi = torch.full((rows,), _KEY_HIGH, dtype=torch.int64, device=device)
    for _ in range(32):
        mid = torch.div(lo + hi, 2, rounding_mode="floor")
        ok = pred(mid)
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid + 1)
    return hi


def floats_of_keys(keys: Tensor) -> Tensor:
    """The float32 values whose `float_keys` are `keys` (the inverse; −inf below the key of −inf)."""
    bits = torch.where(keys >= 0, keys, (-keys) | 0x80000000)
    values = (((bits + 2**31) % 2**32) - 2**31).to(torch.int32).view(torch.float32)
    return torch.where(keys < float_keys(torch.tensor(-torch.inf)), -torch.inf, values)


def nucleus_floor(z: Tensor, top_k: int, top_p: float, vocab: int, group: ProcessGroup) -> Tensor:
    """Float32 [N]: the smallest z of SGLang's top-k then top-p set of each row of `z` [N, V_local] (temperature
    applied), −inf without a truncation: the set is {v : float32(z_v) ≥ floor}. `vocab` is the global vocabulary
    size. Each rank sorts its keys once; every search step is then a `searchsorted` per row and one SUM of [N]
    counts or masses over the TP group."""
    z = z.detach()
    rows, width = z.shape
    use_k, use_p = 0 < top_k < vocab, top_p < 1.0
    if not (use_k or use_p):
        return torch.full((rows,), -torch.inf, device=z.device)
    keys = float_keys(z)
    sorted_keys, order = keys.sort(-1)  # ascending: #{keys > t} = width - searchsorted(t, right)

    def first_above(t: Tensor) -> Tensor:
        return torch.searchsorted(sorted_keys, t[:, None], right=True)  # [N, 1]

    t_k = torch.full((rows,), _KEY_LOW, dtype=torch.int64, device=z.device)
    if use_k:  # τ_k: the smallest t with #{z > t} < k (the k-th largest key)
        t_k = _search(lambda t: _sum((width - first_above(t)).squeeze(-1).to(torch.float64), group) < top_k, rows,
                      z.device)
    if not use_p:
        return floats_of_keys(t_k)
    zmax = z.amax(-1)
    if tp_size(group) > 1:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    mass = (z - zmax[:, None]).to(torch.float64).exp().gather(-1, order)
    above = torch.cat([mass.flip(-1).cumsum(-1).flip(-1), mass.new_zeros(rows, 1)], -1)  # above[j] = Σ_{i≥j}

    def mass_above(t: Tensor) -> Tensor:  # Σ e^z over keys > t, within K (keys ≥ t_k)
        return above.gather(-1, first_above(torch.maximum(t, t_k - 1))).squeeze(-1)

    budget = _sum(above[:, 0].clone(), group) * top_p  # top_p of the full mass (SGLang's joint filter)
    t_p = _search(lambda t: _sum(mass_above(t), group) <= budget, rows, z.device)
    return floats_of_keys(torch.maximum(t_p, t_k))  # K ∩ P


def nucleus_keep(z: Tensor, top_k: int, top_p: float, vocab: int, group: ProcessGroup) -> Tensor:
    """Bool [N, V_local]: the local logits in SGLang's top-k then top-p set of each row of `z` [N, V_local]."""
    return z.to(torch.float32) >= nucleus_floor(z, top_k, top_p, vocab, group)[:, None]


def truncated_token_log_softmax(logits: Tensor, labels: Tensor, *, top_k: int = 0, top_p: float = 1.0,
                                tp_group: ProcessGroup = None, temperature: float = 1.0,
                                chunk_size: int | None = DEFAULT_CHUNK_SIZE, with_entropy: bool = False,
                                entropy_grad: bool = False, backend: KernelBackend = "torch") -> TokenLogProbs:
    """`token_log_softmax` over SGLang's top-k / top-p kept set: lp_trunc (−inf outside it), the full entropy
    when asked, log M and in_kept (None for both when `top_k` ≤ 0 and `top_p` = 1: no truncation)."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (1.0: no nucleus truncation)")
    vocab = logits.size(-1) * tp_size(tp_group)
    truncated = 0 < top_k < vocab or top_p < 1.0
    floor = partial(nucleus_floor, top_k=int(top_k), top_p=float(top_p), vocab=vocab, group=tp_group)
    spec = LogSoftmaxSpec(tp_group, temperature, chunk_size, with_entropy, with_entropy and entropy_grad,
                          floor if truncated else None, backend)
    return token_log_softmax(logits, labels, spec)


def truncated_log_probs(
    logits: Tensor,
    labels: Tensor,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    tp_group: ProcessGroup = None,
    temperature: float = 1.0,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:
    """(log π_trunc(label), in_nucleus) per position from `logits` [..., V/TP] split over `tp_group` (Megatron's
    layout; `labels` hold global ids). `top_k` ≤ 0 and `top_p` = 1 switch the truncation off (SGLang's defaults
    are top_k = -1, top_p = 1.0). Both results are shaped like `labels` and identical on every TP rank; the
    log-prob is differentiable wrt `logits` and −inf where `in_nucleus` is False."""
    out = truncated_token_log_softmax(logits, labels, top_k=top_k, top_p=top_p, tp_group=tp_group,
                                      temperature=temperature, chunk_size=chunk_size)
    inside = torch.ones_like(labels, dtype=torch.bool) if out.in_kept is None else out.in_kept
    return out.log_probs, inside


@torch.no_grad()
def label_in_nucleus(logits: Tensor, labels: Tensor, *, top_k: int = 0, top_p: float = 1.0,
                     tp_group: ProcessGroup = None, temperature: float = 1.0,
                     chunk_size: int | None = DEFAULT_CHUNK_SIZE) -> Tensor:
    """Bool, shaped like `labels`: whether each label lies in SGLang's top-k / top-p set of its row of `logits`
    [..., V/TP] (the set `nucleus_floor` gives, ties kept together), by the module doc's rule with no sort: per
    chunk one MAX all-reduce (the max z and the label's z) and one SUM all-reduce (how many z are above the label's,
    their mass, the total mass, in float64) over the TP group. All True without a truncation."""
    width = logits.size(-1)
    vocab = width * tp_size(tp_group)
    use_k, use_p = 0 < top_k < vocab, top_p < 1.0
    flat, ys = logits.reshape(-1, width), labels.reshape(-1).long()
    inside = torch.ones(ys.numel(), dtype=torch.bool, device=logits.device)
    if not (use_k or use_p) or not ys.numel():
        return inside.reshape(labels.shape)
    start, tp = vocab_start(logits, tp_group), tp_size(tp_group)
    chunk = LogSoftmaxSpec(chunk_size=chunk_size).rows(flat)
    for a in range(0, ys.numel(), chunk):
        z = scaled_logits(flat[a:a + chunk], temperature).to(torch.float32)  # compared in float32, as the floor
        local = ys[a:a + chunk] - start
        mine = (local >= 0) & (local < width)
        label_z = torch.where(mine, z.gather(-1, local.clamp(0, width - 1)[:, None])[:, 0], -torch.inf)
        top = torch.stack([z.amax(-1), label_z], -1)
        if tp > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
        above = z > top[:, 1:]
        mass = (z.to(torch.float64) - top[:, :1].to(torch.float64)).exp()
        sums = torch.stack([above.sum(-1).to(torch.float64), torch.where(above, mass, 0.0).sum(-1), mass.sum(-1)], -1)
        if tp > 1:
            dist.all_reduce(sums, group=tp_group)
        kept = torch.ones_like(mine)
        if use_k:
            kept &= sums[:, 0] < top_k
        if use_p:
            kept &= sums[:, 1] <= top_p * sums[:, 2]
        inside[a:a + chunk] = kept
    return inside.reshape(labels.shape)


def nucleus_disagreement(in_nucleus: Tensor, loss_mask: Tensor) -> Tensor:
    """The share of valid sampled tokens outside the trainer's nucleus: Σ m·[not in N] / Σ m (0 without tokens)."""
    m = (loss_mask > 0) if loss_mask.dtype != torch.bool else loss_mask
    n = m.sum()
    return (m & ~in_nucleus).sum().to(torch.float64) / n.clamp_min(1)


__all__ = ["float_keys", "floats_of_keys", "label_in_nucleus", "nucleus_disagreement", "nucleus_floor", "nucleus_keep",
           "truncated_log_probs", "truncated_token_log_softmax"]
