"""Monitoring pieces on their own: flags and config, the key scheme on the real loss output, the logger's sinks,
the rollout progress, and the recommendation on synthetic runs at each regime (plus the report command)."""

from __future__ import annotations

import argparse
import io
import json
import math
import re
from pathlib import Path

import pytest
import torch

from slime_corr.config import ConfigError, RolloutCorrectionConfig
from slime_corr.correction.diagnostics import VIEWS
from slime_corr.flags.monitoring import add_monitoring_args
from slime_corr.losses import compute_policy_loss
from slime_corr.monitoring.config import MonitoringConfig
from slime_corr.monitoring.keys import loss_step_metrics, with_prefix
from slime_corr.monitoring.logger import MetricsLogger, console_line
from slime_corr.monitoring.progress import RolloutProgress
from slime_corr.monitoring.recommend import PRESETS, Thresholds, recommend
from slime_corr.monitoring.report import load_run
from slime_corr.monitoring.report import main as report_main
from slime_corr.samples import Sample, SampleStatus


# ------------------------------------------------------------------------------------------------ flags
def test_flags_build_a_validated_config_and_keep_megatrons_own():
    megatron_like = argparse.ArgumentParser()
    megatron_like.add_argument("--tensorboard-dir", type=str, default=None)
    megatron_like.add_argument("--log-interval", type=int, default=100)
    megatron_like.add_argument("--wandb-project", type=str, default="")  # Megatron's default is ""
    add_monitoring_args(megatron_like)  # no argparse conflict with the flags the parser already has
    args = megatron_like.parse_args(["--wandb-mode", "offline", "--run-dir", "r"])
    config = MonitoringConfig.from_args(args)
    assert config.log_interval == 100 and config.wandb_project is None and not config.uses_wandb
    assert config.wandb_mode == "offline" and config.run_dir == "r" and config.log_mismatch_diagnostics
    args = megatron_like.parse_args(["--no-log-mismatch-diagnostics", "--log-top-mismatch-samples", "0"])
    assert not MonitoringConfig.from_args(args).log_mismatch_diagnostics


@pytest.mark.parametrize("kwargs, words", [
    ({"log_interval": 0}, "--log-interval"),
    ({"tensorboard_log_interval": -1}, "--tensorboard-log-interval"),
    ({"log_top_mismatch_samples": -2}, "--log-top-mismatch-samples"),
    ({"wandb_mode": "sometimes"}, "--wandb-mode"),
    ({"rollout_progress": "fancy"}, "--rollout-progress"),
])
def test_bad_values_are_refused_with_the_flag_name(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        MonitoringConfig(**kwargs)


def test_main_job_refuses_a_bad_logging_flag_at_parse_time(capsys):
    from slime_corr.cli import main as cli_main

    with pytest.raises(SystemExit) as e:
        cli_main(["--log-interval", "0", "--self-check"])
    assert e.value.code == 2 and "--log-interval must be an integer >= 1, got 0" in capsys.readouterr().err
    assert cli_main(["--self-check"]) == 0 and "rollout correction config:" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ keys, logger
def test_key_scheme_on_the_real_loss_output_with_a_custom_weighting_function():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 10, generator=g, dtype=torch.float64)
    ro = old + 0.05 * torch.randn(4, 10, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 10, generator=g, dtype=torch.float64)
    cfg = RolloutCorrectionConfig(use_tis=True, custom_tis_function_path="examples/custom_tis.py:length_aware_geometric_is")
    out = compute_policy_loss(old.clone().requires_grad_(), old, ro, adv, torch.ones(4, 10, dtype=torch.bool), cfg)
    flat = {k: float(v) for k, v in out.metrics.items()}
    keyed = loss_step_metrics({**flat, "loss": float(out.loss.detach())})
    assert "rollout_corr/custom_rejected_seq_fraction" in keyed  # the custom function's own metric
    assert {"train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl"} <= keyed.keys()
    assert {"rollout_corr/mismatch_k3_kl", "rollout_corr/mis_ess", "rollout_corr/ois"} <= keyed.keys()
    assert all(k.split("/", 1)[1] in flat or k == "train/loss" for k in keyed)  # SPEC names unchanged
    with pytest.raises(ValueError, match="prefix"):
        with_prefix("misc", {"x": 1.0})


