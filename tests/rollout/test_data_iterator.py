"""Samples streaming from a real local engine (HTTP on loopback) through the buffer into Megatron micro-batches."""

from __future__ import annotations

import asyncio

import pytest
import torch

from slime_corr.layout.context_parallel import slice_micro_batch_for_cp, zigzag_unslice
from slime_corr.layout.groups import grpo_advantages
from slime_corr.layout.micro_batch import build_micro_batch, cp_pad_multiple, packed_length
from slime_corr.rollout.buffer import SampleBuffer
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.data_iterator import BufferMicroBatchIterator, background_event_loop
from slime_corr.rollout.rollout import generate_group_samples
from slime_corr.samples import Sample, SampleStatus

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


def _group(g: int, response_lengths: list[int], prompt: int = 2) -> list[Sample]:
    out = []
    for i, n in enumerate(response_lengths):
        s = Sample(prompt_tokens=[65] * prompt, group_id=g, index=10 * g + i)
        s.append_segment(list(range(97, 97 + n)), [-0.25] * n, "v0")
        s.status, s.reward = SampleStatus.COMPLETED, float(i)
        out.append(s)
    return out


# groups of 2 samples; tokens per group (prompt 2 + response): 6, 8, 30 (> a budget of 14), 6, 8
GROUPS = [[1, 1], [2, 2], [13, 13], [1, 1], [2, 2]]


@pytest.mark.parametrize("cp_size", [1, 2])
def test_token_budget_packs_whole_groups_up_to_n_tokens_in_arrival_order(cp_size):
    """Next-fit by tokens: a micro-batch closes when the next group does not fit N·CP tokens (each sample padded
    to 2·CP); the over-long group gets one of its own; every micro-batch equals batching's packed micro-batch of
    its samples with the whole step's advantages (CP-sliced); empty micro-batches fill up to len() = groups."""
    groups = [_group(g, lens) for g, lens in enumerate(GROUPS)]
    budget = 14  # per GPU: N·CP per micro-batch
    with background_event_loop() as loop:
        buffer = SampleBuffer(maxsize=2)  # one group at a time: the rollout waits for the trainer
        feeder = asyncio.run_coroutine_threadsafe(_put_all(buffer, groups), loop)
        it = BufferMicroBatchIterator(buffer, loop, 10, 10, group_size=2, cp_size=cp_size,
                                      max_tokens_per_micro_batch=budget, timeout=10)
        assert len(it) == 5
        batches = list(it)
        feeder.result(timeout=10)
    spans = [[packed_length(s.total_length, cp_size) for s in g] for g in groups]
    expected, current, tokens = [], [], 0
    for g, sp in zip(groups, spans, strict=True):  # the reference next-fit
        if current and tokens + sum(sp) > budget * cp_size:
            expected.append(current)
            current, tokens = [], 0
        current, tokens = current + g, tokens + sum(sp)
    expected.append(current)
    assert it.batch_sizes == [len(b) for b in expected] + [0] * (5 - len(expected))
    assert it.oversized_groups == 1 and it.num_empty == 5 - len(expected)
    assert [s.index for s in it.samples] == [s.index for g in groups for s in g]
    advantages = dict(zip(map(id, it.samples), grpo_advantages(it.samples), strict=True))
    for got, part in zip(batches, expected, strict=False):
        want = build_micro_batch(part, [advantages[id(s)] for s in part], packed=True,
                                 pad_to_multiple=cp_pad_multiple(cp_size))
        _assert_batches_equal(got, slice_micro_batch_for_cp(want, 0, cp_size))
        if len(part) > 2:  # never more than the budget, except a group alone
            assert want["tokens"].shape[1] <= budget * cp_size
    for empty in batches[len(expected):]:
        assert empty["loss_mask"].sum() == 0 and empty["cu_seqlens_padded"].tolist() == [0, 2 * cp_size if
                                                                                         cp_size > 1 else 1]


def test_token_budget_streams_a_micro_batch_before_the_rest_of_the_step_arrives():
    groups = [_group(g, lens) for g, lens in enumerate([[1, 1], [2, 2], [1, 1], [1, 1]])]  # 6, 8, 6, 6 tokens
    with background_event_loop() as loop:
        buffer = SampleBuffer(maxsize=8)
        _feed(loop, buffer, groups[:2])  # 6 + 8 tokens: the second does not fit a 12-token budget
        it = BufferMicroBatchIterator(buffer, loop, 8, 8, group_size=2, max_tokens_per_micro_batch=12, timeout=10)
        first = next(it)
        assert first["cu_seqlens"].numel() == 3 and len(it.samples) == 2  # group 0, while groups 2-3 are not made
        _feed(loop, buffer, groups[2:])
        rest = it.materialize()
    assert it.batch_sizes == [2, 2, 4, 0] and len(rest) == 2  # the trailing empty one is dropped


def test_token_budget_is_checked():
    with background_event_loop() as loop:
        buffer = SampleBuffer(maxsize=2)
        with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch=0 \(--max-tokens-per-gpu\) must be positive"):
            BufferMicroBatchIterator(buffer, loop, 4, 4, group_size=2, max_tokens_per_micro_batch=0)
        # the iterator takes one group at a time: a buffer of one group is enough whatever micro_batch_size is
        BufferMicroBatchIterator(buffer, loop, 8, 8, group_size=2, max_tokens_per_micro_batch=64)
        with pytest.raises(ValueError, match="group_size=4 exceeds the buffer's maxsize=2"):
            BufferMicroBatchIterator(buffer, loop, 8, 8, group_size=4, max_tokens_per_micro_batch=64)


async def _put_all(buffer: SampleBuffer, groups: list[list[Sample]]) -> None:
    for g in groups:
        await buffer.put_group(g)
