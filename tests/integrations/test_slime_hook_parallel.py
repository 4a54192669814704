"""The slime hook under real gloo process groups, called as slime calls it under CP: per-sample lists of this CP
rank's parts (slime's layout, re-derived in `slime_reference.cp_slice`), whole loss masks, groups from Megatron's
parallel_state. One spawn of 4 processes, layouts (CP, DP) = (2, 2) and (4, 1).

Checked per layout and case: the whole modified masks equal slime's mis.py on whole sequences; this rank's
weighted pg_loss equals the reference's slice; slime's CP reduction of the loss (local sums, summed over the CP
ranks) equals the whole-sequence reduction; batch normalization is over every DP rank's micro-batch (the reference
normalizes their union); the metrics are the single-rank correction of the whole batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.integrations.slime_reference import (
    cp_slice,
    icepop_reference,
    make_batch,
    mis_reference,
    slime_args,
    sum_of_sample_mean,
)
from tests.mcore.mcore_helpers import checking, init_layout, spawn

N = 8
LAYOUTS = ((2, 2), (4, 1))


def _cases():
    seq_rs = dict(use_tis=True, tis_mode="truncate", tis_level="sequence", tis_upper_bound=3.0,
                  tis_lower_bound=None, use_rs=True, rs_level="token", rs_lower_bound=0.5, rs_upper_bound=2.0,
                  rs_veto_threshold=1e-4, tis_batch_normalize=False)
    token_bn = dict(use_tis=True, tis_mode="clip", tis_level="token", tis_upper_bound=2.0, tis_lower_bound=0.5,
                    use_rs=False, rs_level="token", rs_lower_bound=None, rs_upper_bound=None, rs_veto_threshold=None,
                    tis_batch_normalize=True)
    geo = dict(use_tis=True, tis_mode="mask", tis_level="geometric", tis_upper_bound=1.05, tis_lower_bound=0.95,
               use_rs=True, rs_level="geometric", rs_lower_bound=None, rs_upper_bound=None, rs_veto_threshold=None,
               tis_batch_normalize=False)
    return {"seq_is_token_rs_veto": seq_rs, "token_clip_batch_norm": token_bn, "geo_mask_geo_rs": geo}


def _worker(rank: int, world: int) -> None:
    from megatron.core import parallel_state as ps

    from slime_corr.config import RolloutCorrectionConfig
    from slime_corr.correction import compute_rollout_correction
    from slime_corr.integrations.slime import compute_mis_weights_with_cp, icepop_function

    train, rollout, masks, pg, totals, resp = make_batch(seed=4, n=N, extreme=True)
    for cp, dp in LAYOUTS:
        init_layout(tp=1, cp=cp)
        cp_rank, dp_rank = ps.get_context_parallel_rank(), ps.get_data_parallel_rank()
        assert ps.get_data_parallel_world_size() == dp
        mine = list(range(dp_rank, N, dp))

        def local(xs, mine=mine, cp_rank=cp_rank, cp=cp):
            """This CP rank's parts of this DP rank's samples (`xs`: all N samples, or one per sample of mine)."""
            own = xs if len(xs) == len(mine) else [xs[i] for i in mine]
            return [cp_slice(x, totals[i], resp[i], cp_rank, cp) for x, i in zip(own, mine, strict=True)]

        for name, kw in _cases().items():
            args = slime_args(**kw)
            checking(f"cp={cp} dp={dp} {name}")
            kwargs = dict(args=args, pg_loss=torch.cat(local(pg)), train_log_probs=local(train),
                          rollout_log_probs=local(rollout), loss_masks=[masks[i] for i in mine],
                          total_lengths=[totals[i] for i in mine], response_lengths=[resp[i] for i in mine])
            pg_loss, mods, metrics = compute_mis_weights_with_cp(**kwargs)
            tag = f"{name} cp={cp} dp={dp} rank={rank}"
            # the reference: whole sequences; batch normalization over every DP rank's samples
            pool = list(range(N)) if kw["tis_batch_normalize"] else mine
            w_all, m_all = mis_reference(args, [train[i] for i in pool], [rollout[i] for i in pool],
                                         [masks[i] for i in pool])
            w_ref = [w_all[pool.index(i)] for i in mine]
            m_ref = [m_all[pool.index(i)] for i in mine]
            for got, want in zip(mods, m_ref, strict=True):
                assert torch.equal(got.double(), want), tag
            local_mod = torch.cat(local(m_ref))
            want_pg = torch.cat(local(pg)) * torch.cat(local(w_ref)) * local_mod
            torch.testing.assert_close(pg_loss * local_mod, want_pg, atol=1e-12, rtol=1e-9, msg=tag)
            # slime's CP reduction: per sample Σ over this rank's part / whole-sample denominator, summed over CP
            loss = torch.zeros((), dtype=torch.float64)
            start = 0
            for k, i in enumerate(mine):
                n_loc = kwargs["train_log_probs"][k].numel()
                loss += (pg_loss[start:start + n_loc] * local_mod[start:start + n_loc]).sum() / masks[i].sum()
                start += n_loc
            if cp > 1:
                dist.all_reduce(loss, group=ps.get_context_parallel_group())
            want_loss = sum_of_sample_mean(torch.cat([pg[i] * w for i, w in zip(mine, w_ref, strict=True)]) *
                                           torch.cat(m_ref), [masks[i] for i in mine])
            assert float(loss) == pytest.approx(float(want_loss), rel=1e-9, abs=1e-12), tag
            # metrics: the single-rank correction of the whole batch (every DP and CP rank logs the same value)
            width = max(resp)
            lp, ro, mk = (torch.stack([torch.nn.functional.pad(x, (0, width - x.numel())) for x in xs])
                          for xs in (train, rollout, masks))
            single = compute_rollout_correction(lp, ro, mk > 0, RolloutCorrectionConfig(get_mismatch_metrics=True))
            for key in ("mismatch_k3_kl", "mismatch_training_ppl", "mismatch_chi2_seq"):
                assert float(metrics[key][0]) == pytest.approx(float(single.metrics[key]), rel=1e-9), (tag, key)
            assert float(metrics["mis_valid_seq_count"][0]) == N, tag
            if kw["tis_batch_normalize"]:
                ratio = float(metrics["mis_ratio_mean_after_mis"][0])
                assert ratio == pytest.approx(1.0, rel=1e-9), tag
        # icepop: per-token, no collective needed for the weights
        args = slime_args(use_tis=True, tis_clip=1.4, tis_clip_low=0.6)
        pg_loss, mods, metrics = icepop_function(
            args, pg_loss=torch.cat(local(pg)), train_log_probs=local(train), rollout_log_probs=local(rollout),
            loss_masks=[masks[i] for i in mine], total_lengths=[totals[i] for i in mine],
            response_lengths=[resp[i] for i in mine])
        w, tis, clipfrac, _ = icepop_reference(args, local(train), local(rollout))
        m_loc = torch.cat(local(masks))
        torch.testing.assert_close(pg_loss * m_loc, torch.cat(local(pg)) * w * m_loc, atol=1e-12, rtol=1e-9)
        torch.testing.assert_close(metrics["tis_clipfrac"].double(), clipfrac, atol=0, rtol=0)


def test_slime_hook_under_cp_and_dp():
    spawn(_worker, 4)
