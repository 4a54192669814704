"""Samples -> one Megatron micro-batch: the micro-batch contract, padding and packing, the samples not trained.

Micro-batch contract (a dict of tensors, ``B`` rows of ``S`` positions)::

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

Samples that carry the engine's nucleus log-mass (``Sample.rollout_nucleus_log_mass``, top-p / top-k with
``--rollout-nucleus-logprobs``; any sample of the batch) add, in the labels' alignment and in ``TOKEN_KEYS``::

    rollout_nucleus_log_mass   [B, S] float32  the engine's log M_μ of labels[t] where known; 0 elsewhere
    rollout_nucleus_known      [B, S] bool     True where that mass is known (a trained token whose nucleus fit)

Samples that carry the engine's kept sets (``Sample.rollout_top_p_token_ids`` / ``_offsets``, SGLang's sampling
mask: ``--rollout-return-sampling-mask``) add the ragged key pair of `slime_corr.layout.kept_sets`: per position
``rollout_kept_token_counts`` [B, S] int32 (in ``TOKEN_KEYS``) and the ids ``rollout_kept_token_ids`` [K] int32 in
the positions' row-major order (with the engine's log-probs of them, ``rollout_kept_token_log_probs`` [K], when
asked); a CP slice keeps the ids of its positions.

``routed_experts`` is not in ``TOKEN_KEYS``: CP emulated on CPU runs whole sequences; slice it with
``keys=(*TOKEN_KEYS, ROUTE_KEY)`` where the model sees only its CP slice.

Packed batches (``packed=True``, Megatron's THD layout) are one row, ``B == 1``: sample i occupies positions
``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])``, its own tokens first, then padding to a multiple of
``pad_to_multiple`` (2·CP with context parallelism, ``cp_pad_multiple``), and two more entries (never CP-sliced)::

    cu_seqlens         [n+1] int32    cumulative sample lengths (Megatron's / TE's ``cu_seqlens``)
    cu_seqlens_padded  [n+1] int32    cumulative padded lengths: where each sample starts in the row

How a CP rank's part is cut from these rows: `slime_corr.layout.context_parallel`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from slime_corr.layout.kept_sets import KEPT_COUNTS_KEY, sample_count_row, sample_counts, sample_entries
from slime_corr.samples import Sample, SampleStatus

BATCH_KEYS = ("tokens", "position_ids", "labels", "loss_mask", "rollout_log_probs", "advantages")
NUCLEUS_MASS_KEY, NUCLEUS_KNOWN_KEY = "rollout_nucleus_log_mass", "rollout_nucleus_known"
# optional per-token entries, laid out (and CP-sliced) like the others: the weight lag of each trained token, the
# engine's nucleus log-mass, the size of each token's kept set (its ids follow: `kept_sets.take_kept_sets`)
TOKEN_KEYS = (*BATCH_KEYS, "weight_lag", NUCLEUS_MASS_KEY, NUCLEUS_KNOWN_KEY, KEPT_COUNTS_KEY)
ROUTE_KEY = "routed_experts"
# Samples the loss trains on: a finished response (stop or length). ABORTED (KEEP policy) and FAILED are not.
TRAINABLE = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
NOT_TRAINED_KEYS = ("loss_mask", "rollout_log_probs", "advantages")  # zeroed for the samples not trained


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _sample_rows(s: Sample, adv: float | Sequence[float], pad_token_id: int,
                 weight_lag: Sequence[int] | None = None, nucleus: bool = False,
                 kept: bool = False) -> dict[str, torch.Tensor]:
    """One sample's 1-D rows (length prompt + response), already shifted to Megatron's alignment; `nucleus`: with
    the engine's nucleus log-mass rows (unknown everywhere for a sample without it); `kept`: with the sizes of its
    kept sets (0 everywhere for a sample without them)."""
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
    if nucleus:
        known = torch.zeros(n, dtype=torch.bool)
        mass = torch.zeros(n, dtype=torch.float32)
        if s.rollout_nucleus_log_mass is not None and r:
            engine = s.rollout_nucleus_log_mass
            known[p - 1 : n - 1] = ~engine.isnan() & (mask[p - 1 : n - 1] > 0)
            mass[p - 1 : n - 1] = torch.where(known[p - 1 : n - 1], engine, 0.0)
        rows[NUCLEUS_MASS_KEY], rows[NUCLEUS_KNOWN_KEY] = mass, known
    if kept:
        rows[KEPT_COUNTS_KEY] = sample_count_row(s, n)
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
    kept_sets: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Build one micro-batch dict (see the module docstring) from ``samples``.

    ``advantages``: one scalar per sample (broadcast over its response tokens) or one list per sample (per
    token); None means zeros. ``pad_to_multiple``: pad S (packed: every sample) to a multiple of it (2 * CP
    size for context parallelism, ``cp_pad_multiple``).
    ``weight_lag``: per sample, the weight lag of each response token (trainer version − the version that
    sampled it); adds ``weight_lag`` [B, S] int64 in the labels' alignment (0 elsewhere). A sample with
    ``rollout_nucleus_log_mass`` adds the engine's nucleus keys (module doc). ``kept_sets``: add the kept-set key
    pair (module doc; None: when a sample carries kept sets); every response token a trainable sample trains on
    must then have its kept set.
    """
    if not samples:
        raise ValueError("samples: empty micro-batch")
    advs = list(advantages) if advantages is not None else [0.0] * len(samples)
    if len(advs) != len(samples):
        raise ValueError(f"advantages: {len(advs)} entries for {len(samples)} samples")
    lags = list(weight_lag) if weight_lag is not None else [None] * len(samples)
    if len(lags) != len(samples):
        raise ValueError(f"weight_lag: {len(lags)} entries for {len(samples)} samples")
    nucleus = any(s.rollout_nucleus_log_mass is not None for s in samples)
    kept = any(s.rollout_top_p_token_ids is not None for s in samples) if kept_sets is None else kept_sets
    if kept:
        _check_trained_kept_sets(samples)
    rows = [_sample_rows(s, a, pad_token_id, lag, nucleus, kept)
            for s, a, lag in zip(samples, advs, lags, strict=True)]
    with_routes = [ROUTE_KEY in r for r in rows]
    if any(with_routes) and not all(with_routes):
        raise ValueError(f"routed_experts: samples {[s.index for s, w in zip(samples, with_routes, strict=True) if not w]} "
                         "carry no routes while others do (ask every request for them, or none)")
    keys = [k for k in (*TOKEN_KEYS, ROUTE_KEY) if k in rows[0]]
    entries = sample_entries(samples) if kept else {}
    if packed:
        return {**_pack_rows(rows, keys, pad_to_multiple, pad_token_id), **entries}
    s_len = _round_up(max(len(r["tokens"]) for r in rows), pad_to_multiple)
    out = {}
    for k in keys:
        t = _filled(rows, k, s_len, pad_token_id).expand(len(rows), s_len, *rows[0][k].shape[1:]).clone()
        for i, r in enumerate(rows):
            t[i, : len(r[k])] = r[k]
        out[k] = t
    out["position_ids"] = torch.arange(s_len).expand(len(rows), s_len).clone()
    return {**out, **entries}


