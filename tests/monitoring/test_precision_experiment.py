"""experiments/precision_pairs.py: its tables and plot from run directories (synthetic ones here, cheap): every
number is the mean over a run's steps of the metric it names, the share outside the bound is the two clip
fractions' sum, and a run is reused only for the same command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from experiment_helpers import experiment_script


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
             "rollout_corr/mismatch_k3_kl": 1e-6 * (i + 1), "rollout_corr/mis_clip_fraction_low": 0.1 * s,
             "rollout_corr/mis_clip_fraction_high": 0.01, "train/train_rollout_logprob_abs_diff": -1.0}
            for s in (1, 2, 3)])
    for j, run in enumerate(trained):
        _write(work / run.name, [{"step": s, "rollout/reward_mean": s / 10 + j, "rollout_corr/mismatch_k3_kl": 2e-6}
                                 for s in range(1, 11)])
    assert experiment.main(args) == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    for i, run in enumerate(measured):
        m = summary["measured"][f"{run.trainer}/{run.engine}"]
        assert m["abs_diff"] == pytest.approx(2 * (i + 1))  # mean of (i+1)·(1, 2, 3); the namespaced key first
        assert m["k3"] == pytest.approx(1e-6 * (i + 1))
        assert m["outside_bound"] == pytest.approx(0.2 + 0.01)
        assert m["steps"] == 3
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
