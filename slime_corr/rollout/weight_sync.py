"""Trainer-side weight sync: to every engine from a checkpoint on disk, or over a process group (slime's path).

Distributed sync (:class:`DistributedWeightSync`): the trainer (rank 0) and every live engine form a
weight-update group (``/init_weights_update_group``; its backend is the caller's, the trainer's from
:func:`slime_corr.device.weight_sync_backend`: NCCL from a GPU to engines on other GPUs, else gloo, the default
here); each sync then pauses the
engines, opens a weight-update session (``/begin_weight_update``), sends the weights bucket by bucket - for each
bucket one ``/update_weights_from_distributed`` request per engine with the names, dtypes and shapes, while the
trainer broadcasts the tensors -, closes the session, flushes the cache and continues generation. The engines
cast what they receive to their own dtype exactly as loading the same tensors from disk would.

The engines join at ``master_address``: by default the trainer's address on the interface that routes to them
(:func:`slime_corr.addresses.master_address`; 127.0.0.1 only for engines on this host), else ``MASTER_ADDR``. The
group's store listens on a port the OS picks as it binds (on every interface: torch's TCPStore binds no single
address), and gloo's connections bind ``master_address`` itself. An engine that cannot reach it fails its join, or
the group times out: :class:`WeightGroupError` names the address, the port and each engine's host.

When the set of live engines changes (the client found one dead), the next sync builds a new group with the
engines that are left. A failure is raised (never a hang: the group has a timeout) and the next sync starts
from a new group. SGLang refuses to build a group under a name it already holds ("The specified group name has
already been created"), and a server outlives the jobs that use it: every group gets a name of its own
(``{group_name}-{pid}-{n}``), and leaving it (a new group, the job's end) destroys it on the engines
(``/destroy_weights_update_group``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from slime_corr.addresses import is_this_host, master_address, route_source, url_host
from slime_corr.errors import ConfigError
from slime_corr.ports import host_store
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.control import ControlError, check_sync_pause_mode
from slime_corr.rollout.weight_group import (
    FLATTENED_BUCKET,
    Bucket,
    WeightUpdateGroup,
    make_buckets,
)

DEFAULT_BUCKET_BYTES = 512 * 1024**2  # slime's --update-weight-buffer-size default
_groups_built = itertools.count()  # this process's groups: a part of each one's name
T = TypeVar("T")


class WeightGroupError(ControlError):
    """The engines could not join the weight-update group at the trainer's address: the message names the address,
    the port, each engine's host and the fix."""

    def __init__(self, address: str, port: int, failures: dict[str, str], chosen: str) -> None:
        super().__init__("/init_weights_update_group", failures)
        detail = "; ".join(f"{w} (host {_host(w)}): {r}" for w, r in failures.items())
        self.address, self.port = address, port
        self.args = (f"the engines could not join the weight-update group at {address}:{port} ({chosen}): {detail}. "
                     f"Each engine connects to {address} (the store on port {port}, then gloo or NCCL): give "
                     "--update-weight-master-address the trainer's address on the network the engines reach (see "
                     "docs/scaling.md), or use --rollout-weight-sync disk with a folder both sides see.",)


def _host(url: str) -> str:
    try:
        return url_host(url)
    except ValueError:
        return url


@dataclass
class SyncReport:
    """What one sync did: engines reached, buckets, bytes and seconds."""

    workers: list[str]
    buckets: int
    bytes: int
    seconds: float


