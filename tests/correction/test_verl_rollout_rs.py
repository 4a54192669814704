"""verl's rejection spelling (`--rollout-rs`, `--rollout-rs-threshold`; slime_corr/verl_rollout_rs.py): the loss mask
of a chain equals verl 0.9.1's own `compute_rollout_rejection_mask` (its real code, from its wheel as
bench/vs_verl.py loads it), single criteria and chains, on uneven masks and an empty sequence; what cannot be
expressed or parsed is refused naming the flag."""

from __future__ import annotations

import argparse

import pytest
import torch

from slime_corr.arguments import add_rollout_correction_args, parse_rollout_correction_config
from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import compute_rollout_correction
from slime_corr.errors import ConfigError
from slime_corr.verl_rollout_rs import rollout_rs_settings
from tests.bench_modules import bench_module
from tests.synthetic import response_mask

B, S = 16, 24
CHAINS = [
    ("token_k1", "1.3"), ("token_k1", "0.7_1.2"), ("seq_sum_k1", "0.5_3.0"), ("seq_mean_k1", "1.05"),
    ("token_k2", "0.02"), ("token_k3", "0.01"), ("seq_sum_k2", "0.05"), ("seq_mean_k3", "0.012"),
    ("seq_max_k2", "0.03"), ("seq_max_k3", "0.02"),
    ("token_k1,seq_max_k2", "0.5_2.0,0.03"), ("seq_mean_k1,token_k3", "1.02,0.01"),
    ("seq_sum_k3,token_k1", "0.04,1.3"), ("seq_mean_k2,seq_sum_k1", "0.012,0.5_3.0"), ("token_k3,token_k1", "1.1"),
]


@pytest.fixture(scope="module")
def verl_rc():
    return bench_module("vs_verl").load_verl().rc  # verl's wheel, downloaded once into bench/.cache/verl


def _data():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(B, S, generator=g, dtype=torch.float64) * 2
    ro = old + 0.15 * torch.randn(B, S, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    lengths[4] = 0  # an empty sequence
    mask = response_mask(lengths, S).to(torch.float64)
    return old, ro, mask


@pytest.mark.parametrize("chain, threshold", CHAINS, ids=[f"{c}={t}" for c, t in CHAINS])
def test_the_mask_is_verls(chain, threshold, verl_rc):
    old, ro, mask = _data()
    want, _ = verl_rc.compute_rollout_rejection_mask(log_ratio=old - ro, response_mask=mask, rollout_rs=chain,
                                                     rollout_rs_threshold=threshold)
    cfg = C(**rollout_rs_settings(chain, threshold))
    got = compute_rollout_correction(old, ro, mask, cfg).loss_mask
    assert torch.equal(got.to(torch.float64), want), (chain, (got - want).abs().sum())
    assert 0 < want.sum() < mask.sum()  # each case rejects something and keeps something


def test_the_flags_set_this_projects_fields():
    parser = add_rollout_correction_args(argparse.ArgumentParser())
    _, cfg = parse_rollout_correction_config(parser, ["--rollout-rs", "token_k1,seq_max_k2",
                                                      "--rollout-rs-threshold", "0.5_2.0,0.03"])
    assert (cfg.use_rs, cfg.rs_level, cfg.rs_lower_bound, cfg.rs_upper_bound) == (True, "token", 0.5, 2.0)
    assert (cfg.rs_metric, cfg.rs_agg, cfg.rs_divergence_bound) == ("k2", "max", 0.03)


BAD = [
    (["--rollout-rs", "token_k4", "--rollout-rs-threshold", "1"], "token_k4 is not one of verl's options"),
    (["--rollout-rs", "token_k1"], "--rollout-rs needs --rollout-rs-threshold"),
    (["--rollout-rs-threshold", "2"], "--rollout-rs-threshold without --rollout-rs"),
    (["--rollout-rs", "token_k1,seq_mean_k1", "--rollout-rs-threshold", "2"], "2 k1 (ratio) options"),
    (["--rollout-rs", "token_k2,seq_max_k3", "--rollout-rs-threshold", "1"], "2 k2/k3 (divergence) options"),
    (["--rollout-rs", "token_k1,token_k2", "--rollout-rs-threshold", "1,2,3"], "3 thresholds for 2 options"),
    (["--rollout-rs", "token_k2", "--rollout-rs-threshold", "0.1_0.2"], "takes one upper bound"),
    (["--rollout-rs", "token_k1", "--rollout-rs-threshold", "2_0.5"], "lower 2.0 > upper 0.5"),
    (["--rollout-rs", "token_k3", "--rollout-rs-threshold", "-1"], "must be a finite number > 0"),
    (["--rollout-rs", "token_k3", "--rollout-rs-threshold", "x"], "'x' (for token_k3) is not a number"),
    (["--rollout-rs", "token_k1", "--rollout-rs-threshold", "2", "--use-rs", "--rs-upper-bound", "3"],
     "sets --rs-upper-bound, --use-rs itself"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_what_cannot_be_expressed_is_refused_naming_the_flag(argv, message, capsys):
    parser = add_rollout_correction_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parse_rollout_correction_config(parser, argv)
    assert message in capsys.readouterr().err


def test_the_pure_translation_refuses_too():
    with pytest.raises(ConfigError, match="no option"):
        rollout_rs_settings(" , ", "1")
