"""Weight quantiles over DP x CP without gathering the weights: a three-round radix select on float32 bits.

For w >= 0 the float32 bit pattern, read as an integer, orders like w (a negative weight, which the metrics report as
an error, ranks as |w|). The 31 bits below the sign are read as three digits: level 1 = exponent + 5 mantissa bits
(`LEVEL1_BINS` = 8192 bins covering every float32 from 0 to inf, each ~3% wide), level 2 = the next 9 mantissa bits,
level 3 = the last 9. Each round is one histogram and one SUM over the groups:

1. the level-1 histogram (`LEVEL1_KEY`, reduced with the other batch statistics);
2. level-2 histograms inside `SLOTS` level-1 bins: the bins that hold the quantiles, then the heaviest others;
3. level-3 histograms inside `SLOTS` level-2 bins, chosen the same way.

Three digits pin a float32 value, so the quantiles of one call are exact (the smallest w with F(w) >= q; float64
weights are ranked as float32) at any spread and under any DP x CP split, ties (e.g. many weights of exactly 1.0),
zeros and inf included, for 2 small extra collectives and no gather. `refine` also reads them off (`CALL_KEY`).

How a histogram is counted (`Counts`), with no device->host sync and no data-dependent shape either way:
- CPU: `torch.bincount` of the bin keys (0/1 units; no sync on the CPU; the uncounted weights, all 0, are counted in
  bin 0 and taken out again) or `index_add_` (other units): the fastest there, ~0.5 ms for 0.5M weights.
- any other device: sort the keys once (a radix sort of int32: a few passes, no atomics, deterministic), then every
  count of all three rounds is a difference of `searchsorted` positions at the bins' starts (other units: of the
  cumulative units in sorted order). Why not the others: scattering millions of values into few bins (`bincount`,
  `index_add_`, `scatter_add_`) contends on global atomics (on an H200 it was 89 % of a token row's GPU time), and
  `bincount` also reads its extremes to the host. `torch.histc` with explicit bounds keeps block-private shared
  memory counts only while its bins fit in shared memory (~12k int32 bins: level 1, not the 32k of levels 2 and 3,
  which fall back to global atomics), still serializes within a block when every weight is 1.0, counts no weighted
  units and refuses deterministic mode; one comparison sum per boundary costs a pass per bin.

Mergeable: the statistics are sums keyed by bin id, so `merge_sketches` adds those of several micro-batches (`merge`).
A step's quantile is exact where every micro-batch refined the bins it falls in; mass a micro-batch did not refine
is spread evenly over its bin, so the rank error is at most that mass (the heaviest bins are always refined).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.functional import pad

from slime_corr.correction.reductions import device_constant

QUANTILES = {"p10": 0.10, "p50": 0.50, "p90": 0.90, "p99": 0.99}
LEVEL1_KEY = "w_hist"
REFINED = {"w_hist2": "w_hist2_ids", "w_hist3": "w_hist3_ids"}  # refined histograms [n, SUB] -> their bin ids [n]
CALL_KEY = "w_quantiles"  # the exact quantiles of one call (float64 [4]); not merged (a step recomputes them)
SLOTS = 64  # bins refined per round: with up to 64 distinct bins a micro-batch merges exactly
SUB_BITS = 9  # bits of levels 2 and 3
SUB = 1 << SUB_BITS
TOP_SHIFT = 2 * SUB_BITS  # level 1 = bits >> 18: exponent (8 bits) + 5 mantissa bits
LEVEL1_BINS = 1 << (31 - TOP_SHIFT)  # every non-negative float32 bit pattern, 0 to inf (and NaN payloads)
ABS_BITS = 0x7FFFFFFF  # the bits below the sign
COUNTING_DEVICES = {"cpu"}  # devices that count by bincount / index_add_; the others sort (see the module doc)
SORT_CHUNK = SORT_CHUNK_DEFAULT = 1 << 21  # weights per sorted piece: bounds the sort's indices and scratch (H200, 8.4M weights: 450 MiB)
_INT32_MAX = 0x7FFFFFFF


def _bits(w: Tensor) -> Tensor:
    """The float32 bit patterns of `w`, flat int32 (a view when `w` is float32)."""
    return w.to(torch.float32).reshape(-1).view(torch.int32)


def level1_keys(w: Tensor) -> Tensor:
    """Level-1 bin of each weight (|bits| >> 18, int32, the shape of `w`): bin k holds [k << 18, (k+1) << 18)."""
    bits = w.to(torch.float32).view(torch.int32)
    return torch.bitwise_and(bits, _const("abs", bits.device)) >> TOP_SHIFT


def _build(name: str) -> Callable[[torch.device], Tensor]:
    def build(device: torch.device) -> Tensor:
        if name == "ranks":  # the margin keeps an exact boundary (e.g. rank 1 of 10) on its value
            return torch.tensor([q * (1 - 1e-12) for q in QUANTILES.values()], dtype=torch.float64, device=device)
        if name == "edges1":  # level-1 bin starts, in key space
            return torch.arange(LEVEL1_BINS, dtype=torch.int32, device=device) << TOP_SHIFT
        if name == "bins":  # level-1 bin ids
            return torch.arange(LEVEL1_BINS, dtype=torch.int32, device=device)
        if name == "edges":  # digit starts inside a bin, shifted later: 0..SUB
            return torch.arange(SUB + 1, dtype=torch.int64, device=device)
        if name == "digits":
            return torch.arange(SUB, dtype=torch.int64, device=device)
        if name == "slot_codes":  # lookup value of slot s: (s + 1) * SUB (0 = not refined)
            return torch.arange(1, SLOTS + 1, dtype=torch.int32, device=device) * SUB
        if name == "zero":
            return torch.zeros(1, dtype=torch.int32, device=device)
        if name in ("abs", "digit"):  # int32 masks: a Python int operand would take a slow path on the CPU
            return torch.tensor(ABS_BITS if name == "abs" else SUB - 1, dtype=torch.int32, device=device)
        if name == "inf":
            return torch.tensor(float("inf"), dtype=torch.float64, device=device)
        raise KeyError(name)
    return build


def _const(name: str, device: torch.device) -> Tensor:
    """Small constant tensors, made once per device (no host->device copy per call)."""
    return device_constant(f"quantiles.{name}", device, _build(name))


class Counts(NamedTuple):
    """One call's weights, prepared once to count the histograms of all three rounds (`level1`, then `refine`).

    Counting (CPU): `key` = level-1 keys [N], `bits` the raw bits; `unit` the float64 units, or None for 0/1 units,
    where the uncounted weights (all 0) are counted in bin 0 and `missing` (1-element, minus their number) takes
    them out again of every histogram's bin of 0 (cheaper than a pass to drop them).
    Sorting (other devices): `chunks` = the |bits| in pieces of at most `SORT_CHUNK`, each sorted (0/1 units: -1
    where the unit is 0, sorted first); `cums` = each piece's units' cumulative sums in that order with a leading 0
    ([n + 1], float64; empty for 0/1 units). A count is the sum of the pieces' counts."""

    key: Tensor | None = None
    bits: Tensor | None = None
    unit: Tensor | None = None
    missing: Tensor | None = None
    chunks: tuple[Tensor, ...] = ()
    cums: tuple[Tensor, ...] = ()
    sorting: bool = False


