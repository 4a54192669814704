"""GRPO groups and data parallelism: advantages per group, samples dealt to DP ranks, groups packed into token
budgets, and the plain padded micro-batch iterator."""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

import torch

from slime_corr.layout.context_parallel import slice_micro_batch_for_cp
from slime_corr.layout.micro_batch import build_micro_batch, cp_pad_multiple
from slime_corr.samples import Sample


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, keep: torch.Tensor | None = None,
                     normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages [N] (float64): (r − mean of the group) [/ (std of the group + eps)], over the samples of the
    same group id that are KEPT (``keep`` [N] bool, default all); std is the unbiased std (0 with one kept sample).
    A sample that is not kept gets 0 and does not enter its group's mean or std."""
    r = rewards.to(torch.float64)
    kept = torch.ones_like(r, dtype=torch.bool) if keep is None else keep.to(torch.bool)
    _, g = torch.unique(group_ids, return_inverse=True)
    k = kept.to(torch.float64)
    n = torch.zeros(int(g.max()) + 1 if g.numel() else 0, dtype=torch.float64, device=r.device).index_add_(0, g, k)
    mean = torch.zeros_like(n).index_add_(0, g, r * k) / n.clamp_min(1)
    centered = (r - mean[g]) * k
    adv = centered
    if normalize_std:
        var = torch.zeros_like(n).index_add_(0, g, centered.square()) / (n - 1).clamp_min(1)
        adv = centered / (var.sqrt()[g] + eps)
    return torch.where(kept, adv, torch.zeros_like(adv))


def grpo_advantages(samples: Sequence[Sample], normalize_std: bool = True, eps: float = 1e-6) -> list[float]:
    """GRPO group-normalised advantage per sample (:func:`group_advantages` by ``group_id``). Rewards must be set."""
    for s in samples:
        if s.reward is None:
            raise ValueError(f"reward: sample {s.index} (group {s.group_id}) has no reward")
    if not samples:
        return []
    rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float64)  # type: ignore[arg-type]
    group_ids = torch.tensor([s.group_id for s in samples])
    return group_advantages(rewards, group_ids, normalize_std=normalize_std, eps=eps).tolist()


def balance_across_dp(lengths: Sequence[int], dp_size: int, equal_count: bool = True) -> list[list[int]]:
    """Assign item indices to ``dp_size`` ranks, balancing the summed ``lengths`` (greedy longest-first).

    Every index goes to exactly one rank. With ``equal_count`` each rank gets the same number of items
    (required so every DP rank runs the same number of micro-batches); ``len(lengths)`` must then be
    divisible by ``dp_size``. Each rank's list is sorted by index.
    """
    n = len(lengths)
    if equal_count and n % dp_size:
        raise ValueError(f"{n} samples cannot be split equally across {dp_size} DP ranks")
    cap = n // dp_size if equal_count else n
    heap = [(0, 0, r) for r in range(dp_size)]  # (tokens, count, rank): the least loaded rank pops first
    out: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        tokens, count, rank = heapq.heappop(heap)
        out[rank].append(i)
        if count + 1 < cap:  # a full rank leaves the heap
            heapq.heappush(heap, (tokens + lengths[i], count + 1, rank))
    return [sorted(x) for x in out]


def split_for_dp(samples: Sequence[Sample], dp_rank: int, dp_size: int) -> list[Sample]:
    """This DP rank's share of a global batch, balanced by token count (see :func:`balance_across_dp`)."""
    parts = balance_across_dp([s.total_length for s in samples], dp_size)
    return [samples[i] for i in parts[dp_rank]]


def pack_by_tokens(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Items of ``sizes`` tokens (e.g. whole GRPO groups, ``packed_length`` summed) into micro-batches of at most
    ``budget`` tokens (slime's ``--max-tokens-per-gpu``), first-fit decreasing: few micro-batches, never an item
    split; an item over the budget on its own gets a micro-batch of its own. Each micro-batch lists its items in
    index order; micro-batches come in the order of their first item."""
    if budget < 1:
        raise ValueError(f"budget={budget}: the token budget per micro-batch must be >= 1")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        fit = next((b for b, load in enumerate(loads) if load + sizes[i] <= budget), None)
        if fit is None:
            bins.append([i])
            loads.append(sizes[i])
        else:
            bins[fit].append(i)
            loads[fit] += sizes[i]
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def micro_batch_iterator(
    samples: Sequence[Sample],
    micro_batch_size: int,
    advantages: Sequence[float | Sequence[float]] | None = None,
    *,
    cp_rank: int = 0,
    cp_size: int = 1,
    pad_token_id: int = 0,
    packed: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """Megatron data iterator: consecutive micro-batches of ``micro_batch_size`` samples, CP-sliced."""
    advs = list(advantages) if advantages is not None else [0.0] * len(samples)
    for i in range(0, len(samples), micro_batch_size):
        mb = build_micro_batch(samples[i : i + micro_batch_size], advs[i : i + micro_batch_size],
                               pad_to_multiple=cp_pad_multiple(cp_size), pad_token_id=pad_token_id,
                               packed=packed)
        yield slice_micro_batch_for_cp(mb, cp_rank, cp_size)
