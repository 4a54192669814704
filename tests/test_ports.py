"""No port is picked free and bound later by this project's own processes (slime_corr/ports.py): a store binds port
0 and its port is held from the moment anyone is told it; ranks join the store their launcher holds, as torchrun's
do. CI lost a data-parallel test to EADDRINUSE when another process took a port between its probe and its bind.

The other places: a world of one (tests/trainer/test_trainer_units.py), the weight-update group
(tests/rollout/test_weight_sync.py), the SGLang server's port (tests/real_sglang/test_sglang_endpoints.py) and the
router's two (tests/rollout/test_router.py), the last two programs that bind their own ports, started again
elsewhere when one is taken."""

from __future__ import annotations

import errno
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from slime_corr import ports
from tests.job_runner import MainJob
from tests.mcore.mcore_helpers import spawn_on_hosted_store


def _bind_error(host: str, port: int) -> str:
    """What another process gets when it tries to bind `port` now: "free" or the errno's name."""
    with socket.socket() as other:
        try:
            other.bind((host, port))
        except OSError as e:
            return errno.errorcode.get(e.errno or 0, str(e))
    return "free"


def test_a_hosted_store_holds_its_port_from_the_moment_it_is_known() -> None:
    store = ports.host_store(world_size=2)
    assert store.port > 0 and _bind_error("127.0.0.1", store.port) == "EADDRINUSE"
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"


def _rank(rank: int, store_env: dict[str, str], out: str) -> None:
    held = _bind_error(store_env["MASTER_ADDR"], int(store_env["MASTER_PORT"]))  # before this rank joins
    os.environ.update(store_env)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        Path(out, f"rank{rank}").write_text(f"{held} {os.environ[ports.AGENT_STORE]} {total.item():g}")
    finally:
        dist.destroy_process_group()


def test_spawned_ranks_join_the_store_their_launcher_holds() -> None:
    """No rank binds a port: rank 0 too is a client of the store the launcher bound before it spawned them."""
    with tempfile.TemporaryDirectory() as out:
        spawn_on_hosted_store(_rank, 2, out)
        seen = sorted(p.read_text() for p in Path(out).iterdir())
    assert seen == ["EADDRINUSE True 3"] * 2, seen


def test_the_job_runner_holds_its_ranks_store_for_the_jobs_life(tmp_path: Path) -> None:
    """Its ranks get torchrun's variables for an agent-hosted store; the port is held until the job has ended."""
    job = MainJob(["--help"], nproc=2, stdout=tmp_path / "out")
    store = job._store  # noqa: SLF001 - what the ranks were told
    assert store is not None and _bind_error("127.0.0.1", store.port) == "EADDRINUSE"
    assert job.wait(120) == 0, (tmp_path / "out").read_text()[-2000:]
    assert job._store is None  # noqa: SLF001 - released with the job
