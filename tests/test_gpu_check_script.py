"""scripts/gpu_check.sh in CI (no GPU): its syntax, its plan, and its CPU-runnable parts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args: str, tmp_path: Path, env: dict[str, str] | None = None, timeout: int = 300
         ) -> tuple[subprocess.CompletedProcess, str]:
    report = tmp_path / "report.md"
    full_env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run(["bash", str(SCRIPT), *args, "--report", str(report)], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, report.read_text() if report.exists() else ""


def test_syntax() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_plans_every_step(tmp_path: Path) -> None:
    proc, report = _run("--dry-run", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for needle in ("torch==", "-m device --device cuda", "test_mcore_device.py",
                   "slime_corr.main --rollout-engine sglang --num-rollout 2", "pytest -q -m sglang",
                   "vs_verl.py --device cuda --compile", "bench/e2e.py", "dry run: nothing was run"):
        assert needle in report, needle


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    proc, _ = _run("--only", "tests,gpus", tmp_path=tmp_path)
    assert proc.returncode == 2 and "unknown step 'gpus'" in proc.stderr


def test_cpu_mode_runs_the_device_subset(tmp_path: Path) -> None:
    """The CPU-runnable parts: the device subset on the CPU and the meta checks (a few cases, to stay short)."""
    proc, report = _run("--cpu", "--only", "env,install,tests,sglang,e2e", tmp_path=tmp_path,
                        env={"GPU_CHECK_PYTEST_K": "packed_rows_create_tensors_on_the_inputs_device or "
                                                      "matches_cpu and token_is and fp64 or step_report"})
    assert proc.returncode == 0, report + proc.stderr
    assert report.count(": PASS") == 3 and "FAIL" not in report, report
    assert "sglang: the real server: SKIP" in report and "RESULT: every step passed or was skipped" in report


@pytest.mark.slow
def test_cpu_mode_whole(tmp_path: Path) -> None:
    """Every CPU-runnable step, the bench included (fetches verl's wheel once into bench/.cache)."""
    proc, report = _run("--cpu", tmp_path=tmp_path, timeout=900)
    assert proc.returncode == 0, report
