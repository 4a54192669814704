"""A bounded buffer between rollout producers (asyncio tasks) and the trainer (sync or async consumer).

Producers ``await put(sample)`` / ``await put_group(samples)``; when the buffer holds ``maxsize`` samples they
wait (backpressure: rollout slows down when training falls behind). The trainer takes samples with
``await get(n)`` or, from another thread (Megatron's synchronous data iterator while the rollout loop runs in a
background thread), with ``get_blocking(n, loop)``. Groups are put atomically so GRPO groups stay whole.
"""

from __future__ import annotations

import asyncio
from collections import deque

from slime_corr.samples import Sample


class BufferClosed(Exception):
    """``put`` on a closed buffer, or ``get`` on a closed buffer with too few samples left."""


class SampleBuffer:
    """Bounded FIFO of samples with awaiting producers and consumers."""

    def __init__(self, maxsize: int) -> None:
        if maxsize <= 0:
            raise ValueError("maxsize must be positive")
        self.maxsize = maxsize
        self._items: deque[Sample] = deque()
        self._cond: asyncio.Condition | None = None
        self._closed = False
        self.total_put = 0
        self.total_got = 0
        self.waiting_producers = 0  # producers blocked right now because the buffer is full

    def _c(self) -> asyncio.Condition:
        if self._cond is None:  # created lazily inside the loop that uses it
            self._cond = asyncio.Condition()
        return self._cond

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    async def put(self, sample: Sample) -> None:
        """Add one sample; waits while the buffer is full."""
        await self.put_group([sample])

    async def put_group(self, samples: list[Sample]) -> None:
        """Add samples atomically; waits until there is room for all of them."""
        if len(samples) > self.maxsize:
            raise ValueError(f"group of {len(samples)} samples larger than the buffer ({self.maxsize})")
        cond = self._c()
        def can_put() -> bool:
            return self._closed or len(self._items) + len(samples) <= self.maxsize

        async with cond:
            if not can_put():  # backpressure: wait until the trainer took enough samples
                self.waiting_producers += 1
                try:
                    await cond.wait_for(can_put)
                finally:
                    self.waiting_producers -= 1
            if self._closed:
                raise BufferClosed("put on a closed buffer")
            self._items.extend(samples)
            self.total_put += len(samples)
            cond.notify_all()

    async def get(self, n: int) -> list[Sample]:
        """Take exactly ``n`` samples (waits for them); raises BufferClosed if closed with fewer left."""
        if n > self.maxsize:
            raise ValueError(f"cannot take {n} samples from a buffer of {self.maxsize}")
        cond = self._c()
        async with cond:
            await cond.wait_for(lambda: len(self._items) >= n or self._closed)
            if len(self._items) < n:
                raise BufferClosed(f"buffer closed with {len(self._items)} < {n} samples")
            out = [self._items.popleft() for _ in range(n)]
            self.total_got += n
            cond.notify_all()
            return out

    async def close(self) -> None:
        """No more puts; wakes every waiter."""
        cond = self._c()
        async with cond:
            self._closed = True
            cond.notify_all()

    def get_blocking(self, n: int, loop: asyncio.AbstractEventLoop, timeout: float | None = None) -> list[Sample]:
        """``get(n)`` from a thread other than ``loop``'s (e.g. the training loop)."""
        return asyncio.run_coroutine_threadsafe(self.get(n), loop).result(timeout)
