"""Samples -> Megatron micro-batches: advantages, padding / packing, CP zig-zag slices, DP balance, TP broadcast.

Micro-batch contract (a dict of CPU tensors, ``B`` rows of ``S`` positions)::

    tokens             [B, S] int64    prompt + response, right-padded with ``pad_token_id``
    position_ids       [B, S] int64    0..S-1 per row (packed: restarting at every sample)
    labels             [B, S] int64    labels[t] = tokens[t+1] within a sample, else pad
    loss_mask          [B, S] float32  1 where labels[t] is a trained response token
    rollout_log_probs  [B, S] float32  SGLang's log-prob of labels[t]; 0 where loss_mask is 0
    advantages         [B, S] float32  advantage of labels[t]; 0 where loss_mask is 0

Megatron's alignment: position ``t`` of labels / loss_mask / rollout_log_probs / advantages is about predicting
``tokens[t+1]`` from the logits at ``t``.

MoE samples that carry the engine's routes (``Sample.routed_experts``, all samples of the batch or none) add::

    routed_experts     [B, S, L, k] uint8/int16   the experts of tokens[t] (the tokens' alignment, not the labels');
                                                  at a sample's last token and at padding: experts 0..k-1

It is not in ``TOKEN_KEYS``: CP emulated on CPU runs whole sequences; slice it with
``keys=(*TOKEN_KEYS, ROUTE_KEY)`` where the model sees only its CP slice.

Packed batches (``packed=True``, Megatron's THD layout) are one row, ``B == 1``: sample i occupies positions
``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])``, its own tokens first, then padding to a multiple of
``pad_to_multiple`` (2·CP with context parallelism), and two more entries (never CP-sliced)::

    cu_seqlens         [n+1] int32    cumulative sample lengths (Megatron's / TE's ``cu_seqlens``)
    cu_seqlens_padded  [n+1] int32    cumulative padded lengths: where each sample starts in the row

Context parallelism (this module owns the layout): padded rows are zig-zag sliced as one sequence per row
(``zigzag_slice``: 2·CP chunks, rank r keeps chunks r and 2·CP−1−r); a packed row is partitioned per sample the way
Megatron-Core partitions THD batches (``get_thd_batch_on_this_cp_rank``, i.e. Transformer Engine's
``thd_get_partitioned_indices``): every sample's padded span is split into 2·CP chunks and rank r keeps chunks r and
2·CP−1−r of each, sample after sample (``thd_partition_index``), so sample i is at local positions
``[cu_seqlens_padded[i] / CP, cu_seqlens_padded[i+1] / CP)`` (``thd_local_offsets``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from slime_corr.rollout.sample import Sample

BATCH_KEYS = ("tokens", "position_ids", "labels", "loss_mask", "rollout_log_probs", "advantages")
# optional per-token entries, laid out (and CP-sliced) like the others: the weight lag of each trained token
TOKEN_KEYS = (*BATCH_KEYS, "weight_lag")
ROUTE_KEY = "routed_experts"


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


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _sample_rows(s: Sample, adv: float | Sequence[float], pad_token_id: int,
                 weight_lag: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """One sample's 1-D rows (length prompt + response), already shifted to Megatron's alignment."""
    p, r = len(s.prompt_tokens), s.response_length
    n = p + r
    tokens = torch.tensor(s.prompt_tokens + s.response_tokens, dtype=torch.long)
    labels = torch.full((n,), pad_token_id, dtype=torch.long)
    labels[:-1] = tokens[1:]
    mask = torch.zeros(n, dtype=torch.float32)
    lp = torch.zeros(n, dtype=torch.float32)
    adv_row = torch.zeros(n, dtype=torch.float32)
    if r:
        m = torch.tensor(s.loss_mask, dtype=torch.float32)
        mask[p - 1 : n - 1] = m
        lp[p - 1 : n - 1] = s.rollout_log_probs * m
        a = torch.full((r,), float(adv)) if isinstance(adv, int | float) else torch.tensor(list(adv), dtype=torch.float32)
        if a.numel() != r:
            raise ValueError(f"advantages: {a.numel()} values for {r} response tokens of sample {s.index}")
        adv_row[p - 1 : n - 1] = a * m
    rows = {"tokens": tokens, "position_ids": torch.arange(n), "labels": labels, "loss_mask": mask,
            "rollout_log_probs": lp, "advantages": adv_row}
    if s.routed_experts is not None:
        re = s.routed_experts
        if re.shape[0] != n - 1:
            raise ValueError(f"routed_experts: sample {s.index} has routes for {re.shape[0]} of its {n - 1} input "
                             "tokens (every token but the last must be routed: was the last segment generated?)")
        rows[ROUTE_KEY] = torch.cat([re, _route_filler(re, 1)])
    if weight_lag is not None:
        if len(weight_lag) != r:
            raise ValueError(f"weight_lag: {len(weight_lag)} values for {r} response tokens of sample {s.index}")
        lag = torch.zeros(n, dtype=torch.long)
        lag[p - 1 : n - 1] = torch.tensor(list(weight_lag), dtype=torch.long)
        rows["weight_lag"] = lag
    return rows


def _route_filler(routes: torch.Tensor, n: int) -> torch.Tensor:
    """[n, L, k] routes of positions with nothing to route (a sample's last token, padding): experts 0..k-1 (k
    distinct experts, as a router's top-k)."""
    _, layers, k = routes.shape
    return torch.arange(k, dtype=routes.dtype).expand(n, layers, k)


def _filled(rows: list[dict[str, torch.Tensor]], key: str, n: int, pad_token_id: int) -> torch.Tensor:
    """`n` padding positions of entry `key` (shaped like rows' entries after their first dim)."""
    if key == ROUTE_KEY:
        return _route_filler(rows[0][key], n)
    fill = pad_token_id if key in ("tokens", "labels") else 0
    return torch.full((n,), fill, dtype=rows[0][key].dtype)


def build_micro_batch(
    samples: Sequence[Sample],
    advantages: Sequence[float | Sequence[float]] | None = None,
    *,
    pad_to_multiple: int = 1,
    pad_token_id: int = 0,
    packed: bool = False,
    weight_lag: Sequence[Sequence[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Build one micro-batch dict (see the module docstring) from ``samples``.

    ``advantages``: one scalar per sample (broadcast over its response tokens) or one list per sample (per
    token); None means zeros. ``pad_to_multiple``: pad S (packed: every sample) to a multiple of it (2 * CP
    size for context parallelism, ``cp_pad_multiple``).
    ``weight_lag``: per sample, the weight lag of each response token (trainer version − the version that
    sampled it); adds ``weight_lag`` [B, S] int64 in the labels' alignment (0 elsewhere).
    """
    if not samples:
        raise ValueError("samples: empty micro-batch")
    advs = list(advantages) if advantages is not None else [0.0] * len(samples)
    if len(advs) != len(samples):
        raise ValueError(f"advantages: {len(advs)} entries for {len(samples)} samples")
    lags = list(weight_lag) if weight_lag is not None else [None] * len(samples)
    if len(lags) != len(samples):
        raise ValueError(f"weight_lag: {len(lags)} entries for {len(samples)} samples")
    rows = [_sample_rows(s, a, pad_token_id, lag) for s, a, lag in zip(samples, advs, lags, strict=True)]
    with_routes = [ROUTE_KEY in r for r in rows]
    if any(with_routes) and not all(with_routes):
        raise ValueError(f"routed_experts: samples {[s.index for s, w in zip(samples, with_routes, strict=True) if not w]} "
                         "carry no routes while others do (ask every request for them, or none)")
    keys = [k for k in (*TOKEN_KEYS, ROUTE_KEY) if k in rows[0]]
    if packed:
        return _pack_rows(rows, keys, pad_to_multiple, pad_token_id)
    s_len = _round_up(max(len(r["tokens"]) for r in rows), pad_to_multiple)
    out = {}
    for k in keys:
        t = _filled(rows, k, s_len, pad_token_id).expand(len(rows), s_len, *rows[0][k].shape[1:]).clone()
        for i, r in enumerate(rows):
            t[i, : len(r[k])] = r[k]
        out[k] = t
    out["position_ids"] = torch.arange(s_len).expand(len(rows), s_len).clone()
    return out


def _pack_rows(rows: list[dict[str, torch.Tensor]], keys: Sequence[str], multiple: int,
               pad_token_id: int) -> dict[str, torch.Tensor]:
    """Samples' rows one after the other in one [1, T] row, each padded to a multiple of `multiple`."""
    lengths = [len(r["tokens"]) for r in rows]
    padded = [_round_up(n, multiple) for n in lengths]
    out = {}
    for k in keys:
        out[k] = torch.cat([torch.cat([r[k], _filled(rows, k, p - n, pad_token_id)])
                            for r, n, p in zip(rows, lengths, padded, strict=True)]).unsqueeze(0)
    out["position_ids"] = torch.cat([torch.arange(p) for p in padded]).unsqueeze(0)
    out["cu_seqlens"] = _cumulative(lengths)
    out["cu_seqlens_padded"] = _cumulative(padded)
    return out


def _cumulative(lengths: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


def packed_length(total_length: int, cp_size: int, sp_size: int = 1) -> int:
    """Positions a sample of `total_length` tokens takes in a packed micro-batch under CP size `cp_size` (and
    sequence parallelism over `sp_size` TP ranks)."""
    return _round_up(total_length, cp_pad_multiple(cp_size, sp_size))


def padding_sample(pad_token_id: int = 0) -> Sample:
    """The one sample of an empty micro-batch: a pad token, no response (nothing to train), group and index -1."""
    return Sample(prompt_tokens=[pad_token_id], group_id=-1, index=-1)


def empty_micro_batch(cp_size: int = 1, pad_token_id: int = 0, packed: bool = True) -> dict[str, torch.Tensor]:
    """A micro-batch with nothing to train (`padding_sample`, loss mask 0): it keeps every rank at the same
    number of micro-batches (see `BufferMicroBatchIterator`). Not yet CP-sliced."""
    return build_micro_batch([padding_sample(pad_token_id)], pad_to_multiple=cp_pad_multiple(cp_size),
                             pad_token_id=pad_token_id, packed=packed)


def cp_pad_multiple(cp_size: int, sp_size: int = 1) -> int:
    """What the sequence length must be a multiple of: 2 * cp_size for :func:`zigzag_slice` (1 without CP), and
    the TP size under sequence parallelism (`sp_size`: Megatron splits the sequence over the TP ranks)."""
    return math.lcm(2 * cp_size if cp_size > 1 else 1, sp_size)


def zigzag_slice(tensor: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """Context-parallel zig-zag slice: split ``dim`` into 2*cp_size chunks, keep chunks r and 2*cp_size-1-r.

    The length of ``dim`` must be a multiple of 2*cp_size (pad with ``pad_to_multiple=2*cp_size``).
    """
    if cp_size == 1:
        return tensor
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} not in [0, {cp_size})")
    n = tensor.size(dim)
    if n % (2 * cp_size):
        raise ValueError(f"size {n} of dim {dim} is not a multiple of 2*cp_size={2 * cp_size}")
    c = n // (2 * cp_size)
    return torch.cat([tensor.narrow(dim, cp_rank * c, c), tensor.narrow(dim, (2 * cp_size - 1 - cp_rank) * c, c)],
                     dim=dim)


def thd_partition_index(cu_seqlens_padded: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Positions of a packed row that CP rank `cp_rank` holds, in its local order (see the module docstring):
    for each sample, chunk r then chunk 2·CP−1−r of its padded span split into 2·CP chunks."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} not in [0, {cp_size})")
    cu = cu_seqlens_padded.long()
    spans = cu.diff()
    if bool((spans % (2 * cp_size)).any()):
        raise ValueError(f"cu_seqlens_padded {cu.tolist()}: every sample's padded length must be a multiple of "
                         f"2*cp_size={2 * cp_size}; build the micro-batch with pad_to_multiple=cp_pad_multiple(cp_size).")
    chunk = spans // (2 * cp_size)
    begins = torch.stack([cu[:-1] + cp_rank * chunk, cu[:-1] + (2 * cp_size - 1 - cp_rank) * chunk], 1).reshape(-1)
    sizes = chunk.repeat_interleave(2)
    which = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    start_of = sizes.cumsum(0) - sizes
    return begins[which] + torch.arange(which.numel()) - start_of[which]


def packed_starts(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Where each sample of a packed micro-batch starts in the full row: `cu_seqlens_padded` (`cu_seqlens` when a
    producer without per-sample padding left it out)."""
    return batch.get("cu_seqlens_padded", batch["cu_seqlens"])


def thd_local_offsets(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Where each sample starts in a CP rank's slice of a packed row: `cu_seqlens_padded / cp_size` (int64)."""
    return cu_seqlens_padded.long() // cp_size


def slice_micro_batch_for_cp(batch: dict[str, torch.Tensor], cp_rank: int, cp_size: int,
                             keys: Sequence[str] = TOKEN_KEYS) -> dict[str, torch.Tensor]:
    """This CP rank's part of every `keys` entry ([B, S]; others are passed through): the zig-zag slice of a
    padded batch, the THD partition of a packed one (`cu_seqlens*` stay whole: they describe the full row)."""
    if cp_size == 1:
        return dict(batch)
    if "cu_seqlens" in batch:
        index = thd_partition_index(packed_starts(batch), cp_rank, cp_size)
        return {k: v.index_select(1, index.to(v.device)) if k in keys else v for k, v in batch.items()}
    return {k: zigzag_slice(v, cp_rank, cp_size, dim=1) if k in keys else v for k, v in batch.items()}


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


def split_for_dp(samples: Sequence[Sample], dp_rank: int, dp_size: int) -> list[Sample]:
    """This DP rank's share of a global batch, balanced by token count (see :func:`balance_across_dp`)."""
    parts = balance_across_dp([s.total_length for s in samples], dp_size)
    return [samples[i] for i in parts[dp_rank]]


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


def broadcast_micro_batch(
    batch: dict[str, torch.Tensor] | None, src: int, group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """Broadcast a micro-batch dict from global rank ``src`` to the other ranks of ``group`` (e.g. a TP group).

    ``src`` passes the dict, the others pass None (or anything) and receive a copy. With no initialised
    process group (single process) the batch is returned as is.
    """
    if not dist.is_available() or not dist.is_initialized():
        if batch is None:
            raise ValueError("batch: required without a process group")
        return batch
    is_src = dist.get_rank() == src
    meta = [[(k, tuple(v.shape), v.dtype) for k, v in batch.items()] if is_src and batch is not None else None]
    dist.broadcast_object_list(meta, src=src, group=group)
    if meta[0] is None:
        raise ValueError("batch: the source rank passed None")
    out = {}
    for k, shape, dtype in meta[0]:
        t = batch[k].contiguous() if is_src and batch is not None else torch.empty(shape, dtype=dtype)
        dist.broadcast(t, src=src, group=group)
        out[k] = t
    return out
