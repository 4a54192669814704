"""Ports: who binds them, so that no other process can take one between its choice and its bind.

A port picked free and bound later (by a store, a server) can be taken meanwhile by any process on the host — a
second job, a test worker beside this one — and the bind then fails with EADDRINUSE. So:

- a store this process hosts binds port 0 and reads back the port the OS chose in the same call (`host_store`);
  the other members are told that port (torchrun's agent does the same for its ranks: `agent_store_environment`);
- a world of one needs no port at all (an in-process `HashStore`);
- a port another program binds itself (the SGLang server, sglang-router) can only be picked here (`free_port`):
  its caller starts the program again on a new port when the program reports the port taken, a bounded number
  of times (`PORT_TRIES`), and names the port and the log when every try lost the race.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

PORT_TRIES = 3  # starts of a program whose picked port another process took before it bound it
LOOPBACK = "127.0.0.1"
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # torchrun's: the ranks join the store their agent hosts


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on `host` right now, for a program that binds it itself; the caller retries when the
    program reports it taken (`PORT_TRIES`). A store this process hosts binds port 0 instead (`host_store`)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_store(host: str = LOOPBACK, world_size: int | None = None,
               timeout: timedelta = timedelta(minutes=10)) -> dist.TCPStore:
    """A `torch.distributed.TCPStore` server on `host`, on the port the OS picks as it binds (`store.port`): the
    port that the other members are told. Returns at once (it does not wait for them)."""
    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)


def agent_store_environment(store: dist.TCPStore) -> dict[str, str]:
    """The variables torchrun gives its ranks when its agent hosts their store: `init_process_group()` (env://)
    then connects every rank, rank 0 included, to `store` as a client, and no rank binds a port of its own."""
    return {"MASTER_ADDR": store.host, "MASTER_PORT": str(store.port), AGENT_STORE: "True"}


def init_world_of_one(backend: str, timeout: timedelta | None = None) -> None:
    """A default process group of this one process over an in-process store: no port, nothing to race for."""
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            **({} if timeout is None else {"timeout": timeout}))


__all__ = ["AGENT_STORE", "LOOPBACK", "PORT_TRIES", "agent_store_environment", "free_port", "host_store",
           "init_world_of_one"]
