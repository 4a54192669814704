"""The engine's kept sets in a micro-batch: ragged ids beside the tokens, never a [T, V] mask.

A sample carries the kept set of each response token (the ids the engine's top-k / top-p filter kept when it
sampled it: SGLang's `output_token_sampling_mask`) under slime's names: `Sample.rollout_top_p_token_ids` [K] int32
and `Sample.rollout_top_p_token_offsets` [R + 1] int32 (token i's ids are `ids[offsets[i]:offsets[i + 1]]`), and
optionally the engine's log-prob of every kept id under its renormalized distribution,
`Sample.rollout_top_p_log_probs` [K] float32 (SGLang's `output_token_sampling_logprobs`, `sampling_logprobs_mode:
"support"`). A micro-batch carries them as a key pair in the labels' alignment (position t is about labels[t]):

    rollout_kept_token_counts     [B, S] int32   |N| of labels[t]'s kept set; 0 where it has none (prompt, padding,
                                                 tokens spliced in by tools): the full vocabulary there
    rollout_kept_token_ids        [K] int32      the kept ids, position after position in row-major order
    rollout_kept_token_log_probs  [K] float32    (optional) the engine's log-prob of each kept id; NaN: unknown

so `offsets = cumsum(counts)` over the flattened positions. The counts pad, pack (THD) and CP-slice like every
token key (`micro_batch.TOKEN_KEYS`); the ids follow the positions a slice keeps (`take_kept_sets`). slime's own
batch (per-sample lists of the Sample fields above, whole responses) becomes this pair with `from_slime_samples`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from slime_corr.samples import Sample

KEPT_COUNTS_KEY = "rollout_kept_token_counts"
KEPT_IDS_KEY = "rollout_kept_token_ids"
KEPT_LOG_PROBS_KEY = "rollout_kept_token_log_probs"
KEPT_ENTRY_KEYS = (KEPT_IDS_KEY, KEPT_LOG_PROBS_KEY)  # [K] entries that follow the counts' positions
# slime's names (Sample fields; slime's batch keys: one entry per sample, the whole response)
SLIME_IDS_KEY, SLIME_OFFSETS_KEY = "rollout_top_p_token_ids", "rollout_top_p_token_offsets"
SLIME_LOG_PROBS_KEY = "rollout_top_p_log_probs"


def has_kept_sets(batch: dict[str, Any]) -> bool:
    """Whether a micro-batch carries kept sets (the key pair of the module doc)."""
    return KEPT_COUNTS_KEY in batch and KEPT_IDS_KEY in batch


def exclusive_cumsum(counts: Tensor) -> Tensor:
    """[n] int64 starts of ragged entries of `counts` [n]: 0, c0, c0 + c1, ..."""
    counts = counts.reshape(-1).long()
    return torch.cumsum(counts, 0) - counts


def ragged_index(starts: Tensor, counts: Tensor) -> Tensor:
    """The entry indices of the ragged runs `[starts[i], starts[i] + counts[i])`, run after run (int64 [Σ counts])."""
    counts = counts.long()
    total = int(counts.sum())
    run = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=total)
    within = torch.arange(total, device=counts.device) - exclusive_cumsum(counts)[run]
    return starts.long()[run] + within


def take_kept_sets(batch: dict[str, Tensor], positions: Tensor) -> dict[str, Tensor]:
    """The `KEPT_ENTRY_KEYS` entries of `batch` (whole rows) at the flattened positions `positions` [P] (row-major
    over `batch[KEPT_COUNTS_KEY]`, in the order a slice keeps them): what a CP rank's slice carries."""
    counts = batch[KEPT_COUNTS_KEY].reshape(-1)
    positions = positions.to(counts.device).long()
    index = ragged_index(exclusive_cumsum(counts)[positions], counts[positions])
    return {k: batch[k][index.to(batch[k].device)] for k in KEPT_ENTRY_KEYS if k in batch}


def sample_counts(s: Sample) -> Tensor | None:
    """int32 [R]: the size of each response token's kept set (None when the sample carries none)."""
    if s.rollout_top_p_token_offsets is None:
        return None
    return s.rollout_top_p_token_offsets.diff().to(torch.int32)