def test_logger_writes_every_metric_to_jsonl_and_a_readable_console_line(tmp_path):
    out = io.StringIO()
    config = MonitoringConfig(log_interval=2)
    with MetricsLogger(config, run_dir=tmp_path / "run", hparams={"lr": 0.1, "_private": {1}, "path": tmp_path},
                       stream=out) as logger:
        for step in (1, 2):
            logger.log(step, {"train/loss": 0.5 * step, "rollout/trained_samples": 16, "rollout_corr/mismatch_k3_kl": 1e-4,
                              "rollout_corr/custom_x": torch.tensor(3.0), "perf/step_time": math.inf})
        logger.log_samples(2, [{"sample_id": 3, "response": "a|b"}])
        with pytest.raises(TypeError, match="'train/bad'"):
            logger.log(3, {"train/bad": "x"})
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert lines[1]["train/loss"] == 1.0 and lines[1]["rollout_corr/custom_x"] == 3.0
    assert lines[0]["perf/step_time"] is None  # non-finite -> null (strict JSON)
    assert json.loads((tmp_path / "run" / "run_config.json").read_text()) == {"lr": 0.1, "path": str(tmp_path)}
    assert json.loads((tmp_path / "run" / "top_mismatch.jsonl").read_text())["sample_id"] == 3
    assert out.getvalue().splitlines() == ["step 2: trained=16 loss=1 step_time=inf mismatch_k3_kl=0.0001"]
    assert console_line(5, {}) == "step 5: "


def test_a_disabled_logger_writes_nothing(tmp_path):
    with MetricsLogger(MonitoringConfig(), run_dir=tmp_path / "r", enabled=False) as logger:
        logger.log(1, {"train/loss": 1.0})
    assert not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match="--run-dir"):
        MetricsLogger(MonitoringConfig())


# ------------------------------------------------------------------------------------------------ progress
def _samples(n: int, status=SampleStatus.COMPLETED) -> list[Sample]:
    return [Sample(prompt_tokens=[1], response_tokens=[2, 3], rollout_log_probs=[-0.1, -0.2], status=status,
                   failure_reason="x" if status == SampleStatus.FAILED else None) for _ in range(n)]


def test_progress_prints_plain_lines_when_not_on_a_terminal():
    out = io.StringIO()
    progress = RolloutProgress(16, step=3, stream=out)  # auto: StringIO is not a TTY
    assert progress.mode == "lines"
    for _ in range(3):
        progress.update(_samples(4))
    progress.update(_samples(4, SampleStatus.FAILED))
    progress.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"rollout 3: {k}/16 samples" for k in (4, 8, 12, 16)]
    assert "32 tokens, 4 failed" in lines[-1]


def test_progress_bar_and_none_modes():
    out = io.StringIO()
    bar = RolloutProgress(4, step=1, mode="bar", stream=out)
    bar.update(_samples(4))
    assert bar.done == 4 and bar.tokens == 8
    bar.close()
    assert "rollout 1:" in out.getvalue() and "/4 [" in out.getvalue()  # tqdm drew the bar
    quiet = io.StringIO()
    none = RolloutProgress(4, step=1, mode="none", stream=quiet)
    none.update(_samples(4))
    assert quiet.getvalue() == "" and none.done == 4


