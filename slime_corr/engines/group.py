"""Several rollout engines behind one entry point: sglang-router when it is installed, else the client's own
balancing over the engines' URLs.

:func:`start_engine_group` starts ``N`` engines with a factory (in-process engines from
:func:`~slime_corr.engines.embedded.engine.start_local_engine`, or engine processes from
:func:`spawn_local_engine`) and, when asked, a router in front of them. The trainer then talks to
:attr:`EngineGroup.urls` with one :class:`~slime_corr.rollout.client.SGLangClient`: generation goes through the
router (or is balanced by the client), control calls and weight updates reach every engine, and an engine that
dies is detected by the client and left out (its samples are retried on the others).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from slime_corr.engines.router import RouterHandle, router_available, start_router, stop_process

RouterChoice = Literal["auto", "on", "off"]


class _HasUrl(Protocol):
    url: str


class StartupAborted(RuntimeError):
    """The run was interrupted (Ctrl-C) while engines were starting: the start-ups still waiting give up."""


_startups_aborted = threading.Event()  # set by _enter_all when the thread that waits for the start-ups is interrupted


def startup_wait(seconds: float, what: str) -> None:
    """Sleep between two polls of a starting engine; raises StartupAborted once the start-ups are aborted."""
    if _startups_aborted.wait(seconds):
        raise StartupAborted(f"{what}: start-up interrupted")


@dataclass
class EngineProcess:
    """An engine in its own process (the embedded engine's ``python -m slime_corr.engines.embedded.engine``, or a
    real SGLang server): ``url``, ``proc``, and where its output goes (``log_path``, None: inherited)."""

    url: str
    proc: subprocess.Popen
    log_path: Path | None = None

    def kill(self) -> None:
        """SIGKILL the engine and the processes of its group (a crash: no goodbye to its clients), and reap it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(self.proc.pid) == self.proc.pid:  # it leads its own group (an SGLang server)
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


@contextlib.contextmanager
def spawn_local_engine(checkpoint_dir: str | None = None, *, fp32: bool = False, threads: int = 1,
                       step_delay: float = 0.0, seed: int = 0, weight_version: str = "default",
                       extra_args: Sequence[str] = (), startup_timeout: float = 120.0) -> Iterator[EngineProcess]:
    """Run the embedded engine in a subprocess on 127.0.0.1; yields once it prints ``READY <url>``.

    Stopped by its PID on exit (terminate, then kill).
    """
    cmd = [sys.executable, "-m", "slime_corr.engines.embedded.engine", "--threads", str(threads),
           "--step-delay", str(step_delay), "--seed", str(seed), "--weight-version", weight_version, *extra_args]
    if checkpoint_dir is not None:
        cmd += ["--checkpoint", checkpoint_dir]
    if fp32:
        cmd.append("--fp32")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + startup_timeout
        while not sel.select(0) and proc.poll() is None and time.monotonic() < deadline:
            startup_wait(0.1, "the embedded engine")
        line = proc.stdout.readline() if sel.select(0) else ""
        if not line.startswith("READY "):
            raise RuntimeError(f"engine process did not start within {startup_timeout}s (exit code "
                               f"{proc.poll()}): {line!r}")
        yield EngineProcess(line.split()[1], proc)
    finally:
        stop_process(proc)


@dataclass
class EngineGroup:
    """Running engines, and the router in front of them (None: the client balances over the engines)."""

    engines: list[Any]  # handles with a ``url`` (LocalEngineHandle, EngineProcess)
    router: RouterHandle | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @property
    def urls(self) -> list[str]:
        """Where the client sends ``/generate``: the router, or every engine."""
        return [self.router.url] if self.router is not None else self.engine_urls

    def describe(self) -> str:
        front = f"sglang-router at {self.router.url}" if self.router else "client-side balancing"
        notes = f" ({'; '.join(self.notes)})" if self.notes else ""
        return f"{len(self.engines)} engine(s) ({', '.join(self.engine_urls)}) behind {front}{notes}"


def use_router(choice: RouterChoice, num_engines: int) -> bool:
    """Whether a group of ``num_engines`` gets a router: ``auto`` = when there are several and it is installed."""
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"router: {choice!r} is not one of 'auto', 'on', 'off'")
    if choice == "on" and not router_available():
        raise RuntimeError("router='on' but sglang-router is not installed: pip install sglang-router")
    return choice == "on" or (choice == "auto" and num_engines > 1 and router_available())


@contextlib.contextmanager
def start_engine_group(
    num_engines: int,
    make_engine: Callable[[int], AbstractContextManager[_HasUrl]],
    *,
    router: RouterChoice = "auto",
    router_policy: str = "round_robin",
    router_args: Sequence[str] = (),
) -> Iterator[EngineGroup]:
    """Start ``num_engines`` engines (``make_engine(i)`` is a context manager yielding a handle with ``url``),
    and sglang-router in front of them per ``router``; stop all of it on exit (router first)."""
    if num_engines < 1:
        raise ValueError(f"num_engines: must be >= 1, got {num_engines}")
    with contextlib.ExitStack() as stack:
        group = EngineGroup(_enter_all(stack, [make_engine(i) for i in range(num_engines)]))
        if use_router(router, num_engines):
            group.router = stack.enter_context(start_router(group.engine_urls, policy=router_policy,
                                                            extra_args=router_args))
        elif num_engines > 1 and router == "auto":
            group.notes.append("sglang-router is not installed")
        yield group


def _enter_all(stack: contextlib.ExitStack, managers: list[AbstractContextManager[Any]]) -> list[Any]:
    """Enter the context managers concurrently (engine processes start in parallel); each one entered is
    exited by ``stack``; the first failure is raised once all have finished starting. Interrupted (Ctrl-C), the
    start-ups still waiting give up at their next poll (`startup_wait`), so the interrupt ends this within
    seconds, not when the slowest server has started."""
    pool = ThreadPoolExecutor(max_workers=len(managers))
    futures = [pool.submit(cm.__enter__) for cm in managers]
    try:
        wait(futures)
    except BaseException:
        _startups_aborted.set()
        raise
    finally:
        pool.shutdown(wait=True)
        _startups_aborted.clear()
        for cm, f in zip(managers, futures, strict=True):
            if f.exception() is None:  # started: stopped with the stack
                stack.push(cm.__exit__)
    for f in futures:
        if f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    return [f.result() for f in futures]
