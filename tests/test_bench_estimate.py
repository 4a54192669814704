"""The benches' own logic: `bench/correction.py`'s fusion estimate does the work it claims (the same loss and
mismatch sums as ours); `bench/vs_verl.py`'s equality check catches differences (and, under -m slow, passes
against verl's real code)."""

from __future__ import annotations

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.losses import compute_policy_loss
from tests.bench_modules import bench_module


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
    est = bench_module("correction").fusion_estimate(lp, old, ro, adv, mask, cfg)
    n_tok = mask.sum()
    assert est[-1].item() == pytest.approx(out.loss.item(), rel=1e-12)
    assert (-est[2] / n_tok).item() == pytest.approx(out.metrics["mismatch_kl"].item(), rel=1e-12)
    assert (est[6] / n_tok).item() == pytest.approx(out.metrics["mismatch_k3_kl"].item(), rel=1e-12)
    assert est[16].item() == pytest.approx(out.metrics["rollout_probs_diff_max"].item(), rel=1e-12)


def test_vs_verl_equality_check_catches_differences():
    """The bench's check (weights and masks bit-equal, loss/grad to rounding, shared metrics within 1e-6) on our
    own results: it passes for identical results and names each kind of difference."""
    bench = bench_module("vs_verl")
    row = bench.rows()[bench.ROW_KEYS["ppo"]]
    x = bench.make_inputs(4, 64)
    ours = bench.run_ours(row, x)
    theirs = {**ours, "metrics": {verl: ours["metrics"][key] for key, verl in row.same_metrics}}
    assert bench.compare(row, ours, theirs) == []
    bad = {**theirs, "weights": theirs["weights"] * (1 + 1e-7), "mask": theirs["mask"][:, :-1],
           "grad": theirs["grad"] * 1.01, "metrics": {**theirs["metrics"], "kl": theirs["metrics"]["kl"] + 1e-3}}
    problems = bench.compare(row, ours, bad)
    assert len(problems) == 4, problems
    assert problems[0].startswith("weights:") and "must be bit-equal" in problems[0]
    assert problems[1].startswith("mask: shape")
    assert problems[2].startswith("grad:")
    assert problems[3].startswith("metric mismatch_kl=")


@pytest.mark.slow
def test_vs_verl_rows_agree_with_verls_real_code():
    """Downloads verl's wheel (pip download --no-deps) and checks every row of the bench at a small size."""
    bench = bench_module("vs_verl")
    verl = bench.load_verl()
    x = bench.make_inputs(8, 256)
    for row in bench.rows():
        assert bench.compare(row, bench.run_ours(row, x), bench.run_verl(verl, row, x)) == [], row.name
