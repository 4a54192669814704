"""Off-policy sequence masking (`slime_corr.opsm`, `--use-opsm --opsm-delta`): the mask against a per-sequence loop
written from the formula (uneven masks, an empty sequence, a non-finite log-prob, per-token and per-sequence
advantages), packed rows against padded ones, the policy loss against the same loss with those tokens' advantages
zeroed, and the flags. DP x CP exactness is in tests/correction/test_distributed.py."""

from __future__ import annotations

import math

import pytest
import torch

from slime_corr.arguments import add_rollout_correction_args, parse_rollout_correction_config
from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.errors import ConfigError
from slime_corr.layout.segments import Segments
from slime_corr.losses import OPSM_COUNT, compute_policy_loss
from slime_corr.opsm import opsm_masked
from tests.synthetic import response_mask

B, S = 6, 10


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, S, generator=g, dtype=torch.float64) * 2
    lp = old + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)
    lp[3, 1] = float("nan")  # a non-finite current log-prob at a valid token
    adv = torch.randn(B, S, generator=g, dtype=torch.float64)
    lengths = torch.tensor([10, 3, 0, 7, 1, 10])
    mask = response_mask(lengths, S)
    mask[5, ::3] = False
    return lp, old, adv, mask


def _reference(lp, old, adv, mask, delta):
    """The formula, one sequence at a time with Python floats."""
    out = torch.zeros(B, S, dtype=torch.bool)
    for i in range(B):
        terms = [old[i, t].item() - lp[i, t].item() for t in range(S) if mask[i, t]]
        terms = [x for x in terms if math.isfinite(x)]
        kl = sum(terms) / max(len(terms), 1)
        for t in range(S):
            out[i, t] = bool(mask[i, t]) and kl > delta and adv[i, t].item() < 0
    return out


@pytest.mark.parametrize("delta", [0.0, 1e-4, 0.05, 10.0])
def test_the_mask_is_the_formula_per_sequence(delta):
    lp, old, adv, mask = _data()
    got = opsm_masked(lp, old, adv, mask, delta, Segments.rows(B, S))
    want = _reference(lp, old, adv, mask, delta)
    assert torch.equal(got, want)
    if delta == 0.0:
        assert got.any() and not got[2].any()  # the empty sequence is never masked


def test_per_sequence_advantages_and_packed_rows_give_the_padded_mask():
    lp, old, adv, mask = _data(1)
    seq_adv = adv[:, 0].clone()
    rows = Segments.rows(B, S)
    padded = opsm_masked(lp, old, rows.expand(seq_adv).expand(B, S), mask, 0.0, rows)
    assert torch.equal(padded, _reference(lp, old, seq_adv[:, None].expand(B, S), mask, 0.0))
    offsets = torch.arange(0, (B + 1) * S, S)
    packed = opsm_masked(lp.reshape(1, -1), old.reshape(1, -1), rows.expand(seq_adv).expand(B, S).reshape(1, -1),
                         mask.reshape(1, -1), 0.0, Segments.packed_row(offsets, B * S))
    assert torch.equal(packed.reshape(B, S), padded)


@pytest.mark.parametrize("preset, agg", [("decoupled_token_is", "token-mean"), ("pg_is", "seq-mean-token-mean"),
                                         (None, "token-mean")])
def test_the_loss_drops_those_tokens_from_its_numerator_only(preset, agg):
    """OPSM's loss equals the loss with the removed tokens' advantages set to 0 (their PPO/REINFORCE term is 0, the
    denominator keeps them), gradient included."""
    lp, old, adv, mask = _data(2)
    lp = torch.where(torch.isfinite(lp), lp, old)  # the comparison needs every token in the numerator's reach
    ro = old + 0.01
    cfg = (C.preset(preset) if preset else C()).replace(loss_agg_mode=agg)
    anchor = ro if cfg.use_rollout_logprobs else old
    removed = _reference(lp, anchor, adv, mask, 0.02)
    assert removed.any()
    x, y = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    got = compute_policy_loss(x, old, ro, adv, mask, cfg.replace(use_opsm=True, opsm_delta=0.02))
    want = compute_policy_loss(y, old, ro, torch.where(removed, 0.0, adv), mask, cfg)
    got.loss.backward()
    want.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-14)
    assert got.metrics[OPSM_COUNT].item() == removed.sum().item()
    assert OPSM_COUNT not in want.metrics


def test_the_flags_are_slimes_and_a_bad_delta_names_the_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_rollout_correction_args(parser)
    _, cfg = parse_rollout_correction_config(parser, ["--use-opsm", "--opsm-delta", "0.5"])
    assert cfg.use_opsm and cfg.opsm_delta == 0.5
    for bad in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"--opsm-delta=.* must be a finite number >= 0"):
            C(use_opsm=True, opsm_delta=bad)