def sample_count_row(s: Sample, length: int) -> Tensor:
    """The sample's counts in its micro-batch row of `length` positions (prompt + response), in the labels'
    alignment: response token i at position prompt − 1 + i; 0 elsewhere."""
    row = torch.zeros(length, dtype=torch.int32)
    counts = sample_counts(s)
    if counts is not None and counts.numel():
        start = len(s.prompt_tokens) - 1
        row[start : start + counts.numel()] = counts
    return row


def sample_entries(samples: Sequence[Sample]) -> dict[str, Tensor]:
    """The kept ids of `samples` one after the other (their rows' order in a padded or packed micro-batch), and the
    engine's log-probs of them when a sample carries them (NaN for the samples that do not)."""
    ids = [s.rollout_top_p_token_ids for s in samples if s.rollout_top_p_token_ids is not None]
    out = {KEPT_IDS_KEY: torch.cat(ids).to(torch.int32) if ids else torch.zeros(0, dtype=torch.int32)}
    if any(s.rollout_top_p_log_probs is not None for s in samples):
        out[KEPT_LOG_PROBS_KEY] = torch.cat([
            torch.zeros(0) if s.rollout_top_p_token_ids is None
            else s.rollout_top_p_log_probs if s.rollout_top_p_log_probs is not None
            else torch.full((s.rollout_top_p_token_ids.numel(),), torch.nan) for s in samples]).to(torch.float32)
    return out


def check_trained_tokens_have_kept_sets(batch: dict[str, Tensor]) -> None:
    """Every position in the loss mask has a kept set (a batch that carries them must carry one per trained token:
    the log-prob there is taken over it); raises ValueError naming the key and the first such position."""
    missing = (batch["loss_mask"] > 0) & (batch[KEPT_COUNTS_KEY] == 0)
    if bool(missing.any()):
        row, col = (int(i) for i in missing.nonzero()[0])
        raise ValueError(f"{KEPT_COUNTS_KEY}: the trained token at [{row}, {col}] has no kept set (count 0) in a "
                         "micro-batch that replays the engine's kept sets: ask every request for them "
                         "(--rollout-return-sampling-mask) or take that token out of the loss mask")


def response_starts(total_lengths: Sequence[int], response_lengths: Sequence[int],
                    row_starts: Sequence[int] | None) -> list[int]:
    """The flattened position of each sample's first response token's label in a micro-batch: row i of width
    `width` (padded, `row_starts` None: i · width is added by the caller) or the packed row's sample start, plus
    prompt − 1."""
    starts = row_starts if row_starts is not None else [0] * len(total_lengths)
    return [int(b) + int(t) - int(r) - 1 for b, t, r in zip(starts, total_lengths, response_lengths, strict=True)]