class DistributedWeightSync:
    """Rank 0 of the weight-update group between the trainer and the engines behind ``client``."""

    def __init__(
        self,
        client: SGLangClient,
        *,
        backend: str = "gloo",
        master_address: str | None = None,
        group_name: str = "slime_corr_weight_sync",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        load_format: str | None = FLATTENED_BUCKET,
        timeout: float = 600.0,
    ) -> None:
        self.client = client
        self.backend, self.group_name = backend, group_name
        self.requested_address = master_address  # --update-weight-master-address; None: the address toward the engines
        self.master_address = master_address or ""  # the address the engines were last told (`connect`)
        self.bucket_bytes, self.load_format, self.timeout = bucket_bytes, load_format, timeout
        self.group: WeightUpdateGroup | None = None
        self.workers: list[str] = []
        self.name = ""  # the current group's name

    async def connect(self) -> None:
        """(Re)build the group with the live engines: they join as ranks 1..N while the trainer joins as 0."""
        await self.disconnect()
        workers = await self.client.control.workers()
        if not workers:
            raise ControlError("/init_weights_update_group", {"(none)": "no live engine to sync"})
        world = 1 + len(workers)
        address = self.master_address = self.requested_address or master_address(workers)
        routed = any(route_source(_host(w)) for w in workers)
        chosen = "--update-weight-master-address" if self.requested_address else \
            "the trainer's address toward the engines" if routed else "MASTER_ADDR: no route to the engines found"
        if not is_this_host(address):
            raise ConfigError(f"the weight-update group's master address {address} ({chosen}) is not an address of "
                              "this host (the trainer's rank 0), so nothing here can listen on it: give "
                              "--update-weight-master-address one of its interfaces' addresses that the engines reach.")
        # the trainer's store is bound before the engines are told its port (no other process can take it between)
        store = host_store(address, world, datetime.timedelta(seconds=self.timeout))
        port = store.port
        name = f"{self.group_name}-{os.getpid()}-{next(_groups_built)}"
        mine = _in_daemon_thread(WeightUpdateGroup, address, port, 0, world, name, self.backend, self.timeout,
                                 store=store)
        theirs = asyncio.ensure_future(self.client.weights.init_weights_update_group(
            address, port, 1, world, name, self.backend, workers=workers))
        try:
            await _both(mine, theirs)  # an engine's refusal surfaces at once (our side then times out by itself)
        except ControlError as e:  # an engine could not join: name the address and its host
            raise WeightGroupError(address, port, e.failures, chosen) from e
        except RuntimeError as e:  # our side failed or timed out: no engine reported why
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise WeightGroupError(address, port, {w: f"the trainer's side of the group failed, after waiting up to "
                                                      f"{self.timeout:g} s for the engines: {reason}"
                                                   for w in workers}, chosen) from e
        self.group, self.workers, self.name = mine.result(), workers, name

    async def disconnect(self) -> None:
        """Leave the group: the engines destroy theirs, then the trainer's side closes. Best effort on the engines'
        side (one may be gone): the next group has a name of its own anyway."""
        if self.group is not None:
            with contextlib.suppress(Exception):
                await self.client.weights.destroy_weights_update_group(self.name, workers=self.workers)
        self.close()

    async def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str,
                   pause_mode: str = "abort") -> SyncReport:
        """Pause, send every tensor bucket by bucket, flush, continue; the engines report ``weight_version``."""
        check_sync_pause_mode(pause_mode)
        t0 = time.perf_counter()
        if self.group is None or set(self.workers) != set(await self.client.control.workers()):
            await self.connect()
        buckets = make_buckets([(n, t.detach()) for n, t in named_tensors], self.bucket_bytes)
        if not buckets:
            raise ValueError("named_tensors: nothing to sync")

        async def send_all() -> None:
            await self.client.weights.begin_weight_update(self.workers)
            try:
                for i, bucket in enumerate(buckets):
                    await self._send(bucket, weight_version if i == len(buckets) - 1 else None)
            except BaseException:
                with contextlib.suppress(Exception):  # no session left open for the next sync
                    await self.client.weights.end_weight_update(self.workers)
                raise
            await self.client.weights.end_weight_update(self.workers)
            await self.client.control.flush_cache()

        try:
            await self.client.control.while_paused(send_all, pause_mode)
        except BaseException:
            self.close()  # the group may be mid-broadcast: the next sync starts from a new one
            raise
        return SyncReport(list(self.workers), len(buckets), sum(b.nbytes for b in buckets),
                          time.perf_counter() - t0)

    async def _send(self, bucket: Bucket, weight_version: str | None) -> None:
        assert self.group is not None
        post = asyncio.ensure_future(self.client.weights.update_weights_from_distributed(
            bucket.names, bucket.dtypes, bucket.shapes, self.name, flush_cache=False,
            weight_version=weight_version, load_format=self.load_format, workers=self.workers,
            nbytes=bucket.nbytes))
        flattened = self.load_format == FLATTENED_BUCKET
        send = asyncio.ensure_future(asyncio.to_thread(self.group.send_bucket, bucket.tensors, flattened))
        await _both(send, post)

    def close(self) -> None:
        """Close the trainer's side of the group (`disconnect` also destroys the engines')."""
        if self.group is not None:
            self.group.close()
        self.group, self.workers = None, []


async def _both(a: asyncio.Future, b: asyncio.Future) -> None:
    """Await two futures; the first failure is raised at once (the other is left to finish or time out)."""
    done, pending = await asyncio.wait({a, b}, return_when=asyncio.FIRST_EXCEPTION)
    for f in done:
        if f.exception() is not None:
            for p in pending:
                p.add_done_callback(_consume)
            raise f.exception()  # type: ignore[misc]
    await asyncio.gather(*pending)


def _in_daemon_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
    """`fn(*args, **kwargs)` in a daemon thread, as a future of the running loop: the trainer's side of a group whose
    engines failed to join waits for them until its own timeout, and must not hold up the process's exit meanwhile
    (the loop's executor threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args, **kwargs), None
        except BaseException as e:  # noqa: BLE001 - handed to the loop
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="slime_corr-weight-group", daemon=True).start()
    return future


def _consume(f: asyncio.Future) -> None:
    if not f.cancelled():
        f.exception()  # retrieved: no "exception was never retrieved" warning


async def sync_weights_from_disk(client: SGLangClient, checkpoint_dir: str, weight_version: str,
                                 pause_mode: str = "abort") -> SyncReport:
    """The disk path with the same report: every engine loads ``checkpoint_dir`` (written by the trainer)."""
    t0 = time.perf_counter()
    await client.weights.sync_weights_from_disk(checkpoint_dir, weight_version, pause_mode)
    return SyncReport(await client.control.workers(), 0, 0, time.perf_counter() - t0)
