"""Ctrl-C handling of the main job (`slime_corr.trainer.interrupts`), with real signals sent to this process and to a
forked child: deferred inside a checkpoint write, never lost, ignored while the run ends. The whole job under a
terminal's Ctrl-C is in tests/trainer/test_fault_table.py (ctrl_c, ctrl_c_terminal)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slime_corr.trainer import interrupts

pytestmark = pytest.mark.cost(50)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)


@pytest.fixture
def installed(monkeypatch):
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for name in ("_installed", "_signalled", "_deferring", "_pending"):
        monkeypatch.setattr(interrupts, name, getattr(interrupts, name))  # restored after the test
    interrupts.install()
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def _signal_self(signum: int = signal.SIGINT) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs in this (the main) thread at the next bytecode


def test_a_signal_in_a_deferred_block_is_raised_when_the_block_ends(installed):
    finished = False
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            _signal_self()
            finished = True
    assert finished


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_dropped_interrupt_is_raised_again_and_later_signals_are_ignored(installed, signum):
    interrupts.raise_if_interrupted()  # nothing yet
    try:
        _signal_self(signum)
    except KeyboardInterrupt:
        pass  # dropped, as a finalizer drops it
    else:
        pytest.fail("the first signal raised nothing")
    with pytest.raises(KeyboardInterrupt):
        interrupts.raise_if_interrupted()
    _signal_self(signum)  # the run is ending: its clean-up is not interrupted again


def _write_after(path: str) -> None:
    time.sleep(0.5)
    Path(path).write_text("whole")


def test_a_writer_forked_inside_a_deferred_block_outlives_a_ctrl_c(installed, tmp_path):
    """Megatron's checkpoint writers are forked inside the save: a terminal's Ctrl-C reaches them too."""
    out = tmp_path / "written"
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            child = multiprocessing.get_context("fork").Process(target=_write_after, args=(str(out),))
            child.start()
            time.sleep(0.1)
            os.kill(child.pid, signal.SIGINT)
            _signal_self()
            child.join(30)
    assert child.exitcode == 0 and out.read_text() == "whole"


SPAWN_IN_A_DEFERRED_BLOCK = """
import multiprocessing, signal
from slime_corr.trainer import interrupts

def blocked_here(queue):
    queue.put(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))

if __name__ == "__main__":
    interrupts.install()
    ctx = multiprocessing.get_context("spawn")
    with interrupts.deferred():
        queue = ctx.Queue()  # the process's first spawn-context object (Megatron's save: a spawned Manager's queue)
        child = ctx.Process(target=blocked_here, args=(queue,))
        child.start()
        in_child = queue.get(timeout=120)
        in_parent = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        child.join(60)
    print(f"child={in_child} parent={in_parent}")
"""


def test_a_process_spawned_inside_a_deferred_block_starts_with_sigint_blocked(tmp_path):
    """A process spawned inside a save (megatron-core's results-queue manager, where it starts one); the spawn also
    starts multiprocessing's resource tracker, which unblocks SIGINT in its caller. A fresh interpreter, so that the tracker is not running yet (CI:
    a terminal's Ctrl-C reached the manager while it still imported multiprocessing: a traceback)."""
    script = tmp_path / "spawn_in_block.py"
    script.write_text(SPAWN_IN_A_DEFERRED_BLOCK)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(Path(interrupts.__file__).parents[2])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "child=True parent=True", proc.stdout + proc.stderr[-2000:]


def test_without_install_nothing_changes(monkeypatch):
    monkeypatch.setattr(interrupts, "_installed", False)
    with interrupts.deferred():
        pass
    interrupts.raise_if_interrupted()


FAKE_SGLANG_PYTHON = """#!/bin/sh
# an SGLang python whose server never starts serving (it passes the job's `import sglang` check)
case "$1" in -c) exit 0 ;; esac
sleep 600
"""


def test_ctrl_c_while_an_sglang_server_starts_ends_the_job_within_seconds(tmp_path):
    """The server start-ups wait in a thread pool: interrupted, they give up at their next poll and stop their
    server, instead of waiting out the 600 s start-up bound."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_SGLANG_PYTHON)
    fake.chmod(0o755)
    cmd = [sys.executable, "-m", "slime_corr.main", "--num-rollout", "1", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "2", "--rollout-progress", "none", "--rollout-engine", "sglang",
           "--sglang-python", str(fake), "--run-dir", str(tmp_path / "run")]

    def stuck_server_running() -> bool:
        return subprocess.run(["pgrep", "-f", f"{fake} -m sglang.launch_server"], capture_output=True).returncode == 0

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).parents[2], preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                                            signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300  # imports and start-up on a loaded machine
        while not stuck_server_running():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        seconds = time.monotonic() - start
    finally:
        proc.kill()
    print(f"exit {proc.returncode} {seconds:.1f} s after the interrupt: {out.strip().splitlines()[-1]!r}")
    assert proc.returncode == 130 and seconds < 30, (proc.returncode, seconds, out[-2000:])
    assert re.search(r"slime_corr\.main: interrupted after rollout 0 of 1 \(step 0\)[^\n]*\.\s*\Z", out), out[-2000:]
    assert "Traceback" not in out and not stuck_server_running()


def test_ctrl_c_during_the_imports_exits_with_one_line():
    proc = subprocess.Popen([sys.executable, "-m", "slime_corr.main", "--rollout-engine", "embedded"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parents[2],
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(0.5)  # importing torch and Megatron takes longer on any machine
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in out, out[-2000:]
    assert re.search(r"slime_corr\.main: interrupted (while starting|after rollout 0)[^\n]*\.\s*\Z", out), out[-2000:]


def test_ctrl_c_under_torchrun_exits_130_with_one_line(tmp_path):
    """scripts/launch_torchrun.sh, DP=2: a terminal's Ctrl-C reaches torchrun and both ranks; rank 0 says where the
    run stopped and the launcher exits 130 without a traceback of its own (slime_corr.trainer.torchrun)."""
    out_path = tmp_path / "out"
    cmd = ["bash", "scripts/launch_torchrun.sh", "2", "--num-rollout", "50", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--rollout-progress", "none",
           "--rollout-engine", "embedded", "--run-dir", str(tmp_path / "run")]
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2],
                                env={**os.environ, "PY": sys.executable, "PYTHONUNBUFFERED": "1"},
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), process_group=0)
    try:
        deadline = time.monotonic() + 300
        while "step 2:" not in out_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, out_path.read_text()[-2000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    text = out_path.read_text()
    assert proc.returncode == 130 and "Traceback" not in text, (proc.returncode, text[-3000:])
    assert re.search(r"\nslime_corr\.main: interrupted after rollout \d+ of 50 \(step \d+\)[^\n]*\.\s*\Z", text), \
        text[-2000:]
