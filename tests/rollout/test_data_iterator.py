"""Samples streaming from a real local engine (HTTP on loopback) through the buffer into Megatron micro-batches."""

from __future__ import annotations

import asyncio

import pytest
import torch

from slime_corr.mcore.context_parallel import zigzag_unslice
from slime_corr.rollout.batching import build_micro_batch, grpo_advantages, slice_micro_batch_for_cp
from slime_corr.rollout.buffer import SampleBuffer
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.data_iterator import BufferMicroBatchIterator, background_event_loop
from slime_corr.rollout.rollout import generate_group_samples
from slime_corr.rollout.sample import Sample, SampleStatus

PROMPTS = [list(b"Count: "), list(b"Say hi: "), list(b"Spell it: "), list(b"x = ")]
GROUP = 2
PARAMS = {"max_new_tokens": 6, "temperature": 1.0}


def reward(sample: Sample) -> float:
    return sum(97 <= t <= 122 for t in sample.response_tokens) / max(1, sample.response_length)


async def _rollout(url: str, buffer: SampleBuffer) -> list[Sample]:
    async with SGLangClient(url) as client:
        return await generate_group_samples(client, PROMPTS, GROUP, PARAMS, stream=True, reward_fn=reward,
                                            buffer=buffer)


def _assert_batches_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("cp_size", [1, 2])
def test_streamed_micro_batches_equal_the_whole_batch_reference(engine, cp_size):
    micro_batch_size, n_micro = 2 * GROUP, len(PROMPTS) // 2
    with background_event_loop() as loop:
        # The buffer holds ONE micro-batch: the rollout must wait for the trainer (backpressure) to finish.
        buffer = SampleBuffer(maxsize=micro_batch_size)
        rollout = asyncio.run_coroutine_threadsafe(_rollout(engine.url, buffer), loop)
        iterators = [BufferMicroBatchIterator(buffer, loop, len(PROMPTS) * GROUP, micro_batch_size, group_size=GROUP,
                                              cp_rank=r, cp_size=cp_size, timeout=60) for r in range(cp_size)]
        # The CP ranks of one micro-batch see the same samples: here rank 0 takes them, the others rebuild them.
        batches = list(iterators[0])
        samples = rollout.result(timeout=60)
    taken = iterators[0].samples
    assert sorted(s.index for s in taken) == list(range(len(PROMPTS) * GROUP))  # each sample exactly once
    assert all(s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) for s in samples)
    assert iterators[0].skipped == [] and buffer.total_got == buffer.total_put == len(samples)

    # Reference: GRPO advantages over the WHOLE step, then one micro-batch per consecutive slice of the taken order.
    advantages = dict(zip(map(id, samples), grpo_advantages(samples), strict=True))
    assert len(batches) == n_micro
    for k, got in enumerate(batches):
        part = taken[k * micro_batch_size : (k + 1) * micro_batch_size]
        want = build_micro_batch(part, [advantages[id(s)] for s in part], pad_to_multiple=2 * cp_size
                                 if cp_size > 1 else 1)
        if cp_size > 1:
            parts = [slice_micro_batch_for_cp(want, r, cp_size) for r in range(cp_size)]
            _assert_batches_equal(got, parts[0])
            assert torch.equal(zigzag_unslice([p["loss_mask"] for p in parts]), want["loss_mask"])
        else:
            _assert_batches_equal(got, want)
        assert got["loss_mask"].sum() > 0


def _sample(index: int, group: int, status: SampleStatus, reward_value: float | None, n: int = 3) -> Sample:
    s = Sample(prompt_tokens=[65, 66], group_id=group, index=index)
    if status != SampleStatus.FAILED:
        s.append_segment(list(range(97, 97 + n)), [-0.5] * n, "v0")
    s.status, s.reward = status, reward_value
    if status == SampleStatus.FAILED:
        s.failure_reason = "server error 503 after 3 attempts"
    return s


def _feed(loop: asyncio.AbstractEventLoop, buffer: SampleBuffer, groups: list[list[Sample]]) -> None:
    async def put_all() -> None:
        for g in groups:
            await buffer.put_group(g)

    asyncio.run_coroutine_threadsafe(put_all(), loop).result(timeout=10)


