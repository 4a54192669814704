"""The rollout-correction loss in Megatron's schedule convention (`get_forward_backward_func`).

    hook = RolloutCorrectionLoss(config, temperature=rollout_temperature)
    model_config.calculate_per_token_loss = True          # required, see below
    model_config.finalize_model_grads_func = finalize_model_grads
    metrics = hook.train_step(model, micro_batches)       # decoupled recompute (if needed) + fwd/bwd
    optimizer.step()

or, inside an existing training loop — Megatron-LM's `pretrain()` included — pass `hook.forward_step` as
`forward_step_func` (or write your own that returns `(logits, partial(hook.loss_func, batch, model=model))`) and
feed it a `RolloutStepIterator` (slime_corr.mcore.rollout_steps), whose steps `next_micro_batch` prepares: lp_old
in decoupled mode, the step's `--tis-batch-normalize` mean. Outside `pretrain()`, `hook.prepare_step(model,
micro_batches)` before the schedule and `hook.reduce_step_metrics(...)` on what it returns do the same.

Modes (from the config): decoupled (default; lp_old recomputed by a forward-only pass before the update and
stored as `batch["old_log_probs"]`), bypass (`use_rollout_logprobs`: lp_old := lp_rollout, no extra forward),
REINFORCE (`loss_type="reinforce"`, bypass only).

KL and entropy terms (`loss_terms`, `slime_corr.loss_terms`): the reference policy's log-probs
(`batch["ref_log_probs"]`) come from the same forward-only pass as lp_old, with `ref_model`; the entropy of π_θ from
the training forward (with its gradient).

Diagnostics (`diagnostics_top_k`): `loss_func` adds each training micro-batch's `diagnostic_sums`
(`slime_corr.correction.diagnostics`) from the log-probs it already has (no recompute), with the batch's
`weight_lag` [B, S] and `sample_ids` [B] when present; `reduce_step_metrics` (or `pop_diagnostics`, on every rank)
reduces them once per step into `last_diagnostics`.

Normalization. `loss_func` returns Megatron's per-token triple `(loss_sum, count, report)` where `count` is the
core's local denominator (valid tokens for token-mean, valid sequences counted once across CP for seq-mean-*).
With `calculate_per_token_loss=True` Megatron sums the counts over micro-batches, all-reduces them over DP×CP
and divides the summed gradients by that total, so the gradient is

    ∇ Σ_{ranks, micro-batches} loss_sum / Σ_{ranks, micro-batches} count

— the single-rank full-batch value for any (TP, CP, DP) factorization, even when CP ranks hold different
numbers of valid tokens. `calculate_per_token_loss=False` (a per-rank mean) is refused on every path
(`slime_corr.mcore.per_token_loss`).

Reporting. `report` is Megatron's `{key: tensor([numerator, denominator])}` (`slime_corr.mcore.step_metrics`):
Megatron-LM's `train_step` turns it into the step's loss, loss-level metrics and every ratio-of-sums correction
metric. The other correction metrics (min/max, std, quantiles, ESS, counts) need the step's merged statistics:
`hook.pop_step_metrics()` gives every correction metric of the step's training micro-batches, exactly;
`reduce_step_metrics` (the project's trainer) gives everything.

Several micro-batches per step. Every batch quantity is over the whole step, across DP×CP: the loss and its
gradient (above), the correction metrics, and the `--tis-batch-normalize` mean and budgeted bounds, which a pre-pass
over the step's micro-batches computes first (`prepare_step`, slime_corr.mcore.step_prepass). Only the extra metrics
of a custom weighting function are averaged over micro-batches with equal weight.

Mixture of Experts (`slime_corr.mcore.routing.routed_forward` as `model_forward`): a training forward stores the
trainer's own routes in the batch; `loss_func` then adds the routing-mismatch pairs (trainer vs engine routes at
the trained positions, `correction.routing`) to the report, reduced like the others.

Layouts. Micro-batches are padded [B, S] (one sequence per row) or packed (THD: one row [1, T] with `cu_seqlens`
and `cu_seqlens_padded`, `slime_corr.layout.micro_batch`); every sequence-level quantity is per packed sequence, the
same as padded. `seq-mean-token-sum-norm` divides by `seq_length_for_norm` (the run's maximum response length; a
padded batch defaults to its length S·CP, a packed one must be given it).

Pipeline parallelism (PP). The log-probs, the loss and the correction metrics live on the last stage (where
Megatron-LM logs; `train_step` returns {} on the other stages). The forward-only passes before a step (lp_old and the
reference's, slime_corr.mcore.policy_log_probs; the bypass pre-pass) run through Megatron's pipelined schedule, so
`train_step` / `prepare_step` work at any PP size; inside `pretrain()` a step that needs one fails with the fix.

Where it lives: this module holds the hook's state, the Megatron hooks (`forward_step`, `next_micro_batch`,
`loss_func`: everything one loss call does), the step's metrics and `train_step`. The hook holds two parts that do
the rest, each usable alone: `hook.policy`, a `PolicyLogProbs` (slime_corr.mcore.policy_log_probs: `log_probs` from
logits, the forward-only passes for lp_old and the reference, loglinear π_old), and `hook.prepass`, a `StepPrepass`
(slime_corr.mcore.step_prepass: `prepare_step`, the step's mean and budgeted bounds, `kept_sequences`, `can_stream`).
The hook's methods and properties of the same names hand over to them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import metrics_to_host
from slime_corr.correction.diagnostics import DiagnosticsResult, MismatchDiagnostics, response_positions
from slime_corr.layout.context_parallel import is_packed, seq_length_for_norm
from slime_corr.layout.kept_sets import check_trained_tokens_have_kept_sets, has_kept_sets
from slime_corr.loss_terms import LossTermsConfig
from slime_corr.losses import compute_policy_loss
from slime_corr.mcore.compat import get_forward_backward_func, megatron_lm_args
from slime_corr.mcore.context_parallel import ParallelGroups, batch_segments, packed_seq_params
from slime_corr.mcore.logprobs import DEFAULT_CHUNK_SIZE
from slime_corr.mcore.nucleus import (
    RENORMALIZED_KEYS,
    UNTRUNCATED_ROLLOUT,
    Truncation,
    kept_set_report,
    nucleus_report,
    renormalize_batch,
    store_replay_metrics,
)
from slime_corr.mcore.per_token_loss import check_model_config, check_per_token_loss, guard_loss
from slime_corr.mcore.pipeline import MicroBatches, run_schedule
from slime_corr.mcore.policy_log_probs import ModelForward, PolicyLogProbs
from slime_corr.mcore.rollout_steps import RolloutStep, pop_step
from slime_corr.mcore.routing import TRAINER_ROUTES_KEY, routing_report, stage_routing_reports
from slime_corr.mcore.step_metrics import (
    ADVANTAGE_COUNT,
    COUNT_FRACTIONS,
    StepStatistics,
    build_report,
    reduce_reports,
)
from slime_corr.mcore.step_prepass import PRECOMPUTED_CORRECTION, STEP_BOUNDS, StepPrepass


def default_model_forward(model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Logits [B, S, V/TP] of a Megatron GPTModel for this rank's (CP-sliced) micro-batch; a packed micro-batch
    passes its `PackedSeqParams` (THD attention needs TransformerEngine)."""
    packed = {"packed_seq_params": packed_seq_params(batch)} if is_packed(batch) else {}
    return model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=batch.get("attention_mask"),
        **packed,
    )


