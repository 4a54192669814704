"""Weight quantiles over DP x CP without gathering the weights: a three-round radix select on float32 bits.

For w >= 0 the float32 bit pattern, read as an integer, orders like w. It is read as three digits: level 1 =
exponent + 5 mantissa bits (a fixed grid of 4096 bins over [2^-64, 2^64), each ~3% wide), level 2 = the next 9
mantissa bits, level 3 = the last 9. Each round is one bincount and one SUM over the groups:

1. the level-1 histogram (`LEVEL1_KEY`, reduced with the other batch statistics);
2. level-2 histograms inside `SLOTS` level-1 bins: the bins that hold the quantiles, then the heaviest others;
3. level-3 histograms inside `SLOTS` level-2 bins, chosen the same way.

Three digits pin a float32 value, so the quantiles of one call are exact (the smallest w with F(w) >= q; float64
weights are ranked as float32) at any spread and under any DP x CP split, ties (e.g. many weights of exactly 1.0)
included, for 2 small extra collectives and no gather.

Mergeable: the statistics are sums keyed by bin id, so `merge_stats` adds those of several micro-batches (`merge`).
A step's quantile is exact where every micro-batch refined the bins it falls in; mass a micro-batch did not refine
is spread evenly over its bin, so the rank error is at most that mass (the heaviest bins are always refined).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

QUANTILES = {"p10": 0.10, "p50": 0.50, "p90": 0.90, "p99": 0.99}
LEVEL1_KEY = "w_hist"
REFINED = {"w_hist2": "w_hist2_ids", "w_hist3": "w_hist3_ids"}  # refined histograms [n, SUB] -> their bin ids [n]
SLOTS = 64  # bins refined per round: with up to 64 distinct bins a micro-batch merges exactly
SUB_BITS = 9  # bits of levels 2 and 3
SUB = 1 << SUB_BITS
TOP_SHIFT = 2 * SUB_BITS  # level 1 = bits >> 18: exponent (8 bits) + 5 mantissa bits
EXP_OFFSET = (127 - 64) << (23 - TOP_SHIFT)  # level-1 key of 2^-64
LEVEL1_BINS = (128 << (23 - TOP_SHIFT)) + 1  # bin 0: below 2^-64 (zero); bins 1..4096: [2^-64, 2^64)


def _bits(w: Tensor) -> Tensor:
    """The float32 bit patterns of `w` as int32 (a view when `w` is float32)."""
    return w.to(torch.float32).view(torch.int32)


def _bincount(index: Tensor, unit: Tensor | None, size: int) -> Tensor:
    """Σ unit per key over [0, size), float64. A float32 `unit` must hold counts (0/1: exact below 2^24 values);
    anything else is accumulated in float64. index_add_, not bincount: bincount first scans for the min and max
    (on an accelerator, a device->host sync). `unit=None`: count the keys below `size` (`_binary_on_cpu`)."""
    if unit is None:  # keys >= size are the trash bin of uncounted weights
        return torch.bincount(index.reshape(-1), minlength=size + 1)[:size].to(torch.float64)
    weights = unit.reshape(-1)
    if weights.dtype != torch.float32 or weights.numel() > 2**24:
        weights = weights.to(torch.float64)
    out = torch.zeros(size, dtype=weights.dtype, device=weights.device)
    return out.index_add_(0, index.reshape(-1), weights).to(torch.float64)


def level1_keys(w: Tensor) -> Tensor:
    """Level-1 keys of `w`: weights below 2^-64 (and negative ones) fall in bin 0, whose value is 0; weights above
    2^64 in the top bin."""
    return (_bits(w) >> TOP_SHIFT).sub_(EXP_OFFSET - 1).clamp_(0, LEVEL1_BINS - 1)


def _binary_on_cpu(key: Tensor, binary: bool) -> bool:
    """Whether the histograms are plain counts (`binary`: the units are 0/1) by `torch.bincount`: on the CPU, a
    counting bincount costs about half of a weighted index_add_; elsewhere it would sync with the host."""
    return binary and key.device.type == "cpu"


def level1_histogram(key: Tensor, unit: Tensor, binary: bool = False) -> Tensor:
    """The level-1 histogram [LEVEL1_BINS] of `level1_keys`, weighted by `unit`. Kept out of compiled code: a
    compiled scatter adds atomically from every thread into the few bins narrow weights share.
    `binary` (the units are 0/1): on the CPU, `key` is then changed IN PLACE to the trash key LEVEL1_BINS where
    `unit` is 0, and every histogram counts keys (pass `binary` to `refine` too)."""
    if _binary_on_cpu(key, binary):
        key.masked_fill_(unit.reshape(key.shape) == 0, LEVEL1_BINS)
        return _bincount(key, None, LEVEL1_BINS)
    return _bincount(key, unit, LEVEL1_BINS)


def _locate(hist: Tensor, rank: Tensor) -> tuple[Tensor, Tensor]:
    """For each row of `hist` [n, bins] (or one [bins] histogram for all ranks): the bin where `rank` [n] falls
    (first bin whose cumulative sum reaches it) and the rank left inside that bin."""
    hist = hist.expand(rank.numel(), -1) if hist.dim() == 1 else hist
    cum = hist.cumsum(-1)
    i = torch.searchsorted(cum, rank[:, None]).clamp_max(hist.shape[-1] - 1)
    left = rank - (cum.gather(-1, i) - hist.gather(-1, i)).squeeze(-1)
    return i.squeeze(-1), left


def _ranks(hist1: Tensor) -> Tensor:
    qs = torch.tensor(list(QUANTILES.values()), dtype=torch.float64, device=hist1.device)
    return qs * hist1.sum() * (1 - 1e-12)  # the margin keeps an exact boundary (e.g. rank 1 of 10) on its value


def _slots(hist: Tensor, targets: Tensor) -> Tensor:
    """`SLOTS` bin ids to refine: the quantiles' bins first, then the heaviest others (ids may repeat)."""
    score = hist.clone()
    score[targets] = -1.0
    return torch.cat([targets, score.topk(SLOTS - targets.numel()).indices])


