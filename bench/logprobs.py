"""Log-probs + entropy from logits, forward + backward: slime_corr's function against the peers' own code.

Variants (each measured in a fresh process of its own, interleaved over repeats; medians):
- `ours`: `slime_corr.mcore.logprobs.vocab_parallel_log_probs` (the torch path: one autograd function, chunked);
- `ours-triton`: the same function's Triton kernel (`--device cuda`, or CPU under TRITON_INTERPRET=1: values only);
- `verl`: verl 0.9.1's `logprobs_from_logits` + `entropy_from_logits` (its FSDP actor's path; the wheel is fetched
  as bench/vs_verl.py fetches it);
- `megatron`: Megatron-Core's `vocab_parallel_cross_entropy` + verl 0.9.1's `vocab_parallel_entropy`, called as
  verl's Megatron engine calls them (the cross entropy, which works in place on fp32 logits, on `logits.clone()`);
- `liger`: Liger-Kernel's fused linear-free cross entropy + entropy (`--device cuda`, where installed).

Entropy "metric": the entropy is computed without gradient (logged only); "loss": it is in the loss with a
coefficient (its gradient flows). The loss is Σ w1·lp (+ Σ w2·H) with fixed random weights; temperature 1.

Time: one forward + backward, the median of `--iters` calls per process, then the median over `--repeats`
processes. Extra peak memory, in one more process per variant and case: its own high-water mark (VmHWM, reset through
/proc/self/clear_refs after the inputs are allocated and one warm-up call has run) minus its resident memory at that
moment, for one call, with glibc's mmap threshold fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_) so that a freed buffer
leaves the process at once and the mark follows the live tensors, not the allocator's reuse of freed blocks (that
setting costs page faults, so the timed processes keep glibc's defaults); the logits' gradient (one [T, V] tensor of
the logits' dtype, which every variant returns) is part of it. On CUDA: torch's peak allocated bytes minus those
allocated before the call, in the timed processes. A ratio > 1 means ours is faster / lighter.

    python bench/logprobs.py                                 # 4096x32768 and 16384x32768, bf16 and fp32, both modes
    python bench/logprobs.py --sizes 4096x32768 --dtypes bf16 --entropy loss --repeats 5
    python bench/logprobs.py --device cuda --variants ours,ours-triton,verl,megatron,liger
    python bench/logprobs.py --markdown docs/benchmarks.md   # rewrites the table between its markers
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from markdown_table import caption_line, write_block  # bench/markdown_table.py

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


# ---------------------------------------------------------------------------------------------- one process
def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_high_water_mark() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


def _variant(name: str, entropy: str, chunk: int):
    """(logits, labels) -> (lp, entropy or None) for one variant; the caller runs backward."""
    import torch

    with_grad = entropy == "loss"
    if name in ("ours", "ours-triton"):
        from slime_corr.mcore.logprobs import vocab_parallel_log_probs

        backend = "triton" if name == "ours-triton" else "torch"

        def ours(logits, labels):
            return vocab_parallel_log_probs(logits, labels, with_entropy=True, entropy_grad=with_grad,
                                            chunk_size=chunk, backend=backend)
        return ours
    if name == "verl":
        from vs_verl import load_verl_module

        functional = load_verl_module("verl.utils.torch_functional")

        def verl(logits, labels):
            lp = functional.logprobs_from_logits(logits, labels)
            if with_grad:
                return lp, functional.entropy_from_logits(logits)
            with torch.no_grad():
                return lp, functional.entropy_from_logits(logits)
        return verl
    if name == "megatron":
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
        from vs_verl import load_verl_module

        from slime_corr.ports import init_world_of_one

        init_world_of_one("nccl" if torch.cuda.is_available() else "gloo")
        parallel_state.initialize_model_parallel(1)
        megatron_verl = load_verl_module("verl.utils.megatron.tensor_parallel")

        def megatron(logits, labels):  # as verl's Megatron engine: the cross entropy (in place) on a clone
            clone = logits.clone()
            if with_grad:
                h = megatron_verl.vocab_parallel_entropy(logits)
            else:
                with torch.no_grad():
                    h = megatron_verl.vocab_parallel_entropy(logits)
            return -vocab_parallel_cross_entropy(clone, labels), h
        return megatron
    if name == "liger":  # its cross entropy writes the gradient into its input in forward: the entropy takes a clone
        from liger_kernel.transformers.functional import liger_cross_entropy

        def entropy_of(x):
            log_softmax = torch.log_softmax(x.float(), -1)
            return -(log_softmax.exp() * log_softmax).sum(-1)

        def liger(logits, labels):
            entropy_logits = logits.clone()
            if with_grad:
                h = entropy_of(entropy_logits)
            else:
                with torch.no_grad():
                    h = entropy_of(entropy_logits)
            return -liger_cross_entropy(logits, labels, reduction="none"), h
        return liger
    raise SystemExit(f"--variants: unknown variant {name!r}")


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant at one size in this process: its median time over `iters` calls, its extra peak memory."""
    import torch

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    dtype = getattr(torch, DTYPES[spec["dtype"]])
    g = torch.Generator().manual_seed(0)
    tokens, vocab = spec["tokens"], spec["vocab"]
    logits = (torch.randn(tokens, vocab, generator=g) * 2).to(dtype).to(device).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    w_lp, w_h = torch.randn(tokens, generator=g).to(device), torch.randn(tokens, generator=g).to(device)
    fn = _variant(spec["variant"], spec["entropy"], spec["chunk"])

    def step() -> tuple[Any, Any, Any]:
        lp, h = fn(logits, labels)
        loss = (w_lp * lp.float()).sum()
        if spec["entropy"] == "loss":
            loss = loss + (w_h * h.float()).sum()
        (grad,) = torch.autograd.grad(loss, logits)
        return lp.detach(), None if h is None else h.detach(), grad

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    lp, h, grad = step()  # warm-up (and the values checked below)
    del grad
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        _reset_high_water_mark()
        before = _vm_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    _, _, grad = step()
    sync()
    times = [time.perf_counter() - t0]
    extra = (torch.cuda.max_memory_allocated() if device.type == "cuda" else _vm_kib("VmHWM") * 1024) - before
    errors = _errors(logits.detach(), labels, lp, h, grad, w_lp, w_h, spec["entropy"] == "loss")
    del grad
    for _ in range(spec["iters"] - 1):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times), "extra_bytes": extra, **errors}