def _sorting(x: Tensor) -> bool:
    return x.device.type not in COUNTING_DEVICES


def level1(w: Tensor, unit: Tensor, binary: bool = False) -> tuple[Tensor, Counts]:
    """The level-1 histogram [LEVEL1_BINS] (float64) of the weights `w` >= 0 with units `unit` (of `w`'s shape, 0
    where a weight does not count; `w` must be 0 there), and what `refine` needs to count the next rounds. `binary`:
    the units are 0/1 (counts, exact below 2^53); otherwise they are summed in float64."""
    bits = _bits(w)
    flat = unit.reshape(-1)
    if _sorting(w):
        keys = torch.bitwise_and(bits, _const("abs", w.device))
        if binary:  # the sort's indices are dropped piece by piece: the peak is the pieces', not the whole batch's
            keys.masked_fill_(flat <= 0, -1)
            counts = Counts(chunks=tuple(torch.sort(part).values for part in keys.split(SORT_CHUNK)), sorting=True)
        else:
            pieces = [torch.sort(part) for part in keys.split(SORT_CHUNK)]
            units = flat.to(torch.float64).split(SORT_CHUNK)
            counts = Counts(chunks=tuple(v for v, _ in pieces), sorting=True,
                            cums=tuple(pad(u[order].cumsum(0), (1, 0)) for (_, order), u in zip(pieces, units,
                                                                                                 strict=True)))
        return _sorted_counts(counts, _const("edges1", w.device)), counts
    key = torch.bitwise_and(bits, _const("abs", w.device)) >> TOP_SHIFT
    if not binary:
        counts = Counts(key, bits, unit=flat.to(torch.float64))
        return _bincount(counts, key, LEVEL1_BINS), counts
    rows = unit.reshape(-1, unit.shape[-1]) if unit.dim() > 1 else unit.reshape(1, -1)
    counts = Counts(key, bits, missing=rows.sum(-1).sum(0, dtype=torch.float64, keepdim=True) - flat.numel())
    return _bincount(counts, key.view(-1), LEVEL1_BINS), counts


