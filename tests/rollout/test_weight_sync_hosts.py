"""The distributed weight sync to an engine on another host (slime_corr/addresses.py): the engines join the group
at the trainer's address on the interface that routes to them, not at 127.0.0.1, and an address they cannot reach
ends the sync with an error naming it and their host.

The other host is a network namespace this module creates (tests/netns.py; root only): the embedded engine runs
there (`python -m slime_corr.engines.embedded.engine --host ADDRESS`), a real process with real HTTP and a real gloo
group to the trainer here, and its 127.0.0.1 is its own, so a wrong address fails for real. The real SGLang server
and sglang-router on another host are tests/real_sglang/test_sglang_other_host.py's, two nodes under torchrun
tests/trainer/test_multi_node.py's. The parse-time checks of the addresses and of a disk sync to another host run
first, without a namespace.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import subprocess
import sys
import time

import pytest
import torch

from slime_corr.addresses import (
    interface_of,
    is_this_host,
    master_address,
    pin_gloo_interface,
    route_source,
    url_host,
)
from slime_corr.engines.embedded.engine import start_local_engine
from slime_corr.engines.embedded.model import load_tiny_lm, teacher_forced_logprobs
from slime_corr.engines.router import stop_process
from slime_corr.errors import ConfigError
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.weight_sync import DistributedWeightSync, WeightGroupError
from slime_corr.trainer.config import TrainerConfig
from tests import netns

pytestmark = pytest.mark.cost(30)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

PROMPT = [72, 101, 108, 108, 111, 32]
ENGINE_START_S = 120.0
GROUP_TIMEOUT_S = 8  # the engine's bound on each try to join a group (c10d retries once after a random back-off)
TRAINER_WAIT_S = 120  # the trainer's side outwaits the engine's tries by far: the engine's refusal always comes first


def test_this_hosts_address_toward_a_peer() -> None:
    assert route_source("127.0.0.1") == "127.0.0.1" and interface_of("127.0.0.1") == "lo"
    assert route_source("host.invalid") is None and interface_of("not an address") is None
    assert url_host("http://10.1.2.3:30000/generate") == "10.1.2.3" and url_host("localhost:30000") == "localhost"
    assert is_this_host("127.0.0.2") and is_this_host("localhost") and is_this_host("host.invalid") is None
    assert is_this_host("192.0.2.99") is False  # TEST-NET-1: no interface of a test machine holds it
    assert master_address(["http://127.0.0.1:30000"]) == "127.0.0.1"


def test_with_no_route_the_master_address_is_master_addr(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "10.9.8.7")
    assert master_address(["http://host.invalid:30000"]) == "10.9.8.7"
    monkeypatch.delenv("MASTER_ADDR")
    assert master_address(["http://host.invalid:30000"]) == "127.0.0.1"


def test_gloo_keeps_its_own_choice_on_one_host_and_a_users_interface(monkeypatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert pin_gloo_interface("127.0.0.1") is None and "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert pin_gloo_interface("192.0.2.99") is None and os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_the_address_flags_are_checked_at_parse_time() -> None:
    with pytest.raises(ConfigError, match=r"--update-weight-master-address '10.0.0.1' is only used by "
                                          r"--rollout-weight-sync distributed"):
        TrainerConfig(update_weight_master_address="10.0.0.1")
    with pytest.raises(ConfigError, match="--update-weight-master-address ' ' is empty"):
        TrainerConfig(update_weight_master_address=" ", rollout_weight_sync="distributed")
    remote = "http://192.0.2.99:30000"
    with pytest.raises(ConfigError, match=f"--sglang-url {remote} is on another host.*set --work-dir"):
        TrainerConfig(sglang_url=(remote,), rollout_weight_sync="disk")
    TrainerConfig(sglang_url=(remote,), rollout_weight_sync="disk", work_dir="/tmp")  # a folder both see: accepted
    TrainerConfig(sglang_url=(remote,), rollout_weight_sync="distributed")
    TrainerConfig(sglang_url=("http://127.0.0.1:30000",), rollout_weight_sync="disk")  # this host: its own folders


def test_a_master_address_of_another_host_is_refused_before_anything_binds(tiny_ckpt, trainer):
    async def go(url: str) -> None:
        async with SGLangClient(url) as client:
            await DistributedWeightSync(client, master_address="192.0.2.99", timeout=10).sync(
                trainer.state_dict().items(), "elsewhere")

    with start_local_engine(tiny_ckpt, dtype=torch.float32) as handle, \
            pytest.raises(ConfigError, match=r"master address 192.0.2.99 \(--update-weight-master-address\) is not "
                                             r"an address of this host"):
        asyncio.run(go(handle.url))


@pytest.fixture(scope="module")
def other_host():
    with netns.other_host() as host:
        yield host


@pytest.fixture(scope="module")
def engine(other_host, tiny_ckpt):
    """The embedded engine (fp32) on the other host, listening on its address; stopped by its PID."""
    cmd = other_host.command([sys.executable, "-m", "slime_corr.engines.embedded.engine", "--checkpoint", tiny_ckpt,
                              "--fp32", "--threads", "1", "--host", other_host.address,
                              "--group-timeout", str(GROUP_TIMEOUT_S)])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        ready = selectors.DefaultSelector()
        ready.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + ENGINE_START_S
        while not ready.select(0.2) and proc.poll() is None and time.monotonic() < deadline:
            pass
        line = proc.stdout.readline() if ready.select(0) else ""
        assert line.startswith("READY "), f"the engine on {other_host.address} did not start: {line!r}, exit " \
                                          f"{proc.poll()}"
        yield line.split()[1]
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def trainer(tiny_ckpt_v1):
    return load_tiny_lm(tiny_ckpt_v1)


def test_the_engines_join_at_the_trainers_address_toward_them(other_host, engine, trainer):
    """By default the engines are told this namespace's end of the pair (the interface that routes to them); the
    weights arrive (the engine then samples with the trainer's log-probs)."""
    assert url_host(engine) == other_host.address

    async def go():
        async with SGLangClient(engine) as client:
            sync = DistributedWeightSync(client, bucket_bytes=1 << 20, timeout=60)
            try:
                report = await sync.sync(trainer.state_dict().items(), "across")
            finally:
                await sync.disconnect()
            out = await client.generate(PROMPT, {"max_new_tokens": 12, "ignore_eos": True, "temperature": 0.8})
            return sync.master_address, report, out

    told, report, out = asyncio.run(go())
    assert told == other_host.here != "127.0.0.1"
    assert report.workers == [engine] and report.bytes > 0
    assert out.weight_version == "across"
    ref = teacher_forced_logprobs(trainer, PROMPT, out.output_ids, temperature=0.8)
    torch.testing.assert_close(torch.tensor(out.log_probs), ref, atol=1e-4, rtol=0)


def test_an_address_the_engines_cannot_reach_is_named_with_their_host(other_host, engine, trainer):
    """127.0.0.1 (the old default) is the engine's own loopback there: its join is refused, and the error names the
    address, the port and the engine's host, and the flag that fixes it."""

    async def go():
        async with SGLangClient(engine) as client:
            sync = DistributedWeightSync(client, master_address="127.0.0.1", timeout=TRAINER_WAIT_S)
            try:
                await sync.sync(trainer.state_dict().items(), "unreachable")
            finally:
                sync.close()

    with pytest.raises(WeightGroupError) as caught:
        asyncio.run(go())
    message = str(caught.value)
    # the engine's own report (SGLang's words), not our side's timeout ("the trainer's side of the group failed")
    assert "Failed to initialize custom process group" in message, message
    assert "the trainer's side" not in message, message
    assert f"at 127.0.0.1:{caught.value.port}" in message and f"(host {other_host.address})" in message, message
    assert "--update-weight-master-address" in message and "could not be reached" in message, message
