"""Padded vs packed (THD) micro-batches through the loss hook: tokens per second and peak memory.

Response lengths are log-normal (mean ~1k tokens, clipped to [1, 8k]), prompts a fixed length; the same sequences
go through `RolloutCorrectionLoss.loss_func` (vocab-parallel log-probs from the logits, the correction, the loss)
and its backward to the logits, once as a padded [B, S] micro-batch (S = the longest sequence) and once packed
into one [1, T] row (T = the sum of the lengths). The model is not run: what is measured is the hook's own cost,
which scales with the positions it is given (the model's cost scales alike, plus attention's).

Time: medians over interleaved repeats (padded, packed, packed, padded, ...), in this process. Memory: the peak
resident memory that one forward+backward adds, measured in a fresh child process per layout (CPU has no
allocator statistics: the peak resident size, reset just before the call through /proc/self/clear_refs).
Throughput counts the RESPONSE tokens (the trained ones): the same in both layouts. Prints both and the
packed / padded ratios.

    python bench/packing.py [--batch 16] [--vocab 512] [--repeats 7] [--preset decoupled_seq_is_rs] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from timing import interleaved_medians  # bench/timing.py (this script's directory is on sys.path)

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.layout.micro_batch import build_micro_batch
from slime_corr.mcore.context_parallel import ParallelGroups
from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
from slime_corr.samples import Sample

MEAN_RESPONSE, MAX_RESPONSE, PROMPT = 1024, 8192, 128
SIGMA = 1.0  # log-normal shape: lengths spread about 10x between the 10th and the 90th percentile


def response_lengths(batch: int, seed: int) -> list[int]:
    """Log-normal lengths with mean MEAN_RESPONSE (before clipping to [1, MAX_RESPONSE])."""
    g = torch.Generator().manual_seed(seed)
    mu = math.log(MEAN_RESPONSE) - SIGMA**2 / 2
    x = torch.randn(batch, generator=g, dtype=torch.float64) * SIGMA + mu
    return x.exp().round().clamp(1, MAX_RESPONSE).long().tolist()


def micro_batches(args: argparse.Namespace) -> dict[str, dict[str, torch.Tensor]]:
    """The same sequences as a padded and as a packed micro-batch (batching's layouts), with lp_old."""
    g = torch.Generator().manual_seed(args.seed + 1)
    samples = []
    for i, n in enumerate(response_lengths(args.batch, args.seed)):
        lps = (-torch.rand(n, generator=g) * 2).tolist()
        samples.append(Sample(prompt_tokens=[1] * PROMPT, response_tokens=torch.randint(0, args.vocab, (n,),
                              generator=g).tolist(), rollout_log_probs=lps, index=i, reward=0.0))
    advantages = torch.randn(len(samples), generator=g).tolist()
    out = {}
    for name, packed in (("padded", False), ("packed", True)):
        batch = build_micro_batch(samples, advantages, packed=packed)
        batch["old_log_probs"] = batch["rollout_log_probs"] + 0.01 * torch.randn(batch["loss_mask"].shape,
                                                                                  generator=g) * batch["loss_mask"]
        out[name] = batch
    return out


def make_step(args: argparse.Namespace, batch: dict[str, torch.Tensor]):
    """One forward+backward of the hook's loss on `batch`, with fresh logits (fp32) each call."""
    cfg = RolloutCorrectionConfig.preset(args.preset, loss_agg_mode="seq-mean-token-mean")
    hook = RolloutCorrectionLoss(cfg, groups=ParallelGroups(), seq_length_for_norm=PROMPT + MAX_RESPONSE)
    shape = (*batch["labels"].shape, args.vocab)
    g = torch.Generator().manual_seed(args.seed + 2)
    base = torch.randn(shape, generator=g)

    def step() -> float:
        logits = base.clone().requires_grad_()
        loss_sum, count, _ = hook.loss_func(batch, logits)
        loss_sum.backward()
        return float(count)

    return step


def peak_memory(args: argparse.Namespace, layout: str) -> float:
    """MiB of resident memory one forward+backward adds, in a fresh process."""
    cmd = [sys.executable, __file__, "--child-memory", layout, "--batch", str(args.batch), "--vocab",
           str(args.vocab), "--preset", args.preset, "--seed", str(args.seed)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_mib"]


def child_memory(args: argparse.Namespace) -> None:
    step = make_step(args, micro_batches(args)[args.child_memory])
    before = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # Linux: reset the peak resident size (VmHWM) to the current one
        f.write("5")
    step()
    print(json.dumps({"peak_mib": _status_mib("VmHWM") - before}))


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size of the logits (bounded by CPU memory)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--preset", default="decoupled_seq_is_rs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child-memory", choices=("padded", "packed"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_memory:
        child_memory(args)
        return
    batches = micro_batches(args)
    lengths = response_lengths(args.batch, args.seed)
    trained = int(batches["padded"]["loss_mask"].sum())
    steps = {name: make_step(args, b) for name, b in batches.items()}
    med = interleaved_medians(steps, args.repeats)
    mem = {name: peak_memory(args, name) for name in steps}
    positions = {name: b["labels"].numel() for name, b in batches.items()}
    print(f"threads={torch.get_num_threads()} batch={args.batch} vocab={args.vocab} preset={args.preset} "
          f"repeats={args.repeats} (medians, interleaved)")
    print(f"response lengths: mean {statistics.mean(lengths):.0f}, median {statistics.median(lengths):.0f}, "
          f"max {max(lengths)}; prompt {PROMPT}; trained tokens {trained}")
    for name in steps:
        print(f"{name:6s}: positions {positions[name]:8d}  {med[name] * 1e3:9.1f} ms  "
              f"{trained / med[name]:10.0f} tokens/s  peak +{mem[name]:8.1f} MiB")
    print(f"packed / padded: positions {positions['packed'] / positions['padded']:.3f}, "
          f"throughput {med['padded'] / med['packed']:.2f}x, peak memory {mem['packed'] / mem['padded']:.3f}")


if __name__ == "__main__":
    main()
