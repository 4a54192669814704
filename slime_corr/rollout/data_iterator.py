"""Streaming samples into Megatron's data iterator.

The rollout runs on an asyncio event loop in a background thread (`background_event_loop`) and puts each GRPO
group into a bounded `SampleBuffer` as soon as the group has finished. The trainer's thread iterates a
`BufferMicroBatchIterator`: every `next()` waits for the next `micro_batch_size` samples and returns a Megatron
micro-batch (see `slime_corr.rollout.batching`), so the first micro-batch is ready while later samples are still
being generated, and the rollout blocks (backpressure) when training falls behind.

    with background_event_loop() as loop:
        buffer = SampleBuffer(maxsize=64)
        rollout = asyncio.run_coroutine_threadsafe(generate_group_samples(..., buffer=buffer), loop)
        micro_batches = BufferMicroBatchIterator(buffer, loop, num_samples=32, micro_batch_size=8, group_size=4)
        forward_backward_func(data_iterator=micro_batches, num_microbatches=len(micro_batches), ...)
        rollout.result()
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import torch

from slime_corr.rollout.batching import (
    build_micro_batch,
    cp_pad_multiple,
    grpo_advantages,
    packed_starts,
    slice_micro_batch_for_cp,
)
from slime_corr.rollout.buffer import SampleBuffer
from slime_corr.rollout.sample import Sample, SampleStatus

# Samples the loss trains on: a finished response (stop or length). ABORTED (KEEP policy) and FAILED are not.
TRAINABLE = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
NOT_TRAINED_KEYS = ("loss_mask", "rollout_log_probs", "advantages")


@contextlib.contextmanager
def background_event_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An asyncio event loop running in a daemon thread for the rollout; stopped and closed on exit."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="slime_corr-rollout", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


class BufferMicroBatchIterator:
    """Megatron data iterator over the samples streaming into `buffer` (filled on `loop`, another thread).

    Takes `num_samples` samples (one step) in micro-batches of `micro_batch_size` (the last may be smaller),
    CP-sliced for (`cp_rank`, `cp_size`). The rollout puts GRPO groups atomically, so a micro-batch holds whole
    groups when both sizes are multiples of `group_size` (checked, also as samples are taken), and the advantages `advantage_fn` computes per micro-batch are those
    of the whole step. A sample that did not finish (FAILED, or ABORTED under the KEEP policy) stays in its
    micro-batch with loss mask, rollout log-probs and advantages zeroed, so every rank runs the same micro-batches
    and no sample is lost silently: it is listed in `skipped`. `samples` holds every sample taken, in order.
    """

    def __init__(
        self,
        buffer: SampleBuffer,
        loop: asyncio.AbstractEventLoop,
        num_samples: int,
        micro_batch_size: int,
        *,
        group_size: int = 1,
        advantage_fn: Callable[[Sequence[Sample]], list[float]] = grpo_advantages,
        cp_rank: int = 0,
        cp_size: int = 1,
        pad_token_id: int = 0,
        packed: bool = False,
        timeout: float | None = None,
    ) -> None:
        for name, n in (("micro_batch_size", micro_batch_size), ("num_samples", num_samples)):
            if n <= 0 or n % group_size:
                raise ValueError(
                    f"{name}={n} must be a positive multiple of group_size={group_size} "
                    "(GRPO groups must not be split across micro-batches)."
                )
        if micro_batch_size > buffer.maxsize:
            raise ValueError(f"micro_batch_size={micro_batch_size} exceeds the buffer's maxsize={buffer.maxsize}.")
        self.buffer, self.loop = buffer, loop
        self.num_samples, self.micro_batch_size, self.group_size = num_samples, micro_batch_size, group_size
        self.advantage_fn = advantage_fn
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.pad_token_id, self.packed, self.timeout = pad_token_id, packed, timeout
        self.samples: list[Sample] = []
        self.skipped: list[Sample] = []
        self._seen_groups: set[int] = set()

    def __iter__(self) -> BufferMicroBatchIterator:
        return self

    def __len__(self) -> int:
        """Number of micro-batches of the step (Megatron's `num_microbatches`)."""
        return -(-self.num_samples // self.micro_batch_size)

    def __next__(self) -> dict[str, torch.Tensor]:
        left = self.num_samples - len(self.samples)
        if left == 0:
            raise StopIteration
        samples = self.buffer.get_blocking(min(self.micro_batch_size, left), self.loop, self.timeout)
        counts = Counter(s.group_id for s in samples)
        split = sorted(g for g, n in counts.items() if n != self.group_size or g in self._seen_groups)
        if split:  # a group split across micro-batches would get advantages from part of its samples
            raise ValueError(f"group_size={self.group_size}: group(s) {split} of this micro-batch are not whole.")
        self._seen_groups.update(counts)
        self.samples.extend(samples)
        trained = [s for s in samples if s.status in TRAINABLE]
        self.skipped.extend(s for s in samples if s.status not in TRAINABLE)
        adv_of = dict(zip(map(id, trained), self.advantage_fn(trained), strict=True)) if trained else {}
        batch = build_micro_batch(
            samples, [adv_of.get(id(s), 0.0) for s in samples], pad_token_id=self.pad_token_id, packed=self.packed,
            pad_to_multiple=cp_pad_multiple(self.cp_size),
        )
        for i, s in enumerate(samples):
            if s.status not in TRAINABLE:
                rows = _sample_positions(batch, i)
                for key in NOT_TRAINED_KEYS:
                    batch[key][rows] = 0
        return slice_micro_batch_for_cp(batch, self.cp_rank, self.cp_size)


def _sample_positions(batch: dict[str, torch.Tensor], i: int) -> tuple[int, slice]:
    """Index of sample `i`'s positions in a padded ([i, :]) or packed ([0, its span in the row]) batch."""
    if "cu_seqlens" in batch:
        starts = packed_starts(batch)
        return 0, slice(int(starts[i]), int(starts[i + 1]))
    return i, slice(None)
