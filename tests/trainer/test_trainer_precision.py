"""The main job's `--bf16` / `--fp16` (Megatron's mixed precision, `slime_corr.mcore.precision`): the precision
notice, and real runs through `python -m slime_corr.main` on the embedded engine: the checkpoint holds 16-bit model
weights and fp32 main weights (Megatron's optimizer), the fp16 run logs its loss scale, a `--bf16` run resumed
from a checkpoint logs what the uninterrupted run logs, and runs under parallel layouts (`--bf16` at TP=2 and at
DP=2 with packed micro-batches, `--fp16` at TP=2) log what the one-process run of their precision logs, to 16-bit
rounding. The flags refused at parse time are in tests/trainer/test_trainer_units.py's BAD_FLAGS.

CI cost: 3 one-process runs and 3 two-process launches, about 40 s here (the first run ~20 s: it starts the
fork server of tests/job_runner.py; each two-process launch 3-4 s).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from slime_corr.main import parse_run_config
from slime_corr.trainer.agreement import precision_notice
from tests.job_runner import run_main_job

pytestmark = pytest.mark.cost(50)  # CI seconds, roughly (tests/conftest.py runs the costliest modules first)

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--rollout-correction-preset", "decoupled_seq_is_rs", "--num-rollout", "2", "--num-steps-per-rollout", "2",
          "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--micro-batch-size", "2",
          "--rollout-max-response-len", "8", "--kl-loss-coef", "0.01", "--rollout-progress", "none", "--seed", "7",
          "--rollout-engine", "embedded",
          # Small steps (the tiny model's default is 1e-2): no token of the second step lies near the PPO clip (the
          # parallel layouts compare their metrics to rounding: test_16_bit_parallel_layouts_log_what_one_process_logs)
          "--lr", "3e-4"]


def test_the_trainer_precision_and_the_notice_follow_the_flags():
    default = parse_run_config(["--self-check"]).trainer
    assert not default.precision.mixed and default.trainer_dtype == "float32" and default.engine_dtype == "bfloat16"
    bf16 = parse_run_config(["--bf16", "--self-check"]).trainer
    assert bf16.precision.bf16 and bf16.trainer_dtype == "bfloat16"
    fp16 = parse_run_config(["--fp16", "--loss-scale", "128", "--self-check"]).trainer
    assert fp16.precision.loss_scale == 128 and fp16.trainer_dtype == "float16"
    assert precision_notice("bfloat16", "float32", corrects=False) is not None  # the default pairing
    assert precision_notice("bfloat16", "bfloat16", corrects=False) is None  # --bf16 with the default engine
    note = precision_notice("bfloat16", "float16", corrects=False)
    assert note is not None and "--engine-dtype float16 matches the trainer" in note
    assert precision_notice("float32", "bfloat16", corrects=False) is not None  # a 16-bit trainer, fp32 engine
    assert precision_notice("float32", "bfloat16", corrects=True) is None


def launch(run_dir: Path, *flags: str, nproc: int = 0) -> dict:
    """The main job in a process of its own, or its `nproc` torchrun ranks (tests/job_runner.py); its output and
    metrics by step."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    proc = run_main_job([*COMMON, "--work-dir", str(run_dir), *flags], nproc=nproc, timeout=600, cwd=ROOT, env=env,
                        output_dir=run_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"out": proc.stdout, "steps": {r["step"]: r for r in records}}


def compared(record: dict) -> dict:
    """The metrics that must not depend on time."""
    return {k: v for k, v in record.items() if k != "time" and not k.startswith("perf/")}


def saved_dtypes(iteration_dir: Path) -> dict[str, str]:
    """Tensor name -> dtype of a dist_checkpointing checkpoint."""
    metadata = FileSystemReader(str(iteration_dir)).read_metadata().state_dict_metadata
    return {k: str(v.properties.dtype) for k, v in metadata.items() if hasattr(v, "properties")}


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bf16")
    return {**launch(run_dir, "--bf16", "--save", str(run_dir / "ckpt"), "--save-interval", "1"), "dir": run_dir}


