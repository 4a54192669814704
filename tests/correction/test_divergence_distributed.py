"""Divergence rejection, budgeted bounds and GSPO split over CP (zig-zag) and DP ranks (gloo, one spawn) equal the
single-rank result: loss, gradient, masks, weights, metrics, with padded rows and with packed rows (each DP rank's
sequences in one row, padded per sequence to 2·CP and split by Megatron's per-sample THD partition). A fixed
divergence bound adds no collective (its sequence decisions ride in the one per-sequence CP all_reduce); a budget
adds one SUM per group; GSPO's sequence mean adds one CP all_reduce to the loss.

Budgets per optimizer step (`StepBounds`): the whole batch as one step of micro-batches of uneven sizes (one holds
only an empty sequence) spread over the DP ranks: every micro-batch decides with the bound of the whole step, as the
single-rank full batch does, with one SUM per group for the step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import StepBounds, compute_rollout_correction, merge_stats, metrics_to_host
from slime_corr.correction.core import correction_metrics
from slime_corr.layout.segments import Segments
from slime_corr.losses import compute_policy_loss
from tests.correction.test_distributed import CountingAllReduce, zigzag_index
from tests.mcore.mcore_helpers import checking, spawn_group
from tests.synthetic import policy_batch

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
    (C(rs_metric="binary_kl", rs_agg="mean", rs_divergence_bound=0.01, use_tis=True), "seq-mean-token-mean", 0, 0),
    (C(rs_metric="binary_kl", rs_agg="token", rs_divergence_bound=0.005), "token-mean", 0, 0),
    (C.preset("decoupled_token_is", policy_ratio_level="sequence", eps_clip=0.05), "seq-mean-token-mean", 0, 1),
    (C(policy_ratio_level="sequence", eps_clip=0.05, use_rollout_logprobs=True, rs_metric="k3", rs_agg="max",
       rs_divergence_bound=0.05), "token-mean", 0, 1),
)


def _data():
    lp, old, ro, adv, mask = policy_batch(3, B, S, rollout_noise=0.25, row_scale=torch.linspace(0.1, 1.5, B)[:, None],
                                          policy_noise=0.05, lengths=LENGTHS)
    ro[1, 2] = float("nan")  # non-finite sequence
    mask[6, ::3] = False
    return lp, old, ro, adv, mask


LENGTHS = (16, 3, 0, 9, 1, 12, 16, 5)  # the rows' sequence lengths (`_data`'s mask, holes aside)
SPAN = 4  # packed: each sequence padded to a multiple of 2·CP (CP ≤ 2)


def packed_slicer(rows: slice, cp_rank: int, cp: int):
    """(slice, Segments) of this rank's packed row: `slice(t)` packs the [B, S] tensor's `rows` (each row's
    LENGTHS positions, padded to a multiple of SPAN) into one row and keeps this CP rank's THD partition: chunks
    cp_rank and 2·CP−1−cp_rank of each sequence's span. Differentiable (indexing)."""
    lengths = LENGTHS[rows]
    spans = [max(SPAN, -(-n // SPAN) * SPAN) for n in lengths]
    src, filled, local, start = [], [], [], 0
    for i, (n, p) in enumerate(zip(lengths, spans, strict=True)):
        src += [i * S + min(t, S - 1) for t in range(p)]
        filled += [t < n for t in range(p)]
        chunk = p // (2 * cp)
        for k in (cp_rank, 2 * cp - 1 - cp_rank):
            local += list(range(start + k * chunk, start + (k + 1) * chunk))
        start += p
    src, filled, local = torch.tensor(src), torch.tensor(filled), torch.tensor(local)
    offsets = torch.tensor([0, *torch.tensor(spans).cumsum(0).tolist()]) // cp

    def sl(t):
        flat = t[rows].reshape(-1)[src]
        return torch.where(filled, flat, torch.zeros_like(flat))[local].unsqueeze(0)

    return sl, Segments.packed_row(offsets, len(local))


def _worker(rank: int) -> None:
    lp, old, ro, adv, mask = _data()
    for dp, cp in LAYOUTS:
        cp_groups = [dist.new_group([d * cp + c for c in range(cp)]) for d in range(dp)]
        dp_groups = [dist.new_group([d * cp + c for d in range(dp)]) for c in range(cp)]
        d, c = divmod(rank, cp)
        cp_group, dp_group = cp_groups[d], dp_groups[c]
        rows = slice(d * B // dp, (d + 1) * B // dp)
        cols = zigzag_index(c, cp, S)
        padded = (lambda t, rows=rows, cols=cols: t[rows][:, cols]), None  # noqa: E731
        for (sl, seg), cfg, agg, extra, loss_extra in [(layout, *case) for layout in (padded, packed_slicer(
                rows, c, cp)) for case in CASES]:
            cfg = cfg.replace(loss_agg_mode=agg)
            tag = f"dp={dp} cp={cp} {'packed' if seg else 'padded'} {agg} {cfg.describe()}"
            checking(tag)
            x = lp.clone().requires_grad_()
            ref = compute_policy_loss(x, old, ro, adv, mask, cfg)
            ref.loss.backward()
            y = lp.clone().requires_grad_()
            counter = CountingAllReduce()
            dist.all_reduce = counter
            try:
                out = compute_policy_loss(sl(y), sl(old), sl(ro), sl(adv), sl(mask), cfg, cp_group=cp_group,
                                          dp_group=dp_group, segments=seg)
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
            if cfg.rs_divergence_budget is not None or cfg.tis_ess_target is not None:
                _check_step_bounds(cfg, sl, seg, rows, old, ro, mask, cp_group, dp_group, tag)
        # the correction alone: a fixed divergence bound adds no collective to the correction
        base_cfg = C(use_tis=True)
        for cfg in (base_cfg, base_cfg.replace(rs_metric="k3", rs_agg="max", rs_divergence_bound=0.1)):
            checking(f"dp={dp} cp={cp} the correction alone: {cfg.describe()}")
            counter = CountingAllReduce()
            dist.all_reduce = counter
            try:
                compute_rollout_correction(sl(old), sl(ro), sl(mask), cfg, cp_group=cp_group, dp_group=dp_group)
            finally:
                dist.all_reduce = counter.real
            assert len(counter.calls) == (5 if cp > 1 else 4), (dp, cp, len(counter.calls))


def _check_step_bounds(cfg, sl, seg, rows, old, ro, mask, cp_group, dp_group, tag) -> None:
    """The whole batch as ONE step of micro-batches (each DP rank's rows split 2 + 1 + rest: the middle one holds a
    single sequence, empty on rank 0 under DP=2): each micro-batch with the step's bounds equals the full batch's
    rows, the step's merged metrics equal the full batch's, one SUM per group gives the step."""
    ref = compute_rollout_correction(old, ro, mask, cfg)
    lo, hi = rows.start, rows.stop
    parts = [slice(lo, lo + 2), slice(lo + 2, lo + 3), slice(lo + 3, hi)]
    if seg is None:
        mbs = [(lambda t, r=r: sl(t)[r.start - lo:r.stop - lo], None) for r in parts]
    else:
        mbs = [packed_slicer(r, dist.get_rank(cp_group) if cp_group else 0, dist.get_world_size(cp_group)
                             if cp_group else 1) for r in parts]

    def run(step):
        return [compute_rollout_correction(f(old), f(ro), f(mask), cfg, cp_group=cp_group, dp_group=dp_group,
                                           segments=s, step_bounds=step) for f, s in mbs]

    bounds = StepBounds()
    run(bounds)  # the collecting pass
    counter = CountingAllReduce()
    dist.all_reduce = counter
    try:
        bounds.finish([g for g in (cp_group, dp_group) if dist.get_world_size(g) > 1])
    finally:
        dist.all_reduce = counter.real
    assert len(counter.calls) == 1, tag  # (one of the two groups is trivial in these layouts)
    outs = run(bounds)
    for (f, _), out in zip(mbs, outs, strict=True):
        assert torch.equal(out.loss_mask, f(ref.loss_mask)), tag
        if ref.weights is not None:
            torch.testing.assert_close(out.weights, f(ref.weights), rtol=1e-10, atol=1e-12, msg=tag)
    got = metrics_to_host(correction_metrics(merge_stats([o.stats for o in outs]), cfg))
    want = metrics_to_host(ref.metrics)
    for k in ("mis_rs_divergence_bound", "mis_tis_ess_bound", "mis_rejected_token_fraction", "mis_ess"):
        if k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-9), f"{tag} step {k}: {got[k]} != {want[k]}"
    per_mb = [metrics_to_host(o.metrics) for o in run(None)]  # each micro-batch's own bound: not the step's
    key = "mis_rs_divergence_bound" if cfg.rs_divergence_budget is not None else "mis_tis_ess_bound"
    assert any(m[key] != want[key] for m in per_mb if m["mis_valid_token_count"] > 0), tag


def test_divergence_budgets_and_gspo_over_cp_and_dp():
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    spawn_group(_worker, WORLD)
