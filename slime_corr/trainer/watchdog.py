"""Bounded waits between the ranks: the driver's liveness and each rollout's outcome, and named errors for the
collectives that time out.

While the driver (global rank 0) starts the engines and generates a rollout, the other ranks have nothing to do.
Waiting for it inside a collective would need a process-group timeout longer than any rollout, and then a stopped
rank would hold the job that long. Instead they wait on a key-value store (a `torch.distributed.TCPStore` rank 0
hosts): the driver beats every second from a thread of its own and publishes each rollout's outcome (its error
message when it failed, so every rank stops with it). A rank stops with `PeerError` when the driver failed, and with
`StuckRankError` when it has shown no sign of life for `--distributed-timeout-minutes` (a stopped or frozen
process; the store, inside the driver, then answers nothing either: each look at it is bounded). Every collective runs under the same timeout (`init_process_group(timeout=...)`, Megatron's flag), so a
rank stuck elsewhere ends the job in as many minutes; `collective_error` words gloo's timeout and lost-peer errors.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from slime_corr.addresses import route_source

BEAT_SECONDS = 1.0  # how often the driver beats
POLL_SECONDS = 0.2  # how often a waiting rank looks at the store
ABORT_KEY = "abort"  # the driver's error, when it failed
T = TypeVar("T")


class StuckRankError(RuntimeError):
    """Another rank showed no sign of life for the distributed timeout."""


class PeerError(RuntimeError):
    """The driver stopped the run with an error (`reported`: it prints it and exits 1; the other ranks stop
    quietly, so the launcher names the driver as the failure), or is gone."""

    def __init__(self, message: str, reported: bool = False) -> None:
        super().__init__(message)
        self.reported = reported


class DriverBeacon:
    """Rank 0's liveness and per-key outcomes, for the other ranks to wait on with a bound (see the module doc).

    Collective to build (every rank, after `init_process_group`); a no-op in a world of one. `publish(key)` on the
    driver; `wait(key)` elsewhere returns when the driver published `key`, raises `PeerError` with the driver's error
    once it published `ABORT_KEY`, or `StuckRankError` after `timeout` seconds without a beat."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.store: dist.TCPStore | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        is_driver = dist.get_rank() == 0
        store = dist.TCPStore(host, 0, dist.get_world_size(), is_master=True, wait_for_workers=False) \
            if is_driver else None
        where: list[object] = [host, store.port if store is not None else 0]
        dist.broadcast_object_list(where, src=0)
        if store is None:
            try:
                store = dist.TCPStore(str(where[0]), int(where[1]), dist.get_world_size(), is_master=False,  # type: ignore[call-overload]
                                      timeout=timedelta(seconds=max(timeout, 1.0)))
            except (RuntimeError, OSError) as e:  # name the address and the host that could not reach it
                raise PeerError(f"the driver's liveness store at {where[0]}:{where[1]} (MASTER_ADDR) could not be "
                                f"reached from {route_source(str(where[0])) or socket.gethostname()}: "
                                f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
        self.store = store
        if is_driver:
            self._thread = threading.Thread(target=self._beat, name="slime_corr-driver-beat", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        assert self.store is not None
        while not self._stop.wait(BEAT_SECONDS):
            try:
                self.store.add("beat", 1)
            except Exception:  # noqa: BLE001 - the store is gone (shutting down): nothing left to tell
                return

    def publish(self, key: str, value: str = "ok") -> None:
        """Driver: `key` is done; `publish(ABORT_KEY, error)`: the run failed with `error` (every wait raises it)."""
        if self.store is not None:
            self.store.set(key, value)

    def wait(self, key: str, what: str) -> None:
        """Until the driver published `key` (`what` it is doing, for the error); see the class doc."""
        if self.store is None:
            return
        store = self.store
        stuck = StuckRankError(
            f"rank 0 (the rollout driver) showed no sign of life for {self.timeout / 60:g} min while {what} "
            "(--distributed-timeout-minutes): is it stopped (SIGSTOP, a debugger) or frozen? Its log and "
            "py-spy dump --pid PID show where it is.")

        def look() -> tuple[str | None, int]:  # (the driver's error, or "done" once `key` is out; the beat count)
            if store.check([ABORT_KEY]):
                return store.get(ABORT_KEY).decode(), 0
            if store.check([key]):
                return "done", 0
            return None, store.add("beat", 0)

        last_beat, last_change = -1, time.monotonic()
        while True:
            try:  # the store lives in rank 0: stopped, it never answers, so each look is bounded
                outcome, beat = _within(max(self.timeout - (time.monotonic() - last_change), POLL_SECONDS), look)
            except TimeoutError:
                raise stuck from None
            except (RuntimeError, OSError) as e:
                raise PeerError(f"rank 0 (the rollout driver) is gone while {what}: {e}") from None
            if outcome == "done":
                return
            if outcome is not None:
                raise PeerError(outcome, reported=True)
            now = time.monotonic()
            if beat != last_beat:
                last_beat, last_change = beat, now
            elif now - last_change > self.timeout:
                raise stuck
            time.sleep(POLL_SECONDS)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * BEAT_SECONDS)


def _within(seconds: float, fn: Callable[[], T]) -> T:
    """`fn()`, or TimeoutError after `seconds`: it runs in a daemon thread, which a call that never returns (a store
    whose host process is stopped) leaves behind without holding up the exit."""
    result: list[tuple[bool, Any]] = []

    def call() -> None:
        try:
            result.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            result.append((False, e))

    thread = threading.Thread(target=call, name="slime_corr-store-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if not result:
        raise TimeoutError(f"no answer within {seconds:.1f} s")
    ok, value = result[0]
    if not ok:
        raise value
    return value


def collective_error(error: BaseException, timeout_minutes: float) -> str | None:
    """A one-line explanation of a collective that failed because a peer timed out or went away (gloo's
    messages), or None for any other error."""
    text = str(error)
    peer = re.search(r"remote=\[([^\]]+)\]:(\d+)", text)
    if "connectFullMesh" in text and peer:  # gloo could not connect to the address another rank handed it
        return (f"gloo on {socket.gethostname()} could not connect to another rank at {peer.group(1)}:{peer.group(2)}, "
                "the address that rank's gloo took (its host name's address, unless GLOO_SOCKET_IFNAME names an "
                "interface; 127.0.0.1 is each host's own): set GLOO_SOCKET_IFNAME on every node to the interface of "
                "the network the nodes share (docs/scaling.md).")
    if "Timed out" in text or "timed out" in text or "Timeout" in text:
        return (f"a collective with the other ranks timed out after --distributed-timeout-minutes {timeout_minutes:g}: "
                f"a rank is stopped, frozen or much slower ({text.strip().splitlines()[0][:200]}). Its log, or "
                "py-spy dump --pid PID, shows where it is.")
    if "Connection closed by peer" in text or "Connection reset by peer" in text or "Broken pipe" in text:
        return (f"another rank went away during a collective ({text.strip().splitlines()[0][:200]}): its own "
                "output says why.")
    return None


__all__ = ["ABORT_KEY", "DriverBeacon", "PeerError", "StuckRankError", "collective_error"]
