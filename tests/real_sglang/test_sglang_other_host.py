"""The REAL SGLang server and sglang-router on another host than the trainer's, both weight-sync modes.

The engines' host is a network namespace this module creates (tests/netns.py; root only), joined to this one by a
veth pair: the server (`--host ITS_ADDRESS`) and the router (`--host` and `--prometheus-host` the same) listen on
its address, and its 127.0.0.1 is its own. The main job runs here with `--sglang-url` the router's URL:

- distributed: the engines join the weight-update group at the trainer's address toward them (this namespace's end
  of the pair), which the server's log records; told 127.0.0.1 they would connect to their own loopback and fail;
- disk: the weight files go to `--work-dir`, a folder both hosts see at the same path (both namespaces share this
  machine's files; across machines, a shared file system).

The server's gloo takes the address of its host's name (this machine's resolves to 127.0.0.1) unless
GLOO_SOCKET_IFNAME names an interface: it gets its end of the pair, as an engine host whose name resolves to
loopback must (docs/scaling.md). Ports: the namespace holds nothing but this module's processes, so the server's and
the router's fixed ports cannot be taken there by anyone else. Both are stopped by their PIDs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime_corr.engines.launch import engine_device
from slime_corr.engines.router import _workers_ready, router_available, router_command, stop_process
from slime_corr.engines.sglang_server import SGLangServerConfig, _wait_until_serving, stop_process_group
from slime_corr.rollout.client import SGLangClient
from tests import netns
from tests.job_runner import run_main_job

pytestmark = pytest.mark.cost(110)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

SERVER_PORT, ROUTER_PORT, PROMETHEUS_PORT = 30000, 30001, 30002  # in the module's own namespace
SMALL = ["--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
         "--num-steps-per-rollout", "1", "--micro-batch-size", "4", "--rollout-max-response-len", "8",
         "--rollout-correction-preset", "decoupled_seq_is_rs"]
RUN_TIMEOUT = 600
ROUTER_START_S = 60.0


@pytest.fixture(scope="module")
def engine_host():
    with netns.other_host() as host:
        yield host


@pytest.fixture(scope="module")
def engines(engine_host, sglang_py, tiny_opt, tmp_path_factory):
    """The server (bf16) and the router in front of it, on the engines' host."""
    if not router_available():
        pytest.skip("sglang-router is not installed (pip install sglang-router)")
    logs = tmp_path_factory.mktemp("other_host_logs")
    config = SGLangServerConfig(model_path=tiny_opt["v0"], python=sglang_py, dtype="bfloat16", device=engine_device(),
                                skip_tokenizer_init=True, weight_version="v0", log_dir=logs, host=engine_host.address)
    server_url = config.url(SERVER_PORT)
    router_url = f"http://{engine_host.address}:{ROUTER_PORT}"
    server_log, router_log = logs / "sglang.log", logs / "router.log"
    with contextlib.ExitStack() as stack:
        with open(server_log, "wb") as log:
            server = subprocess.Popen(engine_host.command(config.command(SERVER_PORT)), stdout=log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                      env=dict(config.environment(), GLOO_SOCKET_IFNAME=engine_host.interface))
        stack.callback(stop_process_group, server)
        _wait_until_serving(server_url, server, server_log, config.startup_timeout)
        with open(router_log, "wb") as log:
            router = subprocess.Popen(engine_host.command(router_command([server_url], ROUTER_PORT, PROMETHEUS_PORT,
                                                                         host=engine_host.address)),
                                      stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        stack.callback(stop_process, router)
        deadline = time.monotonic() + ROUTER_START_S
        while router.poll() is None and time.monotonic() < deadline and not _workers_ready(router_url, [server_url]):
            time.sleep(0.2)
        assert _workers_ready(router_url, [server_url]), f"the router did not list {server_url}: " \
                                                         f"{router_log.read_text(errors='replace')[-2000:]}"
        yield SimpleNamespace(server=server_url, router=router_url, server_log=server_log)


def main(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """The main job here, forked with its imports done (tests/job_runner.py)."""
    return run_main_job([*SMALL, "--run-dir", str(run_dir), *args], timeout=RUN_TIMEOUT,
                        output_dir=run_dir.parent / f"{run_dir.name}_output")


def steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def version(url: str) -> str | None:
    async def go():
        async with SGLangClient(url) as client:
            return (await client.weight_versions())[url]

    return asyncio.run(go())


def told_addresses(log: Path) -> list[str]:
    """The master addresses the server was told, as its log records them."""
    return [line.split("master_address=", 1)[1].split(",", 1)[0]
            for line in log.read_text(errors="replace").splitlines() if "master_address=" in line]


def test_distributed_sync_the_engines_reach_the_trainer_at_its_address(engines, engine_host, tmp_path):
    out = main(tmp_path / "run", "--sglang-url", engines.router, "--rollout-weight-sync", "distributed")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert steps(tmp_path / "run") == [1, 2]
    assert version(engines.server) == "step-2"  # the first push and both rollouts' weights arrived
    told = told_addresses(engines.server_log)
    assert told and set(told) == {engine_host.here}, told  # never 127.0.0.1: the engines' own loopback


def test_disk_sync_through_a_folder_both_hosts_see(engines, tmp_path):
    shared = tmp_path / "shared"
    out = main(tmp_path / "run", "--sglang-url", engines.router, "--rollout-weight-sync", "disk",
               "--work-dir", str(shared))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert steps(tmp_path / "run") == [1, 2]
    assert version(engines.server) == "step-2"
    assert (shared / "weights" / "step-2").is_dir()  # what the server loaded, written here


def test_without_a_shared_folder_a_disk_sync_to_another_host_is_refused(engines, tmp_path):
    out = main(tmp_path / "run", "--sglang-url", engines.router, "--rollout-weight-sync", "disk")
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"--sglang-url {engines.router} is on another host" in out.stderr and "--work-dir" in out.stderr
