"""The main job through its entry point (`python -m slime_corr.main`'s code: tests/job_runner.py forks each process
with the imports done) as one process and as the 2 and 4 ranks torchrun starts (DP=2 packed, TP=2, CP=2 packed,
PP=2, TP=2×DP=2; the README's torchrun commands run under real torchrun in tests/test_readme_commands.py), real
embedded engine on loopback, real gloo groups, real Megatron schedule (1F1B over gloo p2p under PP).

Every run trains the same seed and batch in float64 (engine in float32) with decoupled PPO, sequence IS + RS, a KL
term to the reference policy and an entropy bonus, 2 rollouts × 2 optimizer steps: the parallel runs must print
from one rank, start one engine, and log the metrics of the one-process run (padded micro-batches of 2 samples):
also with packed micro-batches (`--use-dynamic-batch-size --max-tokens-per-gpu`, whole GRPO groups, DP ranks filled
up with empty micro-batches to equal counts) and at PP=2 (saving a checkpoint after each rollout, which must not
change the run). The same command twice gives the same metrics; a run saved after each rollout logs what the
uninterrupted run logs, and resumed from step 2 logs steps 3–4 as it does; the asynchronous loop samples one step
behind and the bypass correction measures that lag.

CI cost: 5 one-process runs and 5 launches of 2 or 4 ranks, ~1 minute here (a fresh interpreter per process made it
~3).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.job_runner import run_main_job

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--rollout-correction-preset", "decoupled_seq_is_rs", "--num-rollout", "2", "--num-steps-per-rollout", "2",
          "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--micro-batch-size", "2",
          "--rollout-max-response-len", "8", "--params-dtype", "float64", "--engine-dtype", "float32",
          "--kl-loss-coef", "0.01", "--kl-loss-type", "k3", "--entropy-coef", "0.001", "--rollout-progress", "none",
          "--seed", "7", "--rollout-engine", "embedded"]  # bit-reproducible: runs are compared number for number

pytestmark = pytest.mark.cost(220)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

PACKED = ["--use-dynamic-batch-size", "--max-tokens-per-gpu"]
LAYOUTS = {  # name: (processes, flags)
    # 2 groups of 68 or 72 tokens per DP rank and step: 140 tokens hold both on one rank and not on the other
    "dp2_packed": (2, [*PACKED, "140"]),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "cp2_packed": (2, ["--context-parallel-size", "2", *PACKED, "80"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2", "--save-interval", "1"]),
    "tp2_dp2": (4, ["--tensor-model-parallel-size", "2"]),
}


def _env() -> dict[str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return env


def launch(run_dir: Path, *flags: str, nproc: int = 0, timeout: int = 300) -> dict:
    """Run the main job (its `nproc` torchrun ranks, else one process: tests/job_runner.py); its output and
    metrics by step."""
    proc = run_main_job([*COMMON, "--work-dir", str(run_dir), *flags], nproc=nproc, env=_env(), timeout=timeout,
                        output_dir=run_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"out": proc.stdout, "err": proc.stderr, "steps": {r["step"]: r for r in records}, "dir": run_dir}


def compared(record: dict) -> dict:
    """The metrics that must not depend on time."""
    return {k: v for k, v in record.items() if k != "time" and not k.startswith("perf/")}


def assert_same_metrics(got: dict, want: dict, tag: str) -> None:
    """Loss-side metrics to 1e-9 relative (float64 reductions in another order), rollouts exactly, correction
    metrics and diagnostics to 1e-8 absolute (the engine's float32 log-probs enter them)."""
    assert sorted(got) == sorted(want), tag
    for step, w in want.items():
        g = compared(got[step])
        w = compared(w)
        assert set(g) == set(w), f"{tag} step {step}: keys differ {set(g) ^ set(w)}"
        for key, value in w.items():
            if key.startswith("rollout/"):
                assert g[key] == value, f"{tag} step {step} {key}: {g[key]} != {value}"
            elif value is None or g[key] is None:
                assert g[key] == value, f"{tag} step {step} {key}"
            else:
                tol = 1e-9 * max(1.0, abs(value)) if key.startswith("train/") else 1e-8
                assert abs(g[key] - value) <= tol, f"{tag} step {step} {key}: {g[key]} != {value}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("one_process"))


def test_several_updates_per_rollout_make_clipping_act(reference):
    steps = reference["steps"]
    assert sorted(steps) == [1, 2, 3, 4]
    for first in (1, 3):  # lp_old is computed with the weights of the rollout's first update: ratio 1 there
        assert steps[first]["train/pg_clipfrac"] == 0 and steps[first]["train/ppo_kl"] == 0
        assert steps[first]["rollout_corr/ois"] == 1.0
        second = steps[first + 1]  # then pi_theta != pi_old: the ratio moves, PPO clips
        assert second["train/pg_clipfrac"] > 0 and second["train/ppo_kl"] != 0
        assert second["rollout_corr/ois"] != 1.0
        assert steps[first]["rollout/reward_mean"] == second["rollout/reward_mean"]  # same rollout
    assert steps[1]["train/kl_loss"] == 0 < steps[2]["train/kl_loss"]  # the policy leaves its reference
    assert all(s["train/entropy"] > 0 for s in steps.values())
    assert [steps[k]["rollout/staleness_mean"] for k in (1, 2, 3, 4)] == [0, 1, 0, 1]
    assert steps[2]["diag/lag/1/token_frac"] == 1.0
    assert reference["out"].count("embedded engines") == 1
    assert all(s["perf/micro_batches"] == 8 and s["perf/empty_micro_batches"] == 0 for s in steps.values())
    for s in steps.values():  # sequence RS: on whom the rejection fell (correction/rejection_outcomes.py)
        rejected = s["rollout_corr/mis_rejected_seq_fraction"]
        split = s["rollout_corr/mis_rejected_seq_pos_adv_fraction"] + s["rollout_corr/mis_rejected_seq_neg_adv_fraction"]
        assert 0 <= split <= 1 and (rejected > 0 or split == 0)  # (a group of equal rewards has advantage 0)
        assert s["rollout_corr/mis_kept_seq_reward_mean"] == pytest.approx(s["rollout/reward_mean"], abs=0.5)


def test_the_same_command_twice_gives_the_same_metrics(reference, tmp_path):
    again = launch(tmp_path / "again")
    assert {s: compared(r) for s, r in again["steps"].items()} == \
        {s: compared(r) for s, r in reference["steps"].items()}


def test_a_resumed_run_continues_as_the_uninterrupted_one(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = launch(tmp_path / "first", "--save", str(ckpt), "--save-interval", "1")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4\n"
    assert {s: compared(r) for s, r in first["steps"].items()} == \
        {s: compared(r) for s, r in reference["steps"].items()}  # saving after rollout 1 changed nothing
    resumed = launch(tmp_path / "resumed", "--load", str(ckpt), "--ckpt-step", "2")
    assert "resumed from" in resumed["out"] and "rollout 1, step 2" in resumed["out"]
    assert sorted(resumed["steps"]) == [3, 4]
    assert {s: compared(r) for s, r in resumed["steps"].items()} == \
        {s: compared(reference["steps"][s]) for s in (3, 4)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torchrun_layouts_train_like_one_process(layout, reference, tmp_path):
    nproc, flags = LAYOUTS[layout]
    if "--save-interval" in flags:
        flags = [*flags, "--save", str(tmp_path / "ckpt")]
    run = launch(tmp_path / layout, *flags, nproc=nproc)
    out = run["out"]
    assert re.findall(r"^step (\d+):", out, re.M) == ["1", "2", "3", "4"], out  # one console
    assert out.count("embedded engines") == 1 and "1 engine(s)" in out  # one driver, one engine
    assert f"({nproc} process(es))" in out
    assert_same_metrics(run["steps"], reference["steps"], layout)
    assert run["steps"][2]["train/pg_clipfrac"] > 0
    steps = run["steps"].values()
    if "packed" in layout:  # fewer micro-batches than padded; DP ranks equal, filled up with empty ones
        assert "micro-batches: packed" in out
        assert all(s["perf/micro_batches"] < 8 for s in steps)
        assert any(s["perf/empty_micro_batches"] > 0 for s in steps) == layout.startswith("dp2"), layout
    if layout == "pp2":
        assert "PP=2" in out and (tmp_path / "ckpt" / "iter_0000002" / "metadata.json").is_file()


def test_async_rollout_samples_one_step_behind_and_the_correction_sees_it(tmp_path):
    run = launch(tmp_path / "async", "--async-rollout", "--rollout-correction-preset", "ppo_is_bypass",
                 "--num-steps-per-rollout", "1", "--num-rollout", "3", "--engine-dtype", "float64",
                 "--kl-loss-coef", "0", "--entropy-coef", "0")
    steps = run["steps"]
    assert "asynchronous" in run["out"]
    assert [steps[s]["rollout/staleness_mean"] for s in (1, 2, 3)] == [0, 1, 1]
    assert [steps[s]["diag/lag/mean"] for s in (1, 2, 3)] == [0, 1, 1]
    top = [json.loads(line) for line in (run["dir"] / "top_mismatch.jsonl").read_text().splitlines()]
    assert {t["step"] for t in top} == {1, 2, 3}
    for t in top:  # rollout k+1 was sampled while step k trained: with the weights of step k - 1
        assert t["weight_version"] == f"step-{max(0, t['step'] - 2)}"
    # bypass: lp_old = lp_rollout at every update. The float64 engine matches the trainer at the same weights
    # (step 1; the samples keep float32 log-probs), and from step 2 on the policy is one update ahead of the
    # samples: the ratio and the mismatch metrics see the lag (k3 ~ 3e-2 here, vs 2e-14 without lag)
    assert abs(steps[1]["train/ppo_kl"]) < 1e-6 and steps[1]["rollout_corr/mismatch_k3_kl"] < 1e-12
    assert steps[1]["train/pg_clipfrac"] == 0
    for s in (2, 3):
        assert abs(steps[s]["train/ppo_kl"]) > 1e-3 and steps[s]["rollout_corr/mismatch_k3_kl"] > 1e-3
        assert steps[s]["train/pg_clipfrac"] > 0


@pytest.mark.parametrize("sync", ["disk", "distributed"])
def test_a_standalone_embedded_engine_at_sglang_url_trains_as_the_job_s_own(sync, reference, tmp_path):
    """`--rollout-engine embedded --sglang-url URL` at `python -m slime_corr.engines.embedded.engine` (started
    with a TinyCausalLM of its own): the first push is a checkpoint that names the trainer's module
    (`engine_module.json`), later ones by `--rollout-weight-sync`; the run logs what the job with its own engine
    logs."""
    from slime_corr.engines.group import spawn_local_engine

    with spawn_local_engine(fp32=True) as engine:
        run = launch(tmp_path / sync, "--sglang-url", engine.url, "--rollout-weight-sync", sync)
    assert f"embedded engines at {engine.url}" in run["out"]
    assert re.findall(rf"weight sync \({sync}\): (step-\d)", run["out"]) == ["step-2", "step-4"], run["out"]
    assert_same_metrics(run["steps"], reference["steps"], f"standalone engine, {sync} sync")