def _bincount(c: Counts, index: Tensor, size: int, zeros_at: Tensor | None = None) -> Tensor:
    """Σ unit per index over [0, size) (counting). 0/1 units: the uncounted weights (zeros), at index `zeros_at`
    (1-element; None: 0), are taken out."""
    if c.unit is not None:
        return torch.zeros(size, dtype=torch.float64, device=index.device).index_add_(0, index, c.unit)
    out = torch.bincount(index, minlength=size).to(torch.float64)
    return out.index_add_(0, zeros_at, c.missing) if zeros_at is not None else out.index_add_(
        0, _const("zero", index.device), c.missing)


def _sorted_counts(c: Counts, edges: Tensor) -> Tensor:
    """Σ unit over [edges[..., i], edges[..., i + 1]) of the sorted keys (sorting), summed over the pieces; float64
    [..., n - 1], or [n] for the level-1 starts (the last bin ends past every key)."""
    total: Tensor | None = None
    for i, key in enumerate(c.chunks):
        pos = torch.searchsorted(key, edges.reshape(-1)).view(edges.shape)
        if edges.dim() == 1:
            pos = pad(pos, (0, 1), value=key.numel())
        part = (c.cums[i][pos] if c.cums else pos).diff(dim=-1).to(torch.float64)
        total = part if total is None else total.add_(part)
    assert total is not None, "no weights to count"
    return total


def bin_sums(key: Tensor, rows: Tensor) -> Tensor:
    """[k, LEVEL1_BINS] float64: Σ rows[i] per level-1 bin `key` (flat keys, `level1_keys`; rows [k, N] float64),
    local. Counting: one index addition; sorting: the rows' cumulative sums in key order at the bin starts."""
    k = rows.shape[0]
    if not _sorting(key):
        index = torch.cat([key.to(torch.int64) + i * LEVEL1_BINS for i in range(k)])
        out = torch.zeros(k * LEVEL1_BINS, dtype=torch.float64, device=rows.device)
        return out.index_add_(0, index, rows.reshape(-1)).view(k, LEVEL1_BINS)
    key, order = torch.sort(key)
    cum = pad(rows[:, order].cumsum(1), (1, 0))
    pos = pad(torch.searchsorted(key, _const("bins", key.device)), (0, 1), value=key.numel())
    return cum[:, pos].diff(dim=-1)


def _slots(hist: Tensor, targets: Tensor) -> Tensor:
    """`SLOTS` distinct bin ids to refine, sorted: the targets' bins, then the heaviest others."""
    score = hist.index_put((targets,), _const("inf", hist.device))
    return score.topk(SLOTS).indices.sort().values


