"""Every endpoint the client uses, against the REAL SGLang 0.5.23 server on CPU (two fp32 servers for the module:
A streams cumulatively, SGLang's default; B with --incremental-streaming-output), serving the trainer's tiny model
as its OPT checkpoint. Log-probs are checked against the trainer's own teacher-forced log-probs (Megatron GPTModel,
fp32, `vocab_parallel_log_probs`). The servers' start-up is tested first: a port taken before a server binds it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slime_corr.engines import sglang_server
from slime_corr.ports import free_port
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.rollout import generate_sample
from slime_corr.rollout.weight_sync import DistributedWeightSync
from slime_corr.samples import Sample, SampleStatus
from tests.real_sglang.sglang_helpers import (
    ServerSpec,
    group_cpu_seconds,
    group_processes,
    megatron_logprobs,
    slowed_down,
    tokens_streamed,
)

pytestmark = pytest.mark.cost(150)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

PROMPTS = [list(b"spell 42: "), list(b"spell 7: "), list(b"hello"), list(b"x")]
LOGPROB_TOL = 1e-4  # fp32 server vs fp32 trainer (SGLANG_ON_CPU.md: 1.0-1.8e-5 measured)


def _specs(tiny_opt) -> tuple[ServerSpec, ServerSpec]:
    return (ServerSpec(tiny_opt["v0"], name="fp32"),
            ServerSpec(tiny_opt["v0"], extra_args=("--incremental-streaming-output",), name="fp32-incremental"))


@pytest.fixture(scope="module")
def servers(shared_servers, tiny_opt):
    a, b = shared_servers(*_specs(tiny_opt))
    return a.url, b.url


def _run(coro):
    return asyncio.run(coro)


async def _samples(url: str, stream: bool, temperature: float, max_new_tokens: int = 12) -> list[Sample]:
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    async with SGLangClient(url) as c:
        return list(await asyncio.gather(*(generate_sample(c, Sample(prompt_tokens=list(p)), params, stream=stream)
                                           for p in PROMPTS)))


def _check_against_trainer(version_dir: str, samples: list[Sample], temperature: float) -> float:
    ref = megatron_logprobs(version_dir, [(s.prompt_tokens, s.response_tokens) for s in samples], temperature)
    worst = 0.0
    for s, r in zip(samples, ref, strict=True):
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED), s.failure_reason
        assert len(s.response_tokens) == len(s.rollout_log_probs) == len(r) > 0
        worst = max(worst, float((s.rollout_log_probs - r.float()).abs().max()))
    assert worst <= LOGPROB_TOL, worst
    return worst


def test_a_port_taken_before_the_bind_starts_the_server_again_elsewhere(shared_servers, tiny_opt, monkeypatch):
    """A server binds its port tens of seconds after the launcher probed it free (its imports come first); CI18 lost
    a module's servers to a port taken meanwhile. The fault is real: a listening socket holds the first port the
    probe returns, the real server fails to bind it, and the launcher starts it again on another port. This test
    starts the group's servers: it stops them first if a module before it started them (in CI it runs first)."""
    shared_servers.stop_all()
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()  # held, not served: a request to it waits, as to a busy process's port
    taken = holder.getsockname()[1]
    ports = iter([taken])
    monkeypatch.setattr(sglang_server, "free_port", lambda host="127.0.0.1": next(ports, None) or free_port(host))
    try:
        started = shared_servers(*_specs(tiny_opt))
    finally:
        holder.close()
    assert all(s.url != f"http://127.0.0.1:{taken}" and s.proc.poll() is None for s in started)
    (failed,) = Path(started[0].log_path).parent.glob(f"*-{taken}.log")  # the first try of one of them
    assert sglang_server.BIND_FAILED in failed.read_text(errors="replace")  # the real server's own words


def test_the_scheduler_and_the_detokenizer_are_forked(shared_servers, tiny_opt):
    """On CPU the server's main process forks its scheduler and detokenizer (sglang_cpu/sitecustomize.py): spawned,
    each imported sglang, torch and transformers again (the detokenizer: 6.7 CPU-s at start against the main
    process's 8.2, measured); forked, the detokenizer has nothing left to do at start (0.0)."""
    server = shared_servers(*_specs(tiny_opt))[0]
    processes = group_processes(server.proc.pid)
    main = processes[server.proc.pid][1]
    (detokenizer,) = [cpu for command, cpu in processes.values() if command == "sglang::detokenizer"]
    assert detokenizer < 0.25 * main, f"detokenizer {detokenizer:.1f} CPU-s, main process {main:.1f}: {processes}"


