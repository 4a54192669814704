"""Cost of divergence rejection, budgeted bounds and GSPO in correction + loss (forward and backward), against
token-level truncated IS in the same run; and of top-k/top-p log-probs against the plain log-softmax path.

Run: `python bench/budget.py [--repeats N] [--batch B --seq S] [--tokens N --vocab V]`. Prints interleaved medians
(bench/timing.py) and ratios to the baseline row of each table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import interleaved_medians  # noqa: E402

from slime_corr.config import RolloutCorrectionConfig as C  # noqa: E402
from slime_corr.correction import metrics_to_host  # noqa: E402
from slime_corr.losses import compute_policy_loss  # noqa: E402
from slime_corr.mcore.logprobs import vocab_parallel_log_probs  # noqa: E402
from slime_corr.mcore.truncated_logprobs import truncated_log_probs  # noqa: E402

BASE = C.preset("decoupled_token_is")
VARIANTS = {
    "token TIS (baseline)": BASE,
    "+ k3 mean RS (bound)": BASE.replace(rs_metric="k3", rs_agg="mean", rs_divergence_bound=0.01),
    "+ k2 max RS (bound)": BASE.replace(rs_metric="k2", rs_agg="max", rs_divergence_bound=2.5),
    "+ k3 token RS (budget)": BASE.replace(rs_metric="k3", rs_agg="token", rs_divergence_budget=0.01),
    "ESS target 0.9": C(use_tis=True, tis_ess_target=0.9),
    "token TIS + GSPO ratio": BASE.replace(policy_ratio_level="sequence", eps_clip=3e-4, eps_clip_high=4e-4),
}


def correction_table(batch: int, seq: int, repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(batch, seq, generator=g) * 3
    ro = old + 0.3 * torch.randn(batch, seq, generator=g)
    lp = old + 0.01 * torch.randn(batch, seq, generator=g)
    adv = torch.randn(batch, generator=g)
    mask = torch.arange(seq)[None] < torch.randint(seq // 4, seq + 1, (batch, 1), generator=g)

    def step(cfg):
        def run():
            x = lp.clone().requires_grad_()
            out = compute_policy_loss(x, old, ro, adv, mask, cfg)
            out.loss.backward()
            return metrics_to_host(out.metrics)
        return run

    times = interleaved_medians({name: step(cfg) for name, cfg in VARIANTS.items()}, repeats)
    base = times["token TIS (baseline)"]
    print(f"correction + loss + backward, {batch} x {seq} float32 (median of {repeats})")
    for name, t in times.items():
        print(f"  {name:26s} {t * 1e3:8.2f} ms   x{t / base:.2f}")


def logprob_table(tokens: int, vocab: int, repeats: int) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(tokens, vocab, generator=g) * 3
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    fns = {
        "log_softmax (baseline)": lambda: vocab_parallel_log_probs(logits, labels),
        "top_k 50": lambda: truncated_log_probs(logits, labels, top_k=50),
        "top_p 0.9": lambda: truncated_log_probs(logits, labels, top_p=0.9),
        "top_k 50 + top_p 0.9": lambda: truncated_log_probs(logits, labels, top_k=50, top_p=0.9),
    }
    times = interleaved_medians(fns, repeats)
    base = times["log_softmax (baseline)"]
    print(f"log-probs of {tokens} tokens over {vocab} logits, forward (median of {repeats})")
    for name, t in times.items():
        print(f"  {name:26s} {t * 1e3:8.2f} ms   x{t / base:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    a = p.parse_args()
    torch.set_num_threads(1)
    correction_table(a.batch, a.seq, a.repeats)
    logprob_table(a.tokens, a.vocab, a.repeats)


if __name__ == "__main__":
    main()
