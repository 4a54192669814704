"""The rollout-correction loss in Megatron's schedule convention (`get_forward_backward_func`).

    hook = RolloutCorrectionLoss(config, temperature=rollout_temperature)
    model_config.calculate_per_token_loss = True          # required, see below
    model_config.finalize_model_grads_func = finalize_model_grads
    metrics = hook.train_step(model, micro_batches)       # decoupled recompute (if needed) + fwd/bwd
    optimizer.step()

or, inside an existing training loop, call `hook.prepare_step(model, micro_batches)` before the schedule (it
recomputes lp_old in decoupled mode and the step's `--tis-batch-normalize` mean), pass `hook.forward_step` as
`forward_step_func`, and `hook.reduce_step_metrics(...)` on what the schedule returns.

Modes (from the config): decoupled (default; lp_old recomputed by a forward-only pass before the update and
stored as `batch["old_log_probs"]`), bypass (`use_rollout_logprobs`: lp_old := lp_rollout, no extra forward),
REINFORCE (`loss_type="reinforce"`, bypass only).

Normalization. `loss_func` returns Megatron's per-token triple `(loss_sum, count, reduced)` where `count` is the
core's local denominator (valid tokens for token-mean, valid sequences counted once across CP for seq-mean-*).
With `calculate_per_token_loss=True` Megatron sums the counts over micro-batches, all-reduces them over DP×CP
and divides the summed gradients by that total, so the gradient is

    ∇ Σ_{ranks, micro-batches} loss_sum / Σ_{ranks, micro-batches} count

— the single-rank full-batch value for any (TP, CP, DP) factorization, even when CP ranks hold different
numbers of valid tokens (a per-rank mean, `calculate_per_token_loss=False`, would not be).

Several micro-batches per step. Every batch quantity is over the whole step, across DP×CP: the loss and its
gradient (above); the `--tis-batch-normalize` mean, from a pre-pass over the step's micro-batches in
`prepare_step` (decoupled mode reuses the recomputed lp_old; bypass mode, which has no lp_old, pays one
forward-only pass, and only when normalization is on with more than one micro-batch); and the correction metrics,
finalized once from the micro-batches' summed statistics (`merge_stats`). Only the extra metrics of a custom
weighting function are averaged over micro-batches with equal weight.
Micro-batches are padded [B, S] (one sequence per row); packed batches are rejected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import (
    compute_rollout_correction,
    correction_metrics,
    merge_stats,
    metrics_to_host,
    weight_mean,
)
from slime_corr.mcore.context_parallel import ParallelGroups, all_reduce_dp_cp, seq_length_for_norm
from slime_corr.mcore.logprobs import DEFAULT_CHUNK_SIZE, vocab_parallel_log_probs

ModelForward = Callable[[torch.nn.Module, dict[str, Tensor]], Tensor]


def default_model_forward(model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Logits [B, S, V/TP] of a Megatron GPTModel for this rank's (CP-sliced) micro-batch."""
    return model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=batch.get("attention_mask"),
    )


def _get_forward_backward_func() -> Callable[..., Any]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()


MicroBatches = Sequence[dict[str, Tensor]] | Iterator[dict[str, Tensor]]  # a stream must also have len()


def _run_schedule(
    fb: Callable[..., Any],
    forward_step: Callable[..., Any],
    model: torch.nn.Module,
    micro_batches: MicroBatches,
    **kwargs: Any,
) -> Any:
    """Run Megatron's schedule `fb` over `micro_batches`: a list, or a stream with `len()` (e.g. a
    `BufferMicroBatchIterator`) that the schedule reads one micro-batch per forward step."""
    if isinstance(micro_batches, Sequence):
        b, s = micro_batches[0]["labels"].shape
        data = iter(micro_batches)
    else:  # shapes are not known ahead of a stream; the schedule without pipelining does not use them
        (b, s), data = (0, 0), micro_batches
    return fb(
        forward_step_func=forward_step,
        data_iterator=data,
        model=model,
        num_microbatches=len(micro_batches),  # type: ignore[arg-type]
        seq_length=s,
        micro_batch_size=b,
        **kwargs,
    )