# ------------------------------------------------------------------------------------------------ recommendation
def _synthetic_run(path: Path, k3: float, steps: int = 10, low_prob_share: float = 0.0) -> Path:
    """A run dir whose mismatch_k3_kl sits around `k3` (±30 %, one outlier step at 20x)."""
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            value = k3 * (1 + 0.3 * math.sin(s)) * (20 if s == 4 else 1)
            rec = {"step": s, "rollout_corr/mismatch_k3_kl": value, "rollout_corr/mismatch_kl": value / 2,
                   "rollout/reward_mean": 0.1 * s, "train/pg_clipfrac": 0.01, "diag/tokens": 1000.0}
            low, high = VIEWS["prob"][1], VIEWS["prob"][-1]  # p in [1e-6, 1e-5) and p >= 0.99
            rec.update({f"diag/prob/{low}/token_frac": 0.02, f"diag/prob/{high}/token_frac": 0.98,
                        f"diag/prob/{low}/k3": value * low_prob_share / 0.02,
                        f"diag/prob/{high}/k3": value * (1 - low_prob_share) / 0.98})
            f.write(json.dumps(rec) + "\n")
    return path


@pytest.mark.parametrize("k3, regime", [(1e-4, "negligible"), (3e-3, "moderate"), (4e-2, "severe")])
def test_recommendation_at_each_regime(tmp_path, k3, regime):
    run = load_run(_synthetic_run(tmp_path / regime, k3))
    rec = recommend(run.records)
    assert rec.regime == regime and rec.preset == PRESETS[regime]
    assert rec.maximum == pytest.approx(k3 * 20 * (1 + 0.3 * math.sin(4)))  # the outlier does not decide alone
    assert rec.median < rec.statistic < rec.maximum


def test_recommendation_thresholds_and_errors(tmp_path):
    records = [{"step": 1, "rollout_corr/mismatch_k3_kl": 1e-3}]
    assert recommend(records).regime == "moderate"  # the lower threshold belongs to "moderate"
    assert recommend([{"step": 1, "rollout_corr/mismatch_k3_kl": 1e-2}]).regime == "severe"
    assert recommend(records, Thresholds(negligible_below=2e-3, severe_from=5e-2)).regime == "negligible"
    with pytest.raises(ValueError, match="--get-mismatch-metrics"):
        recommend([{"step": 1, "train/loss": 1.0}, {"step": 2, "rollout_corr/mismatch_k3_kl": None}])
    with pytest.raises(ValueError, match="--severe-from"):
        Thresholds(negligible_below=0.1, severe_from=0.01)


def test_low_probability_concentration_suggests_a_veto(tmp_path):
    rec = recommend(load_run(_synthetic_run(tmp_path / "r", 3e-3, low_prob_share=0.8)).records)
    assert any("--rs-veto-threshold" in h and "80%" in h for h in rec.hints)
    rec = recommend(load_run(_synthetic_run(tmp_path / "s", 3e-3, low_prob_share=0.02)).records)
    assert not any("veto" in h for h in rec.hints)


@pytest.mark.parametrize("mean, std, lengths, hinted", [
    (-0.02, 0.35, (8, 12, 20), True),  # severe, most sequences outside [0.5, 2]
    (0.05, 0.5, (4, 12, 40), True),  # a mean drift too
    (0.0, 0.15, (2, 3, 4), False),  # severe per token, but short sequences: few outside, sequence RS stays
    (0.0, 0.08, (12, 12, 12), False),  # moderate: decoupled_token_is is recommended, it has no RS
])
def test_sequence_rejection_estimate_against_sampled_sequences(mean, std, lengths, hinted):
    """The estimate of how many sequences `decoupled_seq_is_rs` would drop, from the logged token-level metrics
    only, against the fraction of sampled sequences whose Σ lr leaves [log 0.5, log 2]; above
    --max-rejected-share (0.3) the severe regime recommends decoupled_token_is, and says why."""
    gen = torch.Generator().manual_seed(0)
    records, outside = [], []
    for step, length in enumerate(lengths):
        lr = mean + std * torch.randn(20_000, length, generator=gen, dtype=torch.float64)
        seq = lr.sum(-1)
        outside.append(((seq < math.log(0.5)) | (seq > math.log(2.0))).double().mean().item())
        records.append({"step": step, "rollout_corr/mismatch_k3_kl": (lr.exp() - lr - 1).mean().item(),
                        "rollout_corr/mismatch_kl": -lr.mean().item(), "rollout/response_length_mean": length})
    rec = recommend(records)
    expected = sum(outside) / len(outside)
    assert (expected > 0.3) == hinted
    if rec.regime == "moderate":
        assert rec.predicted_rejected_share is None and rec.preset == "decoupled_token_is"
        return
    assert rec.regime == "severe"
    assert rec.predicted_rejected_share == pytest.approx(expected, abs=0.05), (rec.predicted_rejected_share, expected)
    assert rec.preset == ("decoupled_token_is" if hinted else "decoupled_seq_is_rs")
    if hinted:
        estimate = float(re.search(r"would reject about (\d+)% of the sequences", rec.why).group(1)) / 100
        assert estimate == pytest.approx(rec.predicted_rejected_share, abs=0.006)


