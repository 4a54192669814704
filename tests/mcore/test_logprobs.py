"""The trainer's one log-prob function (`slime_corr.mcore.logprobs.token_log_softmax`, torch path) against a plain
float64 full-tensor reference: log-probs, entropy and the logits' gradient in every logits dtype, temperature, chunk
size and entropy mode, with empty and one-token inputs and non-finite logits; and what it keeps: forward saves
per-token statistics only (the entropy's only when it is in the loss), no tensor of [T, V] fp32 is ever made, and a
Triton backend that cannot run falls back to the torch path with one warning. TP, CP and the loss hook:
tests/mcore/test_mcore_parallel.py; the top-k / top-p kept set: test_truncated_logprobs.py; the Triton kernel under
Triton's interpreter: test_logprobs_triton.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slime_corr.kernel_fallback import KernelFallback
from slime_corr.mcore import logprobs
from slime_corr.mcore.logprobs import LogSoftmaxSpec, token_log_softmax, vocab_parallel_log_probs

V = 61
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp64": 1e-12, "fp32": 2e-6, "bf16": 2e-6, "fp16": 2e-6}  # against the float64 reference of the same
# (rounded) logits: the function computes in fp32 for 16-bit logits, in fp64 for fp64


def _reference(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    log_softmax = torch.log_softmax(logits.double() / temperature, -1)
    return log_softmax.gather(-1, labels[..., None])[..., 0], -(log_softmax.exp() * log_softmax).sum(-1)


def _logits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of `shape` + [V], each token's row at its own scale (flat to peaked), and labels drawn uniformly."""
    g = torch.Generator().manual_seed(seed)
    tokens = int(torch.tensor(shape).prod().item())
    scale = torch.linspace(0.2, 8.0, max(tokens, 1), dtype=torch.float64)[:tokens].reshape(*shape, 1)
    logits = (torch.randn(*shape, V, generator=g, dtype=torch.float64) * scale).to(dtype)
    return logits, torch.randint(0, V, shape, generator=g)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy", ["none", "metric", "loss"])
@pytest.mark.parametrize("chunk_size", [1, 7, 4096])
def test_values_and_gradients_match_a_full_tensor_reference(dtype, temperature, entropy, chunk_size):
    logits, labels = _logits((3, 9), DTYPES[dtype])
    x = logits.clone().requires_grad_()
    out = vocab_parallel_log_probs(x, labels, temperature=temperature, chunk_size=chunk_size,
                                   with_entropy=entropy != "none", entropy_grad=entropy == "loss")
    lp, h = out if entropy != "none" else (out, None)
    assert lp.dtype == (torch.float64 if dtype == "fp64" else torch.float32) and lp.shape == labels.shape
    ref_x = logits.double().requires_grad_()
    ref_lp, ref_h = _reference(ref_x, labels, temperature)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(lp.double(), ref_lp, rtol=tol, atol=tol)
    g = torch.Generator().manual_seed(1)
    w_lp, w_h = torch.randn(labels.shape, generator=g, dtype=torch.float64), torch.randn(labels.shape, generator=g,
                                                                                         dtype=torch.float64)
    loss = (w_lp * lp).sum()
    ref_loss = (w_lp * ref_lp).sum()
    if h is not None:
        torch.testing.assert_close(h.double(), ref_h, rtol=tol, atol=tol)
        assert h.requires_grad == (entropy == "loss")
        if entropy == "loss":
            loss, ref_loss = loss + (w_h * h).sum(), ref_loss + (w_h * ref_h).sum()
    loss.backward()
    ref_loss.backward()
    assert x.grad.dtype == x.dtype
    # the gradient is rounded once to the logits' dtype: within one unit in its last place of the reference
    ulp = {"fp64": 1e-12, "fp32": 2e-6, "bf16": 2 ** -7, "fp16": 2 ** -10}[dtype]
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=ulp, atol=ulp * ref_x.grad.abs().max().item())


@pytest.mark.parametrize("tokens", [0, 1])
def test_empty_and_one_token_inputs(tokens):
    logits, labels = _logits((tokens,), torch.float32)
    x = logits.clone().requires_grad_()
    lp, h = vocab_parallel_log_probs(x, labels, with_entropy=True)
    assert lp.shape == h.shape == (tokens,)
    (lp.sum() + h.sum()).backward()
    ref_lp, ref_h = _reference(logits, labels, 1.0)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(h.double(), ref_h, rtol=2e-6, atol=2e-6)
    assert x.grad.shape == logits.shape


