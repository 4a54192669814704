"""A training step's mismatch diagnostics, gathered from the micro-batches Megatron's schedule runs.

    diag = ScheduleDiagnostics(top_k=4, detokenize=detokenize)
    hook = RolloutCorrectionLoss(config, model_forward=diag.model_forward)
    diag.bind(hook)
    diag.begin_step(data.samples, micro_batch_size, weight_lag=...)   # before hook.train_step(model, data)
    metrics = hook.train_step(model, data)
    diag_metrics, top = diag.end_step()                               # {"diag/...": float}, records with text

This is the main job's route while the loss hook does not compute diagnostics itself: it wraps the hook's
`model_forward` and, in the training pass (grad enabled; the no-grad lp_old recompute is passed through),
recomputes log π_θ from the logits with the hook's own `log_probs` (same temperature and TP group) — one extra
log-softmax per micro-batch, which the hook integration avoids (it already has lp; see
`slime_corr.correction.diagnostics` and the README's monitoring section). Micro-batch k holds
`samples[k·mbs : (k+1)·mbs]`, as `BufferMicroBatchIterator` builds them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from slime_corr.correction.diagnostics import MismatchDiagnostics, response_positions
from slime_corr.monitoring.keys import DIAG, with_prefix
from slime_corr.rollout.sample import Sample

WeightLag = Callable[[Sample], Sequence[int]]  # per response token: trainer version - sampling version
TEXT_CHARS = 120


def version_lag(versions: dict[str, int], current: int) -> WeightLag:
    """Per-token weight lag from `Sample.weight_versions` spans (else `weight_version` for every token), given
    each version's index in `versions` and the trainer's current index. Unknown versions count as lag 0."""

    def lag(sample: Sample) -> list[int]:
        out = [current - versions.get(sample.weight_version or "", current)] * sample.response_length
        for version, start, end in sample.weight_versions:
            out[start:end] = [current - versions.get(version, current)] * (end - start)
        return out

    return lag


class ScheduleDiagnostics:
    """Collects `MismatchDiagnostics` over a step's training micro-batches (see the module docstring)."""

    def __init__(self, *, top_k: int = 4, model_forward: Callable[..., Tensor] | None = None,
                 detokenize: Callable[[list[int]], str] | None = None) -> None:
        self.accumulator = MismatchDiagnostics(top_k)
        self._forward = model_forward
        self.detokenize = detokenize
        self.hook: Any = None
        self._samples: Sequence[Sample] | None = None
        self._mbs = 0
        self._k = 0
        self._lag: WeightLag | None = None

    def bind(self, hook: Any) -> ScheduleDiagnostics:
        """The `RolloutCorrectionLoss` whose `model_forward` this is (its log_probs, mode and groups are used)."""
        self.hook = hook
        return self

    def begin_step(self, samples: Sequence[Sample], micro_batch_size: int, *, weight_lag: WeightLag | None = None
                   ) -> None:
        """`samples`: the step's samples in micro-batch order (may still be filling, e.g. `data.samples`)."""
        self._samples, self._mbs, self._k, self._lag = samples, micro_batch_size, 0, weight_lag
        self.accumulator.parts.clear()

    def model_forward(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
        if self._forward is None:
            from slime_corr.mcore.loss_hook import default_model_forward

            self._forward = default_model_forward
        logits = self._forward(model, batch)
        if torch.is_grad_enabled() and self._samples is not None and self.hook is not None:
            with torch.no_grad():
                self._add(batch, logits.detach())
            self._k += 1
        return logits

    def _add(self, batch: dict[str, Tensor], logits: Tensor) -> None:
        hook = self.hook
        lp = hook.log_probs(logits, batch["labels"])[0]
        decoupled = hook.needs_old_log_probs
        mask = batch["loss_mask"]
        positions = response_positions(mask, batch.get("position_ids"), hook.groups.cp)
        first = self._k * self._mbs
        rows = mask.shape[0]
        ids = torch.arange(first, first + rows, device=lp.device)
        lag = self._token_lags(positions, first, rows) if self._lag is not None else None
        self.accumulator.add(batch["old_log_probs"] if decoupled else lp, batch["rollout_log_probs"], mask,
                             lp_current=lp if decoupled else None, positions=positions, weight_lag=lag,
                             sample_ids=ids)

    def _token_lags(self, positions: Tensor, first: int, rows: int) -> Tensor:
        """[B, S] lag of each token: its sample's per-response-token lag, looked up at its response position."""
        assert self._samples is not None and self._lag is not None
        per_sample = [list(self._lag(s)) for s in self._samples[first:first + rows]]
        width = max([len(v) for v in per_sample] + [1])
        table = torch.zeros(rows, width, dtype=torch.long)
        for i, values in enumerate(per_sample):
            table[i, :len(values)] = torch.tensor(values, dtype=torch.long)
        table = table.to(positions.device)
        return table.gather(1, positions.clamp_max(width - 1))

    def end_step(self) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Reduce the step (collectives over DP × CP once) -> (`diag/...` metrics, top-mismatch records)."""
        groups = self.hook.groups
        result = self.accumulator.reduce(groups.cp, groups.dp)
        samples, self._samples = self._samples, None
        records = [self._record(row, samples) for row in result.top]
        return with_prefix(DIAG, result.metrics), records

    def _record(self, row: dict[str, Any], samples: Sequence[Sample] | None) -> dict[str, Any]:
        record = dict(row)
        sid = row["sample_id"]
        if samples is None or not 0 <= sid < len(samples):
            return record
        s = samples[sid]
        record.update(group_id=s.group_id, index=s.index, reward=s.reward, weight_version=s.weight_version,
                      status=str(s.status))
        if self.detokenize is not None:
            record["prompt"] = self.detokenize(s.prompt_tokens)[-TEXT_CHARS:]
            record["response"] = self.detokenize(s.response_tokens)[:TEXT_CHARS]
            pos = row["max_position"]
            if 0 <= pos < s.response_length:
                record["max_token"] = self.detokenize([s.response_tokens[pos]])
        return record


__all__ = ["ScheduleDiagnostics", "version_lag"]