def test_report_command_on_synthetic_runs(tmp_path, capsys):
    runs = [_synthetic_run(tmp_path / name, k3) for name, k3 in (("naive", 4e-2), ("corrected", 1e-4))]
    assert report_main([*map(str, runs), "--out", str(tmp_path / "cmp"), "--severe-from", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "regime: moderate -> recommended preset: decoupled_token_is" in text  # naive, with --severe-from 0.5
    assert "regime: negligible -> recommended preset: ppo_is_bypass" in text  # corrected
    assert "negligible: q < 0.001 <= moderate < 0.5 <= severe" in text
    assert (tmp_path / "cmp" / "naive" / "summary.txt").read_text() in text
    assert {p.name for p in (tmp_path / "cmp" / "corrected").iterdir()} == {
        "mismatch.png", "is_weights.png", "rejection.png", "reward.png", "clipfrac.png", "prob_buckets.png",
        "diagnostics.png", "summary.txt"}
    assert (tmp_path / "cmp" / "comparison.png").stat().st_size > 10_000


def test_report_command_errors_name_the_problem(tmp_path, capsys):
    for argv, words in (([str(tmp_path)], "no metrics.jsonl"), ([str(tmp_path), str(tmp_path)], "--out"),
                        ([str(tmp_path), "--negligible-below", "1"], "--severe-from")):
        with pytest.raises(SystemExit) as e:
            report_main(argv)
        assert e.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("good_share", [0.25, 0.8])
def test_report_says_on_whom_the_rejection_fell(tmp_path, good_share):
    """The rejected sequences' advantage split is weighted by how many each step rejected; most of them with a
    positive advantage gets a note."""
    from slime_corr.monitoring.report import rejection_lines

    path = _synthetic_run(tmp_path / "run", 4e-2, steps=2)
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    for rec, (rejected, pos) in zip(records, ((0.5, good_share), (0.0, 0.0)), strict=True):  # 5 and 0 rejected
        rec.update({f"rollout_corr/{k}": v for k, v in {
            "mis_rejected_seq_fraction": rejected, "mis_valid_seq_count": 10.0,
            "mis_rejected_seq_pos_adv_fraction": pos, "mis_rejected_seq_neg_adv_fraction": 1 - pos,
            "mis_rejected_seq_reward_mean": 0.9, "mis_kept_seq_reward_mean": 0.2,
            "mis_rejected_pos_adv_token_fraction": 0.3, "mis_rejected_neg_adv_token_fraction": 0.1}.items()})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = rejection_lines(load_run(path))
    assert lines[0] == (f"rejection (all steps): 5 sequences rejected, {good_share:.0%} with a positive advantage, "
                        f"{1 - good_share:.0%} negative; mean reward 0.9 rejected vs 0.2 kept")
    assert lines[1] == "  tokens removed: 30% of the positive-advantage ones, 10% of the negative"
    assert (len(lines) == 3 and "mostly on samples with a positive advantage" in lines[2]) == (good_share > 0.5)