def _reduced(x: Tensor, groups: list[dist.ProcessGroup]) -> Tensor:
    for g in groups:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=g)
    return x


def _sorted_rows(c: Counts, prefix: Tensor, shift: int) -> Tensor:
    """Sorting: [n, SUB] local histograms of the next digit inside the bins `prefix` (their key >> `shift`)."""
    edges = (prefix << shift)[:, None] + (_const("edges", prefix.device) << (shift - SUB_BITS))
    return _sorted_counts(c, edges.clamp_max_(_INT32_MAX).to(torch.int32))


def _counted_rows(c: Counts, index: Tensor, at: Tensor, size: int, shift: int, zeros: Tensor | None
                  ) -> tuple[Tensor, Tensor, Tensor | None]:
    """Counting: [SLOTS, SUB] local histograms of the next digit (bits >> `shift - 9`) of the weights whose
    `index` [N] (< `size`; the uncounted zeros' is `zeros`, None: 0) is at `at` [SLOTS]; and each weight's
    slot * SUB + digit (slot 0: not refined), with the uncounted zeros' (0/1 units)."""
    lut = torch.zeros(size, dtype=torch.int32, device=index.device).index_put_((at,), _const("slot_codes", at.device))
    bits = c.bits >> (shift - SUB_BITS) if shift > SUB_BITS else c.bits
    nxt = lut.index_select(0, index).add_(torch.bitwise_and(bits, _const("digit", at.device)))
    zeros = None if c.missing is None else lut[:1] if zeros is None else lut.index_select(0, zeros)
    hist = _bincount(c, nxt, (SLOTS + 1) * SUB, zeros)
    return hist.view(SLOTS + 1, SUB)[1:], nxt, zeros


def refine(c: Counts, hist1: Tensor, groups: list[dist.ProcessGroup]) -> dict[str, Tensor]:
    """Rounds 2 and 3 (one SUM over `groups` each), given the REDUCED level-1 histogram: `w_hist2` [SLOTS, SUB] with
    `w_hist2_ids` (level-1 bin ids) and `w_hist3` [SLOTS, SUB] with `w_hist3_ids` (level-1 bin << 9 | level-2 digit),
    and the exact quantiles of this call (`CALL_KEY`, float64 [4])."""
    cum1 = hist1.cumsum(0)
    ranks = cum1[-1] * _const("ranks", hist1.device)
    t1 = torch.searchsorted(cum1, ranks)
    r1 = ranks - (cum1 - hist1)[t1]  # the rank inside the bin
    ids2 = _slots(hist1, t1)
    if c.sorting:
        rows2 = _sorted_rows(c, ids2, TOP_SHIFT)
    else:
        rows2, index2, zeros2 = _counted_rows(c, c.key.view(-1), ids2, LEVEL1_BINS, TOP_SHIFT, None)
    rows2 = _reduced(rows2.reshape(-1), groups).view(SLOTS, SUB)
    slot2 = torch.searchsorted(ids2, t1)
    cum2 = rows2[slot2].cumsum(-1)
    d2 = torch.searchsorted(cum2, r1[:, None]).clamp_max_(SUB - 1)
    cells2 = (ids2 << SUB_BITS)[:, None] + _const("digits", ids2.device)  # level-2 bin id of every cell of rows2
    target3 = ((slot2[:, None] << SUB_BITS) + d2).view(-1)  # the cell of each quantile
    ids3 = _slots(rows2.view(-1), target3)
    id3 = cells2.view(-1)[ids3]
    if c.sorting:
        rows3 = _sorted_rows(c, id3, SUB_BITS)
    else:
        rows3, _, _ = _counted_rows(c, index2, ids3 + SUB, (SLOTS + 1) * SUB, SUB_BITS, zeros2)
    rows3 = _reduced(rows3.reshape(-1), groups).view(SLOTS, SUB)
    cum3 = rows3[torch.searchsorted(ids3, target3)].cumsum(-1)
    r2 = r1[:, None] - pad(cum2, (1, 0)).gather(-1, d2)
    d3 = torch.searchsorted(cum3, r2).clamp_max_(SUB - 1)
    bits = (cells2.view(-1)[target3] << SUB_BITS) + d3.view(-1)
    return {"w_hist2": rows2, "w_hist2_ids": ids2.to(torch.float64), "w_hist3": rows3,
            "w_hist3_ids": id3.to(torch.float64), CALL_KEY: bits.to(torch.int32).view(torch.float32).to(torch.float64)}


