"""Decoupled mode inside Megatron-LM's `pretrain()`: a data iterator that knows rollouts and steps.

Decoupled PPO needs lp_old = log π_old of every sample, where π_old is the policy the rollout's FIRST update
starts from, and `--tis-batch-normalize` needs the mean weight of each optimizer step before its first
micro-batch is trained. `pretrain()` has no place to call anything between steps, but the pieces a user hands it
do run at the right moments:

    train_iterator = RolloutStepIterator(rollouts)                  # the data iterator given to pretrain()
    def forward_step(data_iterator, model):
        batch = hook.next_micro_batch(data_iterator, model)        # instead of next(data_iterator)
        ...

`rollouts` yields one rollout at a time: this rank's micro-batches for one or more optimizer steps, a multiple of
Megatron's micro-batches per step (sampled with the same weights). The iterator hands them out one per `next()`;
the first micro-batch of each step carries a reference to its `RolloutStep`. `next_micro_batch` removes it and,
before the model runs on that micro-batch (a plain forward of each micro-batch; under pipeline parallelism this
pass would be a pipelined schedule inside the running one, so there a step that needs it fails with the fix):
- at a rollout's first step: one forward-only pass over ALL the rollout's micro-batches with the current weights:
  lp_old in decoupled mode (`batch["old_log_probs"]`) and the reference policy's log-probs when the loss has a KL
  term (`batch["ref_log_probs"]`), then the hook's `on_rollout_prepared` callback;
- at every step: the step's `--tis-batch-normalize` mean (from lp_old; bypass mode: one forward-only pass of the
  step's micro-batches), and the previous step's correction metrics are finalized (`hook.last_step_metrics`).
Megatron's own `RerunDataIterator` wrapping passes the micro-batches through unchanged. The micro-batches are moved
to this process's device (`slime_corr.device.to_device`, in place) when their rollout starts.

The engine's kept sets (top-p / top-k replay) may come in slime's batch keys, `rollout_top_p_token_ids` and
`rollout_top_p_token_offsets` (one entry per sample: its whole response; with slime's `total_lengths` and
`response_lengths`, and optionally `rollout_top_p_log_probs`): when a rollout starts they become the micro-batch's
kept-set key pair (`slime_corr.layout.kept_sets.from_slime_samples`), so the hook replays them. That needs whole
rows: under context parallelism convert before slicing (refused otherwise, with the fix).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from slime_corr.device import to_device
from slime_corr.layout.kept_sets import SLIME_IDS_KEY, SLIME_OFFSETS_KEY, from_slime_samples
from slime_corr.mcore.context_parallel import ParallelGroups

STEP_KEY = "_slime_corr_rollout_step"


@dataclass(eq=False)
class Rollout:
    """One rollout's micro-batches (all its steps); `old_log_probs_ready` once lp_old is computed for them."""

    micro_batches: list[dict[str, Any]]
    old_log_probs_ready: bool = False


@dataclass(eq=False)
class RolloutStep:
    """The micro-batches of one optimizer step, and the rollout they belong to."""

    micro_batches: list[dict[str, Any]]
    rollout: Rollout
    prepared: bool = False


def megatron_num_microbatches() -> int | None:
    """Megatron's micro-batches per step when its calculator is initialized (a Megatron-LM launch), else None."""
    from megatron.core import num_microbatches_calculator as calc

    if getattr(calc, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None) is None:
        return None
    return calc.get_num_microbatches()


class RolloutStepIterator:
    """Megatron data iterator over `rollouts` (see the module doc).

    `num_microbatches`: micro-batches per optimizer step; default (and checked against, when both are known)
    Megatron's `get_num_microbatches()`.
    """

    def __init__(self, rollouts: Iterable[Sequence[dict[str, Tensor]]], num_microbatches: int | None = None) -> None:
        if num_microbatches is not None and num_microbatches < 1:
            raise ValueError(f"num_microbatches={num_microbatches}: must be >= 1")
        self._rollouts = iter(rollouts)
        self._num_microbatches = num_microbatches
        self._queue: deque[dict[str, Any]] = deque()
        self.rollouts_started = 0

    def num_microbatches(self) -> int:
        megatron = megatron_num_microbatches()
        n = self._num_microbatches or megatron
        if n is None:
            raise ValueError("RolloutStepIterator: pass num_microbatches (micro-batches per optimizer step); "
                             "Megatron's num-microbatches calculator is not initialized.")
        if megatron is not None and n != megatron:
            raise ValueError(f"RolloutStepIterator: num_microbatches={n}, but Megatron runs {megatron} "
                             "micro-batches per step (--global-batch-size / (--micro-batch-size × DP)): steps "
                             "would straddle optimizer steps.")
        return n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self._queue:
            self._start_rollout(list(next(self._rollouts)))  # StopIteration ends the data
        return self._queue.popleft()

    def _start_rollout(self, micro_batches: list[dict[str, Any]]) -> None:
        n = self.num_microbatches()
        if not micro_batches or len(micro_batches) % n:
            raise ValueError(f"rollout {self.rollouts_started}: {len(micro_batches)} micro-batches is not a "
                             f"positive multiple of the {n} micro-batches of an optimizer step.")
        if any(SLIME_IDS_KEY in b or SLIME_OFFSETS_KEY in b for b in micro_batches):
            if ParallelGroups.current().cp_size > 1:
                raise ValueError(f"rollout {self.rollouts_started}: slime's {SLIME_IDS_KEY} / {SLIME_OFFSETS_KEY} "
                                 "describe whole responses, but under context parallelism the micro-batches are CP "
                                 "slices: convert each whole micro-batch with slime_corr.layout.kept_sets."
                                 "from_slime_samples, then slice it (slice_micro_batch_for_cp keeps the kept sets).")
            micro_batches = [from_slime_samples(b) for b in micro_batches]
        for batch in micro_batches:  # once, before any pass reads them: on this process's device (`slime_corr.device`)
            to_device(batch)
        rollout = Rollout(micro_batches)
        for i in range(0, len(micro_batches), n):
            step = RolloutStep(micro_batches[i:i + n], rollout)
            step.micro_batches[0][STEP_KEY] = step
            self._queue.extend(step.micro_batches)
        self.rollouts_started += 1


def pop_step(batch: dict[str, Any]) -> RolloutStep | None:
    """The `RolloutStep` a step's first micro-batch carries (removed from it), else None."""
    return batch.pop(STEP_KEY, None)


__all__ = ["Rollout", "RolloutStep", "RolloutStepIterator", "STEP_KEY", "megatron_num_microbatches", "pop_step"]
