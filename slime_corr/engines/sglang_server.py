"""The real SGLang server as a rollout engine: launched, health-checked, logged and stopped by the trainer.

`launch_sglang_server` starts ``python -m sglang.launch_server`` on 127.0.0.1 (the config's `host`: an address of
this host that its clients reach) at a free port, with its output in a log file, waits (bounded) until ``/health``
answers 200 and one warm-up ``/generate`` has run (the first request of a server pays its lazy initialisation: 8-25 s
on CPU), and on exit, whatever the exit path, stops the server's
whole process group (the HTTP server, scheduler and detokenizer) by its PID: SIGTERM, then SIGKILL after a grace
period.

Which SGLang (`sglang_python`): ``--sglang-python PATH``, else this interpreter when it has sglang (a GPU
machine's own install), else the CPU install that ``scripts/setup_sglang.sh`` makes in ``.venv-sglang/`` (once an
install in progress there has ended: `wait_for_install`).
On CPU (``--device cpu``) the server runs with what SGLANG_ON_CPU.md measured: ``SGLANG_USE_CPU_ENGINE=1``, the
stand-ins of ``sglang_cpu/`` first on PYTHONPATH (see its sitecustomize.py), torch-native attention, no overlap
schedule, no server warm-up, a capped KV cache, a scheduler that sleeps while idle. Extra server flags (slime's
``--sglang-*`` pass-through) come last and win.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from slime_corr.engines.group import EngineProcess, startup_wait
from slime_corr.ports import LOOPBACK, PORT_TRIES, free_port

CPU_STAND_INS = Path(__file__).resolve().parent / "sglang_cpu"
# --sleep-on-idle: an idle scheduler otherwise spins through its self-checks and takes a whole core (10.1 CPU-s in
# 10 s idle, 0.16 with it), the core the trainer beside it computes on
CPU_SERVER_ARGS = ("--attention-backend", "torch_native", "--disable-overlap-schedule", "--skip-server-warmup",
                   "--max-total-tokens", "16384", "--sleep-on-idle")
SETUP_HINT = ("install it with `bash scripts/setup_sglang.sh` (CPU; into .venv-sglang/), or point --sglang-python "
              "at a Python that has sglang (GPU machines: pip install 'sglang[srt]'), or use --rollout-engine "
              "embedded")
STOP_GRACE_S = 5.0
# py-spy and CUDA core dumps of a crashing server (on by default in SGLang): neither exists on CPU
CRASH_DIAGNOSTICS = ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH")
BIND_FAILED = "error while attempting to bind on address"  # uvicorn's words when the port is taken (errno 98)
WARMUP_SLICE_S = 10.0  # seconds per try of the warm-up /generate (an interrupt is seen between tries)
TORCHRUN_VARIABLES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"})


class SGLangLaunchError(RuntimeError):
    """The SGLang server could not be started: the message names why and where its log is."""


@dataclass(frozen=True)
class SGLangServerConfig:
    """How one server is launched. `extra_args` are SGLang's own flags (appended last)."""

    model_path: str
    python: str
    dtype: str = "bfloat16"
    device: str = "cpu"
    skip_tokenizer_init: bool = False
    served_model_name: str | None = None
    weight_version: str = "default"
    random_seed: int | None = None
    extra_args: tuple[str, ...] = ()
    log_dir: Path = field(default_factory=lambda: Path("."))
    startup_timeout: float = 600.0
    host: str = LOOPBACK  # the address it listens on (SGLang's --host)

    def url(self, port: int) -> str:
        return f"http://{self.host}:{port}"

    def command(self, port: int) -> list[str]:
        cmd = [self.python, "-m", "sglang.launch_server", "--model-path", self.model_path, "--host", self.host,
               "--port", str(port), "--dtype", self.dtype, "--device", self.device,
               "--weight-version", self.weight_version]
        if self.skip_tokenizer_init:
            cmd.append("--skip-tokenizer-init")
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.random_seed is not None:
            cmd += ["--random-seed", str(self.random_seed)]
        if self.device == "cpu":
            cmd += CPU_SERVER_ARGS
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        """This process's environment without torchrun's rendezvous variables (a server launched from a torchrun
        rank would read WORLD_SIZE/RANK/MASTER_PORT as its own and wait for peers that never come), plus the CPU
        set-up on CPU (with this PID, so that the server stops itself if this process dies without stopping it)."""
        env = {k: v for k, v in os.environ.items()
               if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            for diagnostic in CRASH_DIAGNOSTICS:  # a stop (SIGTERM) waited 5 s for GPU activity to settle
                env.setdefault(diagnostic, "0")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_STAND_INS), env.get("PYTHONPATH")) if p)
            env["SLIME_CORR_SERVER_PARENT"] = str(os.getpid())  # sglang_cpu/_parent_watch.py
        return env


INSTALL_LOCK = ".install.lock"  # in the environment: scripts/setup_sglang.sh holds it (flock) while it installs
INSTALL_STAMP = ".slime_corr_sglang"  # ... and writes this file as it ends, once everything is installed
INSTALL_WAIT = 900.0  # seconds a job waits for an install in progress (a fresh one takes ~80 s on 2 cores)


