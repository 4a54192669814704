"""The main job end to end: embedded engine (real HTTP) -> rollout -> Megatron GPTModel steps -> weight sync.
(Parallel launches, resume and the asynchronous loop: tests/trainer/test_trainer_launch.py.) The runs are processes
forked from tests/job_runner.py's server; the refused flags go through a fresh interpreter, the entry point as typed."""

import re
import subprocess
import sys

from tests.job_runner import run_main_job


def run_main(tmp_path, *extra):
    cmd = ["--num-rollout", "2", "--num-steps-per-rollout", "1",
           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--micro-batch-size", "4",
           "--rollout-max-response-len", "8", "--rollout-progress", "none", "--work-dir", str(tmp_path),
           "--rollout-engine", "embedded", *extra]
    proc = run_main_job(cmd, timeout=240, output_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = re.findall(r"^step (\d+): trained=(\d+) failed=0 .*train_rollout_logprob_abs_diff=(\S+)", proc.stdout, re.M)
    assert [s[:2] for s in steps] == [("1", "4"), ("2", "4")], proc.stdout
    assert re.findall(r"weight sync \(disk\): (step-\d)", proc.stdout) == ["step-1", "step-2"]
    return [float(s[2]) for s in steps]


def test_main_job_measures_a_real_bf16_mismatch_and_none_in_fp32(tmp_path):
    bf16 = run_main(tmp_path / "bf16", "--rollout-correction-preset", "decoupled_token_is")
    fp32 = run_main(tmp_path / "fp32", "--rollout-correction-preset", "decoupled_token_is",
                    "--engine-dtype", "float32")
    # Same weights on both sides (the engine was synced after step 1): fp32 rollout log-probs equal the
    # trainer's up to kernel rounding, bf16 ones differ by a real amount.
    assert max(fp32) < 1e-4
    assert min(bf16) > 10 * max(fp32)


def test_main_job_rejects_bad_flags_before_starting(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "slime_corr.main", "--use-rollout-logprobs", "--use-tis"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "corrects twice" in proc.stderr and "embedded engine" not in proc.stdout


def test_main_job_stops_with_one_line_on_negative_custom_weights(tmp_path):
    """A custom weighting function's negative weights (they would flip the gradient) end the run at the first step
    with one line naming the function, not a traceback (counted on the device, raised when the metrics are read)."""
    f = tmp_path / "neg_tis.py"
    f.write_text("import torch\nfrom slime_corr.correction import WeightOutputs\n"
                 "def negative(inputs, config):\n"
                 "    return WeightOutputs(weights=-torch.ones_like(inputs.log_ratio), loss_mask=inputs.loss_mask)\n")
    cmd = ["--num-rollout", "2", "--num-steps-per-rollout", "1",
           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--micro-batch-size", "4",
           "--rollout-max-response-len", "4", "--rollout-progress", "none", "--work-dir", str(tmp_path / "run"),
           "--use-tis", "--custom-tis-function-path", f"{f}:negative", "--rollout-engine", "embedded"]
    proc = run_main_job(cmd, timeout=240, output_dir=tmp_path / "output")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"slime_corr.main: error: --custom-tis-function-path {f}:negative returned 16 negative weight(s)" \
        in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "step 2:" not in proc.stdout
