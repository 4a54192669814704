"""Log-probs under SGLang's top-k / top-p truncated, renormalized distribution against a plain full-tensor, sort-based
reference (SGLang 0.5's joint filter: temperature, then top-k AND top-p with the exclusive cumulative sum of the full
distribution): values, the in-nucleus flag and gradients; chunked; TP=2 over gloo (vocab split in two) equal to one rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from slime_corr.mcore.logprobs import vocab_parallel_log_probs
from slime_corr.mcore.truncated_logprobs import float_keys, nucleus_disagreement, truncated_log_probs
from tests.mcore.mcore_helpers import checking, spawn_group

V = 48
SETTINGS = [(0, 1.0, 1.0), (5, 1.0, 1.0), (0, 0.9, 1.0), (0, 0.5, 0.7), (8, 0.8, 1.3), (1, 0.3, 1.0), (0, 0.05, 1.0)]


def ref_truncated(logits: torch.Tensor, labels: torch.Tensor, top_k: int, top_p: float, t: float):
    """Sort-based: the kept set of each row as SGLang builds it, then z_y − logsumexp(z over the set)."""
    z = logits / t
    flat = z.reshape(-1, z.shape[-1])
    keep = torch.zeros_like(flat, dtype=torch.bool)
    for i in range(flat.shape[0]):
        order = flat[i].detach().argsort(descending=True)
        probs = torch.softmax(flat[i].detach()[order], -1)
        kept = torch.ones_like(probs, dtype=torch.bool)
        if top_k > 0:
            kept[top_k:] = False
        if top_p < 1.0:
            kept &= (probs.cumsum(0) - probs) <= top_p
        keep[i, order] = kept
    masked = torch.where(keep, flat, torch.full((), -torch.inf, dtype=flat.dtype))
    lp = (masked.gather(-1, labels.reshape(-1, 1)).squeeze(-1) - torch.logsumexp(masked, -1))
    inside = keep.gather(-1, labels.reshape(-1, 1)).squeeze(-1)
    return lp.reshape(labels.shape), inside.reshape(labels.shape)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 9, V, generator=g, dtype=torch.float64) * torch.linspace(0.3, 6, 5)[:, None, None]
    labels = torch.multinomial(torch.softmax(logits.reshape(-1, V), -1), 1, generator=g).reshape(5, 9)
    labels[0, :3] = logits[0, :3].argmin(-1)  # surely outside any truncation
    return logits, labels


def _check(lp, inside, grad, logits, labels, setting, sl=slice(None)):
    top_k, top_p, t = setting
    checking(f"top_k={top_k} top_p={top_p} t={t}")
    x = logits.clone().requires_grad_()
    want, want_in = ref_truncated(x, labels, top_k, top_p, t)
    assert torch.equal(inside, want_in), setting
    torch.testing.assert_close(lp, want, rtol=1e-12, atol=1e-12, msg=str(setting))
    coef = torch.linspace(-1, 1, labels.numel(), dtype=torch.float64).reshape(labels.shape)
    torch.where(want_in, want * coef, 0.0).sum().backward()
    torch.testing.assert_close(grad, x.grad[..., sl], rtol=1e-10, atol=1e-12, msg=str(setting))
    return want_in


@pytest.mark.parametrize("setting", SETTINGS, ids=[f"k{k}-p{p}-t{t}" for k, p, t in SETTINGS])
@pytest.mark.parametrize("chunk_size", [7, 4096])
def test_truncated_log_probs_match_the_sort_based_reference(setting, chunk_size):
    logits, labels = _data()
    top_k, top_p, t = setting
    x = logits.clone().requires_grad_()
    lp, inside = truncated_log_probs(x, labels, top_k=top_k, top_p=top_p, temperature=t, chunk_size=chunk_size)
    coef = torch.linspace(-1, 1, labels.numel(), dtype=torch.float64).reshape(labels.shape)
    torch.where(inside, lp * coef, 0.0).sum().backward()
    want_in = _check(lp, inside, x.grad, logits, labels, setting)
    assert lp[~inside].eq(-torch.inf).all() and x.grad.isfinite().all()
    if top_k == 0 and top_p == 1.0:  # no truncation: the plain log-softmax
        torch.testing.assert_close(lp, vocab_parallel_log_probs(logits, labels, temperature=t))
        assert inside.all()
    else:
        assert not want_in.all()  # the labels exercise the outside
    frac = nucleus_disagreement(inside, torch.ones_like(labels))
    assert frac.item() == pytest.approx((~want_in).double().mean().item())


def test_float_keys_order_like_the_floats():
    x = torch.tensor([-torch.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, torch.inf])
    k = float_keys(x)
    assert (k[1:] >= k[:-1]).all() and (k[1:] > k[:-1]).sum() == 6


def test_bad_arguments():
    logits, labels = _data()
    with pytest.raises(ValueError, match="top_p=0.0 must be in"):
        truncated_log_probs(logits, labels, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        truncated_log_probs(logits, labels, temperature=0.0)


def _worker(rank: int) -> None:
    logits, labels = _data(seed=1)
    shard = slice(rank * V // 2, (rank + 1) * V // 2)
    for setting in SETTINGS:
        top_k, top_p, t = setting
        x = logits[..., shard].clone().requires_grad_()
        lp, inside = truncated_log_probs(x, labels, top_k=top_k, top_p=top_p, temperature=t, chunk_size=7,
                                         tp_group=dist.group.WORLD)
        coef = torch.linspace(-1, 1, labels.numel(), dtype=torch.float64).reshape(labels.shape)
        torch.where(inside, lp * coef, 0.0).sum().backward()
        _check(lp, inside, x.grad, logits, labels, setting, shard)


def test_tp2_equals_the_full_vocabulary():
    spawn_group(_worker, 2)