def test_generate_plain_and_both_streaming_modes_match_the_trainer(servers, tiny_opt):
    a, b = servers
    for temperature in (1.0, 0.7):
        plain = _run(_samples(a, stream=False, temperature=temperature))
        cumulative = _run(_samples(a, stream=True, temperature=temperature))
        incremental = _run(_samples(b, stream=True, temperature=temperature))
        worst = _check_against_trainer(tiny_opt["v0"], plain + cumulative + incremental, temperature)
        print(f"T={temperature}: max |lp_server - lp_trainer| = {worst:.2e} over "
              f"{sum(len(s.response_tokens) for s in plain + cumulative + incremental)} tokens")
        assert all(s.weight_versions == [("v0", 0, len(s.response_tokens))] for s in plain + incremental)


def test_an_idle_server_sleeps(shared_servers, tiny_opt, servers):
    """On CPU the server runs with --sleep-on-idle (CPU_SERVER_ARGS): without it an idle scheduler spins through
    its self-checks and takes a whole core (10.1 CPU-s in 10 s, measured), the core the trainer beside it needs."""
    server = shared_servers(*_specs(tiny_opt))[0]
    time.sleep(1.0)  # the restore's request and its housekeeping done
    before, start = group_cpu_seconds(server.proc.pid), time.monotonic()
    time.sleep(3.0)
    used, elapsed = group_cpu_seconds(server.proc.pid) - before, time.monotonic() - start
    assert used < 0.15 * elapsed, f"an idle SGLang server used {used:.2f} CPU-s in {elapsed:.1f} s"


