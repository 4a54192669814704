"""The real sglang-router (PyPI ``sglang-router``) in front of 2 embedded engines, on loopback.

Given only the router's URL, the client finds the engines and reaches each of them with every control call;
generation goes through the router. The router and engines start once for the module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from slime_corr.engines import router
from slime_corr.engines.embedded.engine import start_local_engine
from slime_corr.engines.embedded.model import load_tiny_lm, teacher_forced_logprobs
from slime_corr.engines.group import start_engine_group
from slime_corr.ports import free_port
from slime_corr.rollout.client import GenerationError, RetryPolicy, SGLangClient
from slime_corr.rollout.control import ControlError
from slime_corr.rollout.rollout import PausePolicy, generate_sample
from slime_corr.samples import Sample, SampleStatus

from .conftest import require_router
from .fault_server import run_fault_server

PROMPT = [72, 101, 108, 108, 111, 32]
LONG = {"max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def routed(tiny_ckpt):
    """2 fp32 engines (exact log-probs) behind a real sglang-router."""
    require_router()
    with start_engine_group(2, lambda i: start_local_engine(tiny_ckpt, dtype=torch.float32), router="on") as g:
        yield g


@contextlib.contextmanager
def slow(group, delay: float = 0.02):
    """Throttle the engines' decode steps (so a test can act while requests run)."""
    for h in group.engines:
        h.engine.step_delay = delay
    try:
        yield
    finally:
        for h in group.engines:
            h.engine.step_delay = 0.0


async def wait_running(group, n_tokens: int, per_engine: int = 1) -> None:
    """Until every engine runs ``per_engine`` requests with at least ``n_tokens`` output tokens each."""
    for _ in range(3000):
        if all(sum(len(r.output_ids) >= n_tokens for r in list(h.engine.active.values())) >= per_engine
               for h in group.engines):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the engines did not get to run the requests")


def router_json(url: str, path: str):
    with urllib.request.urlopen(url + path, timeout=10) as r:
        return json.loads(r.read())


def test_client_finds_the_workers_behind_the_router(routed):
    router_url = routed.router.url

    async def go():
        async with SGLangClient(router_url) as c:
            control = c.control
            return (await control.workers(), control.is_router(router_url), await control.server_info(),
                    await control.health())

    workers, is_router, info, healthy = asyncio.run(go())
    assert sorted(workers) == sorted(routed.engine_urls) and is_router and healthy
    assert info["port"] in [h.engine.port for h in routed.engines]  # a worker's info, not the router's own
    loads = router_json(router_url, "/get_loads")["workers"]  # the router polls each engine's load
    assert sorted(w["worker"] for w in loads) == sorted(routed.engine_urls) and all(w["load"] >= 0 for w in loads)


def test_generation_plain_and_streamed_through_the_router(routed, tiny_ckpt):
    params = {**LONG, "max_new_tokens": 12, "sampling_seed": 7, "temperature": 0.9}
    before = [h.engine.stats.requests for h in routed.engines]

    async def go():
        async with SGLangClient(routed.router.url) as c:
            await c.sync_weights_from_disk(tiny_ckpt, "gen-v0")  # whatever an earlier test left: the v0 weights
            return await asyncio.gather(*(c.generate(PROMPT, params, stream=s) for s in (False, True) * 4))

    res = asyncio.run(go())
    assert all(h.engine.stats.requests - b >= 2 for h, b in zip(routed.engines, before, strict=True))  # both
    # same seed, same weights: every engine, every batch, plain or streamed gives the same tokens
    assert all(r.output_ids == res[0].output_ids and r.log_probs == res[0].log_probs for r in res)
    assert all(r.weight_version == "gen-v0" and r.finish_reason == {"type": "length", "length": 12} for r in res)
    ref = teacher_forced_logprobs(load_tiny_lm(tiny_ckpt), PROMPT, res[0].output_ids, temperature=0.9)
    torch.testing.assert_close(torch.tensor(res[0].log_probs), ref, atol=1e-4, rtol=0)


