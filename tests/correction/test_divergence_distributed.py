"""Divergence rejection, budgeted bounds and GSPO split over CP (zig-zag) and DP ranks (gloo, one spawn) equal the
single-rank result: loss, gradient, masks, weights, metrics. A fixed divergence bound adds no collective (its
sequence decisions ride in the one per-sequence CP all_reduce); a budget adds one SUM per group; GSPO's sequence
mean adds one CP all_reduce to the loss."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_distributed import CountingAllReduce, zigzag_index

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import compute_rollout_correction, metrics_to_host
from slime_corr.losses import compute_policy_loss

WORLD = 2
B, S = 8, 16
LAYOUTS = ((1, 2), (2, 1))  # (dp, cp)
CASES = (  # (config, loss aggregation, extra collectives per group in the correction, extra CP ones in the loss)
    (C(rs_metric="k3", rs_agg="mean", rs_divergence_bound=0.02), "seq-mean-token-mean", 0, 0),
    (C(rs_metric="k2", rs_agg="max", rs_divergence_bound=0.1, use_tis=True, use_rs=True, rs_level="token",
       rs_upper_bound=1.6, rs_veto_threshold=0.05), "token-mean", 0, 0),
    (C(rs_metric="k3", rs_agg="token", rs_divergence_bound=0.03, use_tis=True, tis_level="sequence"),
     "seq-mean-token-sum", 0, 0),
    (C(rs_metric="k2", rs_agg="token", rs_divergence_budget=0.01, use_tis=True, tis_ess_target=0.8), "token-mean",
     2, 0),
    (C(rs_metric="k3", rs_agg="mean", rs_divergence_budget=0.02, use_tis=True, tis_level="geometric",
       tis_ess_target=0.9), "seq-mean-token-mean", 2, 0),
    (C(rs_metric="k2", rs_agg="sum", rs_divergence_budget=0.05), "seq-mean-token-sum", 1, 0),
    (C.preset("decoupled_token_is", policy_ratio_level="sequence", eps_clip=0.05), "seq-mean-token-mean", 0, 1),
    (C(policy_ratio_level="sequence", eps_clip=0.05, use_rollout_logprobs=True, rs_metric="k3", rs_agg="max",
       rs_divergence_bound=0.05), "token-mean", 0, 1),
)


def _data():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(B, S, generator=g, dtype=torch.float64) * 2
    ro = old + 0.25 * torch.randn(B, S, generator=g, dtype=torch.float64) * torch.linspace(0.1, 1.5, B)[:, None]
    ro[1, 2] = float("nan")  # non-finite sequence
    lp = old + 0.05 * torch.randn(B, S, generator=g, dtype=torch.float64)
    adv = torch.randn(B, S, generator=g, dtype=torch.float64)
    lengths = torch.tensor([16, 3, 0, 9, 1, 12, 16, 5])
    mask = torch.arange(S)[None, :] < lengths[:, None]
    mask[6, ::3] = False
    return lp, old, ro, adv, mask


def _worker(rank: int, store_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    lp, old, ro, adv, mask = _data()
    for dp, cp in LAYOUTS:
        cp_groups = [dist.new_group([d * cp + c for c in range(cp)]) for d in range(dp)]
        dp_groups = [dist.new_group([d * cp + c for d in range(dp)]) for c in range(cp)]
        d, c = divmod(rank, cp)
        cp_group, dp_group = cp_groups[d], dp_groups[c]
        rows = slice(d * B // dp, (d + 1) * B // dp)
        cols = zigzag_index(c, cp, S)
        sl = lambda t, rows=rows, cols=cols: t[rows][:, cols]  # noqa: E731
        for cfg, agg, extra, loss_extra in CASES:
            cfg = cfg.replace(loss_agg_mode=agg)
            tag = f"dp={dp} cp={cp} {agg} {cfg.describe()}"
            x = lp.clone().requires_grad_()
            ref = compute_policy_loss(x, old, ro, adv, mask, cfg)
            ref.loss.backward()
            y = lp.clone().requires_grad_()
            counter = CountingAllReduce()
            dist.all_reduce = counter
            try:
                out = compute_policy_loss(sl(y), sl(old), sl(ro), sl(adv), sl(mask), cfg, cp_group=cp_group,
                                          dp_group=dp_group)
            finally:
                dist.all_reduce = counter.real
            quantile_rounds = 2 if cfg.use_tis else 0
            group = cp_group if cp > 1 else dp_group
            base = (3 if cp > 1 else 2) + quantile_rounds + extra
            assert counter.count(group) == base + (loss_extra if cp > 1 else 0), (tag, counter.count(group))
            out.loss.backward()
            grad, total = y.grad.clone(), out.loss.detach().clone()
            dist.all_reduce(grad)
            dist.all_reduce(total)
            torch.testing.assert_close(total, ref.loss.detach(), rtol=1e-10, atol=1e-12, msg=tag)
            torch.testing.assert_close(grad, x.grad, rtol=1e-10, atol=1e-12, msg=tag)
            rc, lc = ref.correction, out.correction
            assert torch.equal(lc.loss_mask, sl(rc.loss_mask)), tag
            if rc.weights is not None:
                torch.testing.assert_close(lc.weights, sl(rc.weights), rtol=1e-10, atol=1e-12, msg=tag)
            got, want = metrics_to_host(lc.metrics), metrics_to_host(rc.metrics)  # the loss metrics are local
            assert set(got) == set(want), tag
            for k, v in want.items():
                assert abs(got[k] - v) <= 1e-9 * max(1.0, abs(v)), f"{tag} {k}: {got[k]} != {v}"
            if cfg.rejects_divergence:
                assert 0 < want["mis_div_rejected_token_fraction"] < 1, tag
        # the correction alone: a fixed divergence bound adds no collective to the correction
        base_cfg = C(use_tis=True)
        for cfg in (base_cfg, base_cfg.replace(rs_metric="k3", rs_agg="max", rs_divergence_bound=0.1)):
            counter = CountingAllReduce()
            dist.all_reduce = counter
            try:
                compute_rollout_correction(sl(old), sl(ro), sl(mask), cfg, cp_group=cp_group, dp_group=dp_group)
            finally:
                dist.all_reduce = counter.real
            assert len(counter.calls) == (5 if cp > 1 else 4), (dp, cp, len(counter.calls))
    dist.destroy_process_group()


def test_divergence_budgets_and_gspo_over_cp_and_dp():
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "store"),), nprocs=WORLD, join=True)
