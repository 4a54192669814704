"""The start-up agreement check's bounds and message (slime_corr.trainer.agreement); the main job stopped by it is in
tests/trainer/test_fault_table.py (engine_serves_another_model)."""

from __future__ import annotations

import math

import pytest

from slime_corr.trainer.agreement import (
    METRIC,
    EngineAgreementError,
    agreement_bound,
    check_agreement,
    precision_notice,
)


@pytest.mark.parametrize("engine, trainer, bound", [("float32", "float32", 0.01), ("float64", "float32", 0.01),
                                                     ("bfloat16", "float32", 0.25), ("float32", "bfloat16", 0.25),
                                                     ("float16", "float16", 0.25)])
def test_the_bound_follows_the_lower_precision(engine, trainer, bound):
    assert agreement_bound(engine, trainer) == bound
    check_agreement({METRIC: bound}, engine, trainer, 1)  # at the bound: agrees
    with pytest.raises(EngineAgreementError, match=rf"step 1: .* = {bound * 1.5:.4g} nats, above the {bound:g} that "
                                                   rf"an engine in {engine} and a trainer in {trainer} explain"):
        check_agreement({METRIC: bound * 1.5}, engine, trainer, 1)


def test_what_the_check_catches_and_skips():
    # a tied Qwen3-MoE served with a zero LM head (issue 32's measurement): fp32 on both sides
    with pytest.raises(EngineAgreementError, match="tied embeddings"):
        check_agreement({METRIC: 0.13}, "float32", "float32", 7)
    with pytest.raises(EngineAgreementError, match="= nan nats"):
        check_agreement({METRIC: math.nan}, "bfloat16", "float32", 1)
    check_agreement({"rollout_corr/mismatch_kl": 9.0}, "float32", "float32", 1)  # no metric logged: nothing to check
    check_agreement({METRIC: 7e-4}, "bfloat16", "float32", 1)  # the tiny model's measured bf16 mismatch


def test_a_half_precision_engine_without_correction_gets_a_note_naming_the_fixes():
    note = precision_notice("bfloat16", "float32", corrects=False)
    assert note is not None and "engine samples in bfloat16 and the trainer computes in float32" in note
    assert "--rollout-correction-preset" in note and "--engine-dtype float16" in note
    assert precision_notice("float16", "float32", corrects=False) is not None
    assert precision_notice("bfloat16", "float32", corrects=True) is None  # corrected
    assert precision_notice("float32", "float64", corrects=False) is None  # a full-precision gap: 1e-7 nats
    assert precision_notice("float32", "float32", corrects=False) is None


def test_the_main_job_prints_the_note_and_takes_an_fp16_engine(capsys):
    from slime_corr.main import main, parse_run_config

    assert parse_run_config(["--engine-dtype", "float16", "--rollout-engine", "sglang"]).trainer.engine_dtype == "float16"
    assert main(["--self-check"]) == 0
    assert "slime_corr.main: note: the engine samples in bfloat16" in capsys.readouterr().out
    assert main(["--self-check", "--rollout-correction-preset", "decoupled_seq_is_rs"]) == 0
    assert "note:" not in capsys.readouterr().out