@pytest.mark.parametrize("packed", [False, True])
def test_unfinished_samples_stay_in_the_batch_with_no_loss_and_are_reported(packed):
    group = [_sample(0, 0, SampleStatus.COMPLETED, 1.0), _sample(1, 0, SampleStatus.FAILED, None),
             _sample(2, 0, SampleStatus.ABORTED, 0.0), _sample(3, 0, SampleStatus.TRUNCATED, 0.0)]
    with background_event_loop() as loop:
        buffer = SampleBuffer(maxsize=4)
        _feed(loop, buffer, [group])
        it = BufferMicroBatchIterator(buffer, loop, 4, 4, group_size=4, packed=packed, timeout=10)
        (batch,) = list(it)
    assert [s.index for s in it.skipped] == [1, 2]
    # Advantages over the two trained samples only: rewards 1 and 0 -> +-1/sqrt(2) (unbiased std, eps 1e-6).
    a = 0.5 / (2**-0.5 + 1e-6)
    if packed:
        spans = batch["cu_seqlens"].tolist()
        rows = [batch["advantages"][0, spans[i] : spans[i + 1]] for i in range(4)]
        masks = [batch["loss_mask"][0, spans[i] : spans[i + 1]] for i in range(4)]
    else:
        rows, masks = list(batch["advantages"]), list(batch["loss_mask"])
    assert [m.sum().item() for m in masks] == [3, 0, 0, 3]
    assert torch.allclose(rows[0][masks[0] > 0], torch.full((3,), a))
    assert torch.allclose(rows[3][masks[3] > 0], torch.full((3,), -a))
    assert rows[1].abs().sum() == 0 and rows[2].abs().sum() == 0
    assert batch["rollout_log_probs"].abs().sum().item() == pytest.approx(6 * 0.5)


def test_all_failed_micro_batch_has_no_loss_tokens():
    group = [_sample(0, 0, SampleStatus.FAILED, None), _sample(1, 0, SampleStatus.FAILED, None)]
    with background_event_loop() as loop:
        buffer = SampleBuffer(maxsize=2)
        _feed(loop, buffer, [group])
        (batch,) = list(BufferMicroBatchIterator(buffer, loop, 2, 2, group_size=2, timeout=10))
    assert batch["loss_mask"].sum() == 0 and batch["advantages"].abs().sum() == 0


def test_group_size_is_checked():
    with background_event_loop() as loop:
        buffer = SampleBuffer(maxsize=4)
        with pytest.raises(ValueError, match="micro_batch_size=3 must be a positive multiple of group_size=2"):
            BufferMicroBatchIterator(buffer, loop, 4, 3, group_size=2)
        with pytest.raises(ValueError, match="num_samples=5 must be a positive multiple of group_size=2"):
            BufferMicroBatchIterator(buffer, loop, 5, 2, group_size=2)
        with pytest.raises(ValueError, match="exceeds the buffer's maxsize=4"):
            BufferMicroBatchIterator(buffer, loop, 8, 8, group_size=2)
        # Groups of 3 read as groups of 2: the 2nd micro-batch holds the rest of group 0 and half of group 1.
        buffer = SampleBuffer(maxsize=6)
        _feed(loop, buffer, [[_sample(3 * g + i, g, SampleStatus.COMPLETED, 0.0) for i in range(3)] for g in (0, 1)])
        it = BufferMicroBatchIterator(buffer, loop, 6, 2, group_size=2, timeout=10)
        next(it)
        with pytest.raises(ValueError, match=r"group_size=2: group\(s\) \[0, 1\] of this micro-batch are not whole"):
            next(it)
    with background_event_loop() as loop:
        # Groups of 4 read as groups of 2: each micro-batch has 2 of one group, caught by the group seen before.
        buffer = SampleBuffer(maxsize=4)
        _feed(loop, buffer, [[_sample(i, 7, SampleStatus.COMPLETED, 0.0) for i in range(4)]])
        it = BufferMicroBatchIterator(buffer, loop, 4, 2, group_size=2, timeout=10)
        next(it)
        with pytest.raises(ValueError, match=r"group\(s\) \[7\] of this micro-batch are not whole"):
            next(it)


def test_last_micro_batch_takes_what_is_left_of_the_step():
    groups = [[_sample(2 * g + i, g, SampleStatus.COMPLETED, float(i)) for i in range(2)] for g in range(3)]
    with background_event_loop() as loop:
        buffer = SampleBuffer(maxsize=6)
        _feed(loop, buffer, groups)
        it = BufferMicroBatchIterator(buffer, loop, 6, 4, group_size=2, timeout=10)
        assert len(it) == 2
        assert [b["tokens"].shape[0] for b in it] == [4, 2]
    assert [s.index for s in it.samples] == list(range(6)) and len(buffer) == 0
