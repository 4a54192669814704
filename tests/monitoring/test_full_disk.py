"""A full disk is one named error ("no space left on DEVICE while writing PATH"), on real small filesystems (tmpfs
mounts of a few KiB this test makes, where the machine lets it: root; under CI the mount must work): metrics.jsonl
never ends in a partial line, a half-written checkpoint is removed and the tracker still names the last complete
one, the report's files too. `slime_corr/disk.py`."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slime_corr.disk import append_line, device_of
from slime_corr.errors import DiskWriteError
from tests.job_runner import job_env, run_main_job

pytestmark = pytest.mark.cost(45)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

JOB = ["--rollout-engine", "embedded", "--num-rollout", "6", "--num-steps-per-rollout", "2", "--rollout-batch-size",
       "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6", "--rollout-progress", "none", "--seed",
       "5"]


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` for the block (unmounted after)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"CI cannot mount a small tmpfs for the full-disk tests: {mounted.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs here (root only): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_record_that_does_not_fit_is_not_left_half_written(tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "disk", "16k") as disk:
        path = disk / "metrics.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            line = json.dumps({"step": 1, "x": "y" * 3000}) + "\n"
            written = 0
            with pytest.raises(DiskWriteError) as error:
                for _ in range(100):
                    append_line(fd, path, line)
                    written += 1
        finally:
            os.close(fd)
        message = str(error.value)
        assert message.startswith(f"no space left on tmpfs (mounted at {disk}) while writing {path}"), message
        assert "the partial record was removed" in message
        assert path.read_text() == line * written and written > 0  # whole lines only


def test_the_main_job_on_a_full_disk_ends_with_one_named_error(tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "disk", "24k") as disk:  # the config and a few steps' lines (~8 KB each)
        run_dir = disk / "run"
        proc = run_main_job([*JOB, "--rollout-correction-preset", "decoupled_seq_is_rs", "--run-dir", str(run_dir)],
                            env=job_env(), timeout=300, output_dir=tmp_path / "out")
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert errors[0].startswith(f"slime_corr.main: error: no space left on {device_of(run_dir)} while writing "
                                    f"{run_dir}/"), errors
        text = (run_dir / "metrics.jsonl").read_text()
        assert text.endswith("\n") and [json.loads(line)["step"] for line in text.splitlines()] == \
            list(range(1, len(text.splitlines()) + 1))


def test_a_checkpoint_that_does_not_fit_is_removed_and_named(tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "disk", "64k") as disk:
        save = disk / "ckpt"
        proc = run_main_job([*JOB, "--num-rollout", "2", "--run-dir", str(tmp_path / "run"), "--save", str(save),
                             "--save-interval", "1"], env=job_env(), timeout=300, output_dir=tmp_path / "out")
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert f"slime_corr.main: error: no space left on {device_of(save)} while writing {save}/iter_0000002; the " \
               "half-written iter_0000002 was removed; no complete checkpoint was saved yet" in proc.stderr, \
               proc.stderr[-3000:]
        assert not (save / "iter_0000002").exists()
        assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2  # the steps logged before the save


def test_the_report_on_a_full_disk_names_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": s, "rollout_corr/mismatch_k3_kl": 1e-4 * s, "rollout/reward_mean": 0.1 * s} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with small_filesystem(tmp_path / "disk", "8k") as disk:
        proc = subprocess.run([sys.executable, "-m", "slime_corr.cli", "report", str(run_dir), "--out", str(disk)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr and \
            f"slime-corr report: error: no space left on {device_of(disk)} while writing {disk}" in proc.stderr, \
            proc.stderr