def check_model_config(model: torch.nn.Module) -> None:
    """Fail early if the model config would normalize the loss per rank (wrong gradients under CP)."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    if not getattr(config, "calculate_per_token_loss", False):
        raise ValueError(
            "RolloutCorrectionLoss needs the model's TransformerConfig.calculate_per_token_loss=True: the loss "
            "is returned as (loss_sum, count) and Megatron must divide by the global DP×CP count "
            "(a per-rank mean gives wrong gradients when CP ranks hold different token counts)."
        )


class RolloutCorrectionLoss:
    """`forward_step` / `loss_func` for Megatron's schedules, built from a `RolloutCorrectionConfig`.

    `groups`: explicit process groups; by default read from `megatron.core.parallel_state` at each call.
    `model_forward(model, batch) -> logits`: how to run the model (default: GPTModel on tokens/position_ids).
    `temperature`: the rollout sampling temperature (log π = log_softmax(logits / T), as SGLang reports).
    `chunk_size`: tokens per log-prob chunk (bounds the fp32 [chunk, V/TP] temporaries).
    `compute_entropy`: also log the token-mean entropy of π_θ.
    `keep_outputs`: keep each micro-batch's `PolicyLossOutput` in `self.outputs` (debugging, tests).
    """

    def __init__(
        self,
        config: RolloutCorrectionConfig,
        *,
        temperature: float = 1.0,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        groups: ParallelGroups | None = None,
        model_forward: ModelForward = default_model_forward,
        compute_entropy: bool = False,
        keep_outputs: bool = False,
    ) -> None:
        self.config = config
        self.temperature = temperature
        self.chunk_size = chunk_size
        self._groups = groups
        self.model_forward = model_forward
        self.compute_entropy = compute_entropy
        self.keep_outputs = keep_outputs
        self.outputs: list[Any] = []
        self.step_batch_norm_mean: Tensor | None = None  # set by `prepare_step`, cleared by `train_step`

    # ------------------------------------------------------------------ properties
    @property
    def groups(self) -> ParallelGroups:
        return self._groups if self._groups is not None else ParallelGroups.current()

    @property
    def needs_old_log_probs(self) -> bool:
        """Decoupled mode: lp_old must be recomputed before the update (bypass/REINFORCE need no extra pass)."""
        return not self.config.use_rollout_logprobs

    # ------------------------------------------------------------------ log-probs
    def log_probs(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor | None]:
        """(log π(labels), entropy or None) from vocab-parallel logits, with the rollout temperature."""
        out = vocab_parallel_log_probs(
            logits,
            labels,
            tp_group=self.groups.tp,
            temperature=self.temperature,
            chunk_size=self.chunk_size,
            with_entropy=self.compute_entropy,
        )
        if self.compute_entropy:
            return out  # type: ignore[return-value]
        return out, None  # type: ignore[return-value]

    # ------------------------------------------------------------------ Megatron hooks
    def forward_step(self, data_iterator: Iterator[dict[str, Tensor]], model: torch.nn.Module):
        """Megatron `forward_step_func`: run the model on the next micro-batch, return (logits, loss_func)."""
        batch = next(data_iterator)
        logits = self.model_forward(model, batch)
        return logits, partial(self.loss_func, batch)

    def loss_func(self, batch: dict[str, Tensor], logits: Tensor) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """Megatron `loss_func`: (local loss_sum with grad, local count as int tensor, reduced data).

        The reduced data holds the core's statistics (already reduced over DP×CP for this micro-batch), a custom
        weighting function's metrics, and the local numerators that `reduce_step_metrics` reduces once per step.
        """
        from slime_corr.losses import compute_policy_loss

        if "cu_seqlens" in batch:
            raise ValueError(
                "RolloutCorrectionLoss needs padded [B, S] micro-batches (one sequence per row): sequence-level "
                "sums are taken per row, so packed batches (cu_seqlens) would mix sequences."
            )
        cfg = self.config
        groups = self.groups
        log_probs, entropy = self.log_probs(logits, batch["labels"])
        old = None
        if self.needs_old_log_probs:
            old = batch.get("old_log_probs")
            if old is None:
                raise KeyError(
                    "decoupled mode needs batch['old_log_probs']: call RolloutCorrectionLoss.compute_old_log_probs"
                    "(model, micro_batches) before the training pass, or set --use-rollout-logprobs (bypass)."
                )
        loss_mask = batch["loss_mask"]
        out = compute_policy_loss(
            log_probs,
            old,
            batch["rollout_log_probs"].to(log_probs.dtype),
            batch["advantages"].to(log_probs.dtype),
            loss_mask,
            cfg,
            cp_group=groups.cp,
            dp_group=groups.dp,
            seq_length_for_norm=seq_length_for_norm(log_probs.shape[-1], groups.cp_size),
            batch_norm_mean=self.step_batch_norm_mean,
        )
        if self.keep_outputs:
            self.outputs.append(out)
        count = out.denominator.detach().round().to(torch.int)
        corr = out.correction
        reduced = {
            "stats": dict(corr.stats) if corr is not None else {},  # already reduced over DP×CP
            "function": {k: v.detach() for k, v in corr.function_metrics.items()} if corr is not None else {},
            "local": self._local_numerators(out, loss_mask, log_probs, entropy),
        }
        return out.loss_sum, count, reduced

    def _local_numerators(self, out: Any, loss_mask: Tensor, log_probs: Tensor, entropy: Tensor | None) -> dict:
        """This rank's sums for the loss-level metrics the core leaves local (weighted by token counts)."""
        corr = out.correction
        if corr is not None and self.config.use_rollout_correction:
            used = corr.loss_mask > 0
        else:
            used = loss_mask > 0
        nonfinite = out.metrics.get("pg_nonfinite_token_count", torch.zeros((), dtype=torch.float64))
        tokens = used.sum().to(torch.float64) - nonfinite.to(torch.float64)
        sums: dict[str, Tensor] = {
            "loss_sum": out.loss_sum.detach().to(torch.float64),
            "denominator": out.denominator.detach().to(torch.float64),
            "tokens": tokens,
        }
        skip = set(corr.metrics) if corr is not None else set()
        skip.add("pg_loss")
        for key, value in out.metrics.items():
            if key in skip:
                continue
            v = value.detach().to(torch.float64)
            sums[key] = v if key.endswith("_count") else v * tokens
        if entropy is not None:
            valid = loss_mask > 0
            sums["entropy"] = torch.where(valid, entropy.detach(), 0).sum().to(torch.float64)
            sums["entropy_tokens"] = valid.sum().to(torch.float64)
        return sums

    # ------------------------------------------------------------------ step-level
    def reduce_step_metrics(self, losses_reduced: Sequence[dict[str, Any]]) -> dict[str, float]:
        """Combine the schedule's per-micro-batch outputs into step metrics, on the host, in one transfer.

        - `loss` (= `pg_loss`): Σ loss_sum / Σ count over micro-batches and DP×CP (one all-reduce per step);
        - loss-level metrics (`pg_clipfrac`, `ppo_kl`, ...): token-weighted means; `*_count`: sums;
        - correction metrics: finalized from the micro-batches' merged statistics, i.e. over the whole step;
        - a custom weighting function's metrics: equal-weight mean over micro-batches.
        """
        if not losses_reduced:
            return {}
        local_keys = sorted(set().union(*(r["local"] for r in losses_reduced)))
        local = torch.stack(
            [sum((r["local"].get(k, torch.zeros((), dtype=torch.float64)) for r in losses_reduced),
                 torch.zeros((), dtype=torch.float64)) for k in local_keys]
        )
        all_reduce_dp_cp(local, self.groups)
        tot = dict(zip(local_keys, local.unbind(0), strict=True))
        out: dict[str, Tensor] = {}
        out["loss"] = tot["loss_sum"] / tot["denominator"].clamp_min(1)
        out["pg_loss"] = out["loss"]
        out["loss_denominator"] = tot["denominator"]
        for key in local_keys:
            if key in ("loss_sum", "denominator", "tokens", "entropy_tokens"):
                continue
            if key == "entropy":
                out[key] = tot[key] / tot["entropy_tokens"].clamp_min(1)
            elif key.endswith("_count"):
                out[key] = tot[key]
            else:
                out[key] = tot[key] / tot["tokens"].clamp_min(1)
        stats = [r["stats"] for r in losses_reduced if r["stats"]]
        if stats:
            out.update(correction_metrics(merge_stats(stats), self.config))
        for key in sorted(set().union(*(r["function"] for r in losses_reduced))):
            values = [r["function"][key].to(torch.float64) for r in losses_reduced if key in r["function"]]
            out[key] = torch.stack(values).mean()
        return metrics_to_host(out)

    def compute_old_log_probs(
        self,
        model: torch.nn.Module,
        micro_batches: Sequence[dict[str, Tensor]],
        *,
        forward_backward_func: Callable[..., Any] | None = None,
    ) -> list[Tensor]:
        """Decoupled mode: log π_old for every micro-batch by a forward-only pass (no grad), stored in place
        as `batch["old_log_probs"]` ([B, S] local slice, fp32) and returned."""
        outputs = self._forward_log_probs(model, micro_batches, forward_backward_func)
        for batch, lp in zip(micro_batches, outputs, strict=True):
            batch["old_log_probs"] = lp
        return outputs

    def _forward_log_probs(
        self, model: torch.nn.Module, micro_batches: Sequence[dict[str, Tensor]], fb: Callable[..., Any] | None
    ) -> list[Tensor]:
        """log π(labels) of the current weights for every micro-batch: a forward-only pass through Megatron."""

        def forward_step(data_iterator: Iterator[dict[str, Tensor]], model: torch.nn.Module):
            batch = next(data_iterator)
            logits = self.model_forward(model, batch)

            def collect(output: Tensor, non_loss_data: bool = False) -> Tensor:
                return self.log_probs(output, batch["labels"])[0].detach()

            return logits, collect

        with torch.no_grad():
            outputs = _run_schedule(fb or _get_forward_backward_func(), forward_step, model, micro_batches,
                                    forward_only=True, collect_non_loss_data=True)
        return list(outputs)

    def prepare_step(
        self,
        model: torch.nn.Module,
        micro_batches: Sequence[dict[str, Tensor]],
        *,
        forward_backward_func: Callable[..., Any] | None = None,
        recompute_old_log_probs: bool = True,
    ) -> None:
        """Before a step's training pass: lp_old by a forward-only pass (decoupled mode, unless
        `recompute_old_log_probs` is False and the batches carry it), then `step_batch_norm_mean`.

        With `--tis-batch-normalize` and more than one micro-batch, the weights of every micro-batch are divided
        by their mean over the WHOLE step: a pre-pass computes each micro-batch's weight statistics from lp_train
        (lp_old; in bypass mode the log-probs of a forward-only pass, equal to what the training pass sees).
        """
        if self.needs_old_log_probs and recompute_old_log_probs:
            self.compute_old_log_probs(model, micro_batches, forward_backward_func=forward_backward_func)
        self.step_batch_norm_mean = None
        if not self._needs_step_mean(len(micro_batches)):
            return
        if self.needs_old_log_probs:
            train_log_probs = [b["old_log_probs"] for b in micro_batches]
        else:
            train_log_probs = self._forward_log_probs(model, micro_batches, forward_backward_func)
        groups = self.groups
        stats = [
            compute_rollout_correction(lp, b["rollout_log_probs"].to(lp.dtype), b["loss_mask"], self.config,
                                       cp_group=groups.cp, dp_group=groups.dp).stats
            for lp, b in zip(train_log_probs, micro_batches, strict=True)
        ]
        self.step_batch_norm_mean = weight_mean(merge_stats(stats))

    def _needs_step_mean(self, num_micro_batches: int) -> bool:
        return self.config.use_tis and self.config.tis_batch_normalize and num_micro_batches > 1

    def can_stream(self, num_micro_batches: int) -> bool:
        """Whether `train_step` can read the micro-batches once, as a stream: no lp_old recompute (bypass) and
        no step-wide normalization mean, which both need a pass over every micro-batch first."""
        return not self.needs_old_log_probs and not self._needs_step_mean(num_micro_batches)

    def train_step(
        self,
        model: torch.nn.Module,
        micro_batches: MicroBatches,
        *,
        forward_backward_func: Callable[..., Any] | None = None,
        recompute_old_log_probs: bool = True,
    ) -> dict[str, float]:
        """One step's forward+backward over `micro_batches` (gradients accumulated and finalized by Megatron).

        `prepare_step` first (lp_old in decoupled mode unless `recompute_old_log_probs` is False, the step's
        normalization mean), then the training pass. The caller zeroes grads before, steps after.
        `micro_batches` may be a stream with `len()` (e.g. `BufferMicroBatchIterator`) when `can_stream`: the
        schedule then trains each micro-batch as soon as the rollout has filled it.
        """
        streamed = not isinstance(micro_batches, Sequence)
        if streamed and not self.can_stream(len(micro_batches)):  # type: ignore[arg-type]
            raise ValueError(
                "micro_batches: a stream is read once, but decoupled mode (lp_old recompute) and "
                "--tis-batch-normalize over several micro-batches need a pass over all of them first; pass a "
                "list (e.g. list(stream))."
            )
        check_model_config(model)
        fb = forward_backward_func or _get_forward_backward_func()
        if not streamed:
            self.prepare_step(model, micro_batches, forward_backward_func=fb,  # type: ignore[arg-type]
                              recompute_old_log_probs=recompute_old_log_probs)
        try:
            losses = _run_schedule(fb, self.forward_step, model, micro_batches, forward_only=False)
        finally:
            self.step_batch_norm_mean = None
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
