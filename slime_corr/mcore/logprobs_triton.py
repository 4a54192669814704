"""The Triton kernel of `slime_corr.mcore.logprobs.token_log_softmax` (`--logprobs-backend triton`): the same
function, over vocabulary tiles instead of token chunks.

Forward, one program per token: an online softmax over the tiles of its logits row (z = logits / T, divided with
IEEE rounding as torch does), keeping the running max m and, rescaled whenever m grows, Σ e^(z−m), Σ e^(z−m)·z
(the entropy) and Σ over the kept set (z ≥ floor) — four floats per token, nothing of size [T, V]. Across TP ranks
the per-rank statistics are combined in torch (one MAX and one SUM all-reduce of [T] columns, as the torch path).
Backward, one program per (token, tile): p = e^(z − lse_V), the gradient of the module doc's formulas, written
straight into the logits' gradient in the logits' dtype.

Triton's interpreter (TRITON_INTERPRET=1, set before this module is imported) runs the kernels on CPU tensors; that
is how CI checks them against the torch path (tests/mcore/test_logprobs_triton.py). It proves values, not speed or
compilation on a GPU: the kernel is opt-in until scripts/gpu_check.sh has passed it on one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch import Tensor

BLOCK_V = 2048  # vocabulary entries per tile (a power of two)
BLOCK_V_INTERPRETED = 256  # under the interpreter: numpy per program, smaller tiles keep tests quick


@triton.jit
def _row_stats_kernel(logits_ptr, stride, floor_ptr, stats_ptr, vocab, temperature,
                      HAS_FLOOR: tl.constexpr, BLOCK: tl.constexpr):
    """stats[row] = (m, Σ e^(z−m), Σ e^(z−m)·(z−m), Σ_{z ≥ floor} e^(z−m)) of this rank's shard of one row: the
    entropy's sum relative to the max, as the torch path's (no cancellation against lse)."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    floor = tl.load(floor_ptr + row) if HAS_FLOOR else -float("inf")
    m = -float("inf")
    total = 0.0
    weighted = 0.0
    kept = 0.0
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        z = tl.load(base + cols, mask=inside, other=-float("inf")).to(tl.float32)
        z = tl.math.div_rn(z, temperature)
        new_m = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - new_m)
        e = tl.exp(z - new_m)
        e = tl.where(inside, e, 0.0)
        # the old Σ e·(z − m) re-based on the new max: scale · (Σ e·(z − m) + (m − new_m) · Σ e); none at first
        weighted = scale * (weighted + (tl.where(total > 0, m, new_m) - new_m) * total)
        weighted += tl.sum(e * tl.where(inside, z - new_m, 0.0), axis=0)  # no 0 · −inf
        total = total * scale + tl.sum(e, axis=0)
        kept = kept * scale + tl.sum(tl.where(z >= floor, e, 0.0), axis=0)
        m = new_m
    tl.store(stats_ptr + row * 4 + 0, m)
    tl.store(stats_ptr + row * 4 + 1, total)
    tl.store(stats_ptr + row * 4 + 2, weighted)
    tl.store(stats_ptr + row * 4 + 3, kept)


