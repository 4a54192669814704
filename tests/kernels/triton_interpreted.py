"""The project's Triton kernels under Triton's interpreter, on CPU tensors, against their torch paths: the log-prob
function's (`slime_corr.mcore.logprobs_triton`) and the correction's token pass (`slime_corr.correction.
token_pass_triton`). Run by tests/kernels/test_triton_interpreted.py as

    TRITON_INTERPRET=1 python -m tests.kernels.triton_interpreted OUT.json

(the interpreter is chosen when the kernels are defined, so it needs a process of its own). On a GPU,
`python -m tests.kernels.triton_interpreted OUT.json --device cuda` runs the same cases compiled, on CUDA tensors
(scripts/gpu_check.sh, step kernels). Each case writes
"ok" or what differed into OUT.json; TP=2 runs two gloo processes over a file store, each with half the vocabulary.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import compute_rollout_correction, metrics
from slime_corr.mcore import logprobs
from slime_corr.mcore.truncated_logprobs import truncated_token_log_softmax

DEVICE = torch.device("cpu")  # --device cuda on a GPU
V = 600  # not a multiple of the interpreted tile (256): the last tile is partial
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ULP = {"fp32": 2e-6, "bf16": 2 ** -7, "fp16": 2 ** -10}


def _inputs(tokens: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.2, 8.0, max(tokens, 1), dtype=torch.float64)[:tokens, None]
    logits = (torch.randn(tokens, V, generator=g, dtype=torch.float64) * scale).to(dtype)
    return logits.to(DEVICE), torch.randint(0, V, (tokens,), generator=g).to(DEVICE)


def _run(fn: Callable, logits: torch.Tensor, labels: torch.Tensor, entropy: str, backend: str):
    """(lp, H or None, extra outputs, the logits' gradient) of one backend."""
    x = logits.clone().requires_grad_()
    out = fn(x, labels, backend)
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(2, *labels.shape, generator=g).to(DEVICE)
    loss = (weights[0] * torch.where(out.log_probs.isfinite(), out.log_probs, 0.0)).sum()
    if entropy == "loss":
        loss = loss + (weights[1] * out.entropy).sum()
    if x.numel():
        loss.backward()
    return out, x.grad if x.grad is not None else torch.zeros_like(x)


def _compare(name: str, dtype: str, torch_out, triton_out) -> str:
    (a, grad_a), (b, grad_b) = torch_out, triton_out
    problems = []
    if not logprobs.TRITON.usable:  # the kernel must have run, not the fallback
        return f"{name}: the kernel did not run: {logprobs.TRITON.failure}"
    for field in ("log_probs", "entropy", "log_mass"):
        x, y = getattr(a, field), getattr(b, field)
        if (x is None) != (y is None):
            problems.append(f"{field}: {x is None} vs {y is None}")
        elif x is not None and not torch.allclose(x, y, rtol=2e-6, atol=2e-6, equal_nan=True):
            problems.append(f"{field} differs by {(x - y).abs().nan_to_num(0).max().item():.3g}")
    if (a.in_kept is None) != (b.in_kept is None) or (a.in_kept is not None and not torch.equal(a.in_kept, b.in_kept)):
        problems.append("in_kept differs")
    scale = grad_a.double().abs().max().item() if grad_a.numel() else 0.0
    if not torch.allclose(grad_a.double(), grad_b.double(), rtol=ULP[dtype], atol=ULP[dtype] * scale):
        problems.append(f"gradient differs by {(grad_a.double() - grad_b.double()).abs().max().item():.3g}")
    return "ok" if not problems else f"{name}: " + "; ".join(problems)


def single_process_cases() -> dict[str, str]:
    results = {}
    for dtype in DTYPES:
        for temperature in (1.0, 0.7):
            for entropy in ("none", "metric", "loss"):
                def full(x, labels, backend, temperature=temperature, entropy=entropy):
                    spec = logprobs.LogSoftmaxSpec(None, temperature, 5, entropy != "none", entropy == "loss",
                                                   backend=backend)
                    return logprobs.token_log_softmax(x, labels, spec)
                name = f"{dtype}-t{temperature}-entropy_{entropy}"
                logits, labels = _inputs(13, DTYPES[dtype])
                results[name] = _compare(name, dtype, *(_run(full, logits, labels, entropy, b)
                                                        for b in ("torch", "triton")))
    for top_k, top_p in ((5, 1.0), (0, 0.8), (20, 0.6)):
        def truncated(x, labels, backend, top_k=top_k, top_p=top_p):
            return truncated_token_log_softmax(x, labels, top_k=top_k, top_p=top_p, temperature=0.7, chunk_size=4,
                                               with_entropy=True, entropy_grad=True, backend=backend)
        name = f"top_k{top_k}-top_p{top_p}"
        logits, labels = _inputs(13, torch.float32, seed=2)
        labels[:3] = logits[:3].argmin(-1)  # surely outside the kept set
        results[name] = _compare(name, "fp32", *(_run(truncated, logits, labels, "loss", b)
                                                 for b in ("torch", "triton")))
    logits, labels = _inputs(0, torch.float32)
    results["no tokens"] = _compare("no tokens", "fp32", *(_run(
        lambda x, y, b: logprobs.token_log_softmax(x, y, logprobs.LogSoftmaxSpec(None, 1.0, 4, True, True,
                                                                                  backend=b)),
        logits, labels, "loss", b) for b in ("torch", "triton")))
    return results


def _tp_rank(rank: int, store: str, out: str, device: str) -> None:
    global DEVICE
    DEVICE = torch.device(device)  # a spawned process starts from this module's default
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        logits, labels = _inputs(11, torch.bfloat16, seed=3)
        shard = logits[:, rank * V // 2:(rank + 1) * V // 2]
        found = {}
        for backend in ("torch", "triton"):
            x = shard.clone().requires_grad_()
            spec = logprobs.LogSoftmaxSpec(dist.group.WORLD, 0.7, 4, True, True, backend=backend)
            result = logprobs.token_log_softmax(x, labels, spec)
            (result.log_probs.sum() + 0.5 * result.entropy.sum()).backward()
            found[backend] = (result.log_probs.cpu(), result.entropy.cpu(), x.grad.cpu())
        torch.save({"found": found, "failure": logprobs.TRITON.failure}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def tp_case() -> dict[str, str]:
    """TP=2: the kernel's results are the same on both ranks (bitwise), equal the torch path's within rounding,
    and the two gradient shards are the torch path's."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_tp_rank, args=(os.path.join(tmp, "store"), os.path.join(tmp, "out"), str(DEVICE)), nprocs=2,
                           join=True, start_method="spawn")
        ranks = [torch.load(os.path.join(tmp, f"out.{r}")) for r in range(2)]
    problems = [f"rank {r}: the kernel did not run: {ranks[r]['failure']}" for r in range(2) if ranks[r]["failure"]]
    (lp0, h0, _), (lp1, h1, _) = ranks[0]["found"]["triton"], ranks[1]["found"]["triton"]
    if not (torch.equal(lp0, lp1) and torch.equal(h0, h1)):
        problems.append("the TP ranks' results differ")
    for r in range(2):
        (lp_t, h_t, g_t), (lp_k, h_k, g_k) = ranks[r]["found"]["torch"], ranks[r]["found"]["triton"]
        if not (torch.allclose(lp_t, lp_k, rtol=2e-6, atol=2e-6) and torch.allclose(h_t, h_k, rtol=2e-6, atol=2e-6)):
            problems.append(f"rank {r}: values differ from the torch path")
        scale = g_t.double().abs().max().item()
        if not torch.allclose(g_t.double(), g_k.double(), rtol=ULP["bf16"], atol=ULP["bf16"] * scale):
            problems.append(f"rank {r}: gradient shard differs from the torch path by "
                            f"{(g_t.double() - g_k.double()).abs().max().item():.3g} (largest {scale:.3g})")
    return {"tp2": "ok" if not problems else "tp2: " + "; ".join(problems)}


def _token_pass_inputs(rows: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lp_rollout, lp_train = it + a small mismatch (large ones on row 0), uneven lengths (one empty row), and
    NaN / ±inf log-probs inside and outside the mask."""
    g = torch.Generator().manual_seed(seed)
    lp_rollout = -torch.rand(rows, seq_len, generator=g) * 3
    lp_train = lp_rollout + 0.01 * torch.randn(rows, seq_len, generator=g)
    large = torch.tensor([0.5, -0.7, 2.0, -3.0, 0.2, 0.3, 25.0, -30.0, 1e-4, -1e-5])[:seq_len]
    if rows:
        lp_train[0, :len(large)] += large
    lengths = torch.randint(1, seq_len + 1, (rows,), generator=g)
    valid = (torch.arange(seq_len)[None] < lengths[:, None]).float()
    lp_train, lp_rollout, valid = lp_train.to(DEVICE), lp_rollout.to(DEVICE), valid.to(DEVICE)
    for row, column, value in ((2, None, None), (1, 0, "nan"), (3, -1, "-inf"), (4, 0, "inf")):
        if row < rows and column is None:
            valid[row] = 0.0  # an empty sequence
        elif row < rows:  # inside the mask, or outside it where the row is shorter
            (lp_rollout if value == "-inf" else lp_train)[row, column] = float(value)
    return lp_train, lp_rollout, valid


def token_pass_cases() -> dict[str, str]:
    """The correction's token pass: the kernel's lr, per-sequence sums and max d against the eager pass, and its
    k3 and chi2 sums against a float64 reference (a series for small lr: no cancellation)."""
    results = {}
    for rows, seq_len in ((6, 150), (1, 1), (0, 8), (5, 64)):
        name = f"token_pass-{rows}x{seq_len}"
        lp_train, lp_rollout, valid = _token_pass_inputs(rows, seq_len, seed=rows + seq_len)
        eager = metrics.token_pass(lp_train, lp_rollout, valid)
        fused = metrics.token_pass(lp_train, lp_rollout, valid, backend="triton")
        problems = [] if metrics.TRITON.usable else [f"the kernel did not run: {metrics.TRITON.failure}"]
        for field, a, b in zip(eager._fields, eager, fused, strict=True):
            if a.shape != b.shape or a.dtype != b.dtype:
                problems.append(f"{field}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
            elif not torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6, equal_nan=True):
                problems.append(f"{field} differs by {(a.double() - b.double()).abs().nan_to_num(0).max().item():.3g}")
        good = rows and valid[5 if rows > 5 else 0].sum() > 0
        if good and not problems:  # a finite row: k3 and chi2 sums against float64
            r = 5 if rows > 5 else 0
            x = ((lp_train[r].double() - lp_rollout[r].double()) * valid[r].double()).clamp(-20, 20)
            want = torch.stack([(torch.expm1(x) - x).sum(), (torch.expm1(2 * x)).sum()])
            got = fused.rows[r, 1:3]
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-9):
                problems.append(f"k3/chi2 sums {got.tolist()} vs float64 {want.tolist()}")
        results[name] = "ok" if not problems else f"{name}: " + "; ".join(problems)
    results["correction-decoupled_seq_is_rs"] = _whole_correction()
    return results


def _whole_correction() -> str:
    """`compute_rollout_correction` with --rollout-correction-backend triton: the metrics, weights and masks of
    the torch backend's call."""
    lp_train, lp_rollout, valid = _token_pass_inputs(6, 40, seed=9)
    config = RolloutCorrectionConfig.preset("decoupled_seq_is_rs")
    eager = compute_rollout_correction(lp_train, lp_rollout, valid, config)
    fused = compute_rollout_correction(lp_train, lp_rollout, valid, config.replace(rollout_correction_backend="triton"))
    problems = [] if metrics.TRITON.usable else [f"the kernel did not run: {metrics.TRITON.failure}"]
    if eager.metrics.keys() != fused.metrics.keys():
        problems.append(f"metric keys differ: {sorted(eager.metrics.keys() ^ fused.metrics.keys())}")
    for key in eager.metrics.keys() & fused.metrics.keys():
        if not torch.allclose(eager.metrics[key].double(), fused.metrics[key].double(), rtol=1e-5, atol=1e-7,
                              equal_nan=True):
            problems.append(f"{key}: {eager.metrics[key].item()} vs {fused.metrics[key].item()}")
    for field in ("weights", "loss_mask", "denominator_mask"):
        a, b = getattr(eager, field), getattr(fused, field)
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-7, equal_nan=True):
            problems.append(f"{field} differs")
    return "ok" if not problems else "correction: " + "; ".join(problems)


def main(out_path: str, device: str = "cpu") -> None:
    global DEVICE
    DEVICE = torch.device(device)
    if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run under TRITON_INTERPRET=1 (the kernels run on CPU tensors only in the interpreter)")
    results: dict[str, str] = {}
    for cases in (single_process_cases, tp_case, token_pass_cases):
        try:
            results.update(cases())
        except Exception:  # noqa: BLE001 - reported per group of cases
            results[cases.__name__] = traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], *(sys.argv[3:4] if sys.argv[2:3] == ["--device"] else ()))
