"""The step pre-pass of `RolloutCorrectionLoss` (slime_corr.mcore.loss_hook): what is computed over a whole
optimizer step before its training pass, because one micro-batch cannot know it alone.

Several micro-batches per step. Every batch quantity is over the whole step, across DP×CP: the `--tis-batch-normalize`
mean and the budgeted bounds (`--rs-divergence-budget`, `--tis-ess-target`: one bound per step,
`correction.budget.StepBounds`), from a pre-pass over the step's micro-batches (`prepare_step`; decoupled mode reuses
lp_old and hands the training pass its corrections, `PRECOMPUTED_CORRECTION`; bypass mode, which has no lp_old, pays
one forward-only pass, and only when one of these is on with more than one micro-batch). `kept_sequences` and
`set_step_bounds` serve the trainer's baselines before a step; `check_inside_schedule` refuses a
`RolloutStepIterator` step that needs a pass which cannot start from inside Megatron's running schedule.

`RolloutCorrectionLoss` holds one `StepPrepass` as `hook.prepass`, over its `PolicyLogProbs` (`hook.policy`, whose
forward-only passes, process groups and modes it uses); it also works alone, given a config and a `PolicyLogProbs`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import (
    CorrectionResult,
    StepBounds,
    compute_rollout_correction,
    merge_stats,
    normalize_weights,
    weight_mean,
)
from slime_corr.correction.reductions import active_groups
from slime_corr.mcore.context_parallel import batch_segments
from slime_corr.mcore.policy_log_probs import PolicyLogProbs
from slime_corr.mcore.rollout_steps import RolloutStep

# A micro-batch's correction computed by the decoupled normalization pre-pass (lp_train = lp_old, so the training
# pass would compute the very same one): `prepare_step` stores it here, `loss_func` uses it instead of recomputing.
PRECOMPUTED_CORRECTION = "_rollout_correction"
# The budgeted bounds of the micro-batch's optimizer step (`StepBounds`), set before the step (`prepare_step`, and
# `set_step_bounds` for the decoupled baselines); a micro-batch without it bounds itself (one micro-batch per step).
STEP_BOUNDS = "_rollout_correction_step_bounds"


class StepPrepass:
    """`prepare_step` and what it needs (the step's normalization mean and budgeted bounds); see the module doc.
    `policy`: the log-probs (lp_old, the reference's, a bypass pass's) and the process groups."""

    def __init__(self, config: RolloutCorrectionConfig, policy: PolicyLogProbs) -> None:
        self.config = config
        self.policy = policy
        self.step_batch_norm_mean: Tensor | None = None  # set by `prepare_step`

    @property
    def budgeted(self) -> bool:
        """`--rs-divergence-budget` / `--tis-ess-target`: bounds set per optimizer step from its statistics."""
        cfg = self.config
        return cfg.use_rollout_correction and (cfg.rs_divergence_budget is not None or cfg.tis_ess_target is not None)

    def check_inside_schedule(self, step: RolloutStep) -> None:
        """Refuse to prepare `step` from inside Megatron's running schedule under PP when it needs a forward-only
        pass first (that pass is a pipelined schedule of its own)."""
        policy = self.policy
        needs_rollout_pass = (policy.needs_old_log_probs or policy.needs_ref_log_probs) and not \
            step.rollout.old_log_probs_ready
        needs_prepass = needs_rollout_pass or self._needs_step_prepass(len(step.micro_batches))
        if needs_prepass and policy.groups.pp_size > 1:
            raise NotImplementedError(
                "RolloutStepIterator under pipeline parallelism: this step needs a forward-only pass over its "
                "micro-batches first (lp_old in decoupled mode, the reference log-probs of a KL term, the "
                "--tis-batch-normalize mean or the step's --rs-divergence-budget / --tis-ess-target bound), and "
                "under PP "
                "that pass is a pipelined schedule of its own, which cannot start from inside the running one. "
                "Drive the step with hook.train_step(model, micro_batches) (or hook.prepare_step before Megatron's "
                "forward_backward_func); inside pretrain() use bypass mode (--use-rollout-logprobs) without "
                "--tis-batch-normalize and budgets, or one micro-batch per step."
            )

    def kept_sequences(self, batch: dict[str, Tensor]) -> Tensor:
        """[n] bool: the sequences (rows, or a packed row's sequences) of a prepared micro-batch (decoupled mode:
        `old_log_probs` set) that keep at least one token in the loss after the correction's rejection (RS, veto,
        non-finite log-probs), over the whole sequence (one [n] all-reduce over CP). Sequences with no trained token
        are not kept."""
        if not self.policy.needs_old_log_probs or "old_log_probs" not in batch:
            raise ValueError("kept_sequences: needs lp_old (decoupled mode, after prepare_rollout); in bypass mode "
                             "the rejection depends on the current policy and is known only inside the loss.")
        if self.budgeted and STEP_BOUNDS not in batch:
            raise ValueError("kept_sequences: --rs-divergence-budget / --tis-ess-target bound each optimizer step "
                             "from all its micro-batches; call hook.set_step_bounds(step_micro_batches) first.")
        lp = batch["old_log_probs"]
        groups = self.policy.groups
        seg = batch_segments(batch, groups)
        corr = compute_rollout_correction(lp, batch["rollout_log_probs"].to(lp.dtype), batch["loss_mask"],
                                          self.config, cp_group=groups.cp, normalize=False, finalize_metrics=False,
                                          segments=seg, step_bounds=batch.get(STEP_BOUNDS))
        kept = (corr.loss_mask > 0).to(torch.float64)
        counts = seg.sum(kept) if seg is not None else kept.sum(-1)
        if groups.cp_size > 1:
            torch.distributed.all_reduce(counts, group=groups.cp)
        return counts > 0

    def prepare_step(
        self,
        model: torch.nn.Module,
        micro_batches: Sequence[dict[str, Tensor]],
        *,
        recompute_old_log_probs: bool = True,
    ) -> None:
        """Before a step's training pass: lp_old (decoupled mode) and the reference log-probs (KL term) by
        `prepare_rollout`, unless `recompute_old_log_probs` is False and the batches carry them, then the step's
        `step_batch_norm_mean` and budgeted bounds.

        With more than one micro-batch, `--tis-batch-normalize` divides the weights of every micro-batch by their
        mean over the WHOLE step, and `--rs-divergence-budget` / `--tis-ess-target` set ONE bound for the whole
        step (`StepBounds`: the micro-batches' bin sums, one SUM over DP×CP): a pre-pass computes them from
        lp_train. In decoupled mode (lp_train = lp_old) the training pass reuses its corrections (only the step
        divisor is applied); in bypass mode the pre-pass runs a forward-only pass for its log-probs and keeps the
        step mean and the step bounds (stored in each micro-batch), and the training pass computes the correction.
        """
        policy = self.policy
        if recompute_old_log_probs and (policy.needs_old_log_probs or policy.needs_ref_log_probs):
            policy.prepare_rollout(model, micro_batches)
        self.step_batch_norm_mean = None
        for b in micro_batches:
            b.pop(PRECOMPUTED_CORRECTION, None)
            b.pop(STEP_BOUNDS, None)
        if not self._needs_step_prepass(len(micro_batches)):
            return
        cfg, groups = self.config, policy.groups
        decoupled = policy.needs_old_log_probs
        train_log_probs = None if decoupled else policy.forward_log_probs(model, micro_batches,  # all PP stages
                                                                          renormalize=True)
        if not groups.pp_last:  # the mean and bounds are used by the loss, on the last stage
            return
        if train_log_probs is None:
            train_log_probs = [b["old_log_probs"] for b in micro_batches]
        bounds = self._step_bounds(micro_batches, train_log_probs) if self.budgeted else None
        if not decoupled and not self._needs_step_mean(len(micro_batches)):  # bypass: only the bounds
            for b in micro_batches:
                b[STEP_BOUNDS] = bounds
            return
        results = [self._prepass_correction(lp, b, bounds) for lp, b in zip(train_log_probs, micro_batches,
                                                                             strict=True)]
        if self._needs_step_mean(len(micro_batches)):
            self.step_batch_norm_mean = weight_mean(merge_stats([r.stats for r in results]))
        for b, r in zip(micro_batches, results, strict=True):
            if decoupled:  # the training pass only applies the step divisor to the pre-pass's corrections
                b[PRECOMPUTED_CORRECTION] = r if self.step_batch_norm_mean is None else normalize_weights(
                    r, cfg, self.step_batch_norm_mean, finalize_metrics=False)
            elif bounds is not None:  # bypass: lp_train is the training pass's own log-prob, so the correction
                b[STEP_BOUNDS] = bounds  # is computed there, with this mean and these bounds

    def _prepass_correction(self, lp: Tensor, batch: dict[str, Tensor], bounds: StepBounds | None
                            ) -> CorrectionResult:
        """One micro-batch's correction from lp_train, unnormalized and unfinalized (a step pre-pass)."""
        groups = self.policy.groups
        return compute_rollout_correction(lp, batch["rollout_log_probs"].to(lp.dtype), batch["loss_mask"],
                                          self.config, cp_group=groups.cp, dp_group=groups.dp, normalize=False,
                                          finalize_metrics=False, segments=batch_segments(batch, groups),
                                          step_bounds=bounds)

    def _step_bounds(self, micro_batches: Sequence[dict[str, Tensor]], train_log_probs: Sequence[Tensor]
                     ) -> StepBounds:
        """The step's budgeted bounds: a collecting correction of every micro-batch (its results discarded), then
        ONE SUM of the bin sums per group (DP, CP)."""
        bounds = StepBounds()
        for lp, b in zip(train_log_probs, micro_batches, strict=True):
            self._prepass_correction(lp, b, bounds)
        groups = self.policy.groups
        return bounds.finish(active_groups(groups.cp, groups.dp))

    def set_step_bounds(self, micro_batches: Sequence[dict[str, Tensor]]) -> None:
        """Decoupled mode, after `prepare_rollout`: the budgeted bounds of the optimizer step made of
        `micro_batches`, stored in each (for `kept_sequences` before the step; `prepare_step` sets them again).
        Nothing without a budget. On the last PP stage (where lp_old is)."""
        if not self.budgeted:
            return
        bounds = self._step_bounds(micro_batches, [b["old_log_probs"] for b in micro_batches])
        for b in micro_batches:
            b[STEP_BOUNDS] = bounds

    def _needs_step_mean(self, num_micro_batches: int) -> bool:
        return self.config.use_tis and self.config.tis_batch_normalize and num_micro_batches > 1

    def _needs_step_prepass(self, num_micro_batches: int) -> bool:
        """A step quantity of several micro-batches: the normalization mean or the budgeted bounds (one
        micro-batch bounds itself: its correction reduces over DP×CP)."""
        return self._needs_step_mean(num_micro_batches) or (self.budgeted and num_micro_batches > 1)

    def can_stream(self, num_micro_batches: int) -> bool:
        """Whether `train_step` can read the micro-batches once, as a stream: no lp_old recompute (bypass), no
        reference pass, no step-wide normalization mean and no step budget, which all need a pass over every
        micro-batch first."""
        policy = self.policy
        return not (policy.needs_old_log_probs or policy.needs_ref_log_probs
                    or self._needs_step_prepass(num_micro_batches))
