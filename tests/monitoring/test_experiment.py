"""experiments/mismatch_vs_correction.py: its numbers and plot from run directories (synthetic ones here, cheap),
and (slow) the script end to end on real, very short runs of the main job."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest

from slime_corr.monitoring.plots import seed_band
from slime_corr.monitoring.report import load_run
from tests.monitoring.experiment_helpers import experiment_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "mismatch_vs_correction.py"


@pytest.fixture(scope="module")
def experiment():
    with experiment_script("mismatch_vs_correction") as module:
        yield module


def _write_run(experiment, argv: list[str], name: str, lr: float, seed: int, rewards: list[float],
               k3: list[float], grad: list[float] | None = None) -> Path:
    """A finished run as the script leaves it: metrics.jsonl (2 steps per rollout) and its command record."""
    (planned,) = [p for p in experiment.plan_runs(experiment.parse_args(argv))
                  if (p.config, p.lr, p.seed) == (name, lr, seed)]
    planned.run_dir.mkdir(parents=True)
    with open(planned.run_dir / "metrics.jsonl", "w") as f:
        for step in range(1, 2 * len(rewards) + 1):
            rollout = (step - 1) // 2
            record = {"step": step, "rollout/index": float(rollout), "rollout/reward_mean": rewards[rollout],
                      "rollout_corr/mismatch_k3_kl": k3[step - 1],
                      "train/grad_norm": grad[step - 1] if grad else 0.5 + 0.1 * step,
                      "train/pg_clipfrac": 0.0 if step % 2 else 0.2}
            if name == "seq-is-rs":
                record["rollout_corr/mis_rejected_seq_fraction"] = 0.25
            f.write(json.dumps(record) + "\n")
    (planned.run_dir / experiment.DONE_FILE).write_text(json.dumps({"command": planned.command, "seconds": 12.5}))
    return planned.run_dir


def test_plot_only_summarizes_and_plots_finished_runs(experiment, tmp_path):
    out, summary_path = tmp_path / "cmp.png", tmp_path / "cmp.json"
    argv = ["--work-dir", str(tmp_path / "work"), "--num-rollout", "3", "--configs", "naive", "seq-is-rs", "--seeds",
            "1", "2", "--lrs", "0.01", "0.03", "--out", str(out), "--summary", str(summary_path), "--plot-only",
            "--", "--rollout-batch-size", "2"]
    k3 = [1e-6, 2e-6, 0.1, 0.2, 0.3, 0.4]
    data = {("naive", 1): ([0.1, 0.3, 0.6], [0.5, 0.6, 40.0, 0.5, 1e6, 0.4]),
            ("naive", 2): ([0.1, 0.2, 0.4], None),
            ("seq-is-rs", 1): ([0.1, 0.5, 0.9], None)}
    for lr in (0.01, 0.03):
        for (name, seed), (rewards, grad) in data.items():
            _write_run(experiment, argv, name, lr, seed, rewards, k3, grad)
    with pytest.raises(SystemExit, match="seq-is-rs-lr0.01-seed2"):  # a missing run is named
        experiment.main(argv)
    for lr in (0.01, 0.03):
        _write_run(experiment, argv, "seq-is-rs", lr, 2, [0.1, 0.7, 0.4], k3)
    assert experiment.main(argv) == 0
    summary = json.loads(summary_path.read_text())
    assert summary["extra_flags"] == ["--rollout-batch-size", "2"] and summary["num_rollout"] == 3
    assert set(summary["regimes"]) == {"lr=0.01", "lr=0.03"}
    naive = summary["regimes"]["lr=0.03"]["naive"]
    assert naive["preset"] == "disabled" and naive["async_rollout"] is True
    assert naive["reward_last_mean"] == pytest.approx(0.5) and naive["reward_last_min"] == 0.4
    one = naive["seeds"]["1"]
    assert one["rollouts_to_reward_0.5"] == 2 and naive["seeds"]["2"]["rollouts_to_reward_0.5"] is None
    assert one["reward_max_drop"] == 0 and summary["regimes"]["lr=0.03"]["seq-is-rs"]["seeds"]["2"][
        "reward_max_drop"] == pytest.approx(0.3)  # 0.7 then 0.4
    assert one["mismatch_k3_median"] == pytest.approx(statistics.median(k3))
    assert one["grad_norm_max"] == 1e6 and one["grad_norm_steps_above_10"] == 2
    assert one["pg_clipfrac_mean"] == pytest.approx(0.1) and one["rejected_seq_fraction_mean"] is None
    assert summary["regimes"]["lr=0.01"]["seq-is-rs"]["seeds"]["1"]["rejected_seq_fraction_mean"] == 0.25
    assert one["command"] == ("python -m slime_corr.main --rollout-correction-preset disabled --async-rollout "
                              "--lr 0.03 --seed 1 --num-rollout 3 --rollout-progress none --work-dir "
                              "WORK/naive-lr0.03-seed1 --rollout-batch-size 2") and one["seconds"] == 12.5
    assert out.stat().st_size > 20_000


def test_seed_band_is_the_mean_and_range_over_seeds_per_rollout(experiment, tmp_path):
    argv = ["--work-dir", str(tmp_path), "--lrs", "0.01"]
    runs = [load_run(_write_run(experiment, argv, "naive", 0.01, seed, rewards, [0.1] * 4))
            for seed, rewards in ((1, [0.1, 0.3]), (2, [0.2, math.nan]))]
    xs, mean, lo, hi = seed_band(runs, "rollout/reward_mean", by_rollout=True)
    assert xs == [2, 4]  # each rollout at its last optimizer step
    assert mean == pytest.approx([0.15, 0.3]) and lo == [0.1, 0.3] and hi == [0.2, 0.3]  # NaN left out
    xs, mean, _, _ = seed_band(runs, "train/grad_norm")
    assert xs == [1, 2, 3, 4] and mean == pytest.approx([0.6, 0.7, 0.8, 0.9])


def test_a_run_is_reused_only_for_the_same_command(experiment, tmp_path):
    argv = ["--work-dir", str(tmp_path), "--lrs", "0.01", "--seeds", "1", "--configs", "naive"]
    _write_run(experiment, argv, "naive", 0.01, 1, [0.1], [0.1, 0.1])
    (planned,) = experiment.plan_runs(experiment.parse_args(argv))
    assert experiment.finished(planned)
    (other,) = experiment.plan_runs(experiment.parse_args([*argv, "--", "--clip-grad", "0.5"]))
    assert other.run_dir == planned.run_dir and not experiment.finished(other)


@pytest.mark.slow
def test_the_script_end_to_end_on_short_real_runs(tmp_path):
    import subprocess

    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--configs", "naive", "token-is", "--seeds", "1", "--lrs", "0.01",
         "--num-rollout", "2",
         "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "cmp.png"), "--summary",
         str(tmp_path / "cmp.json"), "--", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
         "--num-steps-per-rollout", "2", "--micro-batch-size", "4"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "cmp.json").read_text())["regimes"]["lr=0.01"]
    for name in ("naive", "token-is"):
        numbers = summary[name]["seeds"]["1"]
        assert numbers["steps"] == 4 and numbers["rollouts"] == 2
        assert numbers["mismatch_k3_max"] > 1e-3  # the second rollout is stale: 2 updates behind
    assert (tmp_path / "cmp.png").stat().st_size > 20_000
    assert "0 run(s) reused" in proc.stdout
    again = subprocess.run([sys.executable, str(SCRIPT), "--configs", "naive", "--seeds", "1", "--lrs", "0.01",
                            "--num-rollout", "2",
                            "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "b.png"), "--summary",
                            str(tmp_path / "b.json"), "--", "--rollout-batch-size", "2", "--n-samples-per-prompt",
                            "4", "--num-steps-per-rollout", "2", "--micro-batch-size", "4"],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert again.returncode == 0 and "1 run(s) reused, 0 to run" in again.stdout
