"""`python -m slime_corr.main --rollout-top-p 0.9` on the embedded engine (bit-reproducible, honours top_p as SGLang
does): every step logs the nucleus metrics; the engine sampled inside the trainer's nucleus (an engine ignoring top_p
would put ~1 − M ≈ 10% of the tokens outside it); the corrected ratio has mean ≈ 1 where the uncorrected one is off by
1 / M ≈ 1.1; under TP=2 (vocabulary split in two) the run logs the one-process run's metrics. With
`--rollout-nucleus-logprobs 256` (the tiny model's whole vocabulary: its flat distributions need ~200 tokens for 0.9)
the engine's own nucleus renormalizes nearly every token: its mass and the trainer's agree to float32 rounding (fp32
engine, fp64 trainer). Two launches, ~1-2 minutes here."""

from __future__ import annotations

import math

import pytest

from tests.trainer.test_trainer_launch import assert_same_metrics, launch

pytestmark = pytest.mark.cost(15)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

FLAGS = ("--rollout-top-p", "0.9", "--num-steps-per-rollout", "1", "--global-batch-size", "32",
         "--rollout-nucleus-logprobs", "256")


def test_a_top_p_run_logs_the_nucleus_metrics_and_tp2_logs_the_same(tmp_path):
    run = launch(tmp_path / "top_p", *FLAGS)
    assert sorted(run["steps"]) == [1, 2]
    for step, record in run["steps"].items():
        m = {k.split("/", 1)[1]: v for k, v in record.items() if k.startswith("rollout_corr/mismatch_nucleus")}
        assert all(math.isfinite(v) for v in m.values()), (step, m)
        assert 0 <= m["mismatch_nucleus_disagreement"] < 0.02, (step, m)
        assert -0.3 < m["mismatch_nucleus_log_mass"] < -0.02, (step, m)
        assert abs(m["mismatch_nucleus_ratio_mean"] - 1) < 0.01, (step, m)
        assert m["mismatch_nucleus_uncorrected_ratio_mean"] - 1 > 0.03, (step, m)
        assert m["mismatch_nucleus_engine_share"] > 0.9, (step, m)  # the rest: a boundary within rounding of 0.9
        assert abs(m["mismatch_nucleus_mass_log_ratio"]) < 1e-6 and m["mismatch_nucleus_mass_abs_log_ratio"] < 1e-5
        assert record["train/pg_nonfinite_token_count"] == 0  # one step per rollout: π_θ = π_old at its forward
    tp2 = launch(tmp_path / "top_p_tp2", *FLAGS, "--tensor-model-parallel-size", "2", nproc=2)
    assert_same_metrics(tp2["steps"], run["steps"], "top_p tp2")


def test_a_metric_without_tokens_to_measure_is_absent_not_nan(tmp_path):
    """Without the engine's own nucleus (`--rollout-nucleus-logprobs 0`) no token takes the engine path: the mass
    metrics measured there are undefined, so they are absent from metrics.jsonl and the step line (docs/metrics.md),
    never NaN; the metrics measured on every token are there."""
    run = launch(tmp_path / "top_p", "--rollout-top-p", "0.9", "--num-steps-per-rollout", "1", "--global-batch-size",
                 "32", "--rollout-nucleus-logprobs", "0")
    for record in run["steps"].values():
        assert "rollout_corr/mismatch_nucleus_mass_abs_log_ratio" not in record
        assert "rollout_corr/mismatch_nucleus_mass_log_ratio" not in record
        assert record["rollout_corr/mismatch_nucleus_engine_share"] == 0
        assert all(v is not None for v in record.values()), record  # None is how a NaN is written
    assert "nan" not in run["out"], run["out"]
