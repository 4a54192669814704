"""experiments/precision_pairs.py: its tables and plot from run directories (synthetic ones here, cheap): every
number is the mean over a run's steps of the metric it names, the share outside the bound is the two clip
fractions' sum, a run is reused only for the same command, and `--model smollm2-135m` plans SmolLM2's runs (the
real SGLang server's pairs too) and writes beside the tiny model's results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.monitoring.experiment_helpers import experiment_script


@pytest.fixture(scope="module")
def experiment():
    with experiment_script("precision_pairs") as module:
        yield module


def _write(run_dir: Path, records: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plot_only_summarizes_each_pair_from_its_runs(experiment, tmp_path):
    work = tmp_path / "runs"
    args = ["--work-dir", str(work), "--summary", str(tmp_path / "s.json"), "--out", str(tmp_path / "p.png"),
            "--plot-only"]
    measured, trained = experiment.plan(_namespace(experiment, args))
    assert len(measured) == 9 and len(trained) == 6
    for i, run in enumerate(measured):  # step values chosen so that each pair's means are known
        _write(work / run.name, [
            {"step": s, "rollout_corr/train_rollout_logprob_abs_diff": (i + 1) * s,
             "rollout_corr/mismatch_k3_kl": 1e-6 * (i + 1) * s, "rollout_corr/mis_clip_fraction_low": 0.1 * s,
             "rollout_corr/mis_clip_fraction_high": 0.01, "train/train_rollout_logprob_abs_diff": -1.0,
             "diag/prob/0.1_0.5/large_lr_frac": 1.0, "diag/large_lr_frac": 0.02 * s,
             "rollout_corr/mis_valid_token_count": 10.0}
            for s in (1, 2, 3)])
    for j, run in enumerate(trained):
        _write(work / run.name, [{"step": s, "rollout/reward_mean": s / 10 + j, "rollout_corr/mismatch_k3_kl": 2e-6}
                                 for s in range(1, 11)])
    assert experiment.main(args) == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    for i, run in enumerate(measured):
        m = summary["measured"][f"{run.trainer}/{run.engine}"]
        assert m["abs_diff"] == pytest.approx(2 * (i + 1))  # mean of (i+1)·(1, 2, 3); the namespaced key first
        assert m["k3"] == pytest.approx(2e-6 * (i + 1))
        assert m["k3_per_step"] == pytest.approx([1e-6 * (i + 1) * s for s in (1, 2, 3)])
        assert m["outside_bound"] == pytest.approx(0.2 + 0.01)
        assert (m["below_bound"], m["above_bound"]) == pytest.approx((0.2, 0.01))
        assert m["large_log_ratio"] == pytest.approx(0.04)  # the step's own key, not a bucket's that ends like it
        assert m["steps"] == 3 and m["tokens"] == 30
    for j, run in enumerate(trained):
        label = "naive" if "disabled" in run.flags else "token IS"
        t = summary["trained"][f"{run.trainer}/{run.engine}/{label}"]
        assert t["final_reward"] == pytest.approx(sum(s / 10 + j for s in range(3, 11)) / 8)  # the last 8 steps
        assert t["reward"] == pytest.approx([s / 10 + j for s in range(1, 11)])
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_a_missing_metric_stops_the_summary_naming_it(experiment, tmp_path):
    work = tmp_path / "runs"
    measured, _ = experiment.plan(_namespace(experiment, ["--work-dir", str(work)]))
    _write(work / measured[0].name, [{"step": 1, "rollout_corr/mismatch_k3_kl": 0.0}])
    with pytest.raises(SystemExit, match="no train_rollout_logprob_abs_diff"):
        experiment.summarize(measured[:1], [], work)


def test_a_run_is_reused_only_for_the_same_command(experiment, tmp_path):
    work = tmp_path / "runs"
    measured, _ = experiment.plan(_namespace(experiment, ["--work-dir", str(work)]))
    run = measured[0]
    (work / run.name).mkdir(parents=True)
    (work / run.name / experiment.DONE_FILE).write_text(json.dumps({"command": run.command(work)}))
    assert experiment._finished(run, work)
    other = experiment.plan(_namespace(experiment, ["--work-dir", str(work), "--bound", "1.5"]))[0][0]
    assert other.name == run.name and not experiment._finished(other, work)


def _namespace(experiment, argv: list[str]):
    """The script's parsed flags (its parser is built inside `main`)."""
    return experiment.build_parser().parse_args(argv)


def test_smollm2_measures_every_pair_embedded_and_the_server_s_pairs_on_sglang(experiment, tmp_path):
    args = _namespace(experiment, ["--model", "smollm2-135m"])
    measured, trained = experiment.plan(args)
    setup = experiment.SETUPS["smollm2-135m"]
    embedded = [r for r in measured if r.server == "embedded"]
    on_sglang = [r for r in measured if r.server == "sglang"]
    assert len(embedded) == 9 and [(r.trainer, r.engine) for r in on_sglang] == list(setup.on_sglang)
    assert [r.pair for r in on_sglang] == [f"{t}/{e} sglang" for t, e in setup.on_sglang]
    assert len({r.name for r in measured + trained}) == len(measured) + len(trained)  # one directory each
    assert len(trained) == 2 * len(setup.trained)
    for run in measured + trained:
        command = run.command(tmp_path)
        assert command[command.index("--rollout-engine") + 1] == run.server
        assert ("--model", "smollm2-135m") == tuple(command[command.index("--model"):][:2])
    half = next(r for r in embedded if (r.trainer, r.engine) == ("fp16", "fp32")).command(tmp_path)
    assert half[-4:] == ["--num-rollout", "1", "--rollout-batch-size", "1"]  # last: it wins over the setup's
    assert "--tis-upper-bound" in half and half[half.index("--tis-upper-bound") + 1] == "2.0"


def test_the_tiny_model_s_commands_are_unchanged_by_the_setups(experiment, tmp_path):
    """The runs already in runs/precision_pairs stay reusable: a tiny run's command is what it was."""
    measured, trained = experiment.plan(_namespace(experiment, []))
    assert measured[1].command(tmp_path) == [
        "-m", "slime_corr.main", "--rollout-engine", "embedded", "--engine-dtype", "bfloat16", "--rollout-progress",
        "none", "--run-dir", str(tmp_path / "measure-fp32-bf16"), "--num-rollout", "2", "--get-mismatch-metrics",
        "--use-tis", "--tis-mode", "clip", "--tis-upper-bound", "1.001"]
    assert trained[0].command(tmp_path)[-4:] == ["--num-rollout", "16", "--rollout-correction-preset", "disabled"]
