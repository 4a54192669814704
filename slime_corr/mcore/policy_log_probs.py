"""How `RolloutCorrectionLoss` (slime_corr.mcore.loss_hook) gets the policy's log-probs: from a forward's logits
(`log_probs`), by forward-only passes before a rollout's first update, or by decoupled mode's log-linear π_old.

`log_probs` takes log π = log_softmax(logits / T) from vocab-parallel logits (`mcore.logprobs`), under the
rollout's top-p / top-k when active (`mcore.nucleus`: −inf outside the nucleus).

Decoupled mode recomputes lp_old with a forward-only pass over the rollout's micro-batches (`compute_old_log_probs`,
stored as `batch["old_log_probs"]`); a KL term's reference log-probs (`batch["ref_log_probs"]`) come from the same
kind of pass with `ref_model`; `prepare_rollout` runs both. Under PP the passes run through Megatron's pipelined
schedule (`slime_corr.mcore.pipeline.forward_only`) and the log-probs are stored on the last stage only. Under an
active truncation the policy's own pass also renormalizes the rollout log-probs to its nucleus
(`nucleus.renormalize_batch`). A micro-batch that carries the engine's kept sets (`layout.kept_sets`) is replayed
instead (`nucleus.replayed_log_probs`): the policy term's log-probs over those sets, whatever the truncation, and
the reference's log-probs (KL term) over the full distribution.

`--prox-logp-method loglinear` replaces the pass by AReaL's log-linear interpolation (`loglinear_old`, called by
`loss_func`); a rollout with `measure_prox_error` set recomputes lp_old too and the step logs the approximation's
error (`pop_prox_error`, called by `reduce_step_metrics`).

`RolloutCorrectionLoss` holds one `PolicyLogProbs` as `hook.policy`, built from the hook's arguments; it also works
alone (a config, the process groups and a `model_forward`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction.proximal import check_prox_logp_method, loglinear_prox_log_probs, prox_error_sums
from slime_corr.correction.reductions import active_groups
from slime_corr.layout.kept_sets import has_kept_sets
from slime_corr.loss_terms import LossTermsConfig
from slime_corr.mcore.context_parallel import ParallelGroups
from slime_corr.mcore.logprobs import DEFAULT_CHUNK_SIZE, vocab_parallel_log_probs
from slime_corr.mcore.nucleus import (
    NucleusLogProbs,
    ReplayedLogProbs,
    Truncation,
    nucleus_log_probs,
    renormalize_batch,
    replayed_log_probs,
    store_replay_metrics,
)
from slime_corr.mcore.pipeline import forward_only

ModelForward = Callable[[torch.nn.Module, dict[str, Tensor]], Tensor]


class PolicyLogProbs:
    """`log_probs`; lp_old and the reference log-probs by forward-only passes; the loglinear π_old (module doc).

    The arguments are `RolloutCorrectionLoss`'s of the same names (its docstring says what each means);
    `model_forward(model, batch) -> logits` runs the model (and `ref_model`) in the forward-only passes.
    """

    def __init__(
        self,
        config: RolloutCorrectionConfig,
        *,
        model_forward: ModelForward,
        groups: ParallelGroups | None = None,
        temperature: float = 1.0,
        truncation: Truncation | None = None,
        chunk_size: int | None = DEFAULT_CHUNK_SIZE,
        compute_entropy: bool = False,
        loss_terms: LossTermsConfig | None = None,
        ref_model: torch.nn.Module | None = None,
        prox_logp_method: str = "recompute",
        on_rollout_prepared: Callable[[Sequence[dict[str, Tensor]]], None] | None = None,
    ) -> None:
        self.config = config
        self.prox_logp_method = check_prox_logp_method(prox_logp_method, config,
                                                       truncation is not None and truncation.active)
        self.measure_prox_error = False  # loglinear: also recompute lp_old in this rollout and log the error
        self._prox_error: Tensor | None = None
        self.temperature = temperature
        self.truncation = truncation or Truncation()
        self.chunk_size = chunk_size
        self._groups = groups
        self.model_forward = model_forward
        self.loss_terms = loss_terms or LossTermsConfig()
        self.ref_model = ref_model
        self.compute_entropy = compute_entropy or self.loss_terms.uses_entropy
        self.on_rollout_prepared = on_rollout_prepared

    @property
    def groups(self) -> ParallelGroups:
        """The process groups given, else `megatron.core.parallel_state`'s, read at each call."""
        return self._groups if self._groups is not None else ParallelGroups.current()

    @property
    def needs_old_log_probs(self) -> bool:
        """Decoupled mode: lp_old must be recomputed before the update (bypass/REINFORCE need no extra pass)."""
        return not self.config.use_rollout_logprobs

    @property
    def needs_ref_log_probs(self) -> bool:
        """A KL term: the reference policy's log-probs are computed in the forward-only pass."""
        return self.loss_terms.uses_reference

    def log_probs(self, logits: Tensor, labels: Tensor, with_entropy: bool | None = None
                  ) -> tuple[Tensor, Tensor | None]:
        """(log π(labels), entropy or None) from vocab-parallel logits, with the rollout temperature (and under
        the truncation when active: −inf outside the nucleus; the entropy stays the untruncated one's).
        `with_entropy` defaults to `compute_entropy`; the entropy is differentiable only when the loss has an
        entropy term (`loss_terms.uses_entropy`): a logged-only entropy keeps nothing for backward."""
        entropy = self.compute_entropy if with_entropy is None else with_entropy
        if self.truncation.active:
            nucleus = self.nucleus(logits, labels, entropy)
            return nucleus.log_probs, nucleus.entropy
        out = vocab_parallel_log_probs(
            logits,
            labels,
            tp_group=self.groups.tp,
            temperature=self.temperature,
            chunk_size=self.chunk_size,
            with_entropy=entropy,
            entropy_grad=self.loss_terms.uses_entropy,
            backend=self.config.logprobs_backend,
        )
        if entropy:
            return out  # type: ignore[return-value]
        return out, None  # type: ignore[return-value]

    def nucleus(self, logits: Tensor, labels: Tensor, with_entropy: bool) -> NucleusLogProbs:
        """`nucleus.nucleus_log_probs` of the labels under the truncation, with the hook's settings."""
        return nucleus_log_probs(logits, labels, self.truncation, tp_group=self.groups.tp,
                                 temperature=self.temperature, chunk_size=self.chunk_size, with_entropy=with_entropy,
                                 entropy_grad=self.loss_terms.uses_entropy, backend=self.config.logprobs_backend)

    def replayed(self, logits: Tensor, batch: dict[str, Tensor], with_entropy: bool, full_grad: bool = False,
                 trainer_nucleus: bool = True) -> ReplayedLogProbs:
        """`nucleus.replayed_log_probs` of a micro-batch with kept sets, with the hook's settings (`full_grad`: the
        full distribution's log-probs differentiable, for a KL term; `trainer_nucleus`: the metric of the sampled
        tokens outside the trainer's own nucleus, one more pass, in the pass that renormalizes the batch)."""
        return replayed_log_probs(logits, batch, truncation=self.truncation if trainer_nucleus else None,
                                  tp_group=self.groups.tp,
                                  temperature=self.temperature, chunk_size=self.chunk_size, with_entropy=with_entropy,
                                  entropy_grad=self.loss_terms.uses_entropy, full_grad=full_grad,
                                  backend=self.config.logprobs_backend)

    def compute_old_log_probs(self, model: torch.nn.Module, micro_batches: Sequence[dict[str, Tensor]]) -> list[Tensor]:
        """Decoupled mode: log π_old for every micro-batch by a forward-only pass (no grad), stored in place
        as `batch["old_log_probs"]` (local slice, fp32) and returned. Under PP on the last stage only (the loss's
        stage; the others return [])."""
        outputs = self.forward_log_probs(model, micro_batches, renormalize=True)
        self._store(micro_batches, "old_log_probs", outputs)
        return outputs

    def _store(self, micro_batches: Sequence[dict[str, Tensor]], key: str, outputs: list[Tensor]) -> None:
        """`batch[key]` = each micro-batch's output of a forward-only pass (none off the last PP stage)."""
        if self.groups.pp_last:
            for batch, lp in zip(micro_batches, outputs, strict=True):
                batch[key] = lp

    def prepare_rollout(self, model: torch.nn.Module, micro_batches: Sequence[dict[str, Tensor]]) -> None:
        """Before a rollout's first update: the forward-only passes over its micro-batches that store lp_old
        (decoupled mode, `model`) and the reference policy's log-probs (KL term, `ref_model`) in each batch, then
        `on_rollout_prepared`. Under PP the log-probs are stored on the last stage only."""
        if self.needs_old_log_probs and (self.prox_logp_method == "recompute" or self.measure_prox_error):
            self.compute_old_log_probs(model, micro_batches)
        if self.needs_ref_log_probs:
            self._store(micro_batches, "ref_log_probs", self.forward_log_probs(self.ref_model, micro_batches))
        if self.on_rollout_prepared is not None:
            self.on_rollout_prepared(micro_batches)

    def forward_log_probs(self, model: Any, micro_batches: Sequence[dict[str, Tensor]], *,
                          renormalize: bool = False) -> list[Tensor]:
        """log π(labels) of `model`'s current weights for every micro-batch: a forward-only pass
        (`pipeline.forward_only`: one micro-batch at a time without PP, Megatron's pipelined schedule with it; [] off
        the last stage). Under an active truncation the log-probs are truncated; `renormalize` (the policy's own
        pass) also puts each micro-batch under this nucleus (`nucleus.renormalize_batch`) and returns finite
        log-probs. Micro-batches with kept sets are replayed (module doc): the policy's pass over them (and their
        metric parts kept in the batch), the reference's (`renormalize` False) over the full distribution."""
        replayed = [has_kept_sets(b) for b in micro_batches]
        if any(replayed):
            if not all(replayed):
                raise ValueError("rollout_kept_token_counts / rollout_kept_token_ids: some micro-batches of the "
                                 "rollout carry the engine's kept sets and others do not: every micro-batch must "
                                 "(build_micro_batch(..., kept_sets=True) gives an empty one the keys too)")
            if not renormalize:
                return forward_only(model, micro_batches, self.model_forward,
                                    lambda b, logits: self.replayed(logits, b, False, trainer_nucleus=False
                                                                    ).full_log_probs, self.groups)

            def replay(b: dict[str, Tensor], logits: Tensor) -> Tensor:
                r = self.replayed(logits, b, False)
                n = r.nucleus
                outside = n.in_nucleus if r.outside_nucleus is None else r.outside_nucleus
                return torch.stack([n.log_probs, n.log_mass, r.abs_diff_sum.to(n.log_probs.dtype),
                                    r.compared.to(n.log_probs.dtype), outside.to(n.log_probs.dtype)], -1)

            outputs = forward_only(model, micro_batches, self.model_forward, replay, self.groups)
            lps = []
            for b, o in zip(micro_batches if outputs else [], outputs, strict=True):  # ([] off the last PP stage)
                nucleus = NucleusLogProbs(o[..., 0], o[..., 1], torch.ones_like(o[..., 0], dtype=torch.bool), None)
                outside = o[..., 4] > 0 if self.truncation.active else None
                store_replay_metrics(b, ReplayedLogProbs(nucleus, o[..., 0], o[..., 2], o[..., 3], outside))
                lps.append(renormalize_batch(b, nucleus))
            return lps
        if not self.truncation.active:
            return forward_only(model, micro_batches, self.model_forward,
                                lambda b, logits: self.log_probs(logits, b["labels"], with_entropy=False)[0],
                                self.groups)

        def collect(b: dict[str, Tensor], logits: Tensor) -> Tensor:
            n = self.nucleus(logits, b["labels"], False)
            return torch.stack([n.log_probs, n.log_mass, n.in_nucleus.to(n.log_probs.dtype)], -1)

        outputs = forward_only(model, micro_batches, self.model_forward, collect, self.groups)
        if not renormalize or not outputs:  # ([] off the last PP stage)
            return [o[..., 0] for o in outputs]
        return [renormalize_batch(b, NucleusLogProbs(o[..., 0], o[..., 1], o[..., 2] > 0, None))
                for b, o in zip(micro_batches, outputs, strict=True)]

    def loglinear_old(self, batch: dict[str, Tensor], log_probs: Tensor, recomputed: Tensor | None) -> Tensor:
        """lp_old by AReaL's log-linear interpolation; its error against `recomputed` (when this rollout measures
        it) accumulated for the step."""
        for key in ("weight_lag", "prox_lag"):
            if key not in batch:
                raise KeyError(f"--prox-logp-method loglinear needs batch[{key!r}] (the trainer's micro-batches carry "
                               "it: slime_corr.trainer.data.build_micro_batches); or use recompute.")
        approx = loglinear_prox_log_probs(batch["rollout_log_probs"], log_probs, batch["weight_lag"],
                                          batch["prox_lag"])
        if recomputed is not None and torch.is_grad_enabled():
            sums = prox_error_sums(approx, recomputed, batch["loss_mask"])
            self._prox_error = sums if self._prox_error is None else torch.stack(
                [self._prox_error[0] + sums[0], self._prox_error[1] + sums[1], self._prox_error[2].max(sums[2])])
        return approx

    def pop_prox_error(self, like: Tensor) -> dict[str, Tensor]:
        """The step's loglinear-vs-recompute error over DP×CP (collective when measured: same on every rank)."""
        if self.prox_logp_method != "loglinear" or not self.measure_prox_error:
            return {}
        sums = self._prox_error if self._prox_error is not None else torch.zeros(3, dtype=torch.float64,
                                                                                 device=like.device)
        self._prox_error = None
        total, top = sums[:2].clone(), sums[2:].clone()
        for group in active_groups(self.groups.cp, self.groups.dp):
            torch.distributed.all_reduce(total, group=group)
            torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
        return {"prox_logp_abs_error_mean": total[0] / total[1].clamp(min=1.0), "prox_logp_abs_error_max": top[0]}
