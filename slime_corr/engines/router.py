"""Launch sglang-router (``pip install sglang-router``; tested with 0.3.2) in front of rollout engines.

The router is started as ``python -m sglang_router.launch_router`` (the package's entry point; its console
scripts ``sglang-router`` / ``smg`` need a ``launch`` sub-command) on loopback (`host`: another address of this
host, which its clients and workers reach), with free ports, and stopped by its PID. It is told the workers' URLs as
given: they must be addresses the router's host reaches. The flags this project relies on, and why:

==============================================  ===========================================================
``--host 127.0.0.1``                            listen on loopback only (or on `host`)
``--prometheus-host 127.0.0.1``                 its metrics exporter binds 0.0.0.0:29000 by default (`host`)
``--port P --prometheus-port Q``                free ports (two routers, or a busy 29000, never collide)
``--worker-urls URL ...``                       the engines; registered in the background: wait on ``/workers``
``--policy round_robin``                        spread the samples evenly (``cache_aware`` is its default)
``--disable-retries``                           the client is the one retry authority: every attempt has a
                                                fresh rid, so a timed-out or failed attempt can be aborted by
                                                rid on the workers and never runs twice (the router would
                                                re-send the same rid)
``--request-timeout-secs``                      above the client's own request timeout (default 1800 s)
``--shutdown-grace-period-secs 1``              stop promptly (180 s by default)
``--log-level warn``                            its per-request INFO lines would fill the log
==============================================  ===========================================================

What the router forwards is only ``/generate`` (and its own ``/flush_cache`` fan-out, answering ``206
partial_success`` when a worker is busy): control calls go to the workers directly (see :mod:`.control`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from slime_corr.ports import LOOPBACK, PORT_TRIES, free_port

ROUTER_MODULE = "sglang_router.launch_router"
PORT_IN_USE = "address already in use"  # the router's words (os error 98) when a port it binds is taken


def router_available() -> bool:
    """sglang-router is installed (``pip install sglang-router``, in the ``dev`` and ``sglang`` extras)."""
    return importlib.util.find_spec("sglang_router") is not None


@dataclass
class RouterHandle:
    """A running router: its ``url``, process (stop it by ``proc.pid``) and log file."""

    url: str
    proc: subprocess.Popen
    log_path: str

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return f.read()[-n:]
        return ""


def router_command(worker_urls: Sequence[str], port: int, prometheus_port: int, policy: str = "round_robin",
                   request_timeout_secs: int = 1800, extra_args: Sequence[str] = (),
                   host: str = LOOPBACK) -> list[str]:
    """The command line that starts the router on `host` (see the module docstring for each flag)."""
    return [sys.executable, "-m", ROUTER_MODULE, "--host", host, "--port", str(port),
            "--prometheus-host", host, "--prometheus-port", str(prometheus_port),
            "--worker-urls", *worker_urls, "--policy", policy, "--disable-retries",
            "--request-timeout-secs", str(request_timeout_secs), "--shutdown-grace-period-secs", "1",
            "--log-level", "warn", *extra_args]


def _workers_ready(url: str, expected: Sequence[str]) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/workers", timeout=2.0) as r:
            body = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False
    healthy = {str(w.get("url", "")).rstrip("/") for w in body.get("workers", []) if w.get("is_healthy", True)}
    return set(expected) <= healthy


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Terminate ``proc`` by its PID, kill it after ``grace`` seconds, reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)


@contextlib.contextmanager
def start_router(worker_urls: Sequence[str], *, policy: str = "round_robin", startup_timeout: float = 60.0,
                 request_timeout_secs: int = 1800, extra_args: Sequence[str] = (),
                 host: str = LOOPBACK) -> Iterator[RouterHandle]:
    """Start sglang-router on `host` (default 127.0.0.1) in front of ``worker_urls``; yields once it routes to all
    of them.

    Raises RuntimeError (with the router's log) if it is not installed, exits, or does not list every worker
    as healthy within ``startup_timeout`` seconds. Stops the router by its PID on exit.
    """
    if not router_available():
        raise RuntimeError("sglang-router is not installed: pip install sglang-router (or run without a router)")
    workers = [u.rstrip("/") for u in worker_urls]
    log_dir = tempfile.mkdtemp(prefix="slime_corr_router_")
    handle: RouterHandle | None = None
    for attempt in range(1, PORT_TRIES + 1):  # the router binds the ports picked here: one can be taken meanwhile
        port, prom = free_port(host), free_port(host)
        log_path = os.path.join(log_dir, f"router-{attempt}.log")
        with open(log_path, "ab") as log:
            command = router_command(workers, port, prom, policy, request_timeout_secs, extra_args, host)
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        handle = RouterHandle(f"http://{host}:{port}", proc, log_path)
        deadline = time.monotonic() + startup_timeout
        while proc.poll() is None and time.monotonic() < deadline and not _workers_ready(handle.url, workers):
            time.sleep(0.1)
        if proc.poll() is None and _workers_ready(handle.url, workers):
            break
        stop_process(proc)
        if PORT_IN_USE not in handle.log_tail().lower():
            raise RuntimeError(f"sglang-router did not become ready with workers {workers} within "
                               f"{startup_timeout}s (exit code {proc.returncode}); log:\n{handle.log_tail()}")
        if attempt == PORT_TRIES:
            raise RuntimeError(f"sglang-router could not bind its ports in {PORT_TRIES} tries (the last: {port} and "
                               f"{prom} on {host}, taken by another process before it bound them); its log "
                               f"({log_path}):\n{handle.log_tail()}")
    assert handle is not None
    try:
        yield handle
    finally:
        stop_process(handle.proc)