def test_abort_by_rid_and_abort_all(servers):
    """Two requests running on the server (each has streamed a token; SGLang's throttle keeps them running for
    >= 10 s): the abort by rid ends the first, then abort_all the second, each with its tokens so far."""
    a, _ = servers
    long = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}

    async def go():
        async with SGLangClient(a) as c:
            with tokens_streamed() as streamed:
                jobs = [asyncio.create_task(c.generate(list(p), long, stream=True)) for p in PROMPTS[:2]]
                await streamed(2)
            await c.abort(rid=sorted(c.gate.inflight)[0])
            done, running = await asyncio.wait(jobs, timeout=60, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == len(running) == 1, "the abort by rid ended no request, or both"
            await c.abort(abort_all=True)  # the other one still runs: >= 10 s in all
            return [task.result() for task in done] + [await running.pop()]

    with slowed_down(a, SLOW_FORWARD):
        first, second = _run(go())
    for out in (first, second):
        assert out.finish_type == "abort", out.finish_reason
        assert 0 < len(out.output_ids) < 200 and len(out.log_probs) == len(out.output_ids)


SLOW_FORWARD = 0.05  # s per forward (SGLang's /slow_down): 200 tokens stay in flight >= 10 s on any machine


@contextlib.asynccontextmanager
async def _long_request_running(c: SGLangClient, url: str) -> AsyncIterator[asyncio.Task]:
    """A streamed request for 150 tokens of PROMPTS[0], running on the server (it has streamed a token) when this
    yields, and for >= 3 s more (SGLang's throttle, on until the block ends); its task gives the sample."""
    sample = Sample(prompt_tokens=list(PROMPTS[0]))
    params = {"max_new_tokens": 150, "temperature": 1.0, "ignore_eos": True}
    with slowed_down(url, 0.02), tokens_streamed() as streamed:
        task = asyncio.create_task(generate_sample(c, sample, params, stream=True))
        await streamed(1)
        yield task


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes_then_continue(servers, mode):
    """abort: the running request comes back aborted and the sample resumes after continue (2 attempts); retract:
    held and finished after continue; in_place: kept in place, and /flush_cache answers 400 until continue (which
    is why a weight sync refuses in_place)."""
    a, _ = servers

    async def go():
        async with SGLangClient(a) as c, _long_request_running(c, a) as task:
            await c.pause(mode)
            flush_status = _post(a, "/flush_cache", {}) if mode == "in_place" else None
            await asyncio.sleep(0.3)
            await c.continue_generation()
            return await task, flush_status

    sample, flush_status = _run(go())
    assert sample.status == SampleStatus.TRUNCATED and len(sample.response_tokens) == 150, sample.failure_reason
    assert sample.attempts == (2 if mode == "abort" else 1)
    if mode == "in_place":
        assert flush_status == 400
    _run(_flush(a))  # idle again: flushes (the client retries SGLang's 400 while the request is being released)


def test_a_weight_update_mid_request_switches_the_token_versions_where_it_landed(servers, tiny_opt):
    """A request is running on v0 when the weights change (pause abort -> update from disk to v1 -> continue): the
    client resumes it, and the sample's version spans say which weights produced each token. Checked against the
    trainer: the tokens before the boundary have v0's log-probs, those after it v1's (and not v0's). Leaves server A
    on v1, as the next test does anyway."""
    a, _ = servers

    async def go():
        async with SGLangClient(a) as c, _long_request_running(c, a) as task:
            await c.sync_weights_from_disk(tiny_opt["v1"], "v1")
            return await task

    sample = _run(go())
    n = len(sample.response_tokens)
    assert sample.status == SampleStatus.TRUNCATED and n == 150, sample.failure_reason
    assert len(sample.weight_versions) == 2, sample.weight_versions
    (v_first, start, cut), (v_second, cut2, end) = sample.weight_versions
    assert (v_first, start, v_second, cut2, end) == ("v0", 0, "v1", cut, n) and 0 < cut < n, sample.weight_versions
    seq = [(sample.prompt_tokens, sample.response_tokens)]
    lp0, lp1 = (megatron_logprobs(tiny_opt[v], seq, 1.0)[0].float() for v in ("v0", "v1"))
    got = sample.rollout_log_probs
    before, after = (got[:cut] - lp0[:cut]).abs().max().item(), (got[cut:] - lp1[cut:]).abs().max().item()
    wrong = (got[cut:] - lp0[cut:]).abs().max().item()
    print(f"versions {sample.weight_versions}: max |lp_server - lp_trainer| = {before:.2e} on v0's tokens, "
          f"{after:.2e} on v1's; {wrong:.2e} against v0 after the update")
    assert before <= LOGPROB_TOL and after <= LOGPROB_TOL and wrong > 1e-2


async def _flush(url: str) -> None:
    async with SGLangClient(url) as c:
        await c.flush_cache()


def _post(url: str, path: str, body: dict) -> int:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_update_weights_from_disk_reports_versions_and_serves_them(servers, tiny_opt):
    a, _ = servers

    async def go():
        async with SGLangClient(a) as c:
            await c.sync_weights_from_disk(tiny_opt["v1"], "v1")
            versions = await c.weight_versions()
            info = await c.control.model_info()
            return versions, info

    versions, info = _run(go())
    assert versions == {a: "v1"}, versions
    assert info.get("weight_version") == "v1", info
    samples = _run(_samples(a, stream=True, temperature=1.0))
    assert all(s.weight_version == "v1" for s in samples)
    _check_against_trainer(tiny_opt["v1"], samples, 1.0)


def test_distributed_weight_update_over_gloo(servers, tiny_opt):
    """Both servers join a gloo group with the trainer, receive v1's weights bucket by bucket (flattened buckets,
    several of them) and serve them: log-probs equal the trainer's under v1."""
    a, b = servers
    weights = load_file(f"{tiny_opt['v1']}/model.safetensors")

    async def go():
        async with SGLangClient([a, b]) as c:
            sync = DistributedWeightSync(c, bucket_bytes=64 * 1024)
            try:
                report = await sync.sync(weights.items(), "v1-dist")
            finally:
                sync.close()
            return report, await c.weight_versions()

    report, versions = _run(go())
    assert report.buckets > 1 and set(report.workers) == {a, b}
    assert versions == {a: "v1-dist", b: "v1-dist"}, versions
    samples = _run(_samples(b, stream=True, temperature=1.0)) + _run(_samples(a, stream=False, temperature=1.0))
    _check_against_trainer(tiny_opt["v1"], samples, 1.0)
    assert torch.cat([s.rollout_log_probs for s in samples]).isfinite().all()