def test_bf16_trains_16_bit_weights_with_fp32_main_weights(bf16_run):
    steps = bf16_run["steps"]
    assert sorted(steps) == [1, 2, 3, 4]
    assert "embedded engines (bfloat16; trainer in bfloat16)" in bf16_run["out"]
    assert "slime_corr.main: note:" not in bf16_run["out"]  # a matched pair
    for s in steps.values():
        assert all(math.isfinite(v) for k, v in s.items() if isinstance(v, float)), s
        assert "train/loss_scale" not in s and "train/skipped_steps" not in s  # bf16: no loss scaler, no skips
    assert "loss_scale=" not in bf16_run["out"] and "skipped=" not in bf16_run["out"]
    assert steps[2]["train/ppo_kl"] != 0  # the weights moved
    dtypes = saved_dtypes(bf16_run["dir"] / "ckpt" / "iter_0000004")
    weight = "decoder.layers.mlp.linear_fc1.weight"  # the layers stacked
    assert dtypes[weight] == "torch.bfloat16"
    assert dtypes[f"optimizer.state.fp32_param.{weight}"] == "torch.float32"  # Megatron's main params
    assert dtypes[f"optimizer.state.exp_avg.{weight}"] == "torch.float32"


def test_a_resumed_bf16_run_continues_as_the_uninterrupted_one(bf16_run, tmp_path):
    resumed = launch(tmp_path / "resumed", "--bf16", "--load", str(bf16_run["dir"] / "ckpt"), "--ckpt-step", "2")
    assert "resumed from" in resumed["out"] and "rollout 1, step 2" in resumed["out"]
    assert sorted(resumed["steps"]) == [3, 4]
    assert {s: compared(r) for s, r in resumed["steps"].items()} == \
        {s: compared(bf16_run["steps"][s]) for s in (3, 4)}


FP16_SCALING = ("--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "3")


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("fp16"), *FP16_SCALING)


def test_fp16_scales_the_loss_and_logs_the_scale(fp16_run):
    steps = fp16_run["steps"]
    assert sorted(steps) == [1, 2, 3, 4]
    assert "embedded engines (bfloat16; trainer in float16)" in fp16_run["out"]
    assert "loss_scale=" in fp16_run["out"] and "skipped=" in fp16_run["out"]
    for s in steps.values():
        assert math.isfinite(s["train/loss"]) and math.isfinite(s["train/grad_norm"]), s
        assert s["train/skipped_steps"] == 0
    # no overflow at 1024: the scale doubles after every 3 good steps (Megatron's DynamicGradScaler)
    assert [steps[k]["train/loss_scale"] for k in (1, 2, 3, 4)] == [1024.0, 1024.0, 2048.0, 2048.0]


def test_an_fp16_run_whose_scaler_skips_every_step_says_so(tmp_path):
    """Megatron's default initial loss scale (2^32) overflows fp16 for the first ~20 steps: a 4-step run trains
    nothing. Each step line says trained=0 skipped=1, the first skipped step a notice, the end of the run and the
    report a warning with the fix (--initial-loss-scale)."""
    run = launch(tmp_path / "run", "--fp16")
    steps, out = run["steps"], run["out"]
    assert [steps[k]["train/skipped_steps"] for k in (1, 2, 3, 4)] == [1.0] * 4
    assert all(steps[k]["rollout/trained_samples"] == 0 for k in (1, 2, 3, 4))
    assert len(re.findall(r"step \d+: trained=0 .*skipped=1", out)) == 4, out
    assert out.count("slime_corr.main: note: step 1: the fp16 loss scaler skipped this step") == 1
    assert "slime_corr.main: warning: the fp16 loss scaler skipped every one of the run's 4 optimizer steps" in out
    assert "--initial-loss-scale 65536" in out
    report = subprocess.run([sys.executable, "-m", "slime_corr.cli", "report", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=120)
    assert "warning: the fp16 loss scaler skipped every one of the run's 4 optimizer steps" in report.stdout, \
        report.stdout + report.stderr


UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}  # 8 and 11 significant bits
NOISE_RATIOS = ("k3_share", "mismatch_share")  # shares of a k3 that is rounding noise in the one-process run
LAYOUTS = {  # name: (precision, processes, flags)
    "bf16_tp2": ("bf16", 2, ("--bf16", "--tensor-model-parallel-size", "2")),
    # one GRPO group per DP rank and step (4 samples of up to 24 tokens): one packed micro-batch of up to 96 tokens
    "bf16_dp2_packed": ("bf16", 2, ("--bf16", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "96")),
    "fp16_tp2": ("fp16", 2, (*FP16_SCALING, "--tensor-model-parallel-size", "2")),
}


