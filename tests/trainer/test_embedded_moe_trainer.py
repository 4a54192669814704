"""The main job on the tiny Qwen3-MoE (`--model tiny-moe`) with the embedded engine, which returns the routed
experts as SGLang does (`engines.embedded.routes`), through `slime_corr.main.main` (in this process):

- bf16 engine, `--log-routing-mismatch`: some router decisions differ (> 0, few), and the tokens routed differently
  carry a much larger log-prob mismatch than the others (what replay is for);
- `--use-routing-replay` (R2: the lp_old pass's own routes replayed) trains on the embedded engine without asking
  it for routes, and bypass mode (no lp_old pass) is refused at parse time;
- torchrun, TP=2 (Megatron's sequence parallelism, which MoE with TP needs) with packed micro-batches, an fp32
  engine and replay, 2 rollouts of 2 steps: each rollout's first step, on the weights the engine sampled with, has
  no routing mismatch (the engine's routes are the trainer's own) and log-probs equal to fp32 rounding; the second
  step's trainer routes have moved (> 0, replay still routes with the engine's).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from slime_corr.models.selection import TINY_MOE
from tests.mcore.mcore_helpers import gloo_threads

pytestmark = pytest.mark.cost(50)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

RUN = ["--model", TINY_MOE, "--rollout-engine", "embedded", "--num-rollout", "1", "--rollout-batch-size", "4",
       "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "1", "--micro-batch-size", "8",
       "--rollout-max-response-len", "16", "--rollout-correction-preset", "decoupled_token_is",
       "--rollout-progress", "none"]


def _run(tiny_moe_cache: str, run_dir: Path, *flags: str) -> dict:
    from slime_corr.main import main

    start, threads = time.perf_counter(), gloo_threads()
    assert main([*RUN, "--model-cache-dir", tiny_moe_cache, "--run-dir", str(run_dir), *flags]) == 0
    # the run's Megatron groups destroyed and freed: a MoE model's graph ties them to DDP (mcore/parallel_groups.py)
    left = gloo_threads()
    assert left == threads, f"the run left {left - threads} gloo groups alive in this process"
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = ("diag/routing_mismatch_frac", "diag/routing_mismatch_token_frac", "diag/logprob_abs_diff_routing_diff",
            "diag/logprob_abs_diff_routing_same", "rollout_corr/train_rollout_logprob_abs_diff")
    print(f"{flags}: {time.perf_counter() - start:.1f}s", {k: round(row[k], 6) for k in keys})
    return row


def test_bf16_engine_routes_differ_from_the_trainers(tiny_moe_cache, tmp_path):
    row = _run(tiny_moe_cache, tmp_path / "plain", "--engine-dtype", "bfloat16", "--log-routing-mismatch")
    assert row["rollout/trained_samples"] == 16
    assert 0 < row["diag/routing_mismatch_frac"] < 0.3  # bf16 engine vs fp32 trainer: a few decisions differ
    assert row["diag/logprob_abs_diff_routing_diff"] > 3 * row["diag/logprob_abs_diff_routing_same"]


def test_r2_trains_and_bypass_mode_is_refused(tiny_moe_cache, tmp_path, capsys):
    from slime_corr.main import main

    start = time.perf_counter()
    run_dir = tmp_path / "r2"
    assert main([*RUN, "--model-cache-dir", tiny_moe_cache, "--run-dir", str(run_dir), "--use-routing-replay",
                 "--num-steps-per-rollout", "2"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"R2: {time.perf_counter() - start:.1f}s")
    assert [r["rollout/trained_samples"] for r in rows] == [8, 8] and all(r["train/grad_norm"] > 0 for r in rows)
    assert not any(k.startswith("diag/routing") for k in rows[0])  # no engine routes to compare with
    with pytest.raises(SystemExit) as e:
        main([*RUN, "--model-cache-dir", tiny_moe_cache, "--use-routing-replay", "--rollout-correction-preset",
              "ppo_is_bypass", "--self-check"])
    assert e.value.code == 2
    assert "--use-routing-replay replays the routes of the recomputed lp_old pass" in capsys.readouterr().err


def test_tensor_parallel_packed_replay_through_torchrun(tiny_moe_cache, tmp_path):
    from tests.trainer.test_pretrained_launch import launch

    flags = [*RUN, "--model-cache-dir", tiny_moe_cache, "--engine-dtype", "float32", "--use-rollout-routing-replay",
             "--tensor-model-parallel-size", "2", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "256",
             "--num-rollout", "2", "--num-steps-per-rollout", "2"]
    steps = launch(tmp_path / "tp2", flags, nproc=2)["steps"]
    frac = {step: r["diag/routing_mismatch_frac"] for step, r in steps.items()}
    print(frac)
    assert sorted(frac) == [1, 2, 3, 4]
    for first in (1, 3):  # the engine's weights: its experts are the trainer's own, its log-probs too
        r = steps[first]
        assert r["diag/routing_mismatch_frac"] == 0.0 and r["diag/routing_mismatch_token_frac"] == 0.0
        assert r["rollout_corr/train_rollout_logprob_abs_diff"] < 1e-5
    assert frac[2] > 0 and frac[4] > 0  # one update later the trainer's routers choose otherwise
    assert all(r["rollout/trained_samples"] > 0 and r["train/grad_norm"] > 0 for r in steps.values())
