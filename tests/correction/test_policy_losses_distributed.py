"""The peers' losses and masks over DP and zig-zag CP ranks (gloo, one spawn) equal the single-rank result: summed
losses and gradients, and the tokens each mask took. GMPO's sequence ratio, NeMo-RL's sequence error and M2PO's cut
are whole-micro-batch quantities over CP (M2PO's also per DP rank's micro-batch, as AReaL's: checked on CP layouts
only); Clip-Cov and KL-Cov, per rank by design, refuse CP (tests/correction/test_policy_losses.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.losses import M2PO_COUNT, SEQ_ERROR_COUNT, compute_policy_loss
from tests.correction.test_distributed import zigzag_index
from tests.mcore.mcore_helpers import checking, spawn_group
from tests.synthetic import UNEVEN_LENGTHS, policy_batch

WORLD = 4
B, S = 8, 16
LAYOUTS = ((2, 1), (1, 2), (2, 2), (1, 4))  # (dp, cp)
CASES = (
    (C(loss_type="cispo", eps_clip_high=0.28, use_tis=True, tis_upper_bound=1.3), "token-mean"),
    (C(loss_type="sapo", tau_neg=1.2), "seq-mean-token-mean"),
    (C(loss_type="geo_mean", eps_clip=0.4, use_tis=True, tis_level="geometric", tis_upper_bound=1.2), "seq-mean-token-mean"),
    (C(loss_type="geo_mean", eps_clip=0.1), "seq-mean-token-sum-norm"),
    (C(loss_type="dppo_tv", eps_clip=0.1, use_rs=True, rs_level="token", rs_upper_bound=1.4), "seq-mean-token-sum"),
    (C(loss_type="dppo_kl", eps_clip=0.02, use_opsm=True, opsm_delta=0.0), "token-mean"),
    (C(seq_logprob_error_threshold=1.15, use_tis=True), "seq-mean-token-mean"),
    (C(loss_type="cispo", seq_logprob_error_threshold=1.2), "token-mean"),
    (C(m2_threshold=0.02, use_tis=True), "token-mean"),  # M2PO: CP layouts only (per DP rank, as AReaL's)
    (C(loss_type="geo_mean", m2_threshold=0.01, seq_logprob_error_threshold=1.2), "seq-mean-token-mean"),
)


def _data():
    lp, old, ro, adv, mask = policy_batch(0, B, S, rollout_noise=0.15, policy_noise=0.2, sequence_advantages=True,
                                          lengths=UNEVEN_LENGTHS)
    ro[3, 1] += 2.0  # one token far off
    mask[6, ::3] = False
    return lp, old, ro, adv[:, None].expand(B, S).contiguous(), mask


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
        cols = zigzag_index(c, cp, S)
        for cfg, agg in CASES:
            if cfg.m2_threshold is not None and dp > 1:
                continue
            cfg = cfg.replace(loss_agg_mode=agg)
            tag = f"dp={dp} cp={cp} {cfg.loss_type} {agg}"
            checking(tag)
            x = lp.clone().requires_grad_()
            ref = compute_policy_loss(x, old, ro, adv, mask, cfg)
            ref.loss.backward()
            y = lp.clone().requires_grad_()

            def sl(t, rows=rows, cols=cols):
                return t[rows][:, cols]

            out = compute_policy_loss(sl(y), sl(old), sl(ro), sl(adv), sl(mask), cfg, cp_group=cp_groups[d],
                                      dp_group=dp_groups[c])
            out.loss.backward()
            grad, total = y.grad.clone(), out.loss.detach().clone()
            dist.all_reduce(grad, group=members)
            dist.all_reduce(total, group=members)
            torch.testing.assert_close(total, ref.loss.detach(), rtol=1e-10, atol=1e-12, msg=tag)
            torch.testing.assert_close(grad, x.grad, rtol=1e-10, atol=1e-12, msg=tag)
            for key in (M2PO_COUNT, SEQ_ERROR_COUNT):
                if key in ref.metrics:
                    removed = out.metrics[key].clone()
                    dist.all_reduce(removed, group=members)
                    assert removed.item() == ref.metrics[key].item() > 0, (tag, key)


def test_dp_cp_sharding_matches_single_rank():
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    spawn_group(_worker, WORLD)
