"""Run the main job (`python -m slime_corr.main ARGS`, or the N ranks `torchrun --nproc-per-node N` starts) as
processes forked from a server that has already imported it.

Each process of the main job spends ~7 s of CPU importing torch, megatron-core and the project before it does
anything, and the suite runs the main job a few hundred times: on a 2-core machine the imports alone were minutes
of CI. Here `multiprocessing`'s fork server (one per pytest worker, started on first use) imports `slime_corr.main`
once; every run is a fresh process forked from it, which executes the module as `__main__` with the run's argv,
working directory and environment, as `python -m slime_corr.main` does (`runpy`, the module's own code from its
first line), its output in a file. What it skips is the interpreter's start-up and the imports, the same for every
process of a job; the tests of the documented commands (tests/test_readme_commands.py: `bash scripts/run.sh`,
`torchrun ...`) and of the entry point's signals run real processes.

Ranks get the environment torchrun gives them (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RUN_ID, TORCHELASTIC_USE_AGENT_STORE; OMP_NUM_THREADS=1 unless set) and, as under torchrun,
their store is hosted by the launcher (this process, on a port the OS picked as it bound it: no rank binds a port
that another process could have taken meanwhile), one rank's failure ends the others, and all ranks write to the
run's one output.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from slime_corr.ports import agent_store_environment, host_store

ROOT = Path(__file__).resolve().parents[1]
_GRACE_S = 30.0  # torchrun's wait between SIGTERM and SIGKILL of the ranks left when one fails
_context: multiprocessing.context.ForkServerContext | None = None


def fork_server() -> multiprocessing.context.ForkServerContext:
    """The multiprocessing context whose fork server has imported `slime_corr.main` and frozen what it imported
    (tests/frozen_imports.py); also for gloo worlds that spawn test functions
    (`torch.multiprocessing.start_processes(..., start_method="forkserver")`)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["tests.frozen_imports"])  # slime_corr.main, frozen
    return _context


def spawn_processes(fn: Callable[..., Any], nprocs: int, args: tuple = ()) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)` with the processes forked from the fork server (imports
    done): `fn(rank, *args)` in each, raising the first failure as `ProcessRaisedException`. The children inherit
    the fork server's environment, not this process's later changes: set variables in `fn`."""
    import torch.multiprocessing as mp

    fork_server()
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def _rank(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str, new_group: bool) -> None:
    """A forked child: the main job as `python -m slime_corr.main` runs it, with this run's argv, cwd, environment
    and output (opened for appending: the ranks share the run's files, as torchrun's console)."""
    if new_group:
        os.setpgid(0, 0)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), fd)
    for stream in (sys.stdout, sys.stderr):  # line by line, as a test reading the output while the job runs needs
        stream.reconfigure(line_buffering=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's (the fork server ignores it)
    if "OMP_NUM_THREADS" in env:  # read by a fresh interpreter when torch loads, so set here
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = ["slime_corr.main", *argv]
    sys.modules.pop("slime_corr.main", None)  # run as `python -m` does: the module's code from its first line
    code = 0
    try:
        runpy.run_module("slime_corr.main", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # as the interpreter would: the traceback, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # the job's own, as an interpreter's exit runs them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class MainJob:
    """A running main job (its ranks); `subprocess.Popen`'s poll / wait / send_signal / kill for the tests."""

    def __init__(self, args: Sequence[str], *, nproc: int = 0, cwd: str | Path = ROOT,
                 env: Mapping[str, str] | None = None, stdout: str | Path, stderr: str | Path | None = None,
                 new_process_group: bool = False) -> None:
        base = dict(os.environ if env is None else env)
        world = max(nproc, 1)
        self._store = host_store(world_size=world) if nproc else None  # torchrun's agent's: held for the job's life
        if self._store is not None:
            base.setdefault("OMP_NUM_THREADS", "1")
            base.update(agent_store_environment(self._store), WORLD_SIZE=str(world),
                        LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
                        TORCHELASTIC_RUN_ID=f"job-runner-{os.getpid()}-{time.monotonic_ns()}")
        self.args = ["slime_corr.main", *args]
        out, err = str(stdout), str(stderr or stdout)
        for path in {out, err}:
            open(path, "w").close()
        ctx = fork_server()
        self.ranks = []
        for rank in range(world):
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank)) if nproc else base
            p = ctx.Process(target=_rank, args=(list(args), str(cwd), rank_env, out, err, new_process_group))
            p.start()
            self.ranks.append(p)
        self.pid = self.ranks[0].pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The job's exit code once every rank has ended (the first failing rank's), else None; a failed rank
        ends the others (SIGTERM, then SIGKILL after 30 s), as torchrun does."""
        if self.returncode is not None:
            return self.returncode
        # one reading of the exit codes: a rank that ends between two readings was taken for a success (CI35 saw a
        # job that printed its error and exited 1 reported as exit 0)
        codes = [p.exitcode for p in self.ranks]
        failed = next((code for code in codes if code not in (None, 0)), None)
        if failed is not None and len(self.ranks) > 1:
            _stop(self.ranks, _GRACE_S)
            codes = [p.exitcode for p in self.ranks]
        if all(code is not None for code in codes):
            for p in self.ranks:
                p.join()
            self.returncode = failed if failed is not None else 0  # -N for a signal N, as in Popen
            self._store = None  # the ranks are gone: its port is released
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        for p in self.ranks:
            if p.exitcode is None:
                os.kill(p.pid, sig)

    def kill(self) -> None:
        _stop(self.ranks, 0.0)


def _stop(ranks: list, grace: float) -> None:
    for p in ranks:
        if p.exitcode is None:
            p.terminate()
    end = time.monotonic() + grace
    for p in ranks:
        p.join(max(0.0, end - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


def job_env() -> dict[str, str]:
    """This process's environment for a main job of one process: no GPU, one thread, no torchrun variables."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    return env


def run_main_job(args: Sequence[str], *, nproc: int = 0, cwd: str | Path = ROOT, env: Mapping[str, str] | None = None,
                 timeout: float = 600.0, output_dir: str | Path) -> subprocess.CompletedProcess:
    """`python -m slime_corr.main *args` (nproc 0), or its `nproc` ranks, to its end; its output in `output_dir`
    (main_job.out, main_job.err). -> CompletedProcess (returncode, stdout, stderr). A job still running after
    `timeout` is killed and raises subprocess.TimeoutExpired."""
    out, err = Path(output_dir) / "main_job.out", Path(output_dir) / "main_job.err"
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    job = MainJob(args, nproc=nproc, cwd=cwd, env=env, stdout=out, stderr=err)
    try:
        code = job.wait(timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        raise
    return subprocess.CompletedProcess(job.args, code, out.read_text(), err.read_text())
