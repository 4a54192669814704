"""The main job's `--bf16` / `--fp16` (Megatron's mixed precision, `slime_corr.mcore.precision`): the precision
notice, and real runs through `python -m slime_corr.main` on the embedded engine: the checkpoint holds 16-bit model
weights and fp32 main weights (Megatron's optimizer), the fp16 run logs its loss scale, and a `--bf16` run resumed
from a checkpoint logs what the uninterrupted run logs. The flags refused at parse time are in
tests/trainer/test_trainer_units.py's BAD_FLAGS.

CI cost: 3 one-process runs (~10 s each).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from slime_corr.main import parse_run_config
from slime_corr.trainer.agreement import precision_notice

pytestmark = pytest.mark.cost(40)  # CI seconds, roughly (tests/conftest.py runs the costliest modules first)

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--rollout-correction-preset", "decoupled_seq_is_rs", "--num-rollout", "2", "--num-steps-per-rollout", "2",
          "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--micro-batch-size", "2",
          "--rollout-max-response-len", "8", "--kl-loss-coef", "0.01", "--rollout-progress", "none", "--seed", "7",
          "--rollout-engine", "embedded"]


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


def launch(run_dir: Path, *flags: str) -> dict:
    """The main job in a subprocess; its output and metrics by step."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-m", "slime_corr.main", *COMMON, "--work-dir", str(run_dir), *flags],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
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
        assert s["train/loss_scale"] == 1.0 and s["train/skipped_steps"] == 0  # bf16: no loss scaling
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


def test_fp16_scales_the_loss_and_logs_the_scale(tmp_path):
    run = launch(tmp_path / "fp16", "--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "3")
    steps = run["steps"]
    assert sorted(steps) == [1, 2, 3, 4]
    assert "embedded engines (bfloat16; trainer in float16)" in run["out"]
    assert "loss_scale=" in run["out"] and "skipped=" in run["out"]
    for s in steps.values():
        assert math.isfinite(s["train/loss"]) and math.isfinite(s["train/grad_norm"]), s
        assert s["train/skipped_steps"] == 0
    # no overflow at 1024: the scale doubles after every 3 good steps (Megatron's DynamicGradScaler)
    assert [steps[k]["train/loss_scale"] for k in (1, 2, 3, 4)] == [1024.0, 1024.0, 2048.0, 2048.0]