def test_pause_update_continue_reaches_both_engines(routed, tiny_ckpt, tiny_ckpt_v1):
    """Samples in flight on both engines are paused, resumed on the new weights; both engines report it."""
    samples = [Sample(prompt_tokens=list(PROMPT), index=i) for i in range(4)]

    async def go():
        async with SGLangClient(routed.router.url) as c:
            await c.sync_weights_from_disk(tiny_ckpt, "v0")
            with slow(routed):
                tasks = [asyncio.create_task(generate_sample(c, s, LONG, stream=bool(s.index % 2),
                                                             pause_policy=PausePolicy.RESUME)) for s in samples]
                await wait_running(routed, 3, per_engine=2)
                await c.sync_weights_from_disk(tiny_ckpt_v1, "v1")
                versions = await c.weight_versions()
                await asyncio.gather(*tasks)
            await c.sync_weights_from_disk(tiny_ckpt, "v0")  # leave the module's engines as found
            return versions

    versions = asyncio.run(go())
    assert versions == {u: "v1" for u in routed.engine_urls}
    old, new = load_tiny_lm(tiny_ckpt), load_tiny_lm(tiny_ckpt_v1)
    for s in samples:
        assert s.status == SampleStatus.TRUNCATED and s.response_length == 40 and s.attempts == 2
        (v0, a0, b0), (v1, a1, b1) = s.weight_versions
        assert (v0, a0, v1, b1) == ("v0", 0, "v1", 40) and b0 == a1 >= 3
        ref = torch.cat([teacher_forced_logprobs(old, PROMPT, s.response_tokens)[:b0],
                         teacher_forced_logprobs(new, PROMPT, s.response_tokens)[b0:]])
        torch.testing.assert_close(s.rollout_log_probs, ref, atol=1e-4, rtol=0)


def test_abort_returns_the_partial_samples(routed):
    async def go():
        async with SGLangClient(routed.router.url) as c:
            with slow(routed):
                params = {**LONG, "max_new_tokens": 200}
                tasks = [asyncio.create_task(c.generate(PROMPT, params, stream=s)) for s in (False, True) * 2]
                await wait_running(routed, 3, per_engine=2)
                await c.abort()  # this client's requests, each by its rid, on the workers
                return await asyncio.gather(*tasks)

    res = asyncio.run(go())
    for r in res:
        assert r.finish_reason == {"type": "abort", "message": "Abort request"}
        assert 3 <= len(r.output_ids) < 200 and len(r.log_probs) == len(r.output_ids)
    assert not any(r.finish is None for h in routed.engines for r in list(h.engine.active.values()))
    # A streamed request stays listed, finished, until its handler ends, which can be just after the client has
    # its last chunk (CI saw it): what must hold is that none is left behind.
    for _ in range(500):
        if not any(h.engine.active for h in routed.engines):
            return
        time.sleep(0.01)
    raise AssertionError(f"aborted requests still listed 5 s on: {[list(h.engine.active) for h in routed.engines]}")


def test_flush_under_load_waits_for_each_engine(routed):
    """The router's own /flush_cache answers 206 partial_success while engines are busy: never taken for a
    success; the client flushes each engine, retrying its 400 until it is idle."""
    async def go():
        async with SGLangClient(routed.router.url) as c:
            with slow(routed):
                tasks = [asyncio.create_task(c.generate(PROMPT, LONG)) for _ in range(4)]
                await wait_running(routed, 1, per_engine=2)
                with pytest.raises(ControlError, match="206 partial_success") as ei:
                    await c.control.fan_out("/flush_cache", workers=[routed.router.url])
                await c.flush_cache()
                idle_at_flush = [not h.engine.busy() for h in routed.engines]
                return ei.value, idle_at_flush, await asyncio.gather(*tasks)

    err, idle, res = asyncio.run(go())
    assert all(u in str(err) for u in routed.engine_urls)  # reported per engine
    assert idle == [True, True] and all(len(r.output_ids) == 40 for r in res)