def from_slime_samples(batch: dict[str, Any]) -> dict[str, Any]:
    """The kept-set key pair (module doc) of a micro-batch that carries slime's per-sample keys instead:
    `rollout_top_p_token_ids` and `rollout_top_p_token_offsets` (one entry per sample: its whole response, offsets of
    length response_length + 1, slime's meaning), with slime's `total_lengths` and `response_lengths`, and optionally
    `rollout_top_p_log_probs`. `batch` holds whole rows (padded: one sample per row; packed: `cu_seqlens_padded`).
    Returns a new dict without slime's keys; raises ValueError naming the key that does not fit."""
    if SLIME_IDS_KEY not in batch and SLIME_OFFSETS_KEY not in batch:
        return batch
    for key in (SLIME_IDS_KEY, SLIME_OFFSETS_KEY, "total_lengths", "response_lengths"):
        if key not in batch:
            raise ValueError(f"{key}: missing; a micro-batch with slime's kept sets ({SLIME_IDS_KEY} / "
                             f"{SLIME_OFFSETS_KEY}) needs {SLIME_IDS_KEY}, {SLIME_OFFSETS_KEY}, total_lengths and "
                             "response_lengths (one entry per sample), as slime's batch has them")
    ids, offsets = list(batch[SLIME_IDS_KEY]), list(batch[SLIME_OFFSETS_KEY])
    totals, responses = [int(x) for x in batch["total_lengths"]], [int(x) for x in batch["response_lengths"]]
    log_probs = list(batch[SLIME_LOG_PROBS_KEY]) if batch.get(SLIME_LOG_PROBS_KEY) is not None else None
    n = len(totals)
    if {len(ids), len(offsets), len(responses), len(log_probs) if log_probs is not None else n} != {n}:
        raise ValueError(f"{SLIME_IDS_KEY} / {SLIME_OFFSETS_KEY} / total_lengths / response_lengths"
                         f"{' / ' + SLIME_LOG_PROBS_KEY if log_probs is not None else ''}: one entry per sample, "
                         f"got {len(ids)} / {len(offsets)} / {n} / {len(responses)}")
    labels = batch["labels"]
    width = labels.shape[-1]
    packed = "cu_seqlens" in batch
    if packed:
        starts = batch.get("cu_seqlens_padded", batch["cu_seqlens"]).tolist()[:-1]
    else:
        starts = [i * width for i in range(n)]
        if labels.shape[0] != n:
            raise ValueError(f"total_lengths: {n} samples for a padded micro-batch of {labels.shape[0]} rows")
    counts = torch.zeros(labels.numel(), dtype=torch.int32)
    for i, (o, t, r, first) in enumerate(zip(offsets, totals, responses, response_starts(totals, responses, starts),
                                            strict=True)):
        o = torch.as_tensor(o).long().reshape(-1)
        k = torch.as_tensor(ids[i]).reshape(-1)
        if o.numel() != r + 1 or (r and (o[0] != 0 or o[-1] != k.numel() or bool((o.diff() < 0).any()))):
            raise ValueError(f"{SLIME_OFFSETS_KEY}[{i}]: {o.numel()} offsets for a response of {r} tokens with "
                             f"{k.numel()} kept ids: expected response_length + 1 non-decreasing offsets from 0 to "
                             "len(ids) (slime's meaning: token j's ids are ids[offsets[j]:offsets[j + 1]])")
        if t - r < 1 or first + r > (starts[i] if packed else i * width) + width:
            raise ValueError(f"total_lengths[{i}] / response_lengths[{i}]: a response of {r} of {t} tokens does not "
                             "fit its row")
        counts[first : first + r] = o.diff().to(torch.int32)
    out = {k: v for k, v in batch.items() if k not in (SLIME_IDS_KEY, SLIME_OFFSETS_KEY, SLIME_LOG_PROBS_KEY)}
    out[KEPT_COUNTS_KEY] = counts.reshape(labels.shape).to(labels.device)
    out[KEPT_IDS_KEY] = torch.cat([torch.as_tensor(k).reshape(-1) for k in ids]).to(torch.int32).to(labels.device) \
        if ids else torch.zeros(0, dtype=torch.int32, device=labels.device)
    if log_probs is not None:
        out[KEPT_LOG_PROBS_KEY] = torch.cat([torch.as_tensor(x, dtype=torch.float32).reshape(-1)
                                             for x in log_probs]).to(labels.device)
        if out[KEPT_LOG_PROBS_KEY].numel() != out[KEPT_IDS_KEY].numel():
            raise ValueError(f"{SLIME_LOG_PROBS_KEY}: {out[KEPT_LOG_PROBS_KEY].numel()} log-probs for "
                             f"{out[KEPT_IDS_KEY].numel()} kept ids")
    return out


__all__ = ["KEPT_COUNTS_KEY", "KEPT_ENTRY_KEYS", "KEPT_IDS_KEY", "KEPT_LOG_PROBS_KEY", "SLIME_IDS_KEY",
           "SLIME_LOG_PROBS_KEY", "SLIME_OFFSETS_KEY", "check_trained_tokens_have_kept_sets", "exclusive_cumsum",
           "from_slime_samples", "has_kept_sets", "ragged_index", "response_starts", "sample_count_row",
           "sample_counts", "sample_entries", "take_kept_sets"]
