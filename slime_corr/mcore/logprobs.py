"""Per-token log-probs and entropy of sampled tokens from vocab-parallel logits.

With z = logits / T (T = rollout temperature, applied exactly as SGLang does: log_softmax(logits / T), no
top-p/top-k renormalization) and the vocabulary split over the tensor-parallel (TP) group:

    lse   = log Σ_v exp(z_v)                 (max and Σ exp all-reduced over TP)
    lp    = z[label] − lse                   (z[label] lives on one TP rank; all-reduced)
    H     = lse − Σ_v softmax(z)_v · z_v     (entropy)

One MAX and one SUM all-reduce per chunk. The SUM is the identity in backward (every TP rank computes the same
loss from the reduced value, as in Megatron's vocab-parallel cross entropy), so gradients wrt the local logit
shard are exact and the results are bitwise identical on all TP ranks.

Half-precision logits are upcast to fp32 per chunk. Memory: tokens are processed in chunks of `chunk_size`; with
gradients on, each chunk is recomputed in backward (activation checkpointing, the TP collectives re-run in the same
order on every TP rank), so the fp32 [chunk, V/TP] temporaries exist for one chunk at a time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

ProcessGroup = dist.ProcessGroup | None
DEFAULT_CHUNK_SIZE = 4096  # tokens per chunk


def _tp_size(group: ProcessGroup) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


class _AllReduceSumIdentityGrad(torch.autograd.Function):
    """Forward: all-reduce SUM over `group`. Backward: identity (the loss is replicated on every rank)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def _chunk_stats(
    logits: Tensor, labels: Tensor, vocab_start: int, group: ProcessGroup, temperature: float, entropy: bool
) -> Tensor:
    """[N, V_local] logits, [N] labels -> [N, 1 or 2] (log-prob, entropy) for one chunk."""
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        z = z / temperature  # divide, as SGLang does (logits.div_(T)); not a multiply by 1/T
    tp = _tp_size(group)
    zmax = z.detach().amax(dim=-1)  # lse is invariant to the shift: no gradient needed through the max
    if tp > 1:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    shifted = z - zmax.unsqueeze(-1)
    exp = shifted.exp()
    local = labels - vocab_start
    in_shard = (local >= 0) & (local < z.size(-1))
    target = shifted.gather(-1, local.clamp(0, z.size(-1) - 1).unsqueeze(-1)).squeeze(-1)
    target = torch.where(in_shard, target, torch.zeros((), dtype=z.dtype, device=z.device))
    cols = [exp.sum(-1), target]
    if entropy:
        cols.append((exp * shifted).sum(-1))
    stacked = torch.stack(cols, dim=-1)
    if tp > 1:
        stacked = _AllReduceSumIdentityGrad.apply(stacked, group)
    sum_exp = stacked[:, 0]
    log_sum_exp = sum_exp.log()  # relative to zmax
    out = [stacked[:, 1] - log_sum_exp]
    if entropy:
        out.append(log_sum_exp - stacked[:, 2] / sum_exp)
    return torch.stack(out, dim=-1)


def map_chunks(fn, logits: Tensor, labels: Tensor, tp_group: ProcessGroup, *args: object, chunk_size: int,
               width: int) -> Tensor:
    """Rows of `fn(logits_chunk [n, V_local], labels_chunk [n], vocab_start, tp_group, *args)` -> [n, width] over
    the flattened `logits` [..., V_local] / `labels` [...] in chunks of `chunk_size` rows, concatenated to
    [N, width]; `vocab_start` is the first global id of this rank's vocabulary shard. With gradients on, each chunk
    is recomputed in backward (activation checkpointing, its TP collectives re-run in the same order on every TP
    rank), so the fp32 [chunk, V/TP] temporaries of one chunk exist at a time."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    vocab_start = dist.get_rank(group=tp_group) * logits.size(-1) if _tp_size(tp_group) > 1 else 0
    flat_logits = logits.reshape(-1, logits.size(-1))
    flat_labels = labels.reshape(-1).long()
    use_ckpt = torch.is_grad_enabled() and logits.requires_grad and flat_labels.numel() > chunk_size
    parts = []
    for start in range(0, flat_labels.numel(), chunk_size):
        chunk = (flat_logits[start: start + chunk_size], flat_labels[start: start + chunk_size], vocab_start,
                 tp_group, *args)
        parts.append(checkpoint(fn, *chunk, use_reentrant=False) if use_ckpt else fn(*chunk))
    return torch.cat(parts) if parts else flat_logits.new_zeros(0, width).float()


def vocab_parallel_log_probs(
    logits: Tensor,
    labels: Tensor,
    *,
    tp_group: ProcessGroup = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """log π(label) (and entropy) per position from `logits` [..., V/TP] split over `tp_group`.

    `labels` [...] hold GLOBAL vocab ids; TP rank r owns ids [r·V/TP, (r+1)·V/TP) (Megatron's layout).
    Returns tensors shaped like `labels` (fp32 for bf16/fp16/fp32 logits, fp64 for fp64); identical on every TP
    rank; differentiable wrt `logits`.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    stats = map_chunks(_chunk_stats, logits, labels, tp_group, temperature, with_entropy, chunk_size=chunk_size,
                       width=2 if with_entropy else 1)
    log_probs = stats[:, 0].reshape(labels.shape)
    if with_entropy:
        return log_probs, stats[:, 1].reshape(labels.shape)
    return log_probs


__all__ = ["DEFAULT_CHUNK_SIZE", "map_chunks", "vocab_parallel_log_probs"]
