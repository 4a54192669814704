"""The CPU stand-ins (slime_corr/engines/sglang_cpu) in a process of the real SGLang install, with the environment the
launcher gives every server process: sgl_kernel and torchvision import (and refuse to be called), sglang finds no
AMX kernels (torch-native layers), and the host-allocator table has a plain "cpu" entry (routed-experts buffers)."""

from __future__ import annotations

import subprocess

import pytest

from slime_corr.engines.sglang_server import SGLangServerConfig

pytestmark = pytest.mark.cost(16)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

CHECK = """
import sgl_kernel, torch, torchvision.transforms.v2.functional
from torchvision.transforms import InterpolationMode
from transformers import AutoProcessor  # imports torchvision.io once torchvision is importable
from sglang.srt.utils.common import cpu_has_amx_support
from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS
assert not cpu_has_amx_support()
buf = ALLOC_MEMORY_FUNCS["cpu"]((4, 2, 2), dtype=torch.int32, device="cpu", pin_memory=True, allocator=None)
assert buf.shape == (4, 2, 2) and buf.device.type == "cpu" and not buf.is_pinned()
try:
    sgl_kernel.copy_all_layer_kv_cache_cpu()
except NotImplementedError as e:
    assert "stand-in" in str(e)
else:
    raise AssertionError("a stand-in op ran")
from sglang.srt.environ import envs
print("ok", InterpolationMode.BICUBIC)
print(envs.SGLANG_TIMEOUT_KEEP_ALIVE.get())
"""


@pytest.fixture(scope="module")
def stand_ins_check(sglang_py) -> subprocess.CompletedProcess:
    """CHECK run once in a process of the real SGLang install (an import of SGLang costs ~9 CPU-s)."""
    env = SGLangServerConfig(model_path="unused", python=sglang_py, device="cpu").environment()
    return subprocess.run([sglang_py, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)


def test_stand_ins_in_a_real_sglang_process(stand_ins_check):
    out = stand_ins_check
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stdout[-2000:] + out.stderr[-3000:]


def test_without_the_stand_ins_sglang_cannot_import_its_cpu_path(sglang_py):
    """The stand-ins are what makes it work: without them the first import fails (a check that can fail)."""
    env = SGLangServerConfig(model_path="unused", python=sglang_py, device="cpu").environment()
    env["PYTHONPATH"] = ""
    out = subprocess.run([sglang_py, "-c", "import sgl_kernel"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "sgl_kernel" in out.stderr


def test_the_client_drops_idle_connections_before_sglang_closes_them(stand_ins_check):
    """SGLang's HTTP server (uvicorn) closes a connection idle for SGLANG_TIMEOUT_KEEP_ALIVE seconds (its value in
    the server's environment: CHECK's last line); the client must not keep one longer (a request sent on it as the
    server closes it is never read)."""
    from slime_corr.rollout.client import KEEPALIVE_TIMEOUT

    assert stand_ins_check.returncode == 0, stand_ins_check.stderr[-2000:]
    assert KEEPALIVE_TIMEOUT < float(stand_ins_check.stdout.strip().splitlines()[-1])


def test_a_server_launched_from_a_torchrun_rank_does_not_inherit_its_rendezvous(monkeypatch):
    """torchrun's WORLD_SIZE/RANK/MASTER_PORT in a server's environment make it wait for peers forever."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                 "TORCHELASTIC_RUN_ID": "x", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(k, v)
    env = SGLangServerConfig(model_path="unused", python="python", device="cpu").environment()
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(env)
    assert env["OMP_NUM_THREADS"] == "1" and env["SGLANG_USE_CPU_ENGINE"] == "1"
    # no py-spy / CUDA core dump on CPU: SGLang would wait 5 s "for GPU activity to settle" at every stop
    assert env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"


# A launcher that starts a "server" the way launch_sglang_server does (its own session, the launcher's environment
# for it), prints its PID, then waits to be killed.
LAUNCHER = """
import subprocess, sys, time
from slime_corr.engines.sglang_server import SGLangServerConfig
env = SGLangServerConfig(model_path="unused", python=sys.executable, device="cpu").environment()
server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env, start_new_session=True)
print(server.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:  # a zombie (exited, not reaped: its parent is gone) counts as stopped
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_server_stops_itself_when_its_launcher_is_killed():
    """A trainer killed by SIGKILL cannot stop its servers; each stops itself (sglang_cpu/_parent_watch.py), and
    not while the trainer lives. The "server" is a plain Python with the server's environment: the watch is in the
    stand-ins' sitecustomize, which the server's main process imports (its scheduler and detokenizer are
    forked from it)."""
    import os
    import signal
    import sys
    import time

    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    server = 0
    try:
        server = int(launcher.stdout.readline())
        time.sleep(3)
        assert _alive(server), "the server stopped while its launcher lives"
        launcher.kill()
        launcher.wait(30)
        deadline = time.monotonic() + 30
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(server), "the server outlived its SIGKILLed launcher by 30 s"
    finally:
        launcher.kill()
        if server and _alive(server):
            os.kill(server, signal.SIGKILL)
