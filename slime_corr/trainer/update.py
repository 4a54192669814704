"""The update loop: several optimizer steps on one rollout, through Megatron's schedule and the loss hook.

Every micro-batch goes to the device (`slime_corr.device.to_device`: pinned memory, non_blocking on CUDA) once, when
its rollout starts training. Before a rollout's first step, ONE forward-only pass over ALL the rollout's micro-batches (`hook.prepare_rollout`:
lp_old in decoupled mode, the reference log-probs for the KL term; under pipeline parallelism Megatron's pipelined
forward-only schedule), so the later steps train π_θ ≠ π_old (PPO clipping, `ois` and `pg_clipfrac` act); in
bypass mode lp_old is lp_rollout at every step. Then each optimizer step runs Megatron's `forward_backward_func`
over its micro-batches (`hook.train_step`, which also computes the step's `--tis-batch-normalize` mean); packed
steps may have different numbers of micro-batches, the same on every DP rank.

Under pipeline parallelism the loss, its metrics and the diagnostics exist on the last stage: `train_rollout`
hands them to every stage of the pipeline (one object broadcast per rollout), so the driver (rank 0, first stage)
logs them.

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
from slime_corr.device import to_device
from slime_corr.layout.groups import group_advantages
from slime_corr.mcore.compat import get_forward_backward_func
from slime_corr.mcore.context_parallel import batch_segments
from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
from slime_corr.mcore.params import optimizer_step
from slime_corr.mcore.pipeline import from_last_stage
from slime_corr.mcore.precision import is_megatron_optimizer, step_optimizer


def rebaseline_rejected(hook: RolloutCorrectionLoss, micro_batches: Sequence[dict[str, Tensor]],
                        normalize_std: bool) -> int:
    """Recompute the GRPO advantages of this rank's `micro_batches` (whole groups; per sequence `rewards`,
    `group_ids`, `trained`; padded or packed) over the sequences the correction keeps (`hook.kept_sequences`), in
    place. Returns how many trained sequences were rejected, over all DP ranks."""
    keep = torch.cat([hook.kept_sequences(b) for b in micro_batches])
    trained = torch.cat([b["trained"] for b in micro_batches])
    adv = group_advantages(torch.cat([b["rewards"] for b in micro_batches]),
                           torch.cat([b["group_ids"] for b in micro_batches]), keep, normalize_std)
    start = 0
    for b in micro_batches:
        n = len(b["rewards"])
        seg = batch_segments(b, hook.groups)
        per_seq = adv[start:start + n]
        per_token = seg.expand(per_seq) if seg is not None else per_seq[:, None]  # broadcast along each sequence
        b["advantages"] = per_token.to(b["advantages"].dtype) * b["loss_mask"]
        start += n
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
    """One optimizer step: its metrics (the hook's `reduce_step_metrics` and `grad_norm`; under --bf16 / --fp16
    `loss_scale` and `skipped_steps`), its diagnostics."""

    metrics: dict[str, float]
    diagnostics: DiagnosticsResult


class Updater:
    """Trains rollouts: `train_rollout(steps)` returns each optimizer step's metrics (see the module doc)."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, hook: RolloutCorrectionLoss, *,
                 clip_grad: float, rebaseline: bool, normalize_std: bool) -> None:
        """`optimizer`: a `torch.optim` one, or under --bf16 / --fp16 Megatron's (`mcore.precision.build_optimizer`,
        which clips itself)."""
        self.model, self.optimizer, self.hook = model, optimizer, hook
        self.clip_grad, self.rebaseline, self.normalize_std = clip_grad, rebaseline, normalize_std
        self._loss_seconds = 0.0

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

    def _prepare(self, steps: list[list[dict[str, Tensor]]]) -> int:
        """The rollout's forward-only pass, then its baselines after rejection (on the loss's stage); returns the
        rejected count there (0 elsewhere)."""
        hook = self.hook
        micro_batches = [b for step in steps for b in step]
        if hook.needs_old_log_probs or hook.needs_ref_log_probs:
            hook.prepare_rollout(self.model, micro_batches)
        if self.rebaseline and hook.groups.pp_last:  # lp_old and the advantages live on the last stage
            for step in steps:  # budgeted bounds are per optimizer step: reject as the step will
                hook.set_step_bounds(step)
            return rebaseline_rejected(hook, micro_batches, self.normalize_std)
        return 0

    def train_rollout(self, steps: list[list[dict[str, Tensor]]]) -> tuple[list[StepResult], RolloutTimes]:
        """Every step of one rollout: `steps` holds each optimizer step's micro-batches of this rank (collective:
        every rank calls it). Under PP every stage returns the last stage's results."""
        times, results = RolloutTimes(), []
        start = time.perf_counter()
        for micro_batches in steps:
            for batch in micro_batches:
                to_device(batch)  # in place: every pass below sees the same dicts, on the device
        rejected = self._prepare(steps)
        times.prepare = time.perf_counter() - start
        fb = get_forward_backward_func()
        for k, micro_batches in enumerate(steps):
            start = time.perf_counter()
            self._loss_seconds = 0.0
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad(set_to_none=True)
            metrics = self.hook.train_step(self.model, micro_batches, forward_backward_func=fb,
                                           recompute_old_log_probs=False, forward_step=self._forward_step)
            optimizer_metrics = self._step()  # every stage steps
            if metrics:  # the loss's stage (the last one under PP)
                metrics.update(optimizer_metrics)
                if k == 0:
                    metrics["baseline_rejected_samples"] = float(rejected)
            times.steps.append(time.perf_counter() - start)
            times.loss.append(self._loss_seconds)
            results.append(StepResult(metrics, self.hook.last_diagnostics))
        results, times.loss = from_last_stage((results, times.loss))
        return results, times

    def _step(self) -> dict[str, float]:
        """The optimizer step: `grad_norm` (before clipping); under --fp16 (a loss scaler) also `loss_scale` (the
        scale after the step, Megatron-LM's "loss scale") and `skipped_steps` (1 when an overflow skipped it): a bf16
        run has neither (no scaler: it never skips)."""
        if not is_megatron_optimizer(self.optimizer):
            return {"grad_norm": optimizer_step(self.model, self.optimizer, self.clip_grad)}
        outcome = step_optimizer(self.optimizer)
        if not outcome.scaled:
            return {"grad_norm": outcome.grad_norm}
        return {"grad_norm": outcome.grad_norm, "loss_scale": outcome.loss_scale,
                "skipped_steps": float(not outcome.applied)}


__all__ = ["RolloutTimes", "Updater", "rebaseline_rejected"]