def test_non_finite_logits_stay_in_their_own_row_and_extreme_ones_stay_finite():
    logits, labels = _logits((6,), torch.float32)
    logits[1, 5] = float("nan")
    logits[2, 7] = float("inf")
    logits[3] = torch.linspace(-1e4, 1e4, V)  # extreme but finite: exact, no overflow
    x = logits.clone().requires_grad_()
    lp, h = vocab_parallel_log_probs(x, labels, with_entropy=True, chunk_size=4)
    (lp.sum() + h.sum()).backward()
    assert lp[1].isnan() and lp[2].isnan()  # a non-finite logit poisons its own token only
    fine = torch.tensor([0, 3, 4, 5])
    ref_lp, ref_h = _reference(logits[fine], labels[fine], 1.0)
    torch.testing.assert_close(lp[fine].double(), ref_lp, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(h[fine].double(), ref_h, rtol=2e-6, atol=1e-5)
    assert x.grad[fine].isfinite().all()


@pytest.mark.parametrize("entropy", ["metric", "loss"])
def test_forward_saves_per_token_statistics_only(entropy):
    """Beyond the logits and labels (references, not copies), backward keeps [T] statistics: lse_V, lse_N, and the
    entropy only when it is in the loss; a metric-only entropy keeps nothing for backward."""
    logits, labels = _logits((5, 8), torch.bfloat16)
    x = logits.clone().requires_grad_()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        vocab_parallel_log_probs(x, labels, with_entropy=True, entropy_grad=entropy == "loss", chunk_size=16)
    big = [t for t in saved if t.numel() >= x.numel()]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr() and big[0].dtype == torch.bfloat16
    per_token = [t for t in saved if t.numel() == labels.numel() and t.is_floating_point()]
    assert len(per_token) == (3 if entropy == "loss" else 2)  # lse_V, lse_N (the same tensor here) [, H]


class _LargestFloat(TorchDispatchMode):
    """The largest floating-point tensor any op makes (bytes), the gradient buffer of the logits aside."""

    def __init__(self, skip_numel: int) -> None:
        super().__init__()
        self.skip_numel, self.largest = skip_numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() != self.skip_numel:
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("entropy", ["metric", "loss"])
def test_no_tensor_of_t_by_v_in_fp32_only_chunks(entropy):
    """Forward and backward make fp32 tensors of one chunk at most ([chunk, V]); the only [T, V] tensor made is the
    logits' gradient, in the logits' dtype."""
    tokens, chunk = 64, 8
    logits, labels = _logits((tokens,), torch.bfloat16)
    x = logits.clone().requires_grad_()
    with _LargestFloat(skip_numel=x.numel()) as mode:
        lp, h = vocab_parallel_log_probs(x, labels, with_entropy=True, entropy_grad=entropy == "loss",
                                         chunk_size=chunk)
        loss = lp.sum() + (h.sum() if entropy == "loss" else 0)
        (grad,) = torch.autograd.grad(loss, x)
    assert grad.dtype == torch.bfloat16
    assert mode.largest <= chunk * V * 4, mode.largest


def test_a_triton_backend_that_cannot_run_falls_back_to_torch_with_one_warning(monkeypatch):
    """Here the kernel cannot run: without triton, or with triton and CPU tensors (no interpreter). Either way the
    run goes on: the same values and gradient as the torch path, one warning for the process."""
    monkeypatch.setattr(logprobs, "TRITON", KernelFallback("--logprobs-backend triton"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits, labels = _logits((4, 6), torch.float32)
    results = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for backend in ("triton", "triton", "torch"):
            x = logits.clone().requires_grad_()
            lp, h = vocab_parallel_log_probs(x, labels, with_entropy=True, backend=backend)
            (lp.sum() + h.sum()).backward()
            results.append((lp, h, x.grad))
    fallbacks = [w for w in seen if "--logprobs-backend triton" in str(w.message)]
    assert len(fallbacks) == 1 and "torch path" in str(fallbacks[0].message) and not logprobs.TRITON.usable
    for got in results[:2]:
        for a, b in zip(got, results[2], strict=True):
            assert torch.equal(a, b)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="temperature"):
        LogSoftmaxSpec(temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        LogSoftmaxSpec(chunk_size=0)
    with pytest.raises(ValueError, match="--logprobs-backend 'cuda'"):
        LogSoftmaxSpec(backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="disagree"):
        token_log_softmax(torch.zeros(2, 3, V), torch.zeros(2, 4, dtype=torch.long), LogSoftmaxSpec())
