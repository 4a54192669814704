"""Per-token log-probs and entropy of sampled tokens from vocab-parallel logits: one autograd function.

With z = logits / T (T = rollout temperature, applied exactly as SGLang does: log_softmax(logits / T)), the
vocabulary split over the tensor-parallel (TP) group, and optionally a kept set N per token (top-k / top-p: the
logits at or above a per-token floor, `kept_floor`):

    lse_V = log Σ_v exp(z_v)                 lse_N = log Σ_{v ∈ N} exp(z_v)   (max and sums all-reduced over TP)
    lp    = z[label] − lse_N                 (lse_V without a kept set; −inf for a label outside N)
    H     = lse_V − Σ_v softmax(z)_v · z_v   (entropy of the full distribution)
    log M = lse_N − lse_V                    (the kept set's mass; detached)

Forward walks the tokens in chunks of `chunk_size`: per chunk one MAX and one SUM all-reduce of per-token
statistics, and it keeps per token only what backward needs (lse_V, lse_N, H, the floor) — never a [T, V] fp32
tensor. Backward recomputes the softmax chunk by chunk from the (bf16 / fp16 / fp32) logits, with no collective
(the statistics are already global), and writes the logits' gradient chunk by chunk:

    ∂lp/∂z_v = 1[v = label] − p^N_v            p^N_v = exp(z_v − lse_N) on N, 0 elsewhere
    ∂H/∂z_v  = −p_v · (z_v − lse_V + H)        p_v = exp(z_v − lse_V)

Every TP rank computes the same per-token values from the same reduced statistics, so the results are bitwise
identical on all ranks and each rank's gradient is exact for its shard (as Megatron's vocab-parallel cross
entropy). The entropy's gradient is kept only when it is asked for (`entropy_grad`: the entropy is in the loss
with a non-zero coefficient); a metric-only entropy saves nothing for backward. Peak extra memory: two fp32
[chunk, V/TP] buffers (one without the entropy) plus O(T). On CUDA the Triton kernel of the same function
(`slime_corr.mcore.logprobs_triton`, `--logprobs-backend triton`) computes it over vocabulary tiles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, get_args

import torch
import torch.distributed as dist
from torch import Tensor

from slime_corr.config import KernelBackend
from slime_corr.kernel_fallback import KernelFallback

ProcessGroup = dist.ProcessGroup | None
DEFAULT_CHUNK_SIZE: int | None = None  # tokens per chunk; None: as many as fill CHUNK_BYTES of the device
# bytes of one fp32 [chunk, V/TP] buffer when the chunk is not given: on a CPU about a cache's worth (smaller chunks
# were faster: bench/logprobs.py), on a GPU enough that each op of a chunk fills the device and a call launches few
CHUNK_BYTES = {"cpu": 4 * 2**20, "cuda": 256 * 2**20}
KeptFloor = Callable[[Tensor], Tensor]  # z [n, V_local] (temperature applied) -> [n] floor: N = {v : z_v >= floor}
BACKENDS: tuple[KernelBackend, ...] = get_args(KernelBackend)


def tp_size(group: ProcessGroup) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def vocab_start(logits: Tensor, group: ProcessGroup) -> int:
    """The first global vocabulary id of this TP rank's shard (Megatron's layout: rank r owns [r·V/TP, (r+1)·V/TP))."""
    return dist.get_rank(group=group) * logits.size(-1) if tp_size(group) > 1 else 0


@dataclass(frozen=True)
class LogSoftmaxSpec:
    """What `token_log_softmax` computes: the TP group, the temperature, the chunk, which outputs, and where
    (`backend`: "torch", or "triton", the kernel of `slime_corr.mcore.logprobs_triton`)."""

    tp_group: ProcessGroup = None
    temperature: float = 1.0
    chunk_size: int | None = DEFAULT_CHUNK_SIZE
    with_entropy: bool = False
    entropy_grad: bool = False  # the entropy is differentiable (in the loss); else a detached metric
    kept_floor: KeptFloor | None = None  # the kept set N per token (top-k / top-p); None: the full vocabulary
    backend: KernelBackend = "torch"

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size={self.chunk_size} must be >= 1 (or None: sized to the device)")
        if self.backend not in BACKENDS:
            raise ValueError(f"--logprobs-backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")


    def rows(self, logits: Tensor) -> int:
        """Tokens per chunk for `logits` [T, V_local]: `chunk_size`, else as many as fill the device's CHUNK_BYTES."""
        if self.chunk_size is not None:
            return self.chunk_size
        budget = CHUNK_BYTES.get(logits.device.type, CHUNK_BYTES["cuda"])
        return max(1, budget // (4 * max(logits.size(-1), 1)))


class TokenLogProbs(NamedTuple):
    """Per token: lp (under N when a kept set is given; differentiable), the full entropy (None unless asked),
    log M and whether the label is in N (None without a kept set; both detached)."""

    log_probs: Tensor
    entropy: Tensor | None
    log_mass: Tensor | None
    in_kept: Tensor | None


class _Statistics(NamedTuple):
    """What forward computes per token and backward needs: lp, lse_V, lse_N (lse_V without a kept set), H (None
    unless asked) and the kept set's floor (None without one)."""

    log_probs: Tensor
    lse_full: Tensor
    lse_kept: Tensor
    entropy: Tensor | None
    floor: Tensor | None


def compute_dtype(logits: Tensor) -> torch.dtype:
    """The dtype every log-prob is computed in: fp32 for bf16 / fp16 / fp32 logits, fp64 for fp64."""
    return torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype


def scaled_logits(chunk: Tensor, temperature: float, out: Tensor | None = None) -> Tensor:
    """`chunk` in fp32 (fp64 for fp64) divided by T — divided, as SGLang does (logits.div_(T)) — into `out` (a
    workspace reused chunk after chunk: a fresh [chunk, V] buffer per chunk costs the kernel's zeroing of its pages,
    on a CPU more than the arithmetic) or a fresh tensor."""
    z = chunk.to(compute_dtype(chunk), copy=True) if out is None else out[: chunk.size(0)].copy_(chunk)
    return z.div_(temperature) if temperature != 1.0 else z


def _workspace(logits: Tensor, spec: LogSoftmaxSpec, count: int) -> list[Tensor]:
    """`count` fp32 (fp64 for fp64) [min(chunk, T), V_local] buffers, reused by every chunk of one call."""
    rows = max(min(spec.rows(logits), logits.size(0)), 1)
    return [logits.new_empty(rows, logits.size(-1), dtype=compute_dtype(logits)) for _ in range(count)]


def _dropped(z: Tensor, floor: Tensor) -> Tensor:
    """Bool [n, V_local]: the logits outside the kept set, compared in float32 (as the floor was found)."""
    return z.to(torch.float32) < floor[:, None]


def _label_columns(labels: Tensor, start: int, width: int) -> tuple[Tensor, Tensor]:
    """(each label's column in this rank's shard, clamped into it, [n, 1]; whether it lies in the shard, [n]): gathers
    and scatters at fixed shapes, no host sync (a `nonzero` would wait for the device)."""
    local = labels - start
    return local.clamp(0, max(width - 1, 0))[:, None], (local >= 0) & (local < width)


# ---------------------------------------------------------------------------------------------- the torch path
def _forward_torch(logits: Tensor, labels: Tensor, spec: LogSoftmaxSpec) -> _Statistics:
    """Token chunks: per chunk z, then e^(z − max) (two fp32 [chunk, V] buffers), one MAX and one SUM all-reduce."""
    group, width = spec.tp_group, logits.size(-1)
    start, tp = vocab_start(logits, group), tp_size(group)
    n, dtype = labels.numel(), compute_dtype(logits)
    log_probs = logits.new_empty(n, dtype=dtype)
    lse_full = logits.new_empty(n, dtype=dtype)
    lse_kept = lse_full if spec.kept_floor is None else logits.new_empty(n, dtype=dtype)
    floor = None if spec.kept_floor is None else logits.new_empty(n, dtype=torch.float32)
    entropy = logits.new_empty(n, dtype=dtype) if spec.with_entropy else None
    z_buffer, exp_buffer = _workspace(logits, spec, 2)
    chunk = spec.rows(logits)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        z = scaled_logits(logits[a:b], spec.temperature, z_buffer)
        drop = None
        if floor is not None:
            assert spec.kept_floor is not None
            floor[a:b] = spec.kept_floor(z)
            drop = _dropped(z, floor[a:b])
        zmax = z.amax(-1)  # lse is shift-invariant; the max of N is the max of V (the argmax is always kept)
        if tp > 1:
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        z.sub_(zmax[:, None])
        cols, inside = _label_columns(labels[a:b], start, width)
        target = torch.where(inside, z.gather(-1, cols)[:, 0], 0.0)
        exp = torch.exp(z, out=exp_buffer[: b - a])
        columns = [exp.sum(-1), target]
        if entropy is not None:  # Σ e·(z − max), in z's buffer (z is not needed after it)
            columns.append(z.mul_(exp).sum(-1))
        if drop is not None:
            label_dropped = (drop.gather(-1, cols)[:, 0] & inside).to(z.dtype)
            columns += [exp.masked_fill_(drop, 0.0).sum(-1), label_dropped]
        stats = torch.stack(columns, -1)
        if tp > 1:
            dist.all_reduce(stats, group=group)
        log_sum = stats[:, 0].log()
        lse_full[a:b] = zmax + log_sum
        if entropy is not None:
            entropy[a:b] = log_sum - stats[:, 2] / stats[:, 0]
        if drop is None:
            log_probs[a:b] = stats[:, 1] - log_sum
        else:
            log_kept_sum = stats[:, -2].log()
            lse_kept[a:b] = zmax + log_kept_sum
            log_probs[a:b] = torch.where(stats[:, -1] > 0, -torch.inf, stats[:, 1] - log_kept_sum)
    return _Statistics(log_probs, lse_full, lse_kept, entropy, floor)


def _grad_torch(logits: Tensor, labels: Tensor, spec: LogSoftmaxSpec, saved: _Statistics, grad_lp: Tensor,
                lp_coef: Tensor, grad_entropy: Tensor | None) -> Tensor:
    """The logits' gradient chunk by chunk, recomputing p from the logits (one fp32 [chunk, V] buffer, two with
    the entropy's gradient); no collective. The 1/T of ∂z/∂logits is folded into the per-token coefficients."""
    grad_logits = torch.empty_like(logits)
    start, width, n = vocab_start(logits, spec.tp_group), logits.size(-1), labels.numel()
    lse_full, entropy, floor = saved.lse_full, saved.entropy, saved.floor
    inverse_t = 1.0 / spec.temperature
    lp_coef, grad_lp = lp_coef * inverse_t, grad_lp * inverse_t
    entropy_coef = None if grad_entropy is None else -grad_entropy * inverse_t
    buffers = _workspace(logits, spec, 1 if entropy_coef is None else 2)
    chunk = spec.rows(logits)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        z = scaled_logits(logits[a:b], spec.temperature, buffers[0])  # bitwise the forward's z
        drop = None if floor is None else _dropped(z, floor[a:b])
        if entropy_coef is None:  # lp_coef · p (on N), in place
            z.sub_(lse_full[a:b, None]).exp_().mul_(lp_coef[a:b, None])
            if drop is not None:
                z.masked_fill_(drop, 0.0)
        else:
            assert entropy is not None
            p = torch.sub(z, lse_full[a:b, None], out=buffers[1][: b - a]).exp_()
            # z := p · (−g_H · (z − lse_V + H)) + p · lp_coef (the latter on N only)
            z.sub_((lse_full[a:b] - entropy[a:b])[:, None]).mul_(entropy_coef[a:b, None]).mul_(p)
            p.mul_(lp_coef[a:b, None])
            if drop is not None:
                p.masked_fill_(drop, 0.0)
            z.add_(p)
        cols, inside = _label_columns(labels[a:b], start, width)
        if drop is not None:  # a label outside N has lp = −inf: no one-hot term
            inside = inside & ~drop.gather(-1, cols)[:, 0]
        z.scatter_add_(-1, cols, torch.where(inside, grad_lp[a:b], 0.0)[:, None])
        grad_logits[a:b].copy_(z)
    return grad_logits


# ---------------------------------------------------------------------------------------------- the Triton path
TRITON = KernelFallback("--logprobs-backend triton")  # the kernel's state in this process (warned once, then torch)


def _forward_triton(logits: Tensor, labels: Tensor, spec: LogSoftmaxSpec) -> _Statistics:
    """The kernel's per-rank statistics, combined over TP in torch; a kept set's floor found in torch chunks."""
    from slime_corr.mcore import logprobs_triton  # lazily: triton is optional (CUDA builds of torch bring it)

    group, width = spec.tp_group, logits.size(-1)
    start, tp = vocab_start(logits, group), tp_size(group)
    floor = None
    if spec.kept_floor is not None:
        chunk = spec.rows(logits)
        floor = torch.cat([spec.kept_floor(scaled_logits(logits[a:a + chunk], spec.temperature))
                           for a in range(0, labels.numel(), chunk)]) if labels.numel() else \
            logits.new_empty(0, dtype=torch.float32)
    stats = logprobs_triton.row_stats(logits, floor, spec.temperature)
    cols, inside = _label_columns(labels, start, width)
    target = torch.where(inside, scaled_logits(logits.gather(-1, cols)[:, 0], spec.temperature).float(), 0.0)
    label_dropped = None
    if floor is not None:
        label_dropped = (inside & (target < floor)).float()
    lse_full, lse_kept, entropy, label_z, dropped = logprobs_triton.combine(stats, target, label_dropped, group, tp)
    if floor is None:
        lse_kept = lse_full
    log_probs = torch.where(dropped > 0, -torch.inf, label_z - lse_kept)
    return _Statistics(log_probs, lse_full, lse_kept, entropy if spec.with_entropy else None, floor)


def _grad_triton(logits: Tensor, labels: Tensor, spec: LogSoftmaxSpec, saved: _Statistics, grad_lp: Tensor,
                 lp_coef: Tensor, grad_entropy: Tensor | None) -> Tensor:
    from slime_corr.mcore import logprobs_triton  # lazily: triton is optional (CUDA builds of torch bring it)

    def per_token(t: Tensor | None) -> Tensor | None:  # the kernel reads [T] tensors at stride 1 (an incoming
        return None if t is None else t.float().contiguous()  # gradient may be an expanded scalar)

    return logprobs_triton.logits_grad(logits, labels.contiguous(), vocab_start(logits, spec.tp_group),
                                       per_token(saved.floor), per_token(saved.lse_full), per_token(saved.entropy),
                                       per_token(lp_coef), per_token(grad_lp), per_token(grad_entropy),
                                       spec.temperature)


def _use_triton(spec: LogSoftmaxSpec, logits: Tensor) -> bool:
    return spec.backend == "triton" and TRITON.usable and logits.dtype != torch.float64


# ---------------------------------------------------------------------------------------------- the function
class _TokenLogSoftmax(torch.autograd.Function):
    """The function of the module doc over flattened [N, V_local] logits and [N] global labels."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, spec: LogSoftmaxSpec):  # type: ignore[override]
        saved = None
        if _use_triton(spec, logits):
            logits = logits.contiguous()
            try:
                saved = _forward_triton(logits, labels, spec)
            except Exception as error:  # noqa: BLE001 - compile or launch failures of any kind: the torch path
                TRITON.failed(error)
        if saved is None:
            saved = _forward_torch(logits, labels, spec)
        ctx.spec = spec
        ctx.set_materialize_grads(False)  # an output the loss does not use gets no gradient (None), not zeros
        ctx.save_for_backward(logits, labels, saved.lse_full, saved.lse_kept,
                              saved.entropy if spec.entropy_grad else None, saved.floor)
        log_mass = in_kept = None
        if saved.floor is not None:
            in_kept = saved.log_probs.isfinite()
            log_mass = torch.where(in_kept, (saved.lse_kept - saved.lse_full).clamp_max(0.0), 0.0)
            ctx.mark_non_differentiable(log_mass, in_kept)
        if saved.entropy is not None and not spec.entropy_grad:
            ctx.mark_non_differentiable(saved.entropy)
        return saved.log_probs, saved.entropy, log_mass, in_kept

    @staticmethod
    def backward(ctx, grad_lp, grad_entropy, _grad_mass, _grad_kept):  # type: ignore[override]
        logits, labels, lse_full, lse_kept, entropy, floor = ctx.saved_tensors
        spec: LogSoftmaxSpec = ctx.spec
        saved = _Statistics(lse_full, lse_full, lse_kept, entropy, floor)
        dtype = lse_full.dtype
        grad_lp = torch.zeros_like(lse_full) if grad_lp is None else grad_lp.to(dtype)
        grad_entropy = None if entropy is None or grad_entropy is None else grad_entropy.to(dtype)
        # the lp term: −g · p^N with p^N = p · exp(lse_V − lse_N) on N (and 0 off it)
        lp_coef = -grad_lp if floor is None else -grad_lp * torch.exp(lse_full - lse_kept)
        if _use_triton(spec, logits):
            try:
                return _grad_triton(logits, labels, spec, saved, grad_lp, lp_coef, grad_entropy), None, None
            except Exception as error:  # noqa: BLE001 - as in forward
                TRITON.failed(error)
        return _grad_torch(logits, labels, spec, saved, grad_lp, lp_coef, grad_entropy), None, None


def token_log_softmax(logits: Tensor, labels: Tensor, spec: LogSoftmaxSpec) -> TokenLogProbs:
    """`TokenLogProbs` per position of `labels` [...] (GLOBAL vocabulary ids) from `logits` [..., V/TP]: fp32
    (fp64 for fp64 logits), shaped like `labels`, identical on every TP rank; lp (and the entropy when
    `spec.entropy_grad`) differentiable wrt `logits`."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    flat = _TokenLogSoftmax.apply(logits.reshape(-1, logits.size(-1)), labels.reshape(-1).long(), spec)
    return TokenLogProbs(*(None if t is None else t.reshape(labels.shape) for t in flat))


def vocab_parallel_log_probs(
    logits: Tensor,
    labels: Tensor,
    *,
    tp_group: ProcessGroup = None,
    temperature: float = 1.0,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    backend: KernelBackend = "torch",
) -> Tensor | tuple[Tensor, Tensor]:
    """log π(label) (and entropy) per position from `logits` [..., V/TP] split over `tp_group`.

    `labels` [...] hold GLOBAL vocab ids; TP rank r owns ids [r·V/TP, (r+1)·V/TP) (Megatron's layout).
    Returns tensors shaped like `labels` (fp32 for bf16/fp16/fp32 logits, fp64 for fp64); identical on every TP
    rank; differentiable wrt `logits` (the entropy only with `entropy_grad`: False for a metric-only entropy).
    """
    spec = LogSoftmaxSpec(tp_group, temperature, chunk_size, with_entropy, with_entropy and entropy_grad,
                          backend=backend)
    out = token_log_softmax(logits, labels, spec)
    if with_entropy:
        return out.log_probs, out.entropy  # type: ignore[return-value]
    return out.log_probs


__all__ = ["BACKENDS", "DEFAULT_CHUNK_SIZE", "TRITON", "LogSoftmaxSpec", "TokenLogProbs", "compute_dtype", "scaled_logits",
           "token_log_softmax", "tp_size", "vocab_parallel_log_probs", "vocab_start"]
