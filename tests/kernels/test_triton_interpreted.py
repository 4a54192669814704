"""The project's Triton kernels, checked on CPU under Triton's interpreter against their torch paths
(tests/kernels/triton_interpreted.py, in a process of its own: the interpreter is chosen when the kernels are
defined). The log-prob function's: values, gradients, temperatures, bf16 / fp16 / fp32 logits, the entropy as metric
or in the loss, the top-k / top-p kept set, no tokens, and TP=2. The correction's token pass: lr, the per-sequence
sums and max d against the eager pass, on uneven, empty and non-finite rows. They prove the kernels' values, not
their speed or their compilation on a GPU (scripts/gpu_check.sh does that where a GPU is lent).

triton is not in .venv (megatron-core 0.16 would pick it up); scripts/test_mcore019.sh's overlay has it, so these
run in the megatron-core 0.19 run of scripts/test.sh and skip in the first."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = [f"{d}-t{t}-entropy_{e}" for d in ("fp32", "bf16", "fp16") for t in (1.0, 0.7)
         for e in ("none", "metric", "loss")] + ["top_k5-top_p1.0", "top_k0-top_p0.8", "top_k20-top_p0.6",
                                                   "no tokens", "tp2"] + \
    [f"token_pass-{r}x{s}" for r, s in ((6, 150), (1, 1), (0, 8), (5, 64))] + ["correction-decoupled_seq_is_rs"]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed here: scripts/test_mcore019.sh runs these (its "
                                       "overlay has triton)")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("triton") / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.triton_interpreted", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_the_kernel_equals_the_torch_path_under_the_interpreter(interpreted, case):
    failures = {k: v for k, v in interpreted.items() if k not in CASES}  # a group of cases that raised
    assert not failures, failures
    assert interpreted.get(case) == "ok", interpreted.get(case, f"{case} did not run")
