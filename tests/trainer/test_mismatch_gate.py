"""The mismatch gate (--max-train-rollout-logprob-abs-diff, --max-mismatch-k3-kl; slime_corr/trainer/mismatch_gate.py):
its message and bounds, and the main job on the embedded engine that it ends at the step whose logged mismatch
passes the bound. The injected error: `--async-rollout --lr 0.03` makes the engine sample rollout k+1 with weights a
rollout older than those trained, so from step 3 on lp_rollout is far from lp_train (measured: ~8e-4 nats at steps
1-2, the bf16 engine's precision gap, then ~0.1): a bound of 0.05 passes steps 1 and 2 and stops step 3."""

from __future__ import annotations

import json
import math
import re

import pytest

from slime_corr.trainer.mismatch_gate import MismatchGateError, check_mismatch_gate
from tests.job_runner import run_main_job

METRIC = "rollout_corr/train_rollout_logprob_abs_diff"


def test_the_gate_names_the_step_the_value_and_the_bound():
    gates = {"train_rollout_logprob_abs_diff": 0.05}
    check_mismatch_gate({METRIC: 0.05}, gates, 1)  # at the bound: passes
    check_mismatch_gate({"rollout_corr/mismatch_k3_kl": 9.0}, gates, 1)  # not gated
    check_mismatch_gate({}, gates, 1)  # a step that trained nothing logs no mismatch
    with pytest.raises(MismatchGateError, match=r"^step 7: train_rollout_logprob_abs_diff = 0\.0625, above the "
                                                r"mismatch gate's bound 0\.05 \(--max-train-rollout-logprob-abs-diff\)"):
        check_mismatch_gate({METRIC: 0.0625}, gates, 7)
    with pytest.raises(MismatchGateError, match=r"step 2: mismatch_k3_kl = nan, above .* \(--max-mismatch-k3-kl\)"):
        check_mismatch_gate({"rollout_corr/mismatch_k3_kl": math.nan}, {"mismatch_k3_kl": 0.01}, 2)


def test_the_main_job_ends_at_the_step_that_passes_the_bound(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_main_job(["--num-rollout", "3", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                         "--rollout-max-response-len", "4", "--rollout-progress", "none", "--rollout-engine",
                         "embedded", "--async-rollout", "--lr", "0.03", "--run-dir", str(run_dir),
                         "--max-train-rollout-logprob-abs-diff", "0.05"], timeout=600, output_dir=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r[METRIC] for r in records if METRIC in r}
    assert sorted(logged) == [1, 2, 3], logged  # the failing step is logged, none after it
    assert logged[1] <= 0.05 and logged[2] <= 0.05 < logged[3]
    message = re.search(r"slime_corr\.main: error: step (\d+): train_rollout_logprob_abs_diff = (\S+), above the "
                        r"mismatch gate's bound 0\.05 \(--max-train-rollout-logprob-abs-diff\)", out)
    assert message, out[-3000:]
    assert int(message[1]) == 3 and float(message[2]) == pytest.approx(logged[3], rel=1e-5)
    assert "Traceback" not in out
