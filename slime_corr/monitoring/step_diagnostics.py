"""A step's mismatch diagnostics for the logs: `diag/` metrics and the top-mismatch table with the samples' text.

The loss hook computes the diagnostics itself from the log-probs it already has (`RolloutCorrectionLoss(...,
diagnostics_top_k=k)`, see `slime_corr.correction.diagnostics`); micro-batches carry `sample_ids` (the sample's
index in the rollout) and `weight_lag`. The rollout driver holds the samples, so the text of the top sequences is
looked up here:

    result = hook.last_diagnostics                                    # after hook.reduce_step_metrics(...)
    metrics.update(diagnostic_metrics(result))                        # {"diag/...": float}
    logger.log_samples(step, top_mismatch_records(result, samples, detokenize))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from slime_corr.correction.diagnostics import DiagnosticsResult
from slime_corr.monitoring.keys import DIAG, with_prefix
from slime_corr.samples import Sample

TEXT_CHARS = 120


def diagnostic_metrics(result: DiagnosticsResult) -> dict[str, float]:
    """The result's metrics under `diag/`."""
    return with_prefix(DIAG, result.metrics)


def top_mismatch_records(result: DiagnosticsResult, samples: Sequence[Sample],
                         detokenize: Callable[[list[int]], str] | None = None) -> list[dict[str, Any]]:
    """One record per top sequence: its statistics, and when `sample_id` indexes `samples` its group, reward,
    weight version, status and (with `detokenize`) prompt, response and the token where |lp_train − lp_rollout|
    is largest."""
    records = []
    for row in result.top:
        record: dict[str, Any] = dict(row)
        sid = row["sample_id"]
        if 0 <= sid < len(samples):
            s = samples[sid]
            record.update(group_id=s.group_id, index=s.index, reward=s.reward, weight_version=s.weight_version,
                          status=str(s.status))
            if detokenize is not None:
                record["prompt"] = detokenize(s.prompt_tokens)[-TEXT_CHARS:]
                record["response"] = detokenize(s.response_tokens)[:TEXT_CHARS]
                pos = row["max_position"]
                if 0 <= pos < s.response_length:
                    record["max_token"] = detokenize([s.response_tokens[pos]])
        records.append(record)
    return records


__all__ = ["diagnostic_metrics", "top_mismatch_records"]
