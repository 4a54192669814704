"""Abort and pause against the real local engine: partial samples and the pause policy (resume / resample / keep)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from slime_corr.engines.embedded.engine import start_local_engine
from slime_corr.engines.embedded.model import load_tiny_lm, teacher_forced_logprobs
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.rollout import PausePolicy, generate_sample
from slime_corr.samples import Sample, SampleStatus

from .engine_helpers import wait_tokens

PROMPT = [10, 20, 30, 40]
PARAMS = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 1.0}




@pytest.fixture
def slow_fp32_engine(tiny_ckpt):
    with start_local_engine(tiny_ckpt, dtype=torch.float32, step_delay=0.01) as h:
        yield h


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_abort_request_returns_partial_output(slow_fp32_engine, stream):
    h = slow_fp32_engine

    async def go():
        async with SGLangClient(h.url) as c:
            task = asyncio.create_task(c.generate(PROMPT, PARAMS, stream=stream))
            await wait_tokens(h.engine, c, 3)
            await c.abort()  # every request this client has in flight, by its exact rid
            return await task

    res = asyncio.run(go())
    assert res.finish_type == "abort" and res.finish_reason.get("status_code") is None
    assert 3 <= len(res.output_ids) < 40 and len(res.log_probs) == len(res.output_ids)


def test_pause_resume_across_weight_update(slow_fp32_engine, tiny_ckpt, tiny_ckpt_v1):
    """RESUME: partial tokens kept, generation continues on the new weights, versions recorded per segment."""
    h = slow_fp32_engine
    sample = Sample(prompt_tokens=list(PROMPT))

    async def go():
        async with SGLangClient(h.url) as c:
            task = asyncio.create_task(generate_sample(c, sample, PARAMS, stream=True,
                                                       pause_policy=PausePolicy.RESUME))
            await wait_tokens(h.engine, c, 5)
            await c.pause("abort")
            await asyncio.sleep(0.1)
            assert not task.done()  # the resumed request is held back until continue_generation
            await c.update_weights_from_disk(tiny_ckpt_v1, weight_version="v1", flush_cache=False)
            await c.flush_cache()
            await c.continue_generation()
            return await task

    s = asyncio.run(go())
    assert s.status == SampleStatus.TRUNCATED and s.response_length == 40
    (v0, a0, b0), (v1, a1, b1) = s.weight_versions
    assert (v0, a0, v1, b1) == ("default", 0, "v1", 40) and b0 == a1 >= 5
    old, new = load_tiny_lm(tiny_ckpt), load_tiny_lm(tiny_ckpt_v1)
    ref_old = teacher_forced_logprobs(old, PROMPT, s.response_tokens)[:b0]
    ref_new = teacher_forced_logprobs(new, PROMPT, s.response_tokens)[b0:]
    torch.testing.assert_close(s.rollout_log_probs, torch.cat([ref_old, ref_new]), atol=1e-4, rtol=0)
    assert s.loss_mask == [1] * 40


@pytest.mark.parametrize("policy", [PausePolicy.RESAMPLE, PausePolicy.KEEP])
def test_pause_resample_or_keep(slow_fp32_engine, policy):
    h = slow_fp32_engine
    sample = Sample(prompt_tokens=list(PROMPT))

    async def go():
        async with SGLangClient(h.url) as c:
            task = asyncio.create_task(generate_sample(c, sample, PARAMS, pause_policy=policy))
            await wait_tokens(h.engine, c, 5)
            await c.pause("abort")
            await asyncio.sleep(0.05)
            await c.update_weights_from_disk(h.checkpoint_dir, weight_version="again")
            await c.continue_generation()
            return await task

    s = asyncio.run(go())
    if policy == PausePolicy.RESAMPLE:
        assert s.status == SampleStatus.TRUNCATED and s.response_length == 40
        assert s.weight_versions == [("again", 0, 40)]
    else:
        assert s.status == SampleStatus.ABORTED and 5 <= s.response_length < 40
        assert s.failure_reason and "pause" in s.failure_reason


def test_in_place_pause_keeps_the_request_and_records_versions(slow_fp32_engine, tiny_ckpt, tiny_ckpt_v1):
    """mode=in_place: the request is not aborted; tokens after the update come from the new weights."""
    h = slow_fp32_engine
    sample = Sample(prompt_tokens=list(PROMPT))

    async def go():
        async with SGLangClient(h.url) as c:
            task = asyncio.create_task(generate_sample(c, sample, PARAMS, stream=True))
            await wait_tokens(h.engine, c, 5)
            await c.pause("in_place")
            await c.update_weights_from_disk(tiny_ckpt_v1, weight_version="v1", flush_cache=False)
            await c.continue_generation()
            return await task

    s = asyncio.run(go())
    assert s.status == SampleStatus.TRUNCATED and s.attempts == 1 and s.response_length == 40
    (v0, a0, b0), (v1, a1, b1) = s.weight_versions
    assert (v0, a0, v1, b1) == ("default", 0, "v1", 40) and b0 == a1 >= 5
    ref_old = teacher_forced_logprobs(load_tiny_lm(tiny_ckpt), PROMPT, s.response_tokens)[:b0]
    ref_new = teacher_forced_logprobs(load_tiny_lm(tiny_ckpt_v1), PROMPT, s.response_tokens)[b0:]
    torch.testing.assert_close(s.rollout_log_probs, torch.cat([ref_old, ref_new]), atol=1e-4, rtol=0)


def test_concurrency_per_server_is_bounded(slow_fp32_engine):
    h = slow_fp32_engine
    seen = []

    async def go():
        async with SGLangClient(h.url, max_concurrency_per_server=3) as c:
            jobs = asyncio.gather(*(c.generate(PROMPT, {"max_new_tokens": 5, "ignore_eos": True})
                                    for _ in range(9)))
            while not jobs.done():
                seen.append(len(h.engine.active))
                await asyncio.sleep(0.003)
            return await jobs

    res = asyncio.run(go())
    assert len(res) == 9 and max(seen) == 3


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_flush_after_retract_or_in_place_pause(slow_fp32_engine, mode):
    """As in SGLang: a retract pause sends running requests back to the waiting queue (the cache can be flushed),
    an in_place one keeps them running (flush refused); either way they finish, unchanged, after continue."""
    h = slow_fp32_engine
    params = {**PARAMS, "sampling_seed": 9}

    async def go():
        async with SGLangClient(h.url) as c:
            reference = await c.generate(PROMPT, params)
            task = asyncio.create_task(c.generate(PROMPT, params, stream=True))
            await wait_tokens(h.engine, c, 5)
            await c.pause(mode)
            status, _ = await c.control._post(h.url, "/flush_cache")
            await c.continue_generation()
            return reference, await task, status

    reference, res, flush_status = asyncio.run(go())
    assert flush_status == (200 if mode == "retract" else 400)
    assert res.attempts == 1 and res.output_ids == reference.output_ids and res.log_probs == reference.log_probs
