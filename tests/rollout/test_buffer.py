"""The bounded sample buffer: backpressure with real concurrent producers, and a sync consumer thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from slime_corr.rollout.buffer import BufferClosed, SampleBuffer
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.rollout import generate_group_samples
from slime_corr.samples import Sample


def _s(i: int) -> Sample:
    return Sample(prompt_tokens=[1], index=i)


async def _settle() -> None:
    """Let every ready task run until it finishes or waits (no timers, no I/O: deterministic)."""
    for _ in range(50):
        await asyncio.sleep(0)


def test_producers_block_when_full():
    async def go():
        buf = SampleBuffer(maxsize=4)
        done: list[int] = []

        async def producer(i: int) -> None:
            await buf.put(_s(i))
            done.append(i)

        tasks = [asyncio.create_task(producer(i)) for i in range(10)]
        await _settle()
        # backpressure: four puts went through, six producers are blocked inside put()
        assert len(buf) == 4 and len(done) == 4 and buf.waiting_producers == 6
        assert sum(not t.done() for t in tasks) == 6
        got = await buf.get(3)
        await _settle()
        assert len(done) == 7 and len(buf) == 4 and buf.waiting_producers == 3
        rest = [*got]
        while len(rest) < 10:
            rest += await buf.get(1)
        await asyncio.gather(*tasks)
        assert sorted(s.index for s in rest) == list(range(10))
        await buf.close()
        with pytest.raises(BufferClosed):
            await buf.get(1)
        with pytest.raises(BufferClosed):
            await buf.put(_s(99))

    asyncio.run(go())


def test_groups_are_atomic():
    async def go():
        buf = SampleBuffer(maxsize=5)
        await buf.put_group([_s(0), _s(1), _s(2)])
        t = asyncio.create_task(buf.put_group([_s(3), _s(4), _s(5)]))
        await _settle()
        assert not t.done() and len(buf) == 3 and buf.waiting_producers == 1  # no partial group
        await buf.get(3)
        await t
        assert [s.index for s in await buf.get(3)] == [3, 4, 5]
        with pytest.raises(ValueError):
            await buf.put_group([_s(i) for i in range(6)])

    asyncio.run(go())


def test_rollout_into_buffer_with_sync_trainer(engine):
    """Rollout runs in a background loop against the real engine; the 'trainer' thread starts draining only
    once the buffer is full and a rollout producer is blocked on it (backpressure), then takes every group."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    buf = SampleBuffer(maxsize=4)
    max_seen = 0
    blocked = threading.Event()

    def until_blocked() -> None:
        if buf.waiting_producers and len(buf) == 4:
            blocked.set()
        else:
            loop.call_later(0.005, until_blocked)

    async def rollout():
        async with SGLangClient(engine.url) as c:
            return await generate_group_samples(c, [[1, 2, 3]] * 6, 2, {"max_new_tokens": 4, "ignore_eos": True},
                                                buffer=buf, reward_fn=lambda s: float(len(s.response_tokens)))

    fut = asyncio.run_coroutine_threadsafe(rollout(), loop)
    try:
        loop.call_soon_threadsafe(until_blocked)
        assert blocked.wait(60), "the buffer never filled up"
        assert not fut.done() and buf.total_put == 4  # generation finished for more, but they wait
        got = []
        for _ in range(6):
            max_seen = max(max_seen, len(buf))
            group = buf.get_blocking(2, loop, timeout=30)
            assert group[0].group_id == group[1].group_id
            got += group
            threading.Event().wait(0.01)
        samples = fut.result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert max_seen <= 4 and buf.total_put == 12 and buf.total_got == 12
    assert sorted(s.index for s in got) == list(range(12)) == [s.index for s in samples]
    assert all(s.reward == 4.0 for s in got)