def test_failed_control_calls_leave_the_client_usable(routed, tiny_ckpt, tmp_path):
    """A pause refused by every engine, a pause refused by one worker, a weight update that fails: each is an
    error the caller sees; then the client is not paused, no engine is paused, and generate() works."""
    with run_fault_server() as (bad, fault), fault.failing("/pause_generation", 500):
        async def go():
            async with SGLangClient(routed.router.url, max_pause_wait=20) as c, \
                    SGLangClient([routed.router.url, bad], max_pause_wait=20) as mixed:
                with pytest.raises(ControlError, match="pause_generation.*HTTP 400"):
                    await c.pause("sideways")
                with pytest.raises(ControlError, match="pause_generation") as ei:
                    await mixed.pause()
                assert list(ei.value.failures) == [bad] and sorted(ei.value.succeeded) == sorted(routed.engine_urls)
                with pytest.raises(ControlError, match="update_weights_from_disk.*Failed to update weights"):
                    await c.sync_weights_from_disk(str(tmp_path), "never")
                state = c.paused, mixed.paused, [h.engine.paused for h in routed.engines]
                out = await asyncio.wait_for(c.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True}), 30)
                return state, out, await c.weight_versions()

        (client_paused, mixed_paused, engines_paused), out, versions = asyncio.run(go())
    assert not client_paused and not mixed_paused and engines_paused == [False, False]
    assert len(out.output_ids) == 4 and "never" not in versions.values()
    assert ("/continue_generation", {}) in fault.calls  # the restore went everywhere the pause may have landed


def test_client_timeouts_leave_no_duplicate_work(routed):
    """Each timed-out attempt is aborted on the engines before the next one (a new rid) is sent: at no moment
    do two copies of the sample run."""
    seen: list[int] = []

    async def go():
        retry = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.02)
        async with SGLangClient(routed.router.url, read_timeout=0.4, retry=retry) as c:
            with slow(routed, 0.05):
                task = asyncio.create_task(c.generate(PROMPT, {**LONG, "max_new_tokens": 60}))
                while not task.done():
                    seen.append(sum(r.rid.startswith(c.rid_prefix) for h in routed.engines
                                    for r in list(h.engine.active.values()) if r.finish is None))
                    await asyncio.sleep(0.01)
                with pytest.raises(GenerationError, match="gave up after 3 attempts.*timeout"):
                    await task
                return c.rid_prefix

    prefix = asyncio.run(go())
    finished = {rid: kind for h in routed.engines for rid, kind in h.engine.stats.finished.items()
                if rid.startswith(prefix)}
    assert max(seen) == 1 and len(finished) == 3 and set(finished.values()) == {"abort"}


def test_a_port_taken_before_the_router_binds_it_starts_the_router_again_elsewhere(routed, monkeypatch):
    """The router binds the ports picked for it (its HTTP port, its Prometheus port) itself, after its start: one can
    be taken meanwhile. The fault is real: a listening socket holds the first pick, the real router fails to bind
    it, and the launcher starts it again on new ports; when every try loses, the error names the ports."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    try:
        picks = iter([taken])
        monkeypatch.setattr(router, "free_port", lambda host="127.0.0.1": next(picks, None) or free_port(host))
        with router.start_router(routed.engine_urls) as handle:
            assert handle.url != f"http://127.0.0.1:{taken}" and handle.proc.poll() is None
            assert sorted(router_json(handle.url, "/workers")["workers"][i]["url"] for i in range(2)) == \
                sorted(routed.engine_urls)
            first_try = Path(handle.log_path).with_name("router-1.log").read_text(errors="replace").lower()
            assert router.PORT_IN_USE in first_try  # the real router's own words
        monkeypatch.setattr(router, "free_port", lambda host="127.0.0.1": taken)
        with pytest.raises(RuntimeError, match=f"could not bind its ports in {router.PORT_TRIES} tries .*{taken}"):
            with router.start_router(routed.engine_urls):
                pass
    finally:
        holder.close()
