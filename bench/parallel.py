"""Communication and time of the rollout-correction loss hook for a realistic micro-batch (not run by pytest).

    .venv/bin/python bench/parallel.py [--batch 8 --seq 2048 --vocab 8192 --cp 2 --chunk 4096 --repeats 5]

1. Bytes per micro-batch each CP rank sends into collectives, counted by wrapping torch.distributed.all_reduce
   in a CP gloo run of the real loss: the per-sequence [B, k] sums (grow with B only) and the batch statistics
   (fixed size, independent of B and S), versus an all-gather of the full log-prob tensors they avoid
   (log-probs, rollout log-probs and mask, fp32: 3·B·(S/CP)·4·(CP−1) bytes received per rank).
2. Loss-hook time (vocab-parallel log-probs + loss + backward to the logits) with the correction on
   (`decoupled_seq_is_rs`, `pg_is`) versus off (plain PPO, no metrics), single process. Medians; ratios printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from slime_corr.config import RolloutCorrectionConfig  # noqa: E402
from slime_corr.layout.context_parallel import zigzag_slice  # noqa: E402
from slime_corr.mcore.context_parallel import ParallelGroups  # noqa: E402
from slime_corr.mcore.loss_hook import RolloutCorrectionLoss  # noqa: E402
from slime_corr.ports import agent_store_environment, host_store  # noqa: E402


def make_batch(b: int, s: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(s // 4, s + 1, (b,), generator=g)
    mask = (torch.arange(s)[None] < lengths[:, None]).float()
    lp = -torch.rand(b, s, generator=g) * 2
    return dict(
        labels=torch.randint(0, 1000, (b, s), generator=g),
        loss_mask=mask,
        rollout_log_probs=(lp + 0.05 * torch.randn(b, s, generator=g)) * mask,
        old_log_probs=(lp + 0.02 * torch.randn(b, s, generator=g)) * mask,
        advantages=torch.randn(b, 1, generator=g).expand(b, s) * mask,
    )


def _count_worker(rank: int, world: int, store_env: dict[str, str], args: argparse.Namespace, out: dict) -> None:
    os.environ.update(store_env)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cp_group = dist.new_group(list(range(world)))
    sent = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *a, **k):
        sent.append((tensor.dim() == 2, tensor.numel() * tensor.element_size()))  # 2-D = per-sequence [B, k]
        return real_all_reduce(tensor, *a, **k)

    groups = ParallelGroups(cp=cp_group, dp=None, dp_cp=cp_group, cp_size=world, cp_rank=rank)
    batch = {k: zigzag_slice(v, rank, world, dim=1) for k, v in make_batch(args.batch, args.seq).items()}
    v_small = 64  # the vocabulary does not change what the loss communicates
    logits = torch.randn(args.batch, args.seq // world, v_small, requires_grad=True)
    batch["labels"] = batch["labels"] % v_small
    for name in ("decoupled_seq_is_rs", "pg_is"):
        hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset(name), groups=groups)
        sent.clear()
        dist.all_reduce = counting_all_reduce
        try:
            _, _, reduced = hook.loss_func(batch, logits)
            seq = sum(n for is_seq, n in sent if is_seq)
            stats = sum(n for is_seq, n in sent if not is_seq)
            n_mb = len(sent)
            hook.reduce_step_metrics([reduced])  # once per step, not per micro-batch
            per_step = sum(n for _, n in sent[n_mb:])
        finally:
            dist.all_reduce = real_all_reduce
        if rank == 0:
            out[name] = (seq, stats, n_mb, per_step)
    dist.destroy_process_group()


def bytes_report(args: argparse.Namespace) -> None:
    store = host_store(world_size=args.cp)  # the ranks' store, hosted here as torchrun's agent hosts it
    out = mp.Manager().dict()
    mp.spawn(_count_worker, args=(args.cp, agent_store_environment(store), args, out), nprocs=args.cp, join=True)
    local_tokens = args.batch * args.seq // args.cp
    gather = 3 * local_tokens * 4 * (args.cp - 1)  # what each rank would receive to rebuild full tensors
    print(f"\n[bytes each rank sends per micro-batch, CP={args.cp}, B={args.batch}, S={args.seq}]")
    print(f"  all-gather of log-probs, rollout log-probs, mask (fp32) it avoids: {gather} B")
    for name, (seq, stats, n_calls, per_step) in out.items():
        print(f"  {name:20s} per-sequence sums {seq:6d} B ({gather / seq:.0f}x less)  + batch statistics "
              f"{stats:6d} B (fixed size, incl. the weight histogram) = {seq + stats} B in {n_calls} all-reduces "
              f"({gather / (seq + stats):.1f}x less); +{per_step} B once per step")


def time_report(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    batch = make_batch(args.batch, args.seq)
    batch["labels"] = batch["labels"] % args.vocab
    logits = torch.randn(args.batch, args.seq, args.vocab) * 2
    configs = {
        "off (ppo, no metrics)": RolloutCorrectionConfig(),
        "decoupled_seq_is_rs": RolloutCorrectionConfig.preset("decoupled_seq_is_rs"),
        "pg_is": RolloutCorrectionConfig.preset("pg_is"),
    }
    med = {}
    for name, cfg in configs.items():
        hook = RolloutCorrectionLoss(cfg, groups=ParallelGroups(), chunk_size=args.chunk)
        times = []
        for _ in range(args.repeats + 1):
            x = logits.clone().requires_grad_()
            t0 = time.perf_counter()
            loss_sum, _, _ = hook.loss_func(batch, x)
            loss_sum.backward()
            times.append(time.perf_counter() - t0)
        med[name] = statistics.median(times[1:])
    print(f"\n[loss-hook time, B={args.batch}, S={args.seq}, V={args.vocab}, chunk={args.chunk}, "
          f"median of {args.repeats}]")
    base = med["off (ppo, no metrics)"]
    for name, t in med.items():
        print(f"  {name:22s} {t * 1e3:9.1f} ms  ratio vs off {t / base:5.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=8192, help="V/TP of one rank")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    bytes_report(args)
    time_report(args)


if __name__ == "__main__":
    main()
