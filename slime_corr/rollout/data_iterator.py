"""Streaming samples into Megatron's data iterator.

The rollout runs on an asyncio event loop in a background thread (`background_event_loop`) and puts each GRPO
group into a bounded `SampleBuffer` as soon as the group has finished. The trainer's thread iterates a
`BufferMicroBatchIterator`: every `next()` waits for the next `micro_batch_size` samples and returns a Megatron
micro-batch (see `slime_corr.layout.micro_batch`), so the first micro-batch is ready while later samples are still
being generated, and the rollout blocks (backpressure) when training falls behind.

    with background_event_loop() as loop:
        buffer = SampleBuffer(maxsize=64)
        rollout = asyncio.run_coroutine_threadsafe(generate_group_samples(..., buffer=buffer), loop)
        micro_batches = BufferMicroBatchIterator(buffer, loop, num_samples=32, micro_batch_size=8, group_size=4)
        forward_backward_func(data_iterator=micro_batches, num_microbatches=len(micro_batches), ...)
        rollout.result()

Token-balanced packing (slime's `--use-dynamic-batch-size --max-tokens-per-gpu N`): with
`max_tokens_per_micro_batch=N` the micro-batches are packed (THD) and hold whole GRPO groups up to N tokens per GPU
(N·CP per micro-batch, each CP rank holding 1/CP), filled in arrival order: a micro-batch is emitted when the next
group does not fit (or the step's samples are all taken). A group longer than the budget on its own gets a
micro-batch of its own (it cannot be split; failing would lose a generated rollout): `oversized_groups` counts
them. How many micro-batches that makes depends on the lengths, but Megatron's schedule needs `num_microbatches`
before the first one is read, and every DP rank must run as many (the correction reduces over DP once per
micro-batch). So `len()` is a bound that holds on every rank before any sample arrives: the number of groups of
the step (each micro-batch holds at least one); once the samples run out, empty micro-batches (nothing to train,
`layout.micro_batch.empty_micro_batch`) fill up to it. A caller that reads the step as a list first (decoupled mode,
step-wide normalization) drops those with `materialize(dp_group)`: all DP ranks keep the same number, the most
real micro-batches any of them has (one all_reduce).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from slime_corr.device import collective_device
from slime_corr.layout.context_parallel import slice_micro_batch_for_cp
from slime_corr.layout.groups import grpo_advantages
from slime_corr.layout.micro_batch import (
    TRAINABLE,
    build_micro_batch,
    cp_pad_multiple,
    empty_micro_batch,
    mask_not_trained,
    packed_length,
)
from slime_corr.rollout.buffer import SampleBuffer
from slime_corr.samples import Sample


@contextlib.contextmanager
def background_event_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An asyncio event loop running in a daemon thread for the rollout; on exit (also on Ctrl-C or an error) the
    tasks still running are cancelled and awaited (bounded), then the loop is stopped and closed: no request
    is left half-sent and no "Task was destroyed but it is pending!"."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="slime_corr-rollout", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_pending_tasks(), loop).result(timeout=CANCEL_TIMEOUT)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


CANCEL_TIMEOUT = 10.0  # seconds the rollout's cancelled tasks get to finish their clean-up


async def cancel_pending_tasks() -> None:
    """Cancel every other task of the running loop and wait for them to finish their clean-up."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class BufferMicroBatchIterator:
    """Megatron data iterator over the samples streaming into `buffer` (filled on `loop`, another thread).

    Takes `num_samples` samples (one step) in micro-batches of `micro_batch_size` (the last may be smaller),
    CP-sliced for (`cp_rank`, `cp_size`); with `max_tokens_per_micro_batch`, packed micro-batches of whole groups
    up to that many tokens per GPU (and at most `micro_batch_size` samples), see the module doc. The rollout puts
    GRPO groups atomically, so a micro-batch holds whole groups when both sizes are multiples of `group_size`
    (checked, also as samples are taken), and the advantages `advantage_fn` computes per micro-batch are those of
    the whole step. A sample that did not finish (FAILED, or ABORTED under the KEEP policy) stays in its
    micro-batch with loss mask, rollout log-probs and advantages zeroed, so every rank runs the same micro-batches
    and no sample is lost silently: it is listed in `skipped`. `samples` holds every sample taken, in order, and
    `batch_sizes` the number of samples of each micro-batch given out (0 for an empty one). `kept_sets`: the
    samples carry the engine's kept sets (the rollout asked for the sampling mask): every micro-batch carries the
    key pair (`slime_corr.layout.kept_sets`), an empty one too.
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
        max_tokens_per_micro_batch: int | None = None,
        timeout: float | None = None,
        kept_sets: bool = False,
    ) -> None:
        if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch <= 0:
            raise ValueError(f"max_tokens_per_micro_batch={max_tokens_per_micro_batch} (--max-tokens-per-gpu) must "
                             "be positive.")
        for name, n in (("micro_batch_size", micro_batch_size), ("num_samples", num_samples)):
            if n <= 0 or n % group_size:
                raise ValueError(
                    f"{name}={n} must be a positive multiple of group_size={group_size} "
                    "(GRPO groups must not be split across micro-batches)."
                )
        taken_at_once = group_size if max_tokens_per_micro_batch is not None else micro_batch_size
        if taken_at_once > buffer.maxsize:
            what = "group_size" if max_tokens_per_micro_batch is not None else "micro_batch_size"
            raise ValueError(f"{what}={taken_at_once} exceeds the buffer's maxsize={buffer.maxsize}.")
        self.buffer, self.loop = buffer, loop
        self.num_samples, self.micro_batch_size, self.group_size = num_samples, micro_batch_size, group_size
        self.advantage_fn = advantage_fn
        self.kept_sets = kept_sets
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.pad_token_id, self.timeout = pad_token_id, timeout
        self.max_tokens = max_tokens_per_micro_batch
        self.packed = packed or max_tokens_per_micro_batch is not None
        self.samples: list[Sample] = []
        self.skipped: list[Sample] = []
        self.batch_sizes: list[int] = []
        self.oversized_groups = 0
        self._seen_groups: set[int] = set()
        self._held: list[Sample] = []  # a group taken that did not fit the previous micro-batch

    def __iter__(self) -> BufferMicroBatchIterator:
        return self

    def __len__(self) -> int:
        """Number of micro-batches of the step (Megatron's `num_microbatches`); with a token budget, the bound of
        the module doc (the step's number of groups)."""
        if self.max_tokens is not None:
            return self.num_samples // self.group_size
        return -(-self.num_samples // self.micro_batch_size)

    @property
    def num_empty(self) -> int:
        """Empty micro-batches given out so far (token budget: the ones that fill up to `len()`)."""
        return self.batch_sizes.count(0)

    def __next__(self) -> dict[str, torch.Tensor]:
        if len(self.batch_sizes) == len(self):
            raise StopIteration
        samples = self._take_token_budget() if self.max_tokens is not None else self._take()
        self.batch_sizes.append(len(samples))
        if not samples:  # the step's samples are all in earlier micro-batches: keep every rank's count
            return slice_micro_batch_for_cp(empty_micro_batch(self.cp_size, self.pad_token_id,
                                                              kept_sets=self.kept_sets), self.cp_rank, self.cp_size)
        return self._build(samples)

    def materialize(self, dp_group: dist.ProcessGroup | None = None) -> list[dict[str, torch.Tensor]]:
        """The step's micro-batches as a list (for a first pass over all of them). With a token budget, the
        trailing empty ones are dropped down to the most real micro-batches of any rank of `dp_group` (one
        all_reduce MAX), so every DP rank still runs the same number."""
        batches = list(self)
        if self.max_tokens is None:
            return batches
        real = torch.tensor([len(batches) - self.num_empty], dtype=torch.int64, device=_group_device(dp_group))
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(real, op=dist.ReduceOp.MAX, group=dp_group)
        return batches[: max(1, int(real))]

    def _take(self) -> list[Sample]:
        left = self.num_samples - len(self.samples)
        return self.buffer.get_blocking(min(self.micro_batch_size, left), self.loop, self.timeout)

    def _take_token_budget(self) -> list[Sample]:
        """Whole groups in arrival order while they fit `max_tokens` per GPU (a group alone always fits)."""
        budget = self.max_tokens * self.cp_size
        taken, tokens = [], 0
        while self._held or len(self.samples) + len(taken) < self.num_samples:
            group = self._held or self.buffer.get_blocking(self.group_size, self.loop, self.timeout)
            self._held = []
            size = sum(packed_length(s.total_length, self.cp_size) for s in group)
            if taken and (tokens + size > budget or len(taken) + len(group) > self.micro_batch_size):
                self._held = group
                break
            self.oversized_groups += size > budget
            taken += group
            tokens += size
        return taken

    def _build(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
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
            pad_to_multiple=cp_pad_multiple(self.cp_size), kept_sets=self.kept_sets or None,
        )
        return slice_micro_batch_for_cp(mask_not_trained(batch, samples), self.cp_rank, self.cp_size)


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective over `group` takes its tensors (`slime_corr.device`); the CPU without a group."""
    return torch.device("cpu") if group is None else collective_device(dist.get_backend(group))


