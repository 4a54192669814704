"""The update loop: several optimizer steps on one rollout, through Megatron's schedule and the loss hook.

A rollout's micro-batches (this rank's) go into ONE `RolloutStepIterator`; each optimizer step runs Megatron's
`forward_backward_func` over the next `num_microbatches` of them with `hook.forward_step`. At the rollout's first
step the hook runs one forward-only pass over ALL the rollout's micro-batches (lp_old in decoupled mode, the
reference log-probs for the KL term), so the later steps train π_θ ≠ π_old (PPO clipping, `ois` and `pg_clipfrac`
act); in bypass mode lp_old is lp_rollout at every step.

Baselines after rejection (decoupled mode with rejection sampling or the veto): the rejection of a sequence is
decided by lp_old vs lp_rollout, known after that pass and before any update. A rejected sequence is then taken out
of its GRPO group's mean (and std) and the group's other samples get advantages from the kept ones only
(`rebaseline_rejected`); otherwise a rejected sample's reward would still shift its group's baseline (the verl bug
the issue names). Token-level rejection keeps the sequence (it still has trained tokens). In bypass mode the
rejection depends on π_θ at each step and is only known inside the loss: the baselines stay as sampled.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from slime_corr.correction.diagnostics import DiagnosticsResult
from slime_corr.mcore.compat import get_forward_backward_func
from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
from slime_corr.mcore.params import optimizer_step
from slime_corr.mcore.rollout_steps import RolloutStepIterator
from slime_corr.rollout.batching import group_advantages


def rebaseline_rejected(hook: RolloutCorrectionLoss, micro_batches: Sequence[dict[str, Tensor]],
                        normalize_std: bool) -> int:
    """Recompute the GRPO advantages of this rank's `micro_batches` (whole groups; `rewards`, `group_ids`) over the
    sequences the correction keeps (`hook.kept_sequences`), in place. Returns how many trained sequences were
    rejected, over all DP ranks."""
    kept = [hook.kept_sequences(b) for b in micro_batches]
    trained = torch.cat([(b["loss_mask"] > 0).any(-1) for b in micro_batches])
    keep = torch.cat(kept)
    adv = group_advantages(torch.cat([b["rewards"] for b in micro_batches]),
                           torch.cat([b["group_ids"] for b in micro_batches]), keep, normalize_std)
    start = 0
    for b in micro_batches:
        rows = b["loss_mask"].shape[0]
        b["advantages"] = adv[start:start + rows, None].to(b["advantages"].dtype) * b["loss_mask"]
        start += rows
    rejected = (trained & ~keep).sum().to(torch.float64)
    dp = hook.groups.dp
    if dp is not None and torch.distributed.get_world_size(dp) > 1:
        torch.distributed.all_reduce(rejected, group=dp)
    return int(rejected)


@dataclass
class RolloutTimes:
    """Seconds of a rollout's update: the forward-only pass (lp_old / reference), each step's training (without
    that pass), and within it the loss functions' forward (log-probs from logits, correction, policy loss)."""

    prepare: float = 0.0
    steps: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)


@dataclass
class StepResult:
    """One optimizer step: its metrics (the hook's `reduce_step_metrics` and `grad_norm`), its diagnostics."""

    metrics: dict[str, float]
    diagnostics: DiagnosticsResult


class Updater:
    """Trains rollouts: `train_rollout(micro_batches)` yields each optimizer step's metrics."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, hook: RolloutCorrectionLoss, *,
                 num_microbatches: int, micro_batch_size: int, clip_grad: float,
                 rebaseline: bool, normalize_std: bool) -> None:
        self.model, self.optimizer, self.hook = model, optimizer, hook
        self.num_microbatches, self.micro_batch_size, self.clip_grad = num_microbatches, micro_batch_size, clip_grad
        self.rebaseline, self.normalize_std = rebaseline, normalize_std
        self.rejected = 0
        self._prepared_at = 0.0
        self._loss_seconds = 0.0
        hook.on_rollout_prepared = self._on_prepared

    def _forward_step(self, data_iterator: Any, model: torch.nn.Module) -> tuple[Tensor, Any]:
        """The hook's forward_step, with its loss function timed."""
        logits, loss_func = self.hook.forward_step(data_iterator, model)

        def timed(output: Tensor) -> Any:
            start = time.perf_counter()
            try:
                return loss_func(output)
            finally:
                self._loss_seconds += time.perf_counter() - start

        return logits, timed

    def _on_prepared(self, micro_batches: Sequence[dict[str, Tensor]]) -> None:
        self.rejected = rebaseline_rejected(self.hook, micro_batches, self.normalize_std) if self.rebaseline else 0
        self._prepared_at = time.perf_counter()

    def train_rollout(self, micro_batches: list[dict[str, Tensor]]) -> tuple[list[StepResult], RolloutTimes]:
        """Every step of one rollout (collective: every rank calls it with its micro-batches)."""
        steps, rest = divmod(len(micro_batches), self.num_microbatches)
        assert steps and not rest, (len(micro_batches), self.num_microbatches)
        data = RolloutStepIterator([micro_batches], num_microbatches=self.num_microbatches)
        fb = get_forward_backward_func()
        times, results = RolloutTimes(), []
        for k in range(steps):
            start = self._prepared_at = time.perf_counter()
            self._loss_seconds = 0.0
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad(set_to_none=True)
            losses = fb(forward_step_func=self._forward_step, data_iterator=data, model=self.model,
                        num_microbatches=self.num_microbatches, seq_length=0, micro_batch_size=self.micro_batch_size,
                        forward_only=False)
            metrics = self.hook.reduce_step_metrics(losses)
            metrics["grad_norm"] = optimizer_step(self.model, self.optimizer, self.clip_grad)
            end = time.perf_counter()
            if k == 0:
                times.prepare = self._prepared_at - start
                metrics["baseline_rejected_samples"] = float(self.rejected)
            times.steps.append(end - start - (times.prepare if k == 0 else 0.0))
            times.loss.append(self._loss_seconds)
            results.append(StepResult(metrics, self.hook.last_diagnostics))
        return results, times


__all__ = ["RolloutTimes", "Updater", "rebaseline_rejected"]
