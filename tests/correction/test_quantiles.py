"""Weight quantiles (`quantiles.py`): exact against the sorted weights at every spread from 1e-6 to 10, with ties,
outliers and shifted centers; merged over micro-batches; the statistics the hook merges."""

from __future__ import annotations

import math

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import (
    compute_rollout_correction,
    correction_metrics,
    merge_stats,
    metrics_to_host,
    quantiles,
)
from slime_corr.correction.reductions import BatchStats

SPREADS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 3.0, 10.0)


def exact(w: torch.Tensor, q: float) -> float:
    """The smallest float32 value v of `w` with F(v) >= q."""
    v = w.reshape(-1).float().sort().values
    return v[max(math.ceil(q * v.numel() - 1e-9), 1) - 1].item()


def rank_error(w: torch.Tensor, value: float, q: float) -> float:
    """How far q is from the ranks `value` occupies in `w` (0 when value is a q-quantile; ties count as one)."""
    v = w.reshape(-1).float()
    below, at_or_below = (v < value).double().mean().item(), (v <= value).double().mean().item()
    return max(below - q, q - at_or_below, 0.0)


def sketch(w: torch.Tensor, counted: torch.Tensor, binary: bool = True) -> dict[str, torch.Tensor]:
    """The sketch's statistics for weights `w` (0 where not counted), on one rank; without this call's own
    quantiles (`quantiles.CALL_KEY`), so `quantiles.quantiles` reads them from the histograms as for merged statistics."""
    stats = BatchStats()
    hist, counts = quantiles.level1(w, counted, binary)
    stats.add_sum(quantiles.LEVEL1_KEY, hist)
    r = stats.reduce()
    r.update(quantiles.refine(counts, r[quantiles.LEVEL1_KEY], []))
    r.pop(quantiles.CALL_KEY)
    return r


def weights(spread: float, center: float = 1.0, n: int = 20_000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (center * (spread * torch.randn(n, generator=g)).exp()).float()


@pytest.mark.parametrize("center", (1.0, 0.5, 1e-3, 37.0))
@pytest.mark.parametrize("spread", SPREADS)
def test_exact_at_every_spread_and_center(spread, center):
    w = weights(spread, center)
    got = quantiles.quantiles(sketch(w, torch.ones_like(w))).tolist()
    for value, q in zip(got, quantiles.QUANTILES.values(), strict=True):
        assert value == exact(w, q) and rank_error(w, value, q) == 0.0, (spread, center, q)


def test_ties_outliers_zeros_and_padding():
    g = torch.Generator().manual_seed(1)
    w = torch.ones(30_000)  # ties: most weights exactly 1.0 (train and rollout agree on most tokens)
    w[:5000] = 1 + 1e-7 * torch.randint(1, 4, (5000,), generator=g)
    w[5000:5100] = 2.0  # truncated at U
    w[5100:5400] = 0.0  # mask mode
    w[5400:5405] = math.exp(-20)
    counted = torch.ones_like(w)
    counted[-4000:] = 0.0  # padding / rejected: not counted
    w = w * counted
    got = quantiles.quantiles(sketch(w, counted)).tolist()
    kept = w[counted > 0]
    assert got == [exact(kept, q) for q in quantiles.QUANTILES.values()]


@pytest.mark.parametrize("spread", (1e-6, 1e-4, 1.0))
@pytest.mark.parametrize("level", ("token", "sequence"))
def test_through_the_core_with_rejection(spread, level):
    """Built-in IS weights of the core at narrow spreads (the issue's case: every weight within 1e-4 of 1)."""
    g = torch.Generator().manual_seed(2)
    b, s = 512, 64
    lp_r = -torch.rand(b, s, generator=g)
    lp_t = lp_r + spread * torch.randn(b, s, generator=g) / (1 if level == "token" else 8)
    mask = torch.rand(b, s, generator=g) > 0.2
    cfg = C(use_tis=True, tis_level=level, tis_upper_bound=1e6, use_rs=True, rs_level="sequence", rs_upper_bound=1e6)
    res = compute_rollout_correction(lp_t, lp_r, mask, cfg)
    m = metrics_to_host(res.metrics)
    w = res.weights[res.loss_mask > 0] if level == "token" else res.weights.amax(-1)[res.loss_mask.amax(-1) > 0]
    for name, q in quantiles.QUANTILES.items():
        assert m[f"mis_weight_{name}"] == pytest.approx(exact(w, q), rel=1e-7), name


def test_merged_micro_batches_are_exact_when_their_bins_were_refined():
    """The statistics of 4 micro-batches merged (as the hook does) give the step's exact quantiles: narrow data
    falls in few level-1 bins, and every micro-batch refines the heaviest bins."""
    cfg = C(use_tis=True, tis_upper_bound=10.0)
    g = torch.Generator().manual_seed(3)
    lp_r = -torch.rand(16, 512, generator=g)
    lp_t = lp_r + 1e-4 * torch.randn(16, 512, generator=g)
    mask = torch.ones(16, 512, dtype=torch.bool)
    full = metrics_to_host(compute_rollout_correction(lp_t, lp_r, mask, cfg).metrics)
    parts = [compute_rollout_correction(lp_t[k:k + 4], lp_r[k:k + 4], mask[k:k + 4], cfg).stats for k in range(0, 16, 4)]
    merged = metrics_to_host(correction_metrics(merge_stats(parts), cfg))
    for name in quantiles.QUANTILES:
        assert merged[f"mis_weight_{name}"] == full[f"mis_weight_{name}"], name


def test_merged_wide_data_stays_within_its_bin_and_one_percent_rank():
    """Wide data (spread 3) over micro-batches: bins a micro-batch did not refine are spread evenly; the merged
    quantile stays in the exact one's level-1 bin and within 1% rank error."""
    w = weights(3.0, n=40_000, seed=4)
    parts = [sketch(c, torch.ones_like(c)) for c in w.chunk(8)]
    got = quantiles.quantiles(quantiles.merge_sketches(parts)).tolist()
    for value, q in zip(got, quantiles.QUANTILES.values(), strict=True):
        assert rank_error(w, value, q) <= 0.01 and value == pytest.approx(exact(w, q), rel=2**-5), q