class RolloutCorrectionLoss:
    """`forward_step` / `loss_func` for Megatron's schedules, built from a `RolloutCorrectionConfig`.

    `groups`: explicit process groups; by default read from `megatron.core.parallel_state` at each call.
    `model_forward(model, batch) -> logits`: how to run the model (default: GPTModel on tokens/position_ids).
    `temperature`: the rollout sampling temperature (log π = log_softmax(logits / T), as SGLang reports).
    `truncation`: the rollout's top-p / top-k; when active every policy log-prob is taken under the truncated,
    renormalized distribution and the rollout log-probs are renormalized to the trainer's nucleus
    (`slime_corr.mcore.nucleus`; the report gains its `mismatch_nucleus_*` pairs). A micro-batch that carries the
    engine's kept sets (`slime_corr.layout.kept_sets`) is replayed whatever `truncation` says: the policy term's
    log-probs over those sets, the KL and entropy terms over the full distribution (`nucleus.replayed_log_probs`;
    the report gains the `mismatch_kept_*` pairs too).
    `chunk_size`: tokens per log-prob chunk (bounds the fp32 [chunk, V/TP] temporaries; None: sized to the device,
    `slime_corr.mcore.logprobs.CHUNK_BYTES`).
    `compute_entropy`: also log the token-mean entropy of π_θ (on when `loss_terms` has an entropy bonus).
    `seq_length_for_norm`: the constant L of `seq-mean-token-sum-norm` (the run's maximum response length);
    required with packed micro-batches, else a padded micro-batch's full length S·CP.
    `keep_outputs`: keep each micro-batch's `PolicyLossOutput` in `self.outputs` (debugging, tests).
    `on_step_metrics(metrics)`: called with a step's correction metrics (`pop_step_metrics`) when
    `next_micro_batch` starts the next step; they are also kept in `self.last_step_metrics`.
    `loss_terms`: KL to `ref_model` (a frozen reference policy, run by `model_forward`) and the entropy bonus.
    `diagnostics_top_k`: compute the mismatch diagnostics of the training micro-batches, keeping the top-k
    sequences (None: off). `prox_logp_method` (decoupled mode, AReaL's names): "recompute" (the forward-only pass)
    or "loglinear" (`slime_corr.correction.proximal`, from the batch's `weight_lag` and `prox_lag`, no pass; with
    `measure_prox_error` set for a rollout, lp_old is also recomputed and the step logs
    `prox_logp_abs_error_mean` / `_max` of the approximation against it). `on_rollout_prepared(micro_batches)`: called once per rollout after its forward-only
    pass (lp_old / reference log-probs), before any of its micro-batches is trained.

    Its parts: `policy` (`PolicyLogProbs`: the log-probs, from logits and by forward-only passes) and `prepass`
    (`StepPrepass`: the step's pre-pass, over `policy`).
    """

    def __init__(
        self,
        config: RolloutCorrectionConfig,
        *,
        temperature: float = 1.0,
        truncation: Truncation | None = None,
        chunk_size: int | None = DEFAULT_CHUNK_SIZE,
        groups: ParallelGroups | None = None,
        model_forward: ModelForward = default_model_forward,
        compute_entropy: bool = False,
        keep_outputs: bool = False,
        on_step_metrics: Callable[[dict[str, float]], None] | None = None,
        seq_length_for_norm: int | None = None,
        loss_terms: LossTermsConfig | None = None,
        ref_model: torch.nn.Module | None = None,
        diagnostics_top_k: int | None = None,
        on_rollout_prepared: Callable[[Sequence[dict[str, Tensor]]], None] | None = None,
        prox_logp_method: str = "recompute",
    ) -> None:
        self.config = config
        self.policy = PolicyLogProbs(
            config, model_forward=model_forward, groups=groups, temperature=temperature, truncation=truncation,
            chunk_size=chunk_size, compute_entropy=compute_entropy, loss_terms=loss_terms, ref_model=ref_model,
            prox_logp_method=prox_logp_method, on_rollout_prepared=on_rollout_prepared)
        if self.policy.loss_terms.uses_reference and ref_model is None:
            raise ValueError("RolloutCorrectionLoss: --use-kl-loss / --kl-loss-coef need ref_model (the frozen "
                             "reference policy).")
        self.prepass = StepPrepass(config, self.policy)
        self.diagnostics = MismatchDiagnostics(diagnostics_top_k) if diagnostics_top_k is not None else None
        self.last_diagnostics = DiagnosticsResult()
        self.keep_outputs = keep_outputs
        self.on_step_metrics = on_step_metrics
        self.seq_length_for_norm = seq_length_for_norm
        self.outputs: list[Any] = []
        self.step_stats = StepStatistics()
        self.last_step_metrics: dict[str, float] = {}
        self._stage_routed: list[dict[str, Any]] = []  # PP + MoE: this step's micro-batches with routes to merge

    # ------------------------------------------------------------------ the parts' settings and state
    @property
    def groups(self) -> ParallelGroups:
        """The process groups given, else `megatron.core.parallel_state`'s, read at each call."""
        return self.policy.groups

    @property
    def model_forward(self) -> ModelForward:
        """How the model runs: `model_forward(model, batch) -> logits`."""
        return self.policy.model_forward

    @property
    def needs_old_log_probs(self) -> bool:
        """Decoupled mode: lp_old must be recomputed before the update (bypass/REINFORCE need no extra pass)."""
        return self.policy.needs_old_log_probs

    @property
    def needs_ref_log_probs(self) -> bool:
        """A KL term: the reference policy's log-probs are computed in the forward-only pass."""
        return self.policy.needs_ref_log_probs

    @property
    def budgeted(self) -> bool:
        """`--rs-divergence-budget` / `--tis-ess-target`: bounds set per optimizer step from its statistics."""
        return self.prepass.budgeted

    @property
    def measure_prox_error(self) -> bool:
        """Loglinear π_old: also recompute lp_old in this rollout and log the approximation's error."""
        return self.policy.measure_prox_error

    @measure_prox_error.setter
    def measure_prox_error(self, value: bool) -> None:
        self.policy.measure_prox_error = value

    @property
    def step_batch_norm_mean(self) -> Tensor | None:
        """The step's `--tis-batch-normalize` mean, set by `prepare_step` (None: each micro-batch's own)."""
        return self.prepass.step_batch_norm_mean

    # ------------------------------------------------------------------ the parts' calls
    def log_probs(self, logits: Tensor, labels: Tensor, with_entropy: bool | None = None
                  ) -> tuple[Tensor, Tensor | None]:
        """(log π(labels), entropy or None) from vocab-parallel logits: `PolicyLogProbs.log_probs`."""
        return self.policy.log_probs(logits, labels, with_entropy)

    def compute_old_log_probs(self, model: torch.nn.Module, micro_batches: Sequence[dict[str, Tensor]]) -> list[Tensor]:
        """Decoupled mode: lp_old of every micro-batch, stored in it: `PolicyLogProbs.compute_old_log_probs`."""
        return self.policy.compute_old_log_probs(model, micro_batches)

    def prepare_rollout(self, model: torch.nn.Module, micro_batches: Sequence[dict[str, Tensor]]) -> None:
        """Before a rollout's first update, the forward-only passes for lp_old and the reference's log-probs:
        `PolicyLogProbs.prepare_rollout`."""
        self.policy.prepare_rollout(model, micro_batches)

    def prepare_step(self, model: torch.nn.Module, micro_batches: Sequence[dict[str, Tensor]], *,
                     recompute_old_log_probs: bool = True) -> None:
        """Before a step's training pass: its log-probs, normalization mean and budgeted bounds:
        `StepPrepass.prepare_step`."""
        self.prepass.prepare_step(model, micro_batches, recompute_old_log_probs=recompute_old_log_probs)

    def kept_sequences(self, batch: dict[str, Tensor]) -> Tensor:
        """[n] bool: the sequences of a prepared micro-batch that keep a token in the loss:
        `StepPrepass.kept_sequences`."""
        return self.prepass.kept_sequences(batch)

    def set_step_bounds(self, micro_batches: Sequence[dict[str, Tensor]]) -> None:
        """Decoupled mode: the step's budgeted bounds, stored in each micro-batch: `StepPrepass.set_step_bounds`."""
        self.prepass.set_step_bounds(micro_batches)

    def can_stream(self, num_micro_batches: int) -> bool:
        """Whether `train_step` can read the micro-batches once, as a stream: `StepPrepass.can_stream`."""
        return self.prepass.can_stream(num_micro_batches)

    # ------------------------------------------------------------------ Megatron hooks
    def forward_step(self, data_iterator: Iterator[dict[str, Tensor]], model: torch.nn.Module):
        """Megatron `forward_step_func`: run the model on the next micro-batch, return (logits, loss_func)."""
        check_model_config(model)
        batch = self.next_micro_batch(data_iterator, model)
        logits = self.model_forward(model, batch)
        if TRAINER_ROUTES_KEY in batch and self.groups.pp_size > 1:
            self._stage_routed.append(batch)
        return logits, partial(self.loss_func, batch)

    def next_micro_batch(self, data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module) -> dict[str, Any]:
        """`next(data_iterator)` for a forward_step: at the first micro-batch of a `RolloutStepIterator` step,
        prepare the step before the model runs on it (lp_old for a new rollout in decoupled mode, the step's
        normalization mean) and finalize the previous step's correction metrics."""
        batch = next(data_iterator)
        step = pop_step(batch)
        if step is None:
            pass
        elif step.prepared:  # Megatron's rerun machine replays the step, from copies taken as it was first read
            self.step_stats.reset()  # the first attempt's statistics are void
            first = step.micro_batches[0]
            renormalized = RENORMALIZED_KEYS if UNTRUNCATED_ROLLOUT in first else ()
            for key, value in first.items():  # lp_old (and the truncation's keys), set after that copy was taken
                if key not in batch or key in renormalized:
                    batch[key] = value
        else:
            self._start_step(step, model)
        return batch

    def _start_step(self, step: RolloutStep, model: torch.nn.Module) -> None:
        """A `RolloutStepIterator` step read from inside Megatron's schedule: refused under PP when it needs a pass
        first; else the previous step's metrics finalized, lp_old for a new rollout, the step's pre-pass."""
        self.prepass.check_inside_schedule(step)
        if not self.step_stats.empty:
            self.last_step_metrics = self.pop_step_metrics()
            if self.on_step_metrics is not None:
                self.on_step_metrics(self.last_step_metrics)
        rollout = step.rollout
        if not rollout.old_log_probs_ready:
            self.policy.prepare_rollout(model, rollout.micro_batches)
            rollout.old_log_probs_ready = True
        self.prepass.prepare_step(model, step.micro_batches, recompute_old_log_probs=False)
        step.prepared = True

    def loss_func(
        self, batch: dict[str, Tensor], logits: Tensor, model: Any = None
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Megatron `loss_func`: (local loss_sum with grad, local count as int tensor, report).

        `model` (optional, as Megatron-LM's pretrain_gpt passes it) lets the per-token-loss setting be checked
        from its config; else Megatron-LM's arguments are checked when set. The report is Megatron's
        `{key: tensor([numerator, denominator])}` (see the module doc).
        """

        if model is not None:
            check_model_config(model)
        elif (args := megatron_lm_args()) is not None:
            check_per_token_loss(getattr(args, "calculate_per_token_loss", None), "Megatron-LM's arguments")
        cfg = self.config
        policy = self.policy
        groups = policy.groups
        nucleus = kl_log_probs = None
        replay = has_kept_sets(batch)
        if replay:  # the engine's kept sets: the policy term over them, the KL / entropy over the full distribution
            check_trained_tokens_have_kept_sets(batch)
            replayed = policy.replayed(logits, batch, policy.compute_entropy, full_grad=self.needs_ref_log_probs,
                                       trainer_nucleus=not self.needs_old_log_probs)
            nucleus = replayed.nucleus
            log_probs, entropy = nucleus.log_probs, nucleus.entropy
            kl_log_probs = replayed.full_log_probs if self.needs_ref_log_probs else None
            if not self.needs_old_log_probs:  # bypass: renormalized with the policy being trained
                renormalize_batch(batch, nucleus)
                store_replay_metrics(batch, replayed)
        elif policy.truncation.active:
            nucleus = policy.nucleus(logits, batch["labels"], policy.compute_entropy)
            log_probs, entropy = nucleus.log_probs, nucleus.entropy
            if not self.needs_old_log_probs:  # bypass: renormalized to the nucleus of the policy being trained
                renormalize_batch(batch, nucleus)
        else:
            log_probs, entropy = policy.log_probs(logits, batch["labels"])
        old = None
        if self.needs_old_log_probs:
            old = batch.get("old_log_probs")
            if policy.prox_logp_method == "loglinear":
                old = policy.loglinear_old(batch, log_probs, old)
            if old is None:
                raise KeyError(
                    "decoupled mode needs batch['old_log_probs']: read the micro-batches of a RolloutStepIterator "
                    "with hook.next_micro_batch(data_iterator, model), or call RolloutCorrectionLoss."
                    "compute_old_log_probs(model, micro_batches) before the training pass, or set "
                    "--use-rollout-logprobs (bypass)."
                )
        ref = batch.get("ref_log_probs")
        if self.needs_ref_log_probs and ref is None:
            raise KeyError(
                "the KL loss needs batch['ref_log_probs']: read the micro-batches of a RolloutStepIterator with "
                "hook.next_micro_batch(data_iterator, model), or call hook.prepare_rollout(model, micro_batches) "
                "before the training pass."
            )
        loss_mask = batch["loss_mask"]
        segments = batch_segments(batch, groups)
        precomputed = batch.get(PRECOMPUTED_CORRECTION)
        out = compute_policy_loss(
            log_probs,
            old,
            batch["rollout_log_probs"].to(log_probs.dtype),
            batch["advantages"].to(log_probs.dtype),
            loss_mask,
            cfg,
            cp_group=groups.cp,
            dp_group=groups.dp,
            seq_length_for_norm=self._seq_length_for_norm(batch, groups),
            batch_norm_mean=self.prepass.step_batch_norm_mean if precomputed is None else None,
            correction=precomputed,
            step_bounds=batch.get(STEP_BOUNDS) if precomputed is None else None,
            finalize_metrics=False,  # the step's metrics are finalized once, from the merged statistics
            segments=segments,
            loss_terms=policy.loss_terms,
            ref_log_probs=ref,
            entropy=entropy,
            kl_log_probs=kl_log_probs,
        )
        if self.keep_outputs:
            self.outputs.append(out)
        corr = out.correction
        if torch.is_grad_enabled():  # training passes only, not evaluation
            self.step_stats.add_advantage_count(out.metrics[ADVANTAGE_COUNT])
            if corr is not None and corr.stats:
                self.step_stats.add(corr.stats, corr.function_metrics)
        if self.diagnostics is not None and torch.is_grad_enabled():
            lp = log_probs.detach()
            if nucleus is not None:  # a token that left the nucleus during the update: no drift term from it
                lp = torch.where(lp.isfinite(), lp, old if old is not None else batch["rollout_log_probs"].to(lp.dtype))
            self._add_diagnostics(batch, lp, old, groups)
        count = out.denominator.detach().round().to(torch.int)
        report = build_report(out, cfg, groups, loss_mask, entropy, batch, segments)
        if nucleus is not None:
            report.update(nucleus_report(batch, old if old is not None else log_probs))
        if replay:
            report.update(kept_set_report(batch, policy.truncation.active))
        report.update(routing_report(batch, log_probs, groups))  # MoE: trainer vs engine routes ({} otherwise)
        return guard_loss(out.loss_sum), count, report

    def _seq_length_for_norm(self, batch: dict[str, Tensor], groups: ParallelGroups) -> int | None:
        if self.seq_length_for_norm is not None or is_packed(batch):
            return self.seq_length_for_norm  # a packed row has no padded length: the core asks for it if needed
        return seq_length_for_norm(batch["labels"].shape[-1], groups.cp_size)

    def _add_diagnostics(self, batch: dict[str, Tensor], log_probs: Tensor, old: Tensor | None,
                         groups: ParallelGroups) -> None:
        """The micro-batch's diagnostic sums from what `loss_func` computed (decoupled: lp_train = lp_old and the
        drift split old -> current; bypass: lp_train = lp). A packed row is first laid out as one row per sequence
        (`Segments.to_rows`): the diagnostics' per-sequence table and response positions are per row."""
        seg = batch_segments(batch, groups)
        rows = seg.to_rows if seg is not None else (lambda x: x)
        lp = rows(log_probs)
        mask = rows(batch["loss_mask"])
        lag = batch.get("weight_lag")
        position_ids = batch.get("position_ids")
        self.diagnostics.add(  # type: ignore[union-attr]
            rows(old) if old is not None else lp, rows(batch["rollout_log_probs"].to(log_probs.dtype)), mask,
            lp_current=lp if old is not None else None,
            positions=response_positions(mask, None if position_ids is None else rows(position_ids), groups.cp),
            weight_lag=None if lag is None else rows(lag), sample_ids=batch.get("sample_ids"),
        )

    # ------------------------------------------------------------------ step-level
    def pop_diagnostics(self) -> DiagnosticsResult:
        """The step's diagnostics (collectives over DP×CP: call it on every rank, once per step), also kept in
        `last_diagnostics`; empty when `diagnostics_top_k` is None."""
        if self.diagnostics is not None:
            groups = self.groups
            self.last_diagnostics = self.diagnostics.reduce(groups.cp, groups.dp)
        return self.last_diagnostics

    def pop_step_metrics(self) -> dict[str, float]:
        """Every correction metric of the training micro-batches since the last call (the step), exact as if the
        step were one batch — the ratios Megatron logs and the others (min/max, std, quantiles, ESS, counts) —
        plus a custom weighting function's metrics (mean over micro-batches); one host transfer, no collective."""
        return metrics_to_host(self.step_stats.pop(self.config), self.config)

    def reduce_step_metrics(self, losses_reduced: Sequence[dict[str, Tensor]]) -> dict[str, float]:
        """Step metrics from the schedule's per-micro-batch reports (and the step's correction statistics), on the
        host, in one transfer: the reports reduced as Megatron-LM's `train_step` does (ONE all-reduce over DP×CP),
        `loss` (= `pg_loss`), `loss_denominator`, `pg_nonfinite_token_count`, and `pop_step_metrics()`. A ratio
        whose denominator is 0 over the whole step (no token it is measured on, e.g. no token on the nucleus's
        engine path) is undefined: absent, not NaN."""
        if not losses_reduced:
            return {}
        totals = reduce_reports(losses_reduced, self.groups)
        ratios = [k for k, v in totals.items() if v.numel() == 2 and k != "pg_loss"]
        undefined = set()
        if ratios:  # one small transfer: which denominators are 0
            zero = torch.stack([totals[k][1] for k in ratios]).eq(0).tolist()
            undefined = {k for k, z in zip(ratios, zero, strict=True) if z}
        out = {k: v[0] / v[1] if v.numel() == 2 else v for k, v in totals.items()}
        out["loss"] = out["pg_loss"]
        out["loss_denominator"] = totals["pg_loss"][1].round()  # counts are integers; 0 was clamped to 1e-30
        out.update(self.policy.pop_prox_error(out["loss"]))
        out.update(self.step_stats.pop(self.config))
        for count, fraction in COUNT_FRACTIONS.items():  # over DP×CP (the step statistics' counts are this rank's)
            if fraction in totals:
                out[count] = totals[fraction][0]
        self.pop_diagnostics()
        return {k: v for k, v in metrics_to_host(out, self.config).items() if k not in undefined}

    def train_step(
        self,
        model: torch.nn.Module,
        micro_batches: MicroBatches,
        *,
        forward_backward_func: Callable[..., Any] | None = None,
        recompute_old_log_probs: bool = True,
        forward_step: Callable[..., Any] | None = None,
    ) -> dict[str, float]:
        """One step's forward+backward over `micro_batches` (gradients accumulated and finalized by Megatron).

        `prepare_step` first (lp_old in decoupled mode unless `recompute_old_log_probs` is False, the step's
        normalization mean), then the training pass. The caller zeroes grads before, steps after.
        `micro_batches` may be a stream with `len()` (e.g. `BufferMicroBatchIterator`) when `can_stream`: the
        schedule then trains each micro-batch as soon as the rollout has filled it. Under pipeline parallelism the
        step's metrics come back on the last stage; the other stages get {}. `forward_step`: the schedule's
        `forward_step_func` (default `self.forward_step`; e.g. a wrapper that times it).
        """
        streamed = not isinstance(micro_batches, Sequence)
        if streamed and not self.can_stream(len(micro_batches)):  # type: ignore[arg-type]
            raise ValueError(
                "micro_batches: a stream is read once, but decoupled mode (lp_old recompute), "
                "--tis-batch-normalize and --rs-divergence-budget / --tis-ess-target over several micro-batches "
                "need a pass over all of them first; pass a list (e.g. list(stream))."
            )
        check_model_config(model)
        self.step_stats.reset()
        if self.diagnostics is not None:
            self.diagnostics.parts.clear()
        if not streamed:
            self.prepare_step(model, micro_batches,  # type: ignore[arg-type]
                              recompute_old_log_probs=recompute_old_log_probs)
        try:
            fb = forward_backward_func or get_forward_backward_func()
            losses = run_schedule(fb, forward_step or self.forward_step, model, micro_batches, self.groups,
                                  forward_only=False)
            if self._stage_routed:
                stage_routing_reports(self._stage_routed, losses, self.groups)
        finally:
            self.prepass.step_batch_norm_mean = None
            self._stage_routed.clear()
        return self.reduce_step_metrics(losses)


def build_forward_step(config: RolloutCorrectionConfig, **kwargs: Any) -> Callable[..., Any]:
    """`forward_step(data_iterator, model)` for `get_forward_backward_func()`, from a config (see the class)."""
    return RolloutCorrectionLoss(config, **kwargs).forward_step


__all__ = [
    "RolloutCorrectionLoss",
    "build_forward_step",
    "check_model_config",
    "default_model_forward",
]
