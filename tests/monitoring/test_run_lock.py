"""One run directory, one job (slime_corr/monitoring/run_lock.py): two main jobs started together on one --run-dir —
one runs, the other is refused naming the first's PID and host, and metrics.jsonl holds one run's steps; a lock held
by another process refuses; a job killed with SIGKILL leaves the lock free and its record is taken over with a
notice; a clean release leaves no record."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from slime_corr.monitoring.run_lock import LOCK_FILE, RunDirBusyError, RunDirLock
from tests.job_runner import MainJob, job_env

pytestmark = pytest.mark.cost(40)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

FLAGS = ["--rollout-engine", "embedded", "--num-rollout", "2", "--num-steps-per-rollout", "2",
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
         "--rollout-progress", "none", "--seed", "3"]


def test_two_jobs_started_together_on_one_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    jobs = [MainJob([*FLAGS, "--run-dir", str(run_dir)], env=job_env(), stdout=tmp_path / f"job{i}.out",
                    stderr=tmp_path / f"job{i}.err") for i in range(2)]
    codes = [job.wait(300) for job in jobs]
    assert sorted(codes) == [0, 1], codes
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    refusal = (tmp_path / f"job{loser}.err").read_text()
    assert f"--run-dir {run_dir} is in use by another job (PID {jobs[winner].pid} on host {socket.gethostname()}" \
        in refusal, refusal
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # one run's steps, not two interleaved
    assert (run_dir / LOCK_FILE).read_text() == ""  # released on exit


def test_a_held_lock_refuses_and_a_killed_holders_is_taken_over(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom slime_corr.monitoring.run_lock import "
                               "RunDirLock\nlock = RunDirLock.acquire(sys.argv[1])\nprint('held', flush=True)\n"
                               "time.sleep(120)", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusyError, match=f"is in use by another job \\(PID {holder.pid} on host "):
            RunDirLock.acquire(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)  # no chance to release: the OS frees the lock, the record stays
        holder.wait(30)
    lock = RunDirLock.acquire(tmp_path)
    assert lock.notice is not None and f"ended without releasing it (PID {holder.pid} on host" in lock.notice
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""
    with RunDirLock.acquire(tmp_path) as again:
        assert again.notice is None