def merge(parts: list[dict[str, Tensor]], key: str) -> tuple[Tensor, Tensor]:
    """(rows, ids) of the refined histograms `key` of several calls as one: rows with the same id are added."""
    ids = torch.cat([p[REFINED[key]] for p in parts])
    rows = torch.cat([p[key] for p in parts])
    unique, inverse = torch.unique(ids, return_inverse=True)
    return torch.zeros(unique.numel(), SUB, dtype=rows.dtype, device=rows.device).index_add_(0, inverse, rows), unique


def merge_sketches(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The reduced sketch statistics of several calls as one (`merge_stats`): the level-1 histograms add, the
    refined ones are added by bin id (`merge`), a call's own exact quantiles (`CALL_KEY`) are dropped."""
    merged: dict[str, Tensor] = {}
    for sketch in parts:
        for key, value in sketch.items():
            if key in REFINED or key in REFINED.values() or key == CALL_KEY:
                continue
            merged[key] = value if key not in merged else torch.add(merged[key], value)
    for key, ids_key in REFINED.items():
        with_key = [p for p in parts if key in p]
        if with_key:
            merged[key], merged[ids_key] = merge(with_key, key)
    return merged


def _digit(rows: Tensor, ids: Tensor, bin_id: Tensor, mass: Tensor, rank: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The next digit of each quantile inside bin `bin_id` of total `mass`, from the refined rows with that id;
    mass no row refined is spread evenly over the digits. Returns (digit, rank left, mass of that digit)."""
    hist = (ids[None, :] == bin_id[:, None].to(ids.dtype)).to(rows.dtype) @ rows  # [q, SUB]
    unrefined = mass - hist.sum(-1)
    unrefined = torch.where(unrefined > 1e-9 * mass, unrefined, torch.zeros_like(unrefined))
    cum = (hist + (unrefined / SUB)[:, None]).cumsum(-1)
    digit = torch.searchsorted(cum, rank[:, None]).clamp_max_(SUB - 1)
    below = pad(cum, (1, 0)).gather(-1, digit)
    return digit.squeeze(-1), (rank[:, None] - below).squeeze(-1), (cum.gather(-1, digit) - below).squeeze(-1)


def _refined(stats: dict[str, Tensor], key: str) -> tuple[Tensor, Tensor]:
    if key not in stats:  # not refined: every bin's mass is spread evenly
        empty = stats[LEVEL1_KEY].new_zeros(0)
        return empty.view(0, SUB), empty
    return stats[key].reshape(-1, SUB), stats[REFINED[key]].reshape(-1)


def quantiles(stats: dict[str, Tensor]) -> Tensor:
    """The weights at `QUANTILES` (float64 [4]) from reduced, possibly merged, sketch statistics (one call's:
    `CALL_KEY`, read off by `refine`)."""
    if CALL_KEY in stats:
        return stats[CALL_KEY]
    hist1 = stats[LEVEL1_KEY]
    cum1 = hist1.cumsum(0)
    ranks = cum1[-1] * _const("ranks", hist1.device)
    t1 = torch.searchsorted(cum1, ranks).clamp_max_(LEVEL1_BINS - 1)
    r1 = ranks - (cum1 - hist1)[t1]
    (rows2, ids2), (rows3, ids3) = (_refined(stats, key) for key in REFINED)
    d2, r2, mass2 = _digit(rows2, ids2, t1, hist1[t1], r1)
    id2 = (t1 << SUB_BITS) + d2
    d3, _, _ = _digit(rows3, ids3, id2, mass2, r2)
    return ((id2 << SUB_BITS) + d3).to(torch.int32).view(torch.float32).to(torch.float64)
