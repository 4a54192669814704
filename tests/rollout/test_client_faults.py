"""Every fault of a /generate call, injected by a fault server (see fault_server.py for why one is needed).

Asserted for each: retried only when safe, with a NEW fixed-width rid, bounded, and every sample ends exactly
once (complete, or failed with its reason) - never lost, never generated twice. Faults that only exist in a
stream (no [DONE], an error event) are paired with streaming only: a plain response has neither.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from slime_corr.rollout.buffer import SampleBuffer
from slime_corr.rollout.client import GenerationError, RetryPolicy, SGLangClient
from slime_corr.rollout.control import ControlError
from slime_corr.rollout.rollout import generate_group_samples
from slime_corr.samples import SampleStatus

from .fault_server import CODE, closed_port_url, good_output, run_fault_server

pytestmark = pytest.mark.cost(13)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

# fault -> what the failure reason says when it persists
RETRYABLE = {
    "http500": "HTTP 500", "http503": "HTTP 503", "http429": "HTTP 429", "timeout": "timeout",
    "kill_mid_stream": "connection broken", "close_before_headers": "connection broken",
    "no_done": r"without \[DONE\]", "error_event": r"stream error event \(code=500\)",
    "malformed_json": "malformed JSON", "misaligned": "3 entries for 4 output tokens",
    "nan": r"non-finite log-prob: output_token_logprobs\[\d+\] \(response token \d+, id \d+\): log-prob nan is not",
    "missing_logprobs": "output_token_logprobs: missing",
    "token_mismatch": r"token \d+ != output_ids", "abort_503": "aborted by server with status 503",
    "duplicate_rid": "Duplicate request ID",
}
FATAL = {"http400": "HTTP 400", "error_event_fatal": r"stream error event \(code=400\)"}
STREAM_ONLY = {"no_done", "error_event", "error_event_fatal"}  # a plain response has no events and no [DONE]
RETRY = RetryPolicy(max_attempts=3, base_delay=0.005, max_delay=0.02)
RID = re.compile(r"[0-9a-f]{8}-\d{12}")


def _cases(faults) -> list[tuple[str, bool]]:
    return [(f, s) for f in faults for s in (False, True) if s or f not in STREAM_ONLY]


def _ids(cases) -> list[str]:
    return [f"{f}-{'stream' if s else 'plain'}" for f, s in cases]


@pytest.fixture(scope="module")
def fault_server():
    with run_fault_server(timeout_sleep=3.0) as (url, server):
        yield url, server


def _client(urls, **kw) -> SGLangClient:
    # read timeout well below the fault server's 3 s stall, well above a loaded machine's worst gap between bytes
    return SGLangClient(urls, read_timeout=1.0, request_timeout=10.0, retry=RETRY, **kw)


def _generate(urls, prompt, stream):
    async def go():
        async with _client(urls) as c:
            return await c.generate(prompt, {"max_new_tokens": 8}, stream=stream)

    return asyncio.run(go())


_sid = iter(range(1000, 100000))


@pytest.mark.parametrize(("fault", "stream"), _cases(RETRYABLE), ids=_ids(_cases(RETRYABLE)))
def test_retryable_fault_recovers_with_new_rid(fault_server, fault, stream):
    url, server = fault_server
    sid = next(_sid)
    n0, b0 = len(server.rids), len(server.bodies)
    res = _generate(url, [CODE[fault], 1, sid], stream)
    server.wait_idle()
    ids, lps = good_output(sid)
    assert res.output_ids == ids and res.log_probs == pytest.approx(lps)
    assert res.attempts == 2 and len(res.errors) == 1 and re.search(RETRYABLE[fault], res.errors[0])
    rids = server.rids[n0:]
    assert len(rids) == 2 and rids[0] != rids[1] and all(RID.fullmatch(r) for r in rids)
    assert server.served_ok[sid] == 1
    aborts = [b["rid"] for b in server.bodies[b0:] if "input_ids" not in b]
    # a timed-out request, or one whose rid a router re-sent, may still run: its rid is aborted (before the
    # retry goes out); no other fault needs it
    assert aborts == ([rids[0]] if fault in ("timeout", "duplicate_rid") else [])
    if aborts:
        assert server.bodies[b0:][1] == {"rid": rids[0]}


@pytest.mark.parametrize(("fault", "stream"), _cases(RETRYABLE), ids=_ids(_cases(RETRYABLE)))
def test_persistent_fault_fails_after_bounded_attempts(fault_server, fault, stream):
    url, server = fault_server
    sid = next(_sid)
    with pytest.raises(GenerationError) as ei:
        _generate(url, [CODE[fault], 99, sid], stream)
    server.wait_idle()
    assert ei.value.attempts == RETRY.max_attempts == server.attempts[sid]
    assert "gave up after 3 attempts" in ei.value.reason and re.search(RETRYABLE[fault], ei.value.reason)


@pytest.mark.parametrize(("fault", "stream"), _cases(FATAL), ids=_ids(_cases(FATAL)))
def test_fatal_fault_is_not_retried(fault_server, fault, stream):
    url, server = fault_server
    sid = next(_sid)
    with pytest.raises(GenerationError) as ei:
        _generate(url, [CODE[fault], 1, sid], stream=stream)
    server.wait_idle()
    assert ei.value.attempts == 1 and server.attempts[sid] == 1 and re.search(FATAL[fault], ei.value.reason)


def _run_samples(urls, prompts, stream_of):
    """Samples through the rollout driver into a buffer (drained concurrently); returns (samples, drained)."""
    async def go():
        buf = SampleBuffer(maxsize=8)  # smaller than the run: producers block until drained
        drained = []

        async def drain():
            while True:
                try:
                    drained.extend(await buf.get(1))
                except Exception:  # noqa: BLE001 - BufferClosed once everything was taken
                    return

        drainer = asyncio.create_task(drain())
        by_mode = {st: [i for i in range(len(prompts)) if stream_of(i) == st] for st in (False, True)}
        async with _client(urls, max_concurrency_per_server=16) as c:
            parts = await asyncio.gather(*(
                generate_group_samples(c, [prompts[i] for i in idx], 1, {"max_new_tokens": 8}, stream=st,
                                       reward_fn=lambda s: 1.0, buffer=buf)
                for st, idx in by_mode.items()))
        await buf.close()
        await drainer
        samples = [None] * len(prompts)
        for idx, part in zip(by_mode.values(), parts, strict=True):
            for i, s in zip(idx, part, strict=True):
                samples[i] = s
        return samples, drained

    return asyncio.run(go())


def test_every_sample_ends_exactly_once_under_every_fault(fault_server):
    """Each fault, plain and streamed, once transient and once persistent, all concurrently: every sample
    ends exactly once with the predicted status and reason, reaches the buffer once, and the server delivered
    a valid answer for it exactly once (completed) or never (failed)."""
    url, server = fault_server
    cases = [(f, st, n_bad) for f, st in _cases({**RETRYABLE, **FATAL, "ok": ""}) for n_bad in (1, 99)]
    prompts = [[CODE[f], n_bad, next(_sid)] for f, _, n_bad in cases]
    n0 = len(server.rids)
    samples, drained = _run_samples(url, prompts, lambda i: cases[i][1])
    server.wait_idle()
    assert sorted(id(s) for s in drained) == sorted(id(s) for s in samples)  # each sample in the buffer once
    for (fault, _, n_bad), p, s in zip(cases, prompts, samples, strict=True):
        sid = p[2]
        ok = fault == "ok" or (fault in RETRYABLE and n_bad < RETRY.max_attempts)
        if ok:
            assert s.status == SampleStatus.COMPLETED, (fault, n_bad, s.failure_reason)
            assert s.response_tokens == good_output(sid)[0] and s.reward == 1.0
            assert s.rollout_log_probs.tolist() == pytest.approx(good_output(sid)[1])
            assert server.served_ok[sid] == 1
        else:
            assert s.status == SampleStatus.FAILED, (fault, n_bad)
            assert re.search({**RETRYABLE, **FATAL}[fault], s.failure_reason), s.failure_reason
            assert s.response_tokens == [] and s.reward is None and server.served_ok[sid] == 0
            assert s.attempts == (1 if fault in FATAL else RETRY.max_attempts) == server.attempts[sid]
    rids = server.rids[n0:]
    assert len(rids) == len(set(rids)) and all(RID.fullmatch(r) for r in rids)  # a fresh rid per attempt


def test_connection_refused_fails_each_sample_once_or_moves_to_a_live_server(fault_server):
    url, server = fault_server
    with pytest.raises(GenerationError, match="connection failed"):
        _generate(closed_port_url(), [0, 0, 1], stream=False)
    dead = closed_port_url()
    prompts = [[CODE["ok"], 0, next(_sid)] for _ in range(6)]
    samples, drained = _run_samples(dead, prompts, lambda i: i % 2 == 1)
    assert len(drained) == 6 and all(s.status == SampleStatus.FAILED for s in samples)
    assert all("connection failed" in s.failure_reason and s.attempts == RETRY.max_attempts for s in samples)
    samples, drained = _run_samples([dead, url], prompts, lambda i: i % 2 == 1)
    server.wait_idle()
    assert len(drained) == 6 and all(s.status == SampleStatus.COMPLETED for s in samples)
    assert all(server.served_ok[p[2]] == 1 for p in prompts)
    assert any(s.attempts == 2 for s in samples)  # some went to the dead server first, then moved


def test_rid_prefix_is_fixed_width_and_abort_needs_a_target():
    c = SGLangClient("http://127.0.0.1:1", rid_prefix="abcd0123")
    rids = [c.new_rid() for _ in range(3)]
    assert rids == ["abcd0123-000000000000", "abcd0123-000000000001", "abcd0123-000000000002"]
    assert re.fullmatch(r"[0-9a-f]{8}", SGLangClient("http://127.0.0.1:1").rid_prefix)
    for bad in ("ab", "abcd-123", "abcdefghi"):
        with pytest.raises(ValueError, match="rid_prefix"):
            SGLangClient("http://127.0.0.1:1", rid_prefix=bad)
    with pytest.raises(ValueError, match="rid"):  # an empty rid is a prefix of every rid on the server
        asyncio.run(c.abort(rid=""))


def test_control_calls_old_server_names_and_flush_retry(fault_server, tmp_path):
    """Payloads of the control / weight-sync calls as SGLang names them; the old info endpoint names as
    fallbacks; flush_cache retried on 400 only (the fault server plays an old server here)."""
    url, server = fault_server
    server.calls.clear()
    server.flush_statuses[:] = [400, 400]
    ckpt = tmp_path / "step-3"  # a disk sync sends only a folder that exists (SGLang takes others for Hub names)
    ckpt.mkdir()

    async def go():
        async with _client(url) as c:
            mi, si = await c.control.model_info(), await c.control.server_info()  # /model_info, /server_info: 404
            await c.sync_weights_from_disk(str(ckpt), weight_version="step-3", pause_mode="retract")
            await c.weights.init_weights_update_group("127.0.0.1", 29500, 1, 3, group_name="g")
            await c.weights.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 3]], group_name="g",
                                                    weight_version="step-4")
            server.flush_statuses[:] = [500]
            with pytest.raises(RuntimeError, match="flush_cache.*HTTP 500"):
                await c.flush_cache()
            assert not c.control.is_router(url) and await c.control.workers() == [url]
            return mi, si

    mi, si = asyncio.run(go())
    assert mi["weight_version"] == "fault" and si["version"] == "old"
    assert server.calls == [
        ("/get_model_info", {}), ("/get_server_info", {}),
        ("/pause_generation", {"mode": "retract"}),
        ("/update_weights_from_disk", {"model_path": str(ckpt), "flush_cache": False,
                                       "weight_version": "step-3"}),
        ("/get_model_info", {}),  # the update is checked: the server now reports step-3
        ("/flush_cache", {}), ("/flush_cache", {}), ("/flush_cache", {}),  # 400, 400, then 200
        ("/continue_generation", {}),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
                                        "world_size": 3, "group_name": "g", "backend": "nccl"}),
        ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]],
                                              "group_name": "g", "flush_cache": False,
                                              "weight_version": "step-4"}),
        ("/get_model_info", {}),
        ("/flush_cache", {}),  # 500: not retried
    ]


def test_a_control_request_on_a_connection_the_server_closed_goes_out_again(fault_server):
    """SGLang's server closes a connection idle for 5 s; a request that goes out on it as it closes is never read
    (aiohttp: ServerDisconnectedError). The client keeps idle connections 4 s, and sends such a request once more
    instead of failing the weight sync (or marking a live server dead). The fault server closes the connection on
    demand: a real server does so at a moment a test cannot hit."""
    from slime_corr.rollout.client import KEEPALIVE_TIMEOUT

    url, server = fault_server
    server.calls.clear()
    server.close_reused.update({"/continue_generation", "/get_model_info"})

    async def go():
        async with _client(url) as c:
            await c.pause("abort")
            await c.continue_generation()  # on the pause's connection: closed unread, then sent again
            info = await c.control.model_info()  # a GET too
            return c.control.dead, c._get_session().connector._keepalive_timeout, info

    dead, keepalive, info = asyncio.run(go())
    assert not dead and info["weight_version"] == server.weight_version
    assert [p for p, _ in server.calls] == ["/pause_generation", "/continue_generation", "/continue_generation",
                                            "/get_model_info", "/get_model_info"]
    assert not server.close_reused  # both were closed once
    assert keepalive == KEEPALIVE_TIMEOUT < 5.0  # SGLang's SGLANG_TIMEOUT_KEEP_ALIVE: its real value is checked in
    # tests/real_sglang/test_cpu_stand_ins.py


@pytest.mark.parametrize("sync", ["disk", "distributed"])
def test_a_server_gone_right_after_a_weight_update_is_a_control_error_naming_it(tmp_path, sync):
    """A server killed between its answer to a weight update and the client's check of its weight version
    (/model_info): a ControlError that names it, as for the update itself, not aiohttp's connection error (a real
    SGLang server killed mid-run hit this window in a main job, which then ended with a traceback). The fault server
    closes every connection once it answered the update: a kill cannot be timed into that window."""
    with run_fault_server(mode="gone_after_update") as (url, server):
        async def go():
            async with _client(url) as c:
                if sync == "disk":
                    await c.update_weights_from_disk(str(tmp_path), weight_version="step-1")
                else:
                    await c.weights.update_weights_from_distributed(["w"], ["float32"], [[2]], weight_version="step-1")

        with pytest.raises(ControlError, match=rf"/model_info failed on 1 of 1 worker\(s\): {url}: request failed: "
                                               r"ServerDisconnectedError"):
            asyncio.run(go())
        assert server.gone and [p for p, _ in server.calls][-1].startswith("/update_weights_from_")


def test_old_router_endpoints():
    """A router older than /workers: registration by /add_worker?url=, discovery by /list_workers."""
    with run_fault_server(old_router=True) as (url, server), run_fault_server() as (worker, _):
        async def go():
            async with _client(url) as c:
                await c.control.add_worker(worker)
                return await c.control.list_workers(), await c.control.workers(), c.control.is_router(url)

        listed, workers, is_router = asyncio.run(go())
    assert server.calls == [("/add_worker", {"url": worker}), ("/list_workers", {}), ("/list_workers", {})]
    assert listed == {"urls": [worker]} and workers == [worker] and is_router


def test_a_failing_reward_fails_only_its_sample(fault_server):
    url, _ = fault_server
    prompts = [[CODE["ok"], 0, next(_sid)] for _ in range(4)]

    def reward(s):
        if s.index == 1:
            raise ZeroDivisionError("bad reward")
        return float("nan") if s.index == 2 else 1.0

    async def go():
        async with _client(url) as c:
            return await generate_group_samples(c, prompts, 1, {"max_new_tokens": 8}, reward_fn=reward)

    samples = asyncio.run(go())
    assert [s.status for s in samples] == [SampleStatus.COMPLETED, SampleStatus.FAILED, SampleStatus.FAILED,
                                           SampleStatus.COMPLETED]
    assert "bad reward" in samples[1].failure_reason and "reward: must be finite" in samples[2].failure_reason
    assert samples[1].reward is None and samples[2].reward is None and samples[3].reward == 1.0


def test_no_stuck_client(fault_server):
    """A pause that fails leaves nothing paused (the client continues the server, releases its requests) and
    the next generate() succeeds; a pause nobody continues fails later requests after max_pause_wait, never
    hangs them; continue_generation releases the client even when the server refuses it."""
    url, server = fault_server
    prompt = [CODE["ok"], 0, next(_sid)]

    async def go():
        async with _client(url, max_pause_wait=0.3) as c:
            with server.failing("/pause_generation", 503), \
                    pytest.raises(ControlError, match="pause_generation.*HTTP 503"):
                await c.pause()
            after_failed_pause = c.paused, server.calls[-1]
            ok = await asyncio.wait_for(c.generate(prompt, {"max_new_tokens": 8}), 10)
            await c.pause()
            with pytest.raises(GenerationError, match="max_pause_wait=0.3s"):
                await asyncio.wait_for(c.generate(prompt, {"max_new_tokens": 8}), 10)
            with server.failing("/continue_generation", 500), pytest.raises(ControlError, match="continue_gen"):
                await c.continue_generation()
            return after_failed_pause, ok, c.paused

    (paused, last_call), ok, paused_at_end = asyncio.run(go())
    assert not paused and last_call == ("/continue_generation", {}) and ok.output_ids == good_output(prompt[2])[0]
    assert not paused_at_end
