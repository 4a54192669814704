"""The main job on two nodes under real torchrun: `torchrun --nnodes 2 --nproc-per-node 1 --node-rank r
--rdzv-backend c10d --rdzv-endpoint HOST:PORT --local-addr ADDRESS -m slime_corr.main ...`, one process per node
(DP=2 across the nodes), the driver on global rank 0, the embedded engine (bit-reproducible) in it.

Node 0 runs in this network namespace, node 1 in one this module creates (tests/netns.py, root only), joined by a
veth pair: each node's 127.0.0.1 is its own, so every address the job hands across (the rendezvous, MASTER_ADDR,
gloo's connections, which would take the loopback address this machine's name resolves to, the driver's liveness
store) must be one the other node reaches, or the run fails. The rendezvous store is held by this test (bound on a
port the OS picked; both agents join it with `--rdzv-conf is_host=false`).

The two-node run must log the metrics of the one-process run (float64: only the reduction order differs), save a
checkpoint after each rollout with each node writing its own rank's shard into the shared folder, and a two-node run
resumed from the first checkpoint must log the uninterrupted run's second step.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slime_corr.ports import host_store
from slime_corr.trainer.watchdog import collective_error
from tests import netns
from tests.job_runner import run_main_job

pytestmark = pytest.mark.cost(120)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

FLAGS = ["--rollout-correction-preset", "decoupled_seq_is_rs", "--num-rollout", "2", "--num-steps-per-rollout", "1",
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--micro-batch-size", "2",
         "--rollout-max-response-len", "8", "--params-dtype", "float64", "--engine-dtype", "float32",
         "--rollout-progress", "none", "--seed", "7", "--rollout-engine", "embedded"]
RUN_TIMEOUT = 300


def _env() -> dict[str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
        env.pop(name, None)  # the interface is the job's to find
    return env


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k != "time" and not k.startswith("perf/")} for r in rows}


def _same(got: dict, want: dict) -> None:
    """The rollouts exactly, the rest to 1e-9 relative (float64 sums in another order across the two nodes)."""
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():
        if key.startswith("rollout/") or value is None or got[key] is None:
            assert got[key] == value, (key, got[key], value)
        else:
            assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)) + 1e-12, (key, got[key], value)


def test_a_rank_gloo_cannot_connect_to_is_named_with_its_address():
    """What gloo says when a rank's address is out of reach (what this module's run printed before the job chose
    gloo's interface: each node had handed the other 127.0.0.1)."""
    error = RuntimeError("Gloo connectFullMesh failed with [gloo/transport/tcp/pair.cc:152] timed out connecting: "
                         "SO_ERROR: Connection refused, remote=[127.0.0.1]:34182$1")
    line = collective_error(error, 10)
    assert line is not None and "could not connect to another rank at 127.0.0.1:34182" in line
    assert "GLOO_SOCKET_IFNAME" in line and "timed out after --distributed-timeout-minutes" not in line


@pytest.fixture(scope="module")
def node1():
    with netns.other_host() as host:
        yield host


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[int, dict]:
    run_dir = tmp_path_factory.mktemp("one_process")
    out = run_main_job([*FLAGS, "--run-dir", str(run_dir), "--work-dir", str(run_dir)], env=_env(), timeout=RUN_TIMEOUT,
                       output_dir=run_dir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return _metrics(run_dir)


def two_nodes(node1: netns.OtherHost, run_dir: Path, *flags: str) -> tuple[str, str]:
    """The main job as two torchrun nodes (module doc) to their end; (node 0's output, node 1's)."""
    run_dir.mkdir(parents=True)
    rendezvous = host_store(node1.here)  # held until both agents are done
    endpoint = f"{node1.here}:{rendezvous.port}"
    logs, procs = [run_dir / "node0.log", run_dir / "node1.log"], []
    try:
        for rank, address in enumerate((node1.here, node1.address)):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                   "--rdzv-id", run_dir.name, "--rdzv-conf", "is_host=false", "--local-addr", address,
                   "--max-restarts", "0", "-m", "slime_corr.main", *FLAGS, "--run-dir", str(run_dir / "run"),
                   "--work-dir", str(run_dir / "work"), *flags]
            with open(logs[rank], "wb") as log:
                procs.append(subprocess.Popen(node1.command(cmd) if rank else cmd, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, env=_env(), start_new_session=True))
        deadline = time.monotonic() + RUN_TIMEOUT
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        _stop(procs)
    outputs = [log.read_text(errors="replace") for log in logs]
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"exit codes {codes}\n--- node 0:\n{outputs[0][-4000:]}\n--- node 1:\n{outputs[1][-4000:]}"
    return outputs[0], outputs[1]


def _descendants(pid: int) -> list[int]:
    """The live processes below `pid` (Linux /proc): a torchrun agent's workers, which lead sessions of their own."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _stop(procs: list[subprocess.Popen]) -> None:
    """Launchers still running (a run past its bound): SIGTERM, which torchrun passes to its workers, then after a
    grace period SIGKILL to each launcher and every process it started, by their PIDs."""
    running = [p for p in procs if p.poll() is None]
    workers = [pid for p in running for pid in _descendants(p.pid)]
    for p in running:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 40  # torchrun's own grace between its SIGTERM and SIGKILL is 30 s
    while any(p.poll() is None for p in running) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in [p.pid for p in running if p.poll() is None] + workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for p in running:
        p.wait(30)


@pytest.fixture(scope="module")
def saved(node1, tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("two_nodes")
    node0_out, node1_out = two_nodes(node1, run_dir / "first", "--save", str(run_dir / "ckpt"), "--save-interval", "1")
    return {"out": (node0_out, node1_out), "steps": _metrics(run_dir / "first" / "run"), "ckpt": run_dir / "ckpt",
            "dir": run_dir}


def test_two_nodes_log_the_one_process_runs_metrics(saved, one_process):
    node0_out, node1_out = saved["out"]
    assert sorted(saved["steps"]) == [1, 2]
    for step, want in one_process.items():
        _same(saved["steps"][step], want)
    assert "DP=2 (2 process(es))" in node0_out and node0_out.count("embedded engines") == 1  # one driver, one engine
    assert "step 1:" in node0_out and "step 1:" not in node1_out  # the console is global rank 0's


def test_each_node_saves_its_own_rank_and_a_resumed_run_continues(saved, one_process, node1):
    ckpt = saved["ckpt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    for iteration in ("iter_0000001", "iter_0000002"):
        shards = sorted(p.name for p in (ckpt / iteration).glob("*.distcp"))  # __RANK_WRITER.distcp
        assert {name.split("_")[2] for name in shards} == {"0", "1"}, (iteration, shards)  # node 0's rank, node 1's
    node0_out, _ = two_nodes(node1, saved["dir"] / "resumed", "--load", str(ckpt), "--ckpt-step", "1")
    assert "resumed from" in node0_out and "rollout 1, step 1" in node0_out
    resumed = _metrics(saved["dir"] / "resumed" / "run")
    assert sorted(resumed) == [2]
    _same(resumed[2], one_process[2])
