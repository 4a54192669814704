"""Throughput of correction + metrics + loss on a 64 x 8192 batch (CPU), against two baselines.

(a) a straightforward per-metric reference: one masked reduction and one `.item()` per metric, as the reference
    framework does; (b) a memory-bound floor: one elementwise exp over the same tensor.
Prints medians over interleaved repeats and the ratios. Run: `python bench/correction.py [--repeats N] [--batch B --seq S]
[--compile] [--fusion-estimate]` (`--compile` also times the same call under torch.compile; `--fusion-estimate`
times `fusion_estimate`, the same per-token arithmetic rewritten as two row-reduction passes for torch.compile to
fuse: an estimate of what a fused kernel would reach, not product code).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import metrics_to_host
from slime_corr.losses import compute_policy_loss


def naive_step(lp, old, ro, adv, mask, cfg) -> dict[str, float]:
    """The obvious implementation: every metric is its own masked reduction followed by `.item()`."""
    m = mask.float()
    lr = old - ro
    metrics: dict[str, float] = {}

    def mmean(x, mm=m):
        return ((x * mm).sum() / mm.sum().clamp_min(1)).item()

    seq_n = m.sum(-1)
    seq_valid = (seq_n > 0).float()

    def smean(x):
        return ((x * seq_valid).sum() / seq_valid.sum().clamp_min(1)).item()

    seq_lr = (lr * m).sum(-1)
    w_raw = seq_lr.clamp(-20, 20).exp()
    lower, upper = cfg.rs_bounds
    keep = ((w_raw >= lower) & (w_raw <= upper)).float()
    veto = ((lr < torch.log(torch.tensor(cfg.rs_veto_threshold))) & mask).any(-1)
    keep = keep * (~veto).float()
    new_mask = m * keep[:, None]
    w = w_raw.clamp(max=cfg.tis_bounds[1])[:, None] * m
    metrics["mismatch_kl"] = mmean(-lr)
    x = lr.clamp(-20, 20)
    metrics["mismatch_k3_kl"] = mmean(x.exp() - x - 1)
    metrics["mismatch_chi2_token"] = mmean((2 * x).exp() - 1)
    metrics["train_rollout_logprob_abs_diff"] = mmean(lr.abs())
    mt = (old * m).sum(-1) / seq_n.clamp_min(1)
    mr = (ro * m).sum(-1) / seq_n.clamp_min(1)
    metrics["mismatch_training_log_ppl"] = smean(-mt)
    metrics["mismatch_rollout_log_ppl"] = smean(-mr)
    metrics["mismatch_training_ppl"] = smean((-mt).exp())
    metrics["mismatch_rollout_ppl"] = smean((-mr).exp())
    metrics["mismatch_log_ppl_diff"] = smean(mr - mt)
    metrics["mismatch_log_ppl_abs_diff"] = smean((mr - mt).abs())
    metrics["mismatch_ppl_ratio"] = smean((mr - mt).exp())
    metrics["mismatch_chi2_seq"] = smean((2 * seq_lr.clamp(-20, 20)).exp() - 1)
    pt, pr = old.exp(), ro.exp()
    d = (pt - pr).abs()
    metrics["rollout_probs_diff_max"] = d[mask].max().item()
    metrics["rollout_probs_diff_mean"] = mmean(d)
    metrics["rollout_probs_diff_std"] = d[mask].std().item()
    ptv, prv = pt[mask], pr[mask]
    metrics["rollout_actor_probs_pearson_corr"] = torch.corrcoef(torch.stack([ptv, prv]))[0, 1].item()
    metrics["mis_mean_is_weight_before_clip"] = smean(w_raw)
    metrics["mis_truncate_fraction"] = smean((w_raw > upper).float())
    metrics["mis_rs_rejected_seq_fraction"] = smean(1 - keep)
    metrics["mis_catastrophic_seq_fraction"] = smean(veto.float())
    metrics["mis_catastrophic_token_fraction"] = mmean((lr < -9.21).float())
    wk = w[new_mask > 0]
    mean = wk.mean() if wk.numel() else torch.tensor(1.0)
    w = w / mean
    metrics["mis_batch_norm_factor"] = mean.item()
    metrics["mis_ratio_mean_after_mis"] = mmean(w, new_mask)
    metrics["mis_weight_min"] = w[new_mask > 0].min().item() if wk.numel() else 0.0
    metrics["mis_weight_max"] = w[new_mask > 0].max().item() if wk.numel() else 0.0
    for q in (0.1, 0.5, 0.9, 0.99):
        metrics[f"mis_weight_q{q}"] = torch.quantile(w[new_mask > 0], q).item() if wk.numel() else 0.0
    metrics["mis_ess"] = ((w * new_mask).sum() ** 2 / (new_mask.sum() * (w * w * new_mask).sum())).item()
    ratio = (lp - old).clamp(-20, 20).exp()
    lo, hi = cfg.clip_range
    l1, l2 = -adv * ratio, -adv * ratio.clamp(lo, hi)
    loss = torch.maximum(l1, l2) * w
    metrics["pg_clipfrac"] = mmean((l2 > l1).float(), new_mask)
    metrics["ppo_kl"] = mmean(-(lp - old), new_mask)
    metrics["pg_loss"] = ((loss * new_mask).sum() / new_mask.sum().clamp_min(1)).item()
    return metrics


def fusion_estimate(lp, old, ro, adv, mask, cfg) -> Tensor:
    """What `ours` computes per token for the bench's preset (sequence-level truncated IS with batch normalization,
    sequence RS, veto, the token mismatch sums, token-mean PPO), as two passes that each end in row sums, written
    for torch.compile to fuse into few loops. Returns the batch sums and, last, the loss (checked against ours)."""
    f = old.dtype
    m = mask.to(f)
    # pass 1: the correction's per-sequence sums and the token mismatch terms
    lr = torch.where(mask, old - ro, 0.0)
    bad = (lr.abs() > 1e30) | (lr != lr)
    lr = torch.where(bad, 0.0, lr)
    x = lr.clamp(-20.0, 20.0)
    e1 = x.expm1()
    p_t = torch.where(mask, old.exp(), 0.0)
    p_r = torch.where(mask, ro.exp(), 0.0)
    d = p_t - p_r
    veto = lr < math.log(cfg.rs_veto_threshold)
    terms = (m, bad.to(f), lr, torch.where(mask, old, 0.0), torch.where(mask, ro, 0.0), veto.to(f), e1 - x,
             e1 * (e1 + 2.0), lr.abs(), d.abs(), d * d, p_t, p_r, p_t * p_t, p_r * p_r, p_t * p_r)
    rows = torch.stack([t.sum(-1) for t in terms], -1)
    d_max = torch.maximum(d, -d).amax(-1)
    # per sequence: RS, veto, truncated IS weight, batch normalization over the kept sequences
    n, n_bad, s_lr, n_veto = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 5]
    rs_low, rs_high = cfg.rs_bounds
    keep = ((n > 0) & (n_bad == 0) & (n_veto == 0) & (s_lr >= math.log(rs_low)) & (s_lr <= math.log(rs_high))).to(f)
    w = s_lr.clamp(-20.0, 20.0).exp().clamp(max=cfg.tis_bounds[1])
    mean = (w * keep).sum() / keep.sum().clamp_min(1)
    w = w / torch.where(mean > 1e-8, mean, 1.0)
    # pass 2: PPO over the kept tokens (a NaN/inf in lp, lp_old or A drops the token)
    check = lp - old + adv
    mk = m * keep[:, None] * ((check == check) & (check.abs() < math.inf)).to(f)
    log_ratio = torch.where(mk > 0, lp - old, 0.0).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    a = torch.where(mk > 0, adv, 0.0)
    surr1, surr2 = a * ratio, a * ratio.clamp(*cfg.clip_range)
    terms = (-torch.minimum(surr1, surr2), (surr1 > surr2).to(f) * mk, -log_ratio, (ratio - 1.0) * mk, mk)
    loss_rows = torch.stack([t.sum(-1) for t in terms], -1)
    loss = (loss_rows[:, 0] * w).sum() / loss_rows[:, 4].sum().clamp_min(1)
    return torch.cat([rows.sum(0), d_max.amax().reshape(1), loss_rows.sum(0), loss.reshape(1)])


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall time and median minor page faults of each function over `repeats` rounds. The functions run
    interleaved within a round, so a machine shared with other jobs slows all of them alike and the ratios stay
    meaningful."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    faults: dict[str, list[int]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return ({name: statistics.median(ts) for name, ts in times.items()},
            {name: statistics.median(fs) for name, fs in faults.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--compile", action="store_true",
                   help="also time torch.compile of the same call (fused kernels; the compile itself is not timed)")
    p.add_argument("--fusion-estimate", action="store_true",
                   help="also time `fusion_estimate` under torch.compile: what a fused kernel would reach")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.seq)
    old = -torch.rand(shape, generator=g) * 3
    ro = old + 0.01 * torch.randn(shape, generator=g)
    lp = old + 0.01 * torch.randn(shape, generator=g)
    adv = torch.randn(shape, generator=g)
    lengths = torch.randint(args.seq // 4, args.seq + 1, (args.batch,), generator=g)
    mask = torch.arange(args.seq)[None, :] < lengths[:, None]
    cfg = RolloutCorrectionConfig.preset(
        "decoupled_seq_is_rs", tis_batch_normalize=True, rs_lower_bound=0.1, rs_upper_bound=10.0, rs_veto_threshold=1e-4
    )

    def ours():
        with torch.no_grad():
            out = compute_policy_loss(lp, old, ro, adv, mask, cfg)
            return metrics_to_host({**out.metrics, "loss": out.loss})

    def naive():
        with torch.no_grad():
            return naive_step(lp, old, ro, adv, mask, cfg)

    fns = {"ours": ours, "naive": naive, "floor": lambda: torch.exp(lp)}
    if args.compile:
        def loss_and_metrics(lp, old, ro, adv, mask):
            out = compute_policy_loss(lp, old, ro, adv, mask, cfg)
            return torch.stack([v.reshape(()).to(torch.float64) for v in (*out.metrics.values(), out.loss)])

        compiled = torch.compile(loss_and_metrics, dynamic=False)

        def ours_compiled():
            with torch.no_grad():
                return compiled(lp, old, ro, adv, mask).tolist()

        t0 = time.perf_counter()
        ours_compiled()
        print(f"torch.compile: first call (compilation) {time.perf_counter() - t0:.1f} s")
        fns["compiled"] = ours_compiled
    if args.fusion_estimate:
        estimate = torch.compile(fusion_estimate, dynamic=False)

        def fused():
            with torch.no_grad():
                return estimate(lp, old, ro, adv, mask, cfg).tolist()

        t0 = time.perf_counter()
        loss_est = fused()[-1]
        loss_ours = ours()["loss"]
        print(f"fusion estimate: first call (compilation) {time.perf_counter() - t0:.1f} s; loss {loss_est:.8g}, "
              f"ours {loss_ours:.8g} (relative difference {abs(loss_est - loss_ours) / abs(loss_ours):.1e})")
        fns["fused"] = fused
    t, faults = timed(fns, args.repeats)
    t_ours, t_naive, t_floor = t["ours"], t["naive"], t["floor"]
    malloc_env = " ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("MALLOC_")) or "glibc defaults"
    print(
        f"threads={torch.get_num_threads()} batch={shape} tokens={mask.sum().item()} metrics={len(ours())} "
        f"repeats={args.repeats} (medians, interleaved) malloc: {malloc_env}"
    )
    print(f"ours  (correction + metrics + loss): {t_ours * 1e3:8.2f} ms")
    print(f"(a) per-metric reference           : {t_naive * 1e3:8.2f} ms  -> speedup {t_naive / t_ours:.2f}x (target >= 3x)")
    print(f"(b) floor, one exp                 : {t_floor * 1e3:8.2f} ms  -> ours / floor {t_ours / t_floor:.2f}x (target <= 10x)")
    print("minor page faults per call (medians): " + ", ".join(f"{name} {f:.0f}" for name, f in faults.items()))
    if "compiled" in t:
        t_c = t["compiled"]
        print(f"ours, torch.compile                : {t_c * 1e3:8.2f} ms  -> (a) / compiled {t_naive / t_c:.2f}x, "
              f"compiled / floor {t_c / t_floor:.2f}x")
    if "fused" in t:
        t_f = t["fused"]
        print(f"fusion estimate, torch.compile     : {t_f * 1e3:8.2f} ms  -> (a) / estimate {t_naive / t_f:.2f}x, "
              f"estimate / floor {t_f / t_floor:.2f}x")


if __name__ == "__main__":
    main()
