"""The report's advice holds (issue 22, item 6): runs of several presets over the same task get the same regime and
preset; the regime reads the rollout->old drift (a bypass run: each rollout's first step only); hints only where
they apply; sequence-level RS is not recommended while it is predicted to reject many sequences; failed steps are
left out. One test runs the main job for real (four presets, one process); the rest use small synthetic runs."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slime_corr.monitoring.recommend import (
    METRIC,
    Thresholds,
    classify,
    quantile,
    recommend,
    run_facts,
)
from slime_corr.monitoring.report import load_run, summary_text
from slime_corr.monitoring.report import main as report_main

pytestmark = pytest.mark.cost(9)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ("decoupled_seq_is_rs", "ppo_is_bypass", "decoupled_token_is", "disabled")
SMALL = ["--num-rollout", "3", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-steps-per-rollout",
         "2", "--micro-batch-size", "4", "--rollout-max-response-len", "8", "--rollout-progress", "none", "--seed", "7",
         "--rollout-engine", "embedded"]
# one process for all runs: the imports and the first engine start are most of a short run's time
RUNNER = """
import json, sys
from slime_corr.main import main
out, extra, presets = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
for p in presets:
    rc = main(["--rollout-correction-preset", p, *extra, "--run-dir", f"{out}/{p}", "--work-dir", f"{out}/work_{p}"])
    assert rc == 0, (p, rc)
"""


def _run_presets(out: Path, extra: list[str]) -> dict[str, str]:
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(out), json.dumps(extra), *PRESETS], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {p: str(out / p) for p in PRESETS}


def _verdict(summary: str) -> tuple[str, str]:
    regime, preset = re.search(r"regime: (\w+) -> recommended preset: (\w+)", summary).groups()
    return regime, preset


def _summaries(runs: dict[str, str]) -> dict[str, str]:
    """Each run's summary as `slime-corr report` writes it (`report_run` without its plots, which take longer
    than the runs; the command itself is tested on the synthetic run below and in test_monitoring_e2e.py)."""
    out = {}
    for p, path in runs.items():
        run = load_run(path)
        out[p] = summary_text(run, recommend(run.records, Thresholds(), run.config))
    return out


def test_presets_agree_on_a_synchronous_task(tmp_path):
    """Same task and seed, four presets, synchronous: the bf16 mismatch alone, negligible for all of them. A bypass
    run's mismatch_k3_kl over all its steps includes the policy's own updates (that reading said "severe" here);
    its first step of each rollout does not."""
    runs = _run_presets(tmp_path, SMALL)
    summaries = _summaries(runs)
    verdicts = {p: _verdict(s) for p, s in summaries.items()}
    assert set(verdicts.values()) == {("negligible", "ppo_is_bypass")}, verdicts
    bypass = load_run(runs["ppo_is_bypass"])
    all_steps = [r[METRIC] for r in bypass.records]
    assert classify(quantile(all_steps, 0.9), Thresholds()) != "negligible"  # the old reading disagreed
    assert "the rollout->old drift: the first step of each rollout" in summaries["ppo_is_bypass"]
    assert "note: bypass run: " in summaries["ppo_is_bypass"] and "cannot separate drift" in summaries["ppo_is_bypass"]
    for p, s in summaries.items():
        assert "stale" not in s, p  # a synchronous run: the lag within a rollout is the policy's own updates
        if p != "ppo_is_bypass":
            assert "the rollout->old drift: every step (decoupled" in s and "note:" not in s, p


@pytest.mark.slow
def test_presets_agree_on_an_asynchronous_task(tmp_path):
    """Asynchronous at lr 0.03: the rollout->old drift is severe for every preset; sequence-level RS would reject
    most sequences, so all recommend decoupled_token_is, and the stale hint appears."""
    extra = [*SMALL, "--num-rollout", "5", "--async-rollout", "--lr", "0.03"]
    summaries = _summaries(_run_presets(tmp_path, extra))
    verdicts = {p: _verdict(s) for p, s in summaries.items()}
    assert len(set(verdicts.values())) == 1, verdicts
    for p, s in summaries.items():
        assert "samples are stale (async rollout)" in s, p


# ------------------------------------------------------------------------------------------------ synthetic runs
def _records(k3_first: float, k3_later: float, rollouts: int = 4, steps: int = 4, **extra) -> list[dict]:
    """A run's records: per rollout, `steps` steps whose k3 is `k3_first` at the first step, `k3_later` after."""
    out = []
    for k in range(rollouts):
        for j in range(steps):
            k3 = k3_first if j == 0 else k3_later
            out.append({"step": k * steps + j + 1, METRIC: k3, "rollout_corr/mismatch_kl": -k3 / 10,
                        "rollout/index": float(k), "rollout/staleness_mean": float(j), "diag/lag/mean": float(j),
                        "rollout/response_length_mean": 12.0, "rollout/samples": 32.0, "rollout/not_trained": 0.0,
                        **extra})
    return out