def _check_trained_kept_sets(samples: Sequence[Sample]) -> None:
    """In a micro-batch with kept sets, every response token a trainable sample trains on has one (its log-prob is
    taken over it); raises ValueError naming the sample and the token."""
    for s in samples:
        if s.status not in TRAINABLE or not s.response_length:
            continue
        counts = sample_counts(s)
        trained = torch.tensor(s.loss_mask or [], dtype=torch.bool)
        missing = trained if counts is None else trained & (counts == 0)
        if bool(missing.any()):
            raise ValueError(f"rollout_top_p_token_offsets: sample {s.index}'s response token "
                             f"{int(missing.nonzero()[0, 0])} is trained but has no kept set, in a micro-batch that "
                             "replays the engine's kept sets: ask every request for them "
                             "(--rollout-return-sampling-mask), or take the token out of the loss mask")


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


def packed_starts(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Where each sample of a packed micro-batch starts in the full row: `cu_seqlens_padded` (`cu_seqlens` when a
    producer without per-sample padding left it out)."""
    return batch.get("cu_seqlens_padded", batch["cu_seqlens"])


def cp_pad_multiple(cp_size: int, sp_size: int = 1) -> int:
    """What the sequence length must be a multiple of: 2 * cp_size for :func:`zigzag_slice` (1 without CP), and
    the TP size under sequence parallelism (`sp_size`: Megatron splits the sequence over the TP ranks)."""
    return math.lcm(2 * cp_size if cp_size > 1 else 1, sp_size)


def packed_length(total_length: int, cp_size: int, sp_size: int = 1) -> int:
    """Positions a sample of `total_length` tokens takes in a packed micro-batch under CP size `cp_size` (and
    sequence parallelism over `sp_size` TP ranks)."""
    return _round_up(total_length, cp_pad_multiple(cp_size, sp_size))


def padding_sample(pad_token_id: int = 0) -> Sample:
    """The one sample of an empty micro-batch: a pad token, no response (nothing to train), group and index -1."""
    return Sample(prompt_tokens=[pad_token_id], group_id=-1, index=-1)


def empty_micro_batch(cp_size: int = 1, pad_token_id: int = 0, packed: bool = True,
                      kept_sets: bool = False) -> dict[str, torch.Tensor]:
    """A micro-batch with nothing to train (`padding_sample`, loss mask 0): it keeps every rank at the same
    number of micro-batches (see `BufferMicroBatchIterator`); `kept_sets`: with the (empty) kept-set keys, as the
    others of its step. Not yet CP-sliced."""
    return build_micro_batch([padding_sample(pad_token_id)], pad_to_multiple=cp_pad_multiple(cp_size),
                             pad_token_id=pad_token_id, packed=packed, kept_sets=kept_sets or None)


def mask_not_trained(batch: dict[str, torch.Tensor], samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    """Zero the loss mask, rollout log-probs and advantages of the samples that did not finish (not TRAINABLE) in
    the micro-batch built from `samples` (in place; returned): they stay in it, so every rank runs the same
    micro-batches, but contribute nothing."""
    for i, s in enumerate(samples):
        if s.status not in TRAINABLE:
            rows = _sample_positions(batch, i)
            for key in NOT_TRAINED_KEYS:
                batch[key][rows] = 0
    return batch


def _sample_positions(batch: dict[str, torch.Tensor], i: int) -> tuple[int, slice]:
    """Index of sample `i`'s positions in a padded ([i, :]) or packed ([0, its span in the row]) batch."""
    if "cu_seqlens" in batch:
        starts = packed_starts(batch)
        return 0, slice(int(starts[i]), int(starts[i + 1]))
    return i, slice(None)


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
