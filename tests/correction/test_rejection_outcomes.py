"""Reward-aware rejection diagnostics (`correction.rejection_outcomes`) against a plain per-sequence loop, for padded
and packed rows, with empty sequences, per-token advantages, zero advantages and an all-rejected batch; and split
over DP×CP (gloo, one spawn) the pairs summed over the ranks equal the single-rank ones."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import compute_rollout_correction
from slime_corr.correction.rejection_outcomes import REJECTION_OUTCOME_METRICS, rejection_outcome_pairs
from tests.correction.test_distributed import zigzag_index
from tests.correction.test_divergence_distributed import LENGTHS, packed_slicer
from tests.mcore.mcore_helpers import spawn_group
from tests.synthetic import response_mask

B, S = 8, 16
CONFIG = C(use_tis=True, use_rs=True, rs_level="sequence", rs_upper_bound=1.3, rs_veto_threshold=0.05)


def _data():
    g = torch.Generator().manual_seed(11)
    old = -torch.rand(B, S, generator=g, dtype=torch.float64) * 2
    ro = old + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64) * torch.linspace(0.05, 1.0, B)[:, None]
    mask = response_mask(LENGTHS, S)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, S).clone()
    adv[4] = 0.0  # a GRPO group whose rewards were all equal
    adv[5, ::2] = -adv[5, ::2].abs() - 1  # per-token advantages: the sequence's sign is that of their sum
    rewards = torch.rand(B, generator=g, dtype=torch.float64)
    return old, ro, mask, adv, rewards


def reference(valid: torch.Tensor, kept: torch.Tensor, adv: torch.Tensor, rewards: torch.Tensor) -> dict[str, float]:
    """The metrics by a loop over sequences and tokens."""
    rej = pos = neg = 0
    r_rej = r_kept = n_kept = 0.0
    tok = {"pos": [0, 0], "neg": [0, 0]}
    for i in range(valid.shape[0]):
        v, k = valid[i].bool(), kept[i].bool() & valid[i].bool()
        a = float(adv[i][v].sum())
        if v.any() and not k.any():
            rej += 1
            pos += a > 0
            neg += a < 0
            r_rej += float(rewards[i])
        elif k.any():
            n_kept += 1
            r_kept += float(rewards[i])
        for t in range(valid.shape[1]):
            if v[t] and adv[i, t] != 0:
                side = tok["pos" if adv[i, t] > 0 else "neg"]
                side[1] += 1
                side[0] += not k[t]
    ratio = lambda n, d: n / d if d else 0.0  # noqa: E731
    return {"mis_rejected_seq_pos_adv_fraction": ratio(pos, rej), "mis_rejected_seq_neg_adv_fraction": ratio(neg, rej),
            "mis_rejected_seq_reward_mean": ratio(r_rej, rej), "mis_kept_seq_reward_mean": ratio(r_kept, n_kept),
            "mis_rejected_pos_adv_token_fraction": ratio(*tok["pos"]),
            "mis_rejected_neg_adv_token_fraction": ratio(*tok["neg"])}


def _values(pairs: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float(v[0] / v[1]) for k, v in pairs.items()}


def test_pairs_equal_a_per_sequence_loop() -> None:
    old, ro, mask, adv, rewards = _data()
    kept = compute_rollout_correction(old, ro, mask, CONFIG).loss_mask
    want = reference(mask, kept, adv, rewards)
    assert 0 < want["mis_rejected_pos_adv_token_fraction"] < 1  # the data rejects some of each kind, not all
    assert 0 < want["mis_rejected_seq_pos_adv_fraction"] < 1
    got = _values(rejection_outcome_pairs(mask, kept, adv, rewards))
    assert set(got) == set(REJECTION_OUTCOME_METRICS)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key
    assert "mis_rejected_seq_reward_mean" not in rejection_outcome_pairs(mask, kept, adv, None)
    sl, seg = packed_slicer(slice(0, B), 0, 1)  # packed: one row, the same sequences
    packed = _values(rejection_outcome_pairs(sl(mask), sl(kept), sl(adv), rewards, seg))
    assert packed == pytest.approx(got, abs=1e-12)


def test_all_rejected_and_nothing_valid() -> None:
    old, ro, mask, adv, rewards = _data()
    none_kept = torch.zeros_like(mask, dtype=torch.float32)
    got = _values(rejection_outcome_pairs(mask, none_kept, adv, rewards))
    assert got == pytest.approx(reference(mask, none_kept, adv, rewards), abs=1e-12)
    assert got["mis_rejected_pos_adv_token_fraction"] == 1.0 and got["mis_kept_seq_reward_mean"] == 0.0
    empty = _values(rejection_outcome_pairs(torch.zeros_like(mask), none_kept, adv, rewards))
    assert all(v == 0.0 for v in empty.values())  # 0 / (clamped) 0: no NaN


def _worker(rank: int, out: dict) -> None:
    old, ro, mask, adv, rewards = _data()
    kept = compute_rollout_correction(old, ro, mask, CONFIG).loss_mask
    for dp, cp in ((1, 2), (2, 1)):
        cp_groups = [dist.new_group([d * cp + c for c in range(cp)]) for d in range(dp)]
        d, c = divmod(rank, cp)
        rows = slice(d * B // dp, (d + 1) * B // dp)
        cols = zigzag_index(c, cp, S)
        padded = (lambda t, rows=rows, cols=cols: t[rows][:, cols]), None  # noqa: E731
        for name, (sl, seg) in (("padded", padded), ("packed", packed_slicer(rows, c, cp))):
            pairs = rejection_outcome_pairs(sl(mask), sl(kept), sl(adv), rewards[rows], seg, cp_groups[d])
            total = torch.stack([pairs[k] for k in REJECTION_OUTCOME_METRICS])
            total[:, 1] = torch.where(total[:, 1] < 1e-20, 0.0, total[:, 1])  # the clamp, undone before the sum
            dist.all_reduce(total)
            got = {k: float(n / d) if d else 0.0 for k, (n, d) in zip(REJECTION_OUTCOME_METRICS, total, strict=True)}
            want = reference(mask, kept, adv, rewards)
            assert got == pytest.approx(want, abs=1e-12), (dp, cp, name, got, want)
    out[rank] = True


def test_pairs_summed_over_dp_and_cp_equal_one_rank() -> None:
    out = mp.Manager().dict()
    spawn_group(_worker, 2, out)
    assert dict(out) == {0: True, 1: True}