def _lut(size: int, ids: Tensor) -> Tensor:
    """int32 table: key -> (slot + 1) * SUB for the slots' bins (a repeated id keeps one slot), 0 elsewhere."""
    lut = torch.zeros(size, dtype=torch.int32, device=ids.device)
    lut[ids] = torch.arange(1, ids.numel() + 1, device=ids.device, dtype=torch.int32) * SUB
    return lut


def _reduced(x: Tensor, groups: list[dist.ProcessGroup]) -> Tensor:
    for g in groups:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=g)
    return x


def refine(w: Tensor, key1: Tensor, unit: Tensor, hist1: Tensor, groups: list[dist.ProcessGroup],
           binary: bool = False) -> dict[str, Tensor]:
    """Rounds 2 and 3 (one SUM over `groups` each), given the level-1 keys and the REDUCED level-1 histogram.
    Returns the refined statistics: `w_hist2` [SLOTS, SUB] with `w_hist2_ids` (level-1 bin ids) and `w_hist3`
    [SLOTS, SUB] with `w_hist3_ids` (level-1 bin * SUB + level-2 digit). `binary`: as given to
    `level1_histogram` (the trash key maps to slot 0, the row of the unrefined bins, which is dropped)."""
    bits = _bits(w)
    t1, r1 = _locate(hist1, _ranks(hist1))
    ids2 = _slots(hist1, t1)
    lut2 = _lut(LEVEL1_BINS + 1, ids2)
    if _binary_on_cpu(key1, binary):
        unit = None
    idx2 = lut2.index_select(0, key1.reshape(-1)).view_as(key1).add_((bits >> SUB_BITS).bitwise_and_(SUB - 1))
    hist2 = _reduced(_bincount(idx2, unit, (SLOTS + 1) * SUB), groups).view(SLOTS + 1, SUB)[1:]
    slot = lut2[t1].long() // SUB - 1  # the slot that holds each quantile's level-1 bin
    sub2, _ = _locate(hist2[slot], r1)
    ids3 = _slots(hist2.reshape(-1), slot * SUB + sub2)  # in slot * SUB + digit numbering
    idx3 = _lut((SLOTS + 1) * SUB, ids3 + SUB).index_select(0, idx2.reshape(-1)).view_as(idx2)
    idx3 = idx3.add_(bits & (SUB - 1))
    hist3 = _reduced(_bincount(idx3, unit, (SLOTS + 1) * SUB), groups).view(SLOTS + 1, SUB)[1:]
    return {"w_hist2": hist2, "w_hist2_ids": ids2.to(torch.float64),
            "w_hist3": hist3, "w_hist3_ids": (ids2[ids3 // SUB] * SUB + ids3 % SUB).to(torch.float64)}


def merge(parts: list[dict[str, Tensor]], key: str) -> tuple[Tensor, Tensor]:
    """(rows, ids) of the refined histograms `key` of several calls as one: rows with the same id are added."""
    ids = torch.cat([p[REFINED[key]] for p in parts])
    rows = torch.cat([p[key] for p in parts])
    unique, inverse = torch.unique(ids, return_inverse=True)
    return torch.zeros(unique.numel(), SUB, dtype=rows.dtype, device=rows.device).index_add_(0, inverse, rows), unique


def _digit(rows: Tensor, ids: Tensor, bin_id: Tensor, mass: Tensor, rank: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The next digit of each quantile inside bin `bin_id` of total `mass`, from the refined rows with that id;
    mass no row refined is spread evenly over the digits. Returns (digit, rank left, mass of that digit)."""
    hist = (ids[None, :] == bin_id[:, None].to(ids.dtype)).to(rows.dtype) @ rows  # [q, SUB]
    unrefined = mass - hist.sum(-1)
    unrefined = torch.where(unrefined > 1e-9 * mass, unrefined, torch.zeros_like(unrefined))
    hist = hist + (unrefined / SUB)[:, None]
    digit, left = _locate(hist, rank)
    return digit, left, hist.gather(-1, digit[:, None]).squeeze(-1)


def _refined(stats: dict[str, Tensor], key: str) -> tuple[Tensor, Tensor]:
    if key not in stats:  # not refined: every bin's mass is spread evenly
        empty = stats[LEVEL1_KEY].new_zeros(0)
        return empty.view(0, SUB), empty
    return stats[key].reshape(-1, SUB), stats[REFINED[key]].reshape(-1)


def quantiles(stats: dict[str, Tensor]) -> Tensor:
    """The weights at `QUANTILES` (float64 [4]) from reduced, possibly merged, sketch statistics."""
    hist1 = stats[LEVEL1_KEY]
    t1, r1 = _locate(hist1, _ranks(hist1))
    (rows2, ids2), (rows3, ids3) = (_refined(stats, key) for key in REFINED)
    d2, r2, mass2 = _digit(rows2, ids2, t1, hist1[t1], r1)
    d3, _, _ = _digit(rows3, ids3, t1 * SUB + d2, mass2, r2)
    bits = ((t1 - 1 + EXP_OFFSET) << TOP_SHIFT) + (d2 << SUB_BITS) + d3
    value = bits.to(torch.int32).view(torch.float32).to(torch.float64)
    return torch.where(t1 > 0, value, torch.zeros_like(value))  # bin 0: zero (or below 2^-64)
