"""`bench/correction.py`'s fusion estimate must do the work it claims: the same loss and mismatch sums as ours."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.losses import compute_policy_loss

BENCH = Path(__file__).resolve().parents[1] / "bench" / "correction.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_correction", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fusion_estimate_matches_ours():
    g = torch.Generator().manual_seed(3)
    shape = (16, 64)
    old = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    ro = old + 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
    lp = old + 0.05 * torch.randn(shape, generator=g, dtype=torch.float64)
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.arange(64)[None, :] < torch.randint(0, 65, (16,), generator=g)[:, None]
    mask[2, :4] = True
    ro[2, 0], ro[2, 1] = old[2, 0] + 12.0, old[2, 1] - 12.0  # vetoed, though its sequence ratio passes RS
    cfg = RolloutCorrectionConfig.preset(
        "decoupled_seq_is_rs", tis_batch_normalize=True, rs_lower_bound=0.1, rs_upper_bound=10.0, rs_veto_threshold=1e-4
    )
    out = compute_policy_loss(lp, old, ro, adv, mask, cfg)
    assert 0 < out.metrics["mis_rejected_seq_fraction"] < 1  # some sequences kept, some rejected
    est = _bench_module().fusion_estimate(lp, old, ro, adv, mask, cfg)
    n_tok = mask.sum()
    assert est[-1].item() == pytest.approx(out.loss.item(), rel=1e-12)
    assert (-est[2] / n_tok).item() == pytest.approx(out.metrics["mismatch_kl"].item(), rel=1e-12)
    assert (est[6] / n_tok).item() == pytest.approx(out.metrics["mismatch_k3_kl"].item(), rel=1e-12)
    assert est[16].item() == pytest.approx(out.metrics["rollout_probs_diff_max"].item(), rel=1e-12)
