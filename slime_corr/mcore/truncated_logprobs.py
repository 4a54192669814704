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
without gathering the vocabulary. The log-softmax over N then reuses `logprobs._chunk_stats` (one MAX and one SUM
all_reduce), chunked and recomputed in backward by the same `logprobs.map_chunks` as `vocab_parallel_log_probs`;
gradients flow to the logits of N only (the sets are piecewise constant).

`in_nucleus` says whether the sampled token lies in the trainer's N. Tokens the engine sampled outside it have
lp_trunc = −inf: the caller decides (drop them from the loss mask, or let the correction core reject their
sequence, which it does for any non-finite log-prob). `nucleus_disagreement` is their share of the valid tokens.
Cost: one sort of each [chunk, V/TP] key block, then 32 (or 64 with both) cheap search steps, each a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from slime_corr.mcore.logprobs import DEFAULT_CHUNK_SIZE, ProcessGroup, _chunk_stats, _tp_size, map_chunks

_KEY_LOW, _KEY_HIGH = -(2**31), 2**31 - 1


def float_keys(z: Tensor) -> Tensor:
    """Order-preserving int64 keys of the float32 values of `z` (equal floats, −0.0 and 0.0 too, get equal keys;
    NaN-free input): the bits for z ≥ 0, minus the magnitude bits for z < 0."""
    bits = z.to(torch.float32).view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


def _sum(x: Tensor, group: ProcessGroup) -> Tensor:
    if _tp_size(group) > 1:
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


def nucleus_keep(z: Tensor, top_k: int, top_p: float, vocab: int, group: ProcessGroup) -> Tensor:
    """Bool [N, V_local]: the local logits in SGLang's top-k then top-p set of each row of `z` [N, V_local]
    (temperature applied, detached). `vocab` is the global vocabulary size. Each rank sorts its keys once; every
    search step is then a `searchsorted` per row and one SUM of [N] counts or masses over the TP group."""
    keys = float_keys(z)
    rows, width = z.shape
    use_k, use_p = 0 < top_k < vocab, top_p < 1.0
    if not (use_k or use_p):
        return torch.ones_like(z, dtype=torch.bool)
    sorted_keys, order = keys.sort(-1)  # ascending: #{keys > t} = width - searchsorted(t, right)

    def first_above(t: Tensor) -> Tensor:
        return torch.searchsorted(sorted_keys, t[:, None], right=True)  # [N, 1]

    t_k = torch.full((rows,), _KEY_LOW, dtype=torch.int64, device=z.device)
    if use_k:  # τ_k: the smallest t with #{z > t} < k (the k-th largest key)
        t_k = _search(lambda t: _sum((width - first_above(t)).squeeze(-1).to(torch.float64), group) < top_k, rows,
                      z.device)
    if use_p:
        zmax = z.amax(-1)
        if _tp_size(group) > 1:
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        mass = (z - zmax[:, None]).to(torch.float64).exp().gather(-1, order)
        above = torch.cat([mass.flip(-1).cumsum(-1).flip(-1), mass.new_zeros(rows, 1)], -1)  # above[j] = Σ_{i≥j}

        def mass_above(t: Tensor) -> Tensor:  # Σ e^z over keys > t, within K (keys ≥ t_k)
            return above.gather(-1, first_above(torch.maximum(t, t_k - 1))).squeeze(-1)

        budget = _sum(above[:, 0].clone(), group) * top_p  # top_p of the full mass (SGLang's joint filter)
        t_p = _search(lambda t: _sum(mass_above(t), group) <= budget, rows, z.device)
        return keys >= torch.maximum(t_p, t_k)[:, None]  # K ∩ P
    return keys >= t_k[:, None]


def _truncated_chunk(logits: Tensor, labels: Tensor, vocab_start: int, group: ProcessGroup, temperature: float,
                     top_k: int, top_p: float, vocab: int) -> Tensor:
    """[N, V_local] logits, [N] labels -> [N, 2]: (lp_trunc, 1.0 if the label is in the nucleus else 0.0)."""
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        z = z / temperature
    keep = nucleus_keep(z.detach(), top_k, top_p, vocab, group)
    masked = torch.where(keep, z, torch.full((), -torch.inf, dtype=z.dtype, device=z.device))
    lp = _chunk_stats(masked, labels, vocab_start, group, 1.0, False)[:, 0]
    return torch.stack([lp, lp.detach().isfinite().to(lp.dtype)], -1)


def truncated_log_probs(
    logits: Tensor,
    labels: Tensor,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    tp_group: ProcessGroup = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:
    """(log π_trunc(label), in_nucleus) per position from `logits` [..., V/TP] split over `tp_group` (Megatron's
    layout; `labels` hold global ids). `top_k` ≤ 0 and `top_p` = 1 switch the truncation off (SGLang's defaults
    are top_k = -1, top_p = 1.0). Both results are shaped like `labels` and identical on every TP rank; the
    log-prob is differentiable wrt `logits` and −inf where `in_nucleus` is False."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (1.0: no nucleus truncation)")
    vocab = logits.size(-1) * _tp_size(tp_group)
    stats = map_chunks(_truncated_chunk, logits, labels, tp_group, temperature, int(top_k), float(top_p), vocab,
                       chunk_size=chunk_size, width=2)
    return stats[:, 0].reshape(labels.shape), stats[:, 1].detach().reshape(labels.shape) > 0


def nucleus_disagreement(in_nucleus: Tensor, loss_mask: Tensor) -> Tensor:
    """The share of valid sampled tokens outside the trainer's nucleus: Σ m·[not in N] / Σ m (0 without tokens)."""
    m = (loss_mask > 0) if loss_mask.dtype != torch.bool else loss_mask
    n = m.sum()
    return (m & ~in_nucleus).sum().to(torch.float64) / n.clamp_min(1)


__all__ = ["float_keys", "nucleus_disagreement", "nucleus_keep", "truncated_log_probs"]
