"""Every fault of a /generate call, injected by a fault server (see fault_server.py for why one is needed).

Asserted for each: retried only when safe, with a NEW rid, bounded, and every sample ends exactly once.
"""

from __future__ import annotations

import asyncio
import random
import re

import pytest

from slime_corr.rollout.client import GenerationError, RetryPolicy, SGLangClient
from slime_corr.rollout.rollout import generate_group_samples
from slime_corr.rollout.sample import SampleStatus

from .fault_server import CODE, closed_port_url, good_output, run_fault_server

RETRYABLE = ["http500", "http503", "http429", "timeout", "kill_mid_stream", "no_done", "error_event",
             "malformed_json", "misaligned", "nan", "missing_logprobs", "token_mismatch", "abort_503",
             "close_before_headers"]
FATAL = ["http400", "error_event_fatal"]
STREAM_ONLY = {"no_done", "error_event", "error_event_fatal"}  # a plain response has no events / [DONE]
RETRY = RetryPolicy(max_attempts=3, base_delay=0.005, max_delay=0.02)


@pytest.fixture(scope="module")
def fault_server():
    with run_fault_server(timeout_sleep=1.0) as (url, server):
        yield url, server


def _client(urls, **kw) -> SGLangClient:
    return SGLangClient(urls, read_timeout=0.4, request_timeout=5.0, retry=RETRY, **kw)


def _generate(urls, prompt, stream):
    async def go():
        async with _client(urls) as c:
            return await c.generate(prompt, {"max_new_tokens": 8}, stream=stream)

    return asyncio.run(go())


_sid = iter(range(1000, 100000))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("fault", RETRYABLE)
def test_retryable_fault_recovers_with_new_rid(fault_server, fault, stream):
    if fault in STREAM_ONLY and not stream:
        pytest.skip("stream-only fault")
    url, server = fault_server
    sid = next(_sid)
    n0 = len(server.rids)
    res = _generate(url, [CODE[fault], 1, sid], stream)
    ids, lps = good_output(sid)
    assert res.output_ids == ids and res.log_probs == pytest.approx(lps)
    assert res.attempts == 2 and len(res.errors) == 1
    rids = server.rids[n0:]
    assert len(rids) == 2 and rids[0] != rids[1] and len(rids[0]) == len(rids[1])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("fault", RETRYABLE)
def test_persistent_fault_fails_after_bounded_attempts(fault_server, fault, stream):
    if fault in STREAM_ONLY and not stream:
        pytest.skip("stream-only fault")
    url, server = fault_server
    sid = next(_sid)
    with pytest.raises(GenerationError) as ei:
        _generate(url, [CODE[fault], 99, sid], stream)
    assert ei.value.attempts == RETRY.max_attempts == server.attempts[sid]
    assert "gave up after 3 attempts" in ei.value.reason


@pytest.mark.parametrize("fault", FATAL)
def test_fatal_fault_is_not_retried(fault_server, fault):
    url, server = fault_server
    sid = next(_sid)
    with pytest.raises(GenerationError) as ei:
        _generate(url, [CODE[fault], 1, sid], stream=True)
    assert ei.value.attempts == 1 and server.attempts[sid] == 1


def test_nan_never_reaches_a_sample(fault_server):
    url, _ = fault_server
    sid = next(_sid)
    with pytest.raises(GenerationError, match="not a finite number"):
        _generate(url, [CODE["nan"], 99, sid], stream=False)


def test_connection_refused_fails_then_other_server_is_used(fault_server):
    url, server = fault_server
    with pytest.raises(GenerationError, match="connection failed"):
        _generate(closed_port_url(), [0, 0, 1], stream=False)
    sid = next(_sid)
    res = _generate([closed_port_url(), url], [CODE["ok"], 0, sid], stream=True)
    assert res.output_ids == good_output(sid)[0] and res.server == url


def test_every_sample_ends_exactly_once_under_mixed_faults(fault_server):
    """Many concurrent samples with random faults: none lost, none duplicated, statuses as predicted."""
    url, server = fault_server
    rng = random.Random(0)
    prompts, expect = [], []
    for _ in range(120):
        fault = rng.choice([*RETRYABLE, *FATAL, "ok"])
        n_bad = rng.choice([0, 1, 2, 5])
        prompts.append([CODE[fault], n_bad, next(_sid)])
        ok = fault == "ok" or n_bad == 0 or (fault in RETRYABLE and n_bad < RETRY.max_attempts)
        expect.append(SampleStatus.COMPLETED if ok else SampleStatus.FAILED)
    n0 = len(server.rids)

    async def go():
        async with _client(url, max_concurrency_per_server=32) as c:
            return await generate_group_samples(c, prompts, 1, {"max_new_tokens": 8},
                                                stream=True, reward_fn=lambda s: 1.0)

    samples = asyncio.run(go())
    assert sorted(s.index for s in samples) == list(range(len(prompts)))
    for s, st, p in zip(samples, expect, prompts, strict=True):
        assert s.status == st, (s.failure_reason, p)
        if st == SampleStatus.COMPLETED:
            assert s.response_tokens == good_output(p[2])[0] and s.reward == 1.0
        else:
            assert s.failure_reason and s.response_tokens == []
    rids = server.rids[n0:]
    assert len(rids) == len(set(rids))  # every attempt used a fresh rid
    assert all(re.fullmatch(r"[0-9a-f]{8}-\d{12}", r) for r in rids)
