"""The trainer end to end on the REAL SGLang server (bf16, CPU): decoupled and bypass mode, disk and distributed
weight sync, two engines behind the real sglang-router, and a server killed mid-run. Each run goes through
the main job's entry point (`python -m slime_corr.main`'s code, forked with its imports done: tests/job_runner.py). A
server the trainer launches itself (the default engine) is started, used and checked
stopped by tests/test_readme_commands.py, on the main job's command as the README gives it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import pytest

from slime_corr.rollout.client import SGLangClient
from tests.job_runner import MainJob, run_main_job
from tests.real_sglang.sglang_helpers import ServerSpec

pytestmark = pytest.mark.cost(200)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
         "--num-steps-per-rollout", "2", "--micro-batch-size", "4", "--rollout-max-response-len", "8"]
RUN_TIMEOUT = 600


@pytest.fixture(scope="module")
def servers(shared_servers, launch, tiny_opt):
    """A: shared with test_sglang_partial_rollout; B: this module's own (its last test kills it)."""
    (a,) = shared_servers(ServerSpec(tiny_opt["v0"], dtype="bfloat16", name="bf16"))
    (b,) = launch(ServerSpec(tiny_opt["v0"], dtype="bfloat16", name="bf16-b"))
    return a, b


@pytest.fixture(scope="module")
def router(servers):
    from slime_corr.engines.router import start_router

    with start_router([s.url for s in servers]) as handle:
        yield handle.url


def main(run_dir: Path, *args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    """The main job in a process of its own (forked with its imports done: tests/job_runner.py)."""
    return run_main_job([*SMALL, "--run-dir", str(run_dir), *args], timeout=timeout,
                        output_dir=run_dir.parent / f"{run_dir.name}_output")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def versions(urls: list[str]) -> dict[str, str | None]:
    async def go():
        async with SGLangClient(urls) as c:
            return await c.weight_versions()

    return asyncio.run(go())


def test_decoupled_disk_sync(servers, tmp_path):
    a, _ = servers
    out = main(tmp_path, "--sglang-url", a.url, "--rollout-correction-preset", "decoupled_seq_is_rs",
               "--rollout-weight-sync", "disk")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    k3 = [r["rollout_corr/mismatch_k3_kl"] for r in rows]
    assert all(0 < x < 0.1 for x in k3), k3  # bf16 server vs fp32 trainer: a real, small mismatch
    assert all(r["train/pg_clipfrac"] == 0 for r in rows[::2])  # decoupled: π_θ = π_old at a rollout's first step
    assert versions([a.url])[a.url] == "step-4"  # the weights of every step reached the server


def test_bypass_distributed_sync_two_engines_behind_the_router(servers, router, tmp_path):
    out = main(tmp_path, "--sglang-url", router, "--rollout-correction-preset", "ppo_is_bypass",
               "--rollout-weight-sync", "distributed")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = metrics(tmp_path)
    assert len(rows) == 4 and all(r["rollout_corr/mismatch_k3_kl"] > 0 for r in rows)
    assert set(versions([s.url for s in servers]).values()) == {"step-4"}  # both engines got the weights


def test_a_server_killed_mid_run_ends_the_run_with_its_name(servers, tmp_path):
    """Runs last in this module: it kills server B (SIGKILL to its process group) after the first step."""
    _, b = servers
    output = tmp_path.parent / f"{tmp_path.name}_output"
    proc = MainJob([*SMALL, "--num-rollout", "6", "--run-dir", str(tmp_path), "--sglang-url", b.url,
                    "--rollout-correction-preset", "decoupled_token_is"], stdout=output)
    deadline = time.monotonic() + RUN_TIMEOUT
    while "\nstep 1:" not in "\n" + output.read_text() and time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    assert "\nstep 1:" in "\n" + output.read_text(), output.read_text()[-3000:]
    killed_at = time.monotonic()
    b.kill()
    try:
        code = proc.wait(300)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - killed_at
    lines = output.read_text().splitlines(keepends=True)
    text = "".join(lines)
    assert code != 0, text[-3000:]
    assert b.url.split("//")[1] in text, text[-3000:]  # the error names the server
    assert "Traceback" not in text, text[-3000:]
    print(f"killed server: exit {code} after {took:.1f} s; last lines:\n" + "\n".join(text.splitlines()[-4:]))
