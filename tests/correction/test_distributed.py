"""The same batch split over DP and zig-zag CP ranks (gloo, one spawn) matches the single-rank result."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import compute_rollout_correction, metrics_to_host
from slime_corr.losses import OPSM_COUNT, compute_policy_loss
from tests.mcore.mcore_helpers import checking, spawn_group
from tests.synthetic import UNEVEN_LENGTHS, policy_batch

WORLD = 4
B, S = 8, 16
LAYOUTS = ((2, 1), (1, 2), (2, 2), (1, 4), (4, 1))  # (dp, cp)
CASES = (
    (C.preset("decoupled_seq_is_rs", tis_batch_normalize=True, rs_lower_bound=0.3, rs_upper_bound=3.0), "seq-mean-token-mean"),
    (C.preset("decoupled_token_is", tis_batch_normalize=True, rs_veto_threshold=0.05), "token-mean"),
    (C(use_tis=True, tis_level="geometric", tis_mode="mask", tis_upper_bound=1.1, use_rs=True, rs_level="token", rs_upper_bound=1.6), "seq-mean-token-sum"),
    (C.preset("pg_is", tis_batch_normalize=True), "seq-mean-token-sum-norm"),
    (C.preset("pg_rs", rs_upper_bound=1.2), "seq-mean-token-mean"),
    (C(get_mismatch_metrics=True, use_rollout_logprobs=True), "token-mean"),
    (C(), "seq-mean-token-mean"),
    # OPSM: one sequence-level decision over the whole (CP-split) sequence
    (C.preset("decoupled_token_is", use_opsm=True, opsm_delta=0.01), "token-mean"),
    (C(use_opsm=True, opsm_delta=0.0), "seq-mean-token-mean"),
)


def _data():
    lp, old, ro, adv, mask = policy_batch(0, B, S, rollout_noise=0.3, policy_noise=0.2, lengths=UNEVEN_LENGTHS)
    ro[1, 2] = float("nan")  # non-finite sequence
    mask[6, ::3] = False
    return lp, old, ro, adv, mask


def zigzag_index(cp_rank: int, cp: int, s: int = S) -> torch.Tensor:
    c = s // (2 * cp)
    chunks = (cp_rank, 2 * cp - 1 - cp_rank)
    return torch.cat([torch.arange(k * c, (k + 1) * c) for k in chunks])


class CountingAllReduce:
    """Wraps the real `dist.all_reduce` (the collective still runs) and counts calls per process group."""

    def __init__(self) -> None:
        self.real = dist.all_reduce
        self.calls: list[object] = []

    def __call__(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.calls.append(group)
        return self.real(tensor, op=op, group=group, async_op=async_op)

    def count(self, group) -> int:
        return sum(g is group for g in self.calls)


def _check_collective_count(cfg, agg, sl, y, old, ro, adv, mask, cp_group, dp_group, cp, dp, tag) -> None:
    """Per call: ONE all_reduce over CP for all sequence sums, plus one SUM and one MAX per group for the batch
    statistics, plus two small SUMs per group for the exact weight quantiles when there are IS weights; the loss
    adds none (it uses the correction's global counts)."""
    counter = CountingAllReduce()
    dist.all_reduce = counter
    quantile_rounds = 2 if cfg.use_tis else 0
    try:
        if cfg.computes_metrics:
            compute_rollout_correction(sl(old), sl(ro), sl(mask), cfg, cp_group=cp_group, dp_group=dp_group)
            assert counter.count(cp_group) == (3 + quantile_rounds if cp > 1 else 0), tag
            assert counter.count(dp_group) == (2 + quantile_rounds if dp > 1 else 0), tag
            assert len(counter.calls) == (3 + quantile_rounds if cp > 1 else 0) + (
                2 + quantile_rounds if dp > 1 else 0), tag
            counter.calls.clear()
            compute_policy_loss(sl(y), sl(old), sl(ro), sl(adv), sl(mask), cfg, cp_group=cp_group, dp_group=dp_group)
            assert counter.count(cp_group) == (3 + quantile_rounds + cfg.use_opsm if cp > 1 else 0), tag
            assert counter.count(dp_group) == (2 + quantile_rounds if dp > 1 else 0), tag
        else:  # no correction: per-sequence counts (seq-mean-*) over CP, then the global denominator
            compute_policy_loss(sl(y), sl(old), sl(ro), sl(adv), sl(mask), cfg, cp_group=cp_group, dp_group=dp_group)
            seq_level = agg != "token-mean"
            assert counter.count(cp_group) == ((1 + seq_level + cfg.use_opsm) if cp > 1 else 0), tag
            assert counter.count(dp_group) == (1 if dp > 1 else 0), tag
    finally:
        dist.all_reduce = counter.real


def _worker(rank: int) -> None:
    lp, old, ro, adv, mask = _data()
    for dp, cp in LAYOUTS:
        n = dp * cp
        members = dist.new_group(list(range(n))) if n < WORLD else dist.group.WORLD
        cp_groups = [dist.new_group([d * cp + c for c in range(cp)]) for d in range(dp)]
        dp_groups = [dist.new_group([d * cp + c for d in range(dp)]) for c in range(cp)]
        if rank >= n:
            continue
        d, c = divmod(rank, cp)
        rows = slice(d * B // dp, (d + 1) * B // dp)
        cols = zigzag_index(c, cp)
        for cfg, agg in CASES:
            cfg = cfg.replace(loss_agg_mode=agg)
            checking(f"dp={dp} cp={cp} {cfg.rollout_correction_preset} {agg}")
            x = lp.clone().requires_grad_()
            ref = compute_policy_loss(x, old, ro, adv, mask, cfg)
            ref.loss.backward()
            y = lp.clone().requires_grad_()
            sl = lambda t, rows=rows, cols=cols: t[rows][:, cols]  # noqa: E731
            out = compute_policy_loss(
                sl(y), sl(old), sl(ro), sl(adv), sl(mask), cfg, cp_group=cp_groups[d], dp_group=dp_groups[c]
            )
            out.loss.backward()
            grad = y.grad.clone()
            total = out.loss.detach().clone()
            dist.all_reduce(grad, group=members)
            dist.all_reduce(total, group=members)
            tag = f"dp={dp} cp={cp} {cfg.rollout_correction_preset} {agg}"
            torch.testing.assert_close(total, ref.loss.detach(), rtol=1e-10, atol=1e-12, msg=tag)
            torch.testing.assert_close(grad, x.grad, rtol=1e-10, atol=1e-12, msg=tag)
            if cfg.use_opsm:  # the tokens OPSM removed, summed over the ranks: the single rank's
                removed = out.metrics[OPSM_COUNT].clone()
                dist.all_reduce(removed, group=members)
                assert removed.item() == ref.metrics[OPSM_COUNT].item() > 0, tag
            rc, lc = ref.correction, out.correction
            if rc is not None:
                assert torch.equal(lc.loss_mask, sl(rc.loss_mask)), tag
                assert torch.equal(lc.denominator_mask, sl(rc.denominator_mask)), tag
                if rc.weights is not None:
                    torch.testing.assert_close(lc.weights, sl(rc.weights), rtol=1e-10, atol=1e-12, msg=tag)
                got, want = metrics_to_host(lc.metrics), metrics_to_host(rc.metrics)
                assert set(got) == set(want), tag
                for k, v in want.items():
                    assert abs(got[k] - v) <= 1e-9 * max(1.0, abs(v)), f"{tag} {k}: {got[k]} != {v}"
            _check_collective_count(cfg, agg, sl, lp, old, ro, adv, mask, cp_groups[d], dp_groups[c], cp, dp, tag)
        _check_quantiles(rows, c, cp, cp_groups[d], dp_groups[c], f"dp={dp} cp={cp}")


def _check_quantiles(rows: slice, cp_rank: int, cp: int, cp_group, dp_group, tag: str) -> None:
    """Weight quantiles over DP x CP without a gather: exact (the sorted full-batch weights) at narrow and wide
    spreads, at token and sequence level."""
    s = 256
    cols = zigzag_index(cp_rank, cp, s)
    for spread in (1e-6, 1e-4, 1.0):
        g = torch.Generator().manual_seed(5)
        lp_r = -torch.rand(B, s, generator=g, dtype=torch.float64)  # float64: CP's partial sums round alike
        lp_t = lp_r + spread * torch.randn(B, s, generator=g, dtype=torch.float64)
        mask = torch.rand(B, s, generator=g) > 0.3
        for level in ("token", "sequence"):
            checking(f"{tag} quantiles: spread={spread} {level} level")
            cfg = C(use_tis=True, tis_level=level, tis_upper_bound=1e6)
            full = compute_rollout_correction(lp_t, lp_r, mask, cfg)
            local = compute_rollout_correction(lp_t[rows][:, cols], lp_r[rows][:, cols], mask[rows][:, cols], cfg,
                                               cp_group=cp_group, dp_group=dp_group)
            got, want = metrics_to_host(local.metrics), metrics_to_host(full.metrics)
            w = full.weights[mask] if level == "token" else full.weights.amax(-1)[mask.any(-1)]
            v = w.float().sort().values
            for name, q in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
                exact = v[max(math.ceil(q * v.numel() - 1e-9), 1) - 1].item()
                assert got[f"mis_weight_{name}"] == want[f"mis_weight_{name}"] == pytest.approx(exact, rel=1e-7), (
                    tag, spread, level, name, got[f"mis_weight_{name}"], want[f"mis_weight_{name}"], exact)


def test_dp_cp_sharding_matches_single_rank():
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    spawn_group(_worker, WORLD)