def _errors(logits, labels, lp, h, grad, w_lp, w_h, entropy_in_loss: bool) -> dict[str, float]:
    """Largest |difference| of lp, H and the gradient against a float64 full-tensor reference (first 512 tokens)."""
    import torch

    n = min(512, labels.numel())
    x = logits[:n].double().cpu().requires_grad_()
    log_softmax = torch.log_softmax(x, -1)
    ref_lp = log_softmax.gather(-1, labels[:n].cpu()[:, None])[:, 0]
    ref_h = -(log_softmax.exp() * log_softmax).sum(-1)
    loss = (w_lp[:n].cpu().double() * ref_lp).sum()
    if entropy_in_loss:
        loss = loss + (w_h[:n].cpu().double() * ref_h).sum()
    loss.backward()
    out = {"lp_error": (lp[:n].double().cpu() - ref_lp).abs().max().item(),
           "grad_error": (grad[:n].double().cpu() - x.grad).abs().max().item()}
    if h is not None:
        out["entropy_error"] = (h[:n].double().cpu() - ref_h).abs().max().item()
    return out


# ---------------------------------------------------------------------------------------------- the driver
def measure(spec: dict[str, Any], memory: bool = False) -> dict[str, Any]:
    """One child process: timed (glibc's defaults), or `memory` (mmap threshold fixed: see the module doc)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    if memory:
        env.update(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072", MALLOC_TOP_PAD_="0")
        spec = dict(spec, iters=1)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "bench"), str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=3600)
    if proc.returncode != 0:
        return {"failed": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4096x32768,16384x32768", help="T x V, comma-separated")
    parser.add_argument("--dtypes", default="bf16,fp32", help="logits dtypes: bf16, fp16, fp32")
    parser.add_argument("--entropy", default="metric,loss", help="metric (no gradient), loss (in the loss)")
    parser.add_argument("--variants", default="ours,verl,megatron")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="processes per variant and case (interleaved)")
    parser.add_argument("--iters", type=int, default=2, help="timed calls per process")
    parser.add_argument("--chunk", type=int, default=None, help="ours: tokens per chunk (default: the library's)")
    parser.add_argument("--markdown", default=None, help="write the table into this file between its markers")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(run_child(json.loads(args.child))))
        return
    import torch

    from slime_corr.mcore.logprobs import LogSoftmaxSpec
    variants = args.variants.split(",")
    header = ["T x V", "logits", "entropy", "variant", "fwd+bwd s", "extra peak MiB", "beyond the gradient, in "
              "fp32 [chunk, V]",
              "x time / ours", "x memory / ours", "max |Δlp|", "max |ΔH|", "max |Δgrad|"]
    rows = []
    print(" | ".join(header), flush=True)
    for size in args.sizes.split(","):
        tokens, vocab = (int(x) for x in size.split("x"))
        chunk = LogSoftmaxSpec(chunk_size=args.chunk).rows(torch.empty(0, vocab, device=args.device))
        for dtype in args.dtypes.split(","):
            for entropy in args.entropy.split(","):
                results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
                for _ in range(args.repeats):
                    for v in variants:
                        results[v].append(measure(dict(variant=v, tokens=tokens, vocab=vocab, dtype=dtype,
                                                       entropy=entropy, device=args.device, threads=args.threads,
                                                       iters=args.iters, chunk=args.chunk)))
                summary = {}
                for v, runs in results.items():
                    ok = [r for r in runs if "failed" not in r]
                    if not ok:
                        summary[v] = {"failed": runs[0]["failed"]}
                        continue
                    summary[v] = {k: statistics.median(r[k] for r in ok) for k in ok[0]}
                    if args.device == "cpu":
                        peak = measure(dict(variant=v, tokens=tokens, vocab=vocab, dtype=dtype, entropy=entropy,
                                            device=args.device, threads=args.threads, iters=1, chunk=args.chunk),
                                       memory=True)
                        summary[v]["extra_bytes"] = peak.get("extra_bytes", float("nan"))
                ours = summary.get("ours", {})
                buffer = 4 * min(chunk, tokens) * vocab
                gradient = tokens * vocab * {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]  # every variant returns it
                for v, s in summary.items():
                    if "failed" in s:
                        row = [size, dtype, entropy, v, "failed: " + s["failed"][:80]] + [""] * 7
                    else:
                        speed = (s["seconds"] / ours["seconds"]) if ours.get("seconds") else float("nan")
                        memory = (s["extra_bytes"] / ours["extra_bytes"]) if ours.get("extra_bytes") else float("nan")
                        row = [size, dtype, entropy, v, f"{s['seconds']:.3f}", f"{s['extra_bytes'] / 2**20:,.0f}",
                               f"{(s['extra_bytes'] - gradient) / buffer:.2f}", f"{speed:.2f}", f"{memory:.2f}",
                               f"{s['lp_error']:.1e}", f"{s.get('entropy_error', float('nan')):.1e}",
                               f"{s['grad_error']:.1e}"]
                    rows.append(row)
                    print(" | ".join(row), flush=True)
    caption = caption_line(sys.argv, args.device, args.threads,
                           f"ours in chunks of {args.chunk or 'the default'} tokens (extra peak also in units of one "
                           f"fp32 [chunk, V] buffer); medians of {args.repeats} processes")
    if args.markdown:
        write_block(args.markdown, "logprobs.py", caption, header, rows,
                    title="Log-probs and entropy from logits (bench/logprobs.py)")


if __name__ == "__main__":
    main()