def wait_for_install(venv: Path, timeout: float = INSTALL_WAIT) -> None:
    """Return once no ``scripts/setup_sglang.sh`` holds `venv`'s install lock: at once when none runs, else when
    that install ends (a half-installed environment imports sglang but not its dependencies). Raises
    SGLangLaunchError after `timeout` seconds, or when the install that took the lock did not finish."""
    lock = venv / INSTALL_LOCK
    if not lock.is_file():
        return
    deadline, told = time.monotonic() + timeout, False
    with open(lock) as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                if not (venv / INSTALL_STAMP).is_file():
                    raise SGLangLaunchError(f"{venv}: its install did not finish (scripts/setup_sglang.sh failed or "
                                            f"was stopped: no {INSTALL_STAMP}); {SETUP_HINT}.")
                return  # the shared lock is released as the file closes
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SGLangLaunchError(
                        f"{venv}: scripts/setup_sglang.sh has been installing SGLang there for over {timeout:.0f} s "
                        f"(it holds {lock}): let it finish, or stop it and run it again") from None
                if not told:
                    print(f"slime_corr: waiting for scripts/setup_sglang.sh to finish installing SGLang into {venv}",
                          file=sys.stderr, flush=True)
                    told = True
                time.sleep(0.2)


def sglang_python(explicit: str | None = None) -> str:
    """The interpreter that runs the server (see the module doc); raises SGLangLaunchError with the fix."""
    if explicit:
        if not _has_sglang(explicit):
            raise SGLangLaunchError(f"--sglang-python {explicit}: cannot import sglang with it; {SETUP_HINT}.")
        return explicit
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    bundled = Path(__file__).resolve().parents[2] / ".venv-sglang" / "bin" / "python"
    wait_for_install(bundled.parents[1])
    if bundled.is_file() and _has_sglang(str(bundled)):
        return str(bundled)
    raise SGLangLaunchError(f"--rollout-engine sglang: no SGLang server found ({bundled} does not exist); "
                            f"{SETUP_HINT}.")


def _has_sglang(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "import importlib.util as u, sys; "
                               "sys.exit(u.find_spec('sglang') is None)"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@contextlib.contextmanager
def launch_sglang_server(config: SGLangServerConfig, *, name: str = "sglang") -> Iterator[EngineProcess]:
    """Start one server (see the module doc); yields its handle once it serves. Stopped on exit.

    The port is probed free, then bound by the server tens of seconds later (its imports): when something took it
    meanwhile (uvicorn's "address already in use"), the server is stopped and started again on another port."""
    config.log_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, PORT_TRIES + 1):
        port = free_port(config.host)
        log_path = config.log_dir / f"{name}-{port}.log"
        url = config.url(port)
        with open(log_path, "wb") as log:
            log.write(("$ " + " ".join(config.command(port)) + "\n").encode())
            log.flush()
            proc = subprocess.Popen(config.command(port), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=config.environment(),
                                    start_new_session=True)  # its own process group
        try:
            _wait_until_serving(url, proc, log_path, config.startup_timeout)
            break
        except _PortTaken:
            stop_process_group(proc)
            if attempt == PORT_TRIES:
                raise SGLangLaunchError(f"the SGLang server could not bind a free port in {PORT_TRIES} tries; its "
                                        f"last log ({log_path}) ends with:\n{_tail(log_path)}") from None
        except BaseException:
            stop_process_group(proc)
            raise
    try:
        yield EngineProcess(url, proc, log_path=log_path)
    finally:
        stop_process_group(proc)


class _PortTaken(Exception):
    """The server's port was taken between the probe and its bind."""


def _check_bound(log_path: Path) -> None:
    """Raise _PortTaken if the server failed to bind its port (it then lingers ~10 s before it exits, and whatever
    holds the port may answer /health in its place: checked again after the warm-up)."""
    try:
        failed = BIND_FAILED in log_path.read_text(errors="replace")
    except OSError:
        failed = False
    if failed:
        raise _PortTaken


def _wait_until_serving(url: str, proc: subprocess.Popen, log_path: Path, timeout: float) -> None:
    """Poll /health (bounded by `timeout`), then one warm-up /generate of one token."""
    deadline = time.monotonic() + timeout
    while True:
        _check_bound(log_path)
        if proc.poll() is not None:
            raise SGLangLaunchError(f"the SGLang server for {url} exited with code {proc.returncode} while starting; "
                                    f"its log ({log_path}) ends with:\n{_tail(log_path)}")
        if _get(url + "/health", timeout=5) == 200:
            break
        if time.monotonic() > deadline:
            raise SGLangLaunchError(f"the SGLang server for {url} did not answer /health within {timeout:.0f} s; its "
                                    f"log ({log_path}) ends with:\n{_tail(log_path)}")
        startup_wait(0.5, f"the SGLang server for {url}")
    body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}).encode()
    request = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    while True:  # in slices of WARMUP_SLICE_S, so that an interrupt is seen (a repeated one-token request is harmless)
        try:
            with urllib.request.urlopen(request, timeout=WARMUP_SLICE_S) as r:
                r.read()
            _check_bound(log_path)
            return
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            _check_bound(log_path)
            timed_out = isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)
            if not timed_out or time.monotonic() > deadline:
                raise SGLangLaunchError(f"the SGLang server at {url} failed its warm-up /generate ({e}); its log "
                                        f"({log_path}) ends with:\n{_tail(log_path)}") from None
        startup_wait(0, f"the SGLang server for {url}")


def _get(url: str, timeout: float) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, TimeoutError, OSError):
        return None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop_process_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group led by `proc` (its PID), SIGKILL it after `grace` seconds; reap the leader."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 30.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
                os.killpg(proc.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue


def server_args(pairs: Sequence[str]) -> tuple[str, ...]:
    """slime's ``--sglang-X [value]`` pass-through flags as SGLang's own ``--X [value]``."""
    out = []
    for token in pairs:
        out.append("--" + token.removeprefix("--sglang-") if token.startswith("--sglang-") else token)
    return tuple(out)


__all__ = ["CPU_STAND_INS", "SGLangLaunchError", "SGLangServerConfig", "launch_sglang_server", "server_args",
           "sglang_python", "stop_process_group"]
