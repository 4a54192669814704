"""scripts/gpu_check.sh in CI (no GPU): its arguments, its plan, its SKIP reasons without a GPU, the offline install
from a wheel folder (only what the interpreter lacks, never from an index), and its CPU-runnable parts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.cost(30)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
GPU_STEPS = ("device", "failing", "main", "sglang", "megatron", "kernels", "e2e")


def _run(*args: str, tmp_path: Path, env: dict[str, str] | None = None, timeout: int = 300
         ) -> tuple[subprocess.CompletedProcess, str]:
    report = tmp_path / "report.md"
    full_env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT),
                "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # a closed port: an index use fails at once
                "GPU_CHECK_SITE": str(tmp_path / "site"), **(env or {})}
    proc = subprocess.run(["bash", str(SCRIPT), *args, "--report", str(report)], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, report.read_text() if report.exists() else ""


def test_syntax() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_plans_every_step_with_the_given_python_and_no_download(tmp_path: Path) -> None:
    proc, report = _run("--dry-run", "--python", sys.executable, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for needle in ("-m device --device cuda tests/correction/test_device.py", "test_mcore_device.py",
                   "test_compiled_equals_eager[cfg0-dtype0-1e-10]", "test_packed_under_torch_compile_matches_eager",
                   "test_presets_on_one_rank_padded_and_packed_match_the_reference",
                   "test_token_budget_packed_step_equals_the_padded_step",
                   "slime_corr.main --num-rollout 2 --device cuda --rollout-engine embedded",
                   "--rollout-engine sglang", "-m sglang tests/real_sglang", "tests/mcore/test_megatron_lm.py",
                   "vs_verl.py --device cuda --fused --threads 1", "vs_verl.py --device cuda --compile", "bench/e2e.py",
                   "kernels: Triton kernels compiled on cuda against the torch paths: kernels_on_gpu",
                   "bench/logprobs.py --device cuda --variants ours,ours-triton,megatron,verl,liger",
                   f"python: {sys.executable}", "## Summary", "dry run: nothing was run"):
        assert needle in report, needle
    assert "-m venv" not in report and "pip install" not in report and "torch==" not in report


def test_the_script_never_downloads() -> None:
    """No venv, no index, no URL: the only pip call installs local wheels with --no-index."""
    text = SCRIPT.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"\b(curl|wget|pip download)\b|-m venv|https?://", code), "a download in the script"
    installs = [line for line in code.splitlines() if "pip install" in line]
    assert installs and all("--no-index" in line and "--no-deps" in line for line in installs), installs
    assert "PIP_NO_INDEX=1" in code and "HF_HUB_OFFLINE=1" in code


@pytest.mark.parametrize(("args", "message"), [
    (("--only", "device,gpus"), "--only: unknown step 'gpus'"),
    (("--gpus", "2"), "unknown argument '--gpus'"),
    (("--python", "/nonexistent/python3"), "--python /nonexistent/python3: no such interpreter"),
    (("--wheels", "/nonexistent/wheels"), "--wheels /nonexistent/wheels: no such directory"),
    (("--only",), "--only needs a value"),
])
def test_bad_arguments_are_named(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_without_a_gpu_every_gpu_step_is_skipped_with_its_reason(tmp_path: Path) -> None:
    proc, report = _run("--python", sys.executable, "--only", ",".join(("env", *GPU_STEPS)), tmp_path=tmp_path)
    assert proc.returncode == 0, report + proc.stderr
    assert "### env: python, torch, CUDA, packages: PASS" in report and "available False" in report
    for step in GPU_STEPS:
        assert re.search(rf"^\| {step} \| SKIP \| no GPU: torch \S+ sees none", report, re.M), (step, report)
    assert "FAIL" not in report and "RESULT: every step passed or was skipped" in report


def _wheel(folder: Path, dist: str, version: str = "1.0") -> Path:
    """A minimal pure-Python wheel of package `dist` (a module that says its name)."""
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}/__init__.py", f"NAME = {dist!r}\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_wheels_install_only_what_the_interpreter_lacks_from_the_folder(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "gpu_check_demo")
    _wheel(wheels, "torch", "0.0.1")  # the interpreter has torch: never replaced
    calls = tmp_path / "calls.txt"
    python = tmp_path / "python"  # logs every call, then runs the real interpreter
    python.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    proc, report = _run("--python", str(python), "--wheels", str(wheels), "--only", "wheels", tmp_path=tmp_path)
    assert proc.returncode == 0, report + proc.stderr
    site = tmp_path / "site"
    assert (site / "gpu_check_demo" / "__init__.py").is_file() and not (site / "torch").exists()
    assert "have torch" in report and "installed into" in report
    pip_calls = [c for c in calls.read_text().splitlines() if c.startswith("-m pip install")]
    assert len(pip_calls) == 1 and "--no-index" in pip_calls[0] and "--no-deps" in pip_calls[0], pip_calls
    proc, report = _run("--python", str(python), "--wheels", str(wheels), "--only", "wheels", tmp_path=tmp_path)
    assert proc.returncode == 0 and "nothing missing" in report, report  # a rerun finds it installed


def test_cpu_mode_runs_the_device_subset_and_the_meta_checks(tmp_path: Path) -> None:
    """The CPU-runnable parts (a few cases of each test file, to stay short: none that spawns processes)."""
    proc, report = _run("--cpu", "--only", "env,device,meta,sglang,e2e", tmp_path=tmp_path, env={
        "GPU_CHECK_PYTEST_K": "matches_cpu and token_is and fp64 or rng_states or step_report "
                              "or engines_model_and_forward"})
    assert proc.returncode == 0, report + proc.stderr
    assert report.count(": PASS") == 4 and "FAIL" not in report, report
    assert "| sglang | SKIP | CPU mode" in report and "RESULT: every step passed or was skipped" in report


@pytest.mark.slow
def test_cpu_mode_whole(tmp_path: Path) -> None:
    """Every CPU-runnable step (the bench when verl's wheel is in bench/.cache)."""
    proc, report = _run("--cpu", tmp_path=tmp_path, timeout=1800)
    assert proc.returncode == 0, report
