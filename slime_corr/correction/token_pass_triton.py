"""The correction's token pass (`metrics.token_pass`) as one Triton kernel (`--rollout-correction-backend triton`).

One program per sequence (a row of the padded [B, S] inputs) walks its tokens in tiles and, from lp_train, lp_rollout
and the valid mask only, writes lr and accumulates every per-sequence sum the core needs — the `LOCAL` columns
(valid tokens, Σ lr, Σ lp_train, tokens with |lr| > 1e30) and the `TOKEN_SUMS` (−lr, k3, chi2, |lr|, d, p_t, p_r, d²,
p_t², p_r², p_t·p_r) — and max d: one launch where the eager pass makes about twenty. The formulas are the eager
pass's (`metrics.token_pass`): x = clamp(lr, ±20), k3 = e^x − 1 − x (a series for |x| < 1/4, where the subtraction
would cancel), chi2 = e·(e + 2) with e = k3 + x, p = exp(min(lp, 20)) on valid tokens (a non-finite valid lp
counts as 0 there; its sequence is rejected anyway), d = |p_t − p_r|. The sequence reductions after it stay as they
are. Packed rows and float64 inputs take the eager pass.

Triton's interpreter (TRITON_INTERPRET=1 before import) runs it on CPU tensors; that is how CI checks it against the
eager pass (tests/correction/test_token_pass_triton.py). Opt-in until scripts/gpu_check.sh has passed it on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_S = 1024  # tokens per tile on a GPU
BLOCK_S_INTERPRETED = 64  # under the interpreter (numpy per program): small tiles keep the tests quick
COLUMNS = 16  # LOCAL (4), TOKEN_SUMS (11), max d


@triton.jit
def _token_pass_kernel(lp_train_ptr, lp_rollout_ptr, valid_ptr, lr_ptr, out_ptr, seq_len, stride, big,
                       log_ratio_clamp, log_prob_clamp, max_abs_log_ratio, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = row.to(tl.int64) * stride
    n_valid = 0.0
    s_lr = 0.0
    s_lpt = 0.0
    n_bad = 0.0
    s_k3 = 0.0
    s_chi2 = 0.0
    s_abs = 0.0
    s_d = 0.0
    s_pt = 0.0
    s_pr = 0.0
    s_d2 = 0.0
    s_pt2 = 0.0
    s_pr2 = 0.0
    s_ptr = 0.0
    d_max = 0.0
    for start in range(0, seq_len, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < seq_len
        lp_t = tl.load(lp_train_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
        lp_r = tl.load(lp_rollout_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
        valid = tl.load(valid_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
        diff = lp_t - lp_r
        diff = tl.where(diff != diff, big, tl.minimum(tl.maximum(diff, -big), big))  # NaN -> +max, ±inf -> ±max
        lr = diff * valid
        tl.store(lr_ptr + base + cols, lr, mask=inside)
        x = tl.minimum(tl.maximum(lr, -log_ratio_clamp), log_ratio_clamp)
        series = x * x * (0.5 + x * (1.0 / 6 + x * (1.0 / 24 + x * (1.0 / 120 + x * (1.0 / 720 + x * (
            1.0 / 5040 + x * (1.0 / 40320)))))))
        k3 = tl.where(tl.abs(x) < 0.25, series, tl.exp(x) - 1.0 - x)
        e = k3 + x
        abs_lr = tl.abs(lr)
        keep = valid > 0
        t_masked = lp_t * valid
        r_masked = lp_r * valid
        t_clean = tl.where((t_masked == t_masked) & (tl.abs(t_masked) < float("inf")), t_masked, 0.0)
        r_clean = tl.where((r_masked == r_masked) & (tl.abs(r_masked) < float("inf")), r_masked, 0.0)
        p_t = tl.where(keep, tl.exp(tl.minimum(t_clean, log_prob_clamp)), 0.0)
        p_r = tl.where(keep, tl.exp(tl.minimum(r_clean, log_prob_clamp)), 0.0)
        d = tl.abs(p_t - p_r)
        n_valid += tl.sum(valid, axis=0)
        s_lr += tl.sum(lr, axis=0)
        s_lpt += tl.sum(t_clean, axis=0)
        n_bad += tl.sum(tl.where(abs_lr > max_abs_log_ratio, 1.0, 0.0), axis=0)
        s_k3 += tl.sum(k3, axis=0)
        s_chi2 += tl.sum(e * (e + 2.0), axis=0)
        s_abs += tl.sum(abs_lr, axis=0)
        s_d += tl.sum(d, axis=0)
        s_pt += tl.sum(p_t, axis=0)
        s_pr += tl.sum(p_r, axis=0)
        s_d2 += tl.sum(d * d, axis=0)
        s_pt2 += tl.sum(p_t * p_t, axis=0)
        s_pr2 += tl.sum(p_r * p_r, axis=0)
        s_ptr += tl.sum(p_t * p_r, axis=0)
        d_max = tl.maximum(d_max, tl.max(d, axis=0))
    out = out_ptr + row * 16
    tl.store(out + 0, n_valid)
    tl.store(out + 1, s_lr)
    tl.store(out + 2, s_lpt)
    tl.store(out + 3, n_bad)
    tl.store(out + 4, -s_lr)
    tl.store(out + 5, s_k3)
    tl.store(out + 6, s_chi2)
    tl.store(out + 7, s_abs)
    tl.store(out + 8, s_d)
    tl.store(out + 9, s_pt)
    tl.store(out + 10, s_pr)
    tl.store(out + 11, s_d2)
    tl.store(out + 12, s_pt2)
    tl.store(out + 13, s_pr2)
    tl.store(out + 14, s_ptr)
    tl.store(out + 15, d_max)


def token_pass_sums(lp_train: Tensor, lp_rollout: Tensor, valid: Tensor, *, log_ratio_clamp: float,
                    log_prob_clamp: float, max_abs_log_ratio: float) -> tuple[Tensor, Tensor]:
    """(lr [B, S] float32, [B, 16] float32: LOCAL, TOKEN_SUMS, max d) of float32 [B, S] inputs."""
    lp_train, lp_rollout, valid = (t.contiguous() for t in (lp_train, lp_rollout, valid))
    rows, seq_len = valid.shape
    lr = torch.empty_like(lp_train)
    out = torch.empty(rows, COLUMNS, dtype=torch.float32, device=valid.device)
    if rows:
        block = BLOCK_S if valid.is_cuda else BLOCK_S_INTERPRETED
        _token_pass_kernel[(rows,)](lp_train, lp_rollout, valid, lr, out, seq_len, seq_len,
                                    float(torch.finfo(torch.float32).max), float(log_ratio_clamp),
                                    float(log_prob_clamp), float(max_abs_log_ratio), BLOCK=block)
    return lr, out


__all__ = ["COLUMNS", "token_pass_sums"]
