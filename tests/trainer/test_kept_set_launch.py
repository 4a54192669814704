"""`python -m slime_corr.main --rollout-top-p 0.9 --rollout-return-sampling-mask` on the embedded engine (fp32 engine,
fp64 trainer, decoupled seq-IS + RS with a KL and an entropy term): the engine's kept sets travel with the samples
and every step replays them: the engine's mass is known at every token (engine share 1), the corrected ratio has
mean 1, the trainer's kept-set log-probs equal the engine's support log-probs to float32 rounding, few sampled tokens
lie outside the trainer's own nucleus, and the kept-set sizes are logged; TP=2 (vocabulary split) and CP=2 with
packed micro-batches log the one-process run's metrics. Three launches, ~2-4 minutes here."""

from __future__ import annotations

import math

import pytest

from tests.trainer.test_trainer_launch import assert_same_metrics, launch

pytestmark = pytest.mark.cost(40)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

FLAGS = ("--rollout-top-p", "0.9", "--rollout-return-sampling-mask")
KEPT = ("rollout_corr/mismatch_kept_trainer_log_mass", "rollout_corr/mismatch_kept_outside_trainer_nucleus",
        "rollout_corr/mismatch_kept_abs_log_prob_diff", "rollout/kept_set_size_mean", "rollout/kept_set_size_p50",
        "rollout/kept_set_size_p99", "rollout/kept_set_singleton_share")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("replay"), *FLAGS)


def test_a_replay_run_logs_the_kept_set_metrics(one_process):
    steps = one_process["steps"]
    assert sorted(steps) == [1, 2, 3, 4]
    for step, record in steps.items():
        assert all(k in record and math.isfinite(record[k]) for k in KEPT), (step, sorted(record))
        assert record["rollout_corr/mismatch_nucleus_engine_share"] == 1.0  # the engine's mass at every token
        assert record["rollout_corr/mismatch_nucleus_disagreement"] == 0.0  # the sampled token is in its set
        assert record["rollout_corr/mismatch_kept_abs_log_prob_diff"] < 1e-5, record  # fp32 engine, fp64 trainer
        assert record["rollout_corr/mismatch_kept_outside_trainer_nucleus"] < 0.02, record
        assert -0.3 < record["rollout_corr/mismatch_kept_trainer_log_mass"] < -0.02, record
        assert abs(record["rollout_corr/mismatch_nucleus_ratio_mean"] - 1) < 1e-4, record
        assert record["train/pg_nonfinite_token_count"] == 0
        # the tiny model's flat distributions: top-p 0.9 keeps most of its 256 tokens
        assert 1 <= record["rollout/kept_set_size_p50"] <= record["rollout/kept_set_size_p99"] <= 256
    assert "nan" not in one_process["out"]


@pytest.mark.parametrize("layout", ["tp2", "cp2_packed"])
def test_tp2_and_cp2_packed_log_the_one_process_metrics(one_process, tmp_path, layout):
    flags = {"tp2": ["--tensor-model-parallel-size", "2"],
             "cp2_packed": ["--context-parallel-size", "2", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "80"]}
    run = launch(tmp_path / layout, *FLAGS, *flags[layout], nproc=2)
    assert_same_metrics(run["steps"], one_process["steps"], layout)


def test_the_flag_reaches_the_config_and_the_engine_params():
    from slime_corr.main import parse_run_config

    def trainer(*argv: str):
        return parse_run_config([*argv, "--rollout-engine", "embedded"], check_urls=False).trainer

    cfg = trainer("--rollout-top-p", "0.9", "--rollout-return-sampling-mask")
    assert cfg.rollout_return_sampling_mask and cfg.replays_kept_sets and cfg.rollout_top_k == -1
    assert cfg.truncation.sampling_params() == {"top_p": 0.9, "top_k": 4096}  # SGLang's mask needs a finite top_k
    assert trainer("--rollout-top-k", "20", "--rollout-return-sampling-mask").truncation.top_k == 20
    off = trainer("--rollout-return-sampling-mask")  # nothing truncated: nothing to replay
    assert not off.replays_kept_sets and not off.truncation.active
    assert not trainer("--rollout-top-p", "0.9").replays_kept_sets
