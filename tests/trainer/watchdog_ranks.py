"""Two gloo ranks for the watchdog tests (spawned once; each scenario in turn): a driver that stops beating, a
collective one rank never joins, a driver process stopped with SIGSTOP, a driver that fails. Each rank writes what it saw to a file."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist


def _timed_wait(beacon, rollout: int, name: str, seen: dict) -> None:  # noqa: ANN001 - a DriverBeacon
    """Rank 1 waits for the driver's rollout `rollout`: the StuckRankError's message in seen[name], the seconds
    the wait took appended to seen["seconds"]."""
    from slime_corr.trainer.watchdog import StuckRankError

    start = time.monotonic()
    try:
        beacon.wait(f"rollout/{rollout}", f"generating rollout {rollout}")
    except StuckRankError as e:
        seen[name] = str(e)
    seen["seconds"].append(time.monotonic() - start)


def _ranks(rank: int, store_env: dict[str, str], timeout_s: float, out: str) -> None:
    from slime_corr.trainer.watchdog import (
        ABORT_KEY,
        DriverBeacon,
        PeerError,
        collective_error,
    )

    os.environ.update(store_env)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=timeout_s))
    seen: dict[str, object] = {"seconds": []}
    try:
        beacon = DriverBeacon(timeout_s)
        # 1. the driver stops beating (a stopped process): the waiting rank gives up after the timeout
        if rank == 0:
            beacon._stop.set()  # noqa: SLF001 - what a SIGSTOP does to the beat
            time.sleep(timeout_s + 3)
        else:
            _timed_wait(beacon, 0, "silent_driver", seen)
        # 2. a collective rank 1 never joins: rank 0's fails after the process group's timeout
        if rank == 0:
            start = time.monotonic()
            try:
                dist.barrier()
            except RuntimeError as e:
                seen["stuck_collective"] = collective_error(e, timeout_s / 60) or str(e)
            seen["seconds"].append(time.monotonic() - start)  # type: ignore[union-attr]
        else:
            time.sleep(timeout_s + 3)
        # 3. the driver process is stopped (SIGSTOP): the store it hosts answers nothing, and the wait still ends
        assert beacon.store is not None
        if rank == 0:
            beacon.publish("driver_pid", str(os.getpid()))
            beacon.store.wait(["driver_pid_read"], timedelta(seconds=60))  # read before the store stops with us
            os.kill(os.getpid(), signal.SIGSTOP)  # until rank 1 continues it
        else:
            beacon.store.wait(["driver_pid"], timedelta(seconds=60))  # rank 0 may still be in the barrier above
            driver = int(beacon.store.get("driver_pid"))
            beacon.store.set("driver_pid_read", "1")
            try:
                while Path(f"/proc/{driver}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":  # stopped
                    time.sleep(0.05)
                _timed_wait(beacon, 2, "stopped_driver", seen)
            finally:
                os.kill(driver, signal.SIGCONT)
        # 4. the driver fails: the waiting rank stops with its error
        if rank == 0:
            beacon.publish(ABORT_KEY, "rollout 0: 4 of 4 samples failed")
            # the store lives in this process: stay until rank 1 has read the error (however loaded the machine)
            beacon.store.wait(["driver_error_read"], timedelta(seconds=60))
        else:
            try:
                beacon.wait("rollout/1", "generating rollout 1")
            except PeerError as e:
                seen["driver_error"] = str(e)
            finally:
                beacon.store.set("driver_error_read", "1")
        beacon.close()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
        dist.destroy_process_group()


def run_watchdog_ranks(timeout_s: float) -> dict:
    """Spawn the two ranks; their findings merged (seconds: each wait's duration)."""
    from tests.mcore.mcore_helpers import spawn_on_hosted_store

    with tempfile.TemporaryDirectory() as out:
        spawn_on_hosted_store(_ranks, 2, timeout_s, out)
        merged: dict = {"seconds": []}
        for rank in (0, 1):
            seen = json.loads(Path(out, f"rank{rank}.json").read_text())
            merged["seconds"] += seen.pop("seconds")
            merged.update(seen)
        return merged