@triton.jit
def _grad_kernel(logits_ptr, stride, grad_ptr, labels_ptr, floor_ptr, lse_full_ptr, entropy_ptr, lp_coef_ptr,
                 grad_lp_ptr, grad_entropy_ptr, vocab, vocab_start, temperature,
                 HAS_FLOOR: tl.constexpr, HAS_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    """grad[row, tile] = (−g_H·p·(z − lse_V + H) + lp_coef·p·[z ≥ floor] + g_lp·1[v = label, kept]) / T."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    offset = row.to(tl.int64) * stride
    z = tl.load(logits_ptr + offset + cols, mask=inside, other=0.0).to(tl.float32)
    z = tl.math.div_rn(z, temperature)
    lse = tl.load(lse_full_ptr + row)
    p = tl.exp(z - lse)
    lp_coef = tl.load(lp_coef_ptr + row)
    kept = z >= tl.load(floor_ptr + row) if HAS_FLOOR else cols >= 0
    grad = tl.where(kept, lp_coef * p, 0.0)
    if HAS_ENTROPY:
        grad += -tl.load(grad_entropy_ptr + row) * p * (z - lse + tl.load(entropy_ptr + row))
    label = tl.load(labels_ptr + row) - vocab_start
    grad += tl.where((cols == label) & kept, tl.load(grad_lp_ptr + row), 0.0)
    grad = tl.math.div_rn(grad, temperature)
    tl.store(grad_ptr + offset + cols, grad.to(grad_ptr.dtype.element_ty), mask=inside)


def _block(logits: Tensor) -> int:
    return BLOCK_V if logits.is_cuda else BLOCK_V_INTERPRETED


def row_stats(logits: Tensor, floor: Tensor | None, temperature: float) -> Tensor:
    """[N, 4] float32 per-rank statistics of contiguous [N, V_local] logits (see `_row_stats_kernel`)."""
    n, vocab = logits.shape
    stats = torch.empty(n, 4, dtype=torch.float32, device=logits.device)
    if n:
        dummy = stats  # an unused pointer where there is no floor
        _row_stats_kernel[(n,)](logits, logits.stride(0), floor if floor is not None else dummy, stats, vocab,
                                float(temperature), HAS_FLOOR=floor is not None, BLOCK=_block(logits))
    return stats


def combine(stats: Tensor, target: Tensor, label_dropped: Tensor | None, group: dist.ProcessGroup | None,
            tp: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-rank (m, Σe, Σe·(z−m), Σ_N e) and the label's z -> global (lse_V, lse_N, entropy, label z, label
    dropped): one MAX and one SUM all-reduce over the TP group (none at TP = 1)."""
    m = stats[:, 0].clone()
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    scale = torch.exp(stats[:, 0] - m)
    shift = (stats[:, 0] - m) * stats[:, 1]  # Σ e·(z − m_rank) re-based on the global max
    columns = [stats[:, 1] * scale, (stats[:, 2] + torch.where(stats[:, 1] > 0, shift, 0.0)) * scale,
               stats[:, 3] * scale, target]
    if label_dropped is not None:
        columns.append(label_dropped)
    sums = torch.stack(columns, -1)
    if tp > 1:
        dist.all_reduce(sums, group=group)
    log_sum = sums[:, 0].log()
    lse_full = m + log_sum
    lse_kept = m + sums[:, 2].log()
    entropy = log_sum - sums[:, 1] / sums[:, 0]
    dropped = sums[:, 4] if label_dropped is not None else torch.zeros_like(m)
    return lse_full, lse_kept, entropy, sums[:, 3], dropped


def logits_grad(logits: Tensor, labels: Tensor, vocab_start: int, floor: Tensor | None, lse_full: Tensor,
                entropy: Tensor | None, lp_coef: Tensor, grad_lp: Tensor, grad_entropy: Tensor | None,
                temperature: float) -> Tensor:
    """The logits' gradient (their dtype) from the saved per-token statistics (see `_grad_kernel`)."""
    n, vocab = logits.shape
    grad = torch.empty_like(logits)
    if n:
        block = _block(logits)
        dummy = lse_full
        _grad_kernel[(n, triton.cdiv(vocab, block))](
            logits, logits.stride(0), grad, labels, floor if floor is not None else dummy, lse_full,
            entropy if entropy is not None else dummy, lp_coef, grad_lp,
            grad_entropy if grad_entropy is not None else dummy, vocab, vocab_start, float(temperature),
            HAS_FLOOR=floor is not None, HAS_ENTROPY=entropy is not None and grad_entropy is not None, BLOCK=block)
    return grad


__all__ = ["BLOCK_V", "combine", "logits_grad", "row_stats"]