def assert_close_to_16_bit_rounding(got: dict, want: dict, precision: str, tag: str) -> None:
    """Steps 1-2 (the first rollout) of two runs in `precision`: the rollouts equal, the other metrics within
    |got - want| <= 2u + (8u + 1/n)|want| (+ 1/n for a token fraction), u the dtype's unit roundoff, n the step's
    trained tokens. Why: a 16-bit forward that reduces in another order (TP's split matmuls, packed rows) moves each
    token's log-prob by about u (measured, TP=2 vs one process in bf16: mean 7e-4, at most 4e-3 nats), so what
    averages log-probs (ppo_kl, KL, chi2, IS weights) moves by a few u in absolute terms and what multiplies them
    (loss, gradient norm) by a few u relatively; and a token within rounding of the PPO clip or an IS bound can
    land on its other side, moving a token fraction by 1/n and the loss and gradient norm by about its share."""
    u = UNIT_ROUNDOFF[precision]
    for step in (1, 2):
        g, w = compared(got[step]), compared(want[step])
        assert set(g) == set(w), f"{tag} step {step}: keys differ {set(g) ^ set(w)}"
        n = w["rollout_corr/mis_valid_token_count"]
        for key, value in w.items():
            if key.startswith("rollout/") or value is None or g[key] is None:
                assert g[key] == value, f"{tag} step {step} {key}: {g[key]} != {value}"
            elif not key.endswith(NOISE_RATIOS):
                tol = 2 * u + (8 * u + 1 / n) * abs(value) + (1 / n if "frac" in key else 0.0)
                assert abs(g[key] - value) <= tol, f"{tag} step {step} {key}: {g[key]} != {value} (tol {tol:.3g})"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_16_bit_parallel_layouts_log_what_one_process_logs(layout, bf16_run, fp16_run, tmp_path):
    """TP=2, DP=2 with packed micro-batches: Megatron's mixed-precision optimizer reduces the fp32 main gradients
    over DP, their norm and (fp16) the overflow check over TP, and the engine gets the 16-bit weights gathered from
    the TP shards. Compared with the one-process run of the same precision (seed 7), the first rollout samples the
    same tokens (the same initial weights) and its two steps log the same metrics to 16-bit rounding
    (`assert_close_to_16_bit_rounding`). Measured, seeds 7, 8 and 9: the worst metric took 0.37 of its tolerance
    (bf16 TP=2, chi2_seq, 2.9e-3 absolute), fp16 TP=2 0.16, DP=2 packed 0.02; no token clipped at step 2 (ppo_kl
    at most 0.01). At lr 1e-2 11 of 64 tokens clipped at step 2 (ppo_kl 0.046), and on an AVX-512-FP16 CPU (Sapphire
    Rapids) one of them crossed the clip under fp16 TP=2: the gradient norm moved 5.4 %, 2.6 times its tolerance (a
    token's share of the norm is its own gradient's, not 1/n): hence the module's small --lr. The second rollout is
    not compared number by number: Adam scales each element's update by that element's own gradient RMS, so elements
    whose gradient is rounding noise step by ±lr either way: the engine then samples other tokens, and the rewards
    differ."""
    precision, nproc, flags = LAYOUTS[layout]
    want = {"bf16": bf16_run, "fp16": fp16_run}[precision]
    run = launch(tmp_path / layout, *flags, nproc=nproc)
    out = run["out"]
    assert f"({nproc} process(es))" in out and out.count("embedded engines") == 1
    assert ("micro-batches: packed" in out) == ("packed" in layout)
    assert sorted(run["steps"]) == sorted(want["steps"]) == [1, 2, 3, 4]
    assert_close_to_16_bit_rounding(run["steps"], want["steps"], precision, layout)
    for step in (3, 4):
        g, w = compared(run["steps"][step]), compared(want["steps"][step])
        assert set(g) == set(w), f"{layout} step {step}: keys differ {set(g) ^ set(w)}"
        assert all(math.isfinite(v) for k, v in g.items() if k.startswith("train/") and isinstance(v, float)), g
    for key in ("train/loss_scale", "train/skipped_steps"):  # fp16: the same scaler history, no overflow; bf16: none
        got, expected = ([steps[s].get(key) for s in (1, 2, 3, 4)] for steps in (run["steps"], want["steps"]))
        assert got == expected and (precision == "fp16") == (None not in got), (key, got, expected)