def test_bypass_runs_read_the_first_step_of_each_rollout():
    bypass = {"rollout_correction_preset": "ppo_is_bypass", "async_rollout": False}
    decoupled = {"rollout_correction_preset": "disabled", "async_rollout": False}
    records = _records(2e-6, 0.05)
    rec = recommend(records, config=bypass)
    assert (rec.regime, rec.preset, rec.steps) == ("negligible", "ppo_is_bypass", 4)
    assert "cannot separate drift from mismatch" in rec.notes[0] and "(4 of 16 steps)" in rec.notes[0]
    assert recommend(records, config=decoupled).regime == "severe"  # decoupled: every step is rollout->old
    no_index = [{k: v for k, v in r.items() if k != "rollout/index"} for r in records]
    rec = recommend(no_index, config=bypass)  # nothing says which steps are first: an upper bound, and said so
    assert rec.regime == "severe" and "cannot separate drift from mismatch" in rec.notes[0]
    assert "upper bound" in rec.notes[0]


def test_run_facts_from_the_run_config(tmp_path):
    assert run_facts({"rollout_correction_preset": "ppo_is_bypass"}).bypass is True
    assert run_facts({"rollout_correction_preset": "decoupled_seq_is_rs", "async_rollout": True}) == \
        run_facts({"use_tis": True, "async_rollout": True}) == run_facts({"use_tis": True, "async_rollout": True})
    assert run_facts({"use_rollout_logprobs": True, "get_mismatch_metrics": True}).bypass is True
    assert run_facts({"custom_config_path": str(tmp_path / "gone.yaml")}).bypass is None
    assert run_facts(None, [{"step": 1, "diag/drift/rollout_to_old_k3": 1e-6}]).bypass is False
    assert run_facts(None, []).bypass is None


def test_stale_hint_only_on_asynchronous_runs():
    sync = _records(1e-4, 1e-4)  # the lag within a rollout is 0, 1, 2, 3 (the policy's own updates)
    assert not any("stale" in h for h in recommend(sync, config={"async_rollout": False}).hints)
    assert not any("stale" in h for h in recommend(sync).hints)  # unknown: the first steps' lag is 0
    stale = [{**r, "rollout/staleness_mean": r["rollout/staleness_mean"] + 4} for r in sync]
    hints = recommend(stale, config={"async_rollout": True}).hints
    assert any("samples are stale (async rollout)" in h and "up to 4.00 weight versions" in h for h in hints)


@pytest.mark.parametrize("k3, length, preset", [
    (0.1, 12.0, "decoupled_token_is"),  # docs/experiments.md's experiment: about two thirds rejected
    (0.02, 2.0, "decoupled_seq_is_rs"),  # severe per token, short responses: few rejected
    (0.02, 200.0, "decoupled_token_is"),  # the same per token, long responses: most rejected
])
def test_the_level_accounts_for_length_and_predicted_rejection(k3, length, preset):
    records = [{**r, "rollout/response_length_mean": length} for r in _records(k3, k3)]
    rec = recommend(records, config={"use_tis": True})
    assert rec.regime == "severe" and rec.preset == preset
    assert (rec.predicted_rejected_share > 0.3) == (preset == "decoupled_token_is")
    assert rec.response_length == length
    if preset == "decoupled_token_is":
        assert "would reject about" in rec.why and "--max-rejected-share 0.3" in rec.why
    loose = recommend(records, Thresholds(max_rejected_share=1.0), config={"use_tis": True})
    assert loose.preset == "decoupled_seq_is_rs"


def test_failed_steps_are_not_evidence(tmp_path, capsys):
    """Every sample failed: k3 = 0 over no token is no measurement; with such steps only there is no advice."""
    good = _records(2e-2, 2e-2, rollouts=2)
    failed = [{**r, "step": r["step"] + 8, METRIC: 0.0, "rollout/not_trained": 32.0, "rollout/index": r["rollout/index"] + 2}
              for r in good]
    no_token = [{**r, "step": r["step"] + 16, METRIC: 0.0, "rollout_corr/mis_valid_token_count": 0.0,
                 "rollout/index": r["rollout/index"] + 4} for r in good]
    absent = [{k: v for k, v in r.items() if k != METRIC} | {"step": r["step"] + 24, "train/loss_denominator": 0.0,
                                                             "rollout/index": r["rollout/index"] + 6} for r in good]
    rec = recommend(good + failed + no_token + absent, config={"use_tis": True})
    assert rec.regime == "severe" and rec.steps == 8 and rec.excluded_steps == 24 and rec.median == 2e-2
    with pytest.raises(ValueError, match="every sample failed or no token was measured"):
        recommend(failed + no_token, config={"use_tis": True})
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good + failed))
    assert report_main([str(run)]) == 0
    assert "8 step(s) left out (every sample failed or no token measured)" in capsys.readouterr().out
    assert math.isfinite(rec.statistic)
