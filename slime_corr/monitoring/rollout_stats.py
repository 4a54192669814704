"""The `rollout/` metrics of a step, from its samples."""

from __future__ import annotations

from collections.abc import Sequence

from slime_corr.layout.micro_batch import TRAINABLE
from slime_corr.monitoring.keys import ROLLOUT, with_prefix
from slime_corr.rollout.sample import Sample, SampleStatus


def rollout_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """`rollout/samples`, `not_trained` (failed or aborted), `failed`, and over the trained samples (absent when
    there is none) `reward_mean`, `response_length_mean` and `truncated_fraction` (hit the length cap)."""
    trained = [s for s in samples if s.status in TRAINABLE]
    out = {"samples": len(samples), "not_trained": len(samples) - len(trained),
           "failed": sum(s.status == SampleStatus.FAILED for s in samples)}
    if trained:
        n = len(trained)
        out.update(reward_mean=sum(s.reward or 0.0 for s in trained) / n,
                   response_length_mean=sum(s.response_length for s in trained) / n,
                   truncated_fraction=sum(s.status == SampleStatus.TRUNCATED for s in trained) / n)
    return with_prefix(ROLLOUT, out)


def step_sample_counts(samples: Sequence[Sample]) -> dict[str, float]:
    """One optimizer step's samples: `rollout/trained_samples` (finished, with at least one response token in the
    loss) and `rollout/failed_samples` (failed after their retries; aborted ones are neither)."""
    return with_prefix(ROLLOUT, {
        "trained_samples": sum(s.status in TRAINABLE and sum(s.loss_mask or ()) > 0 for s in samples),
        "failed_samples": sum(s.status == SampleStatus.FAILED for s in samples),
    })


__all__ = ["rollout_metrics", "step_sample_counts"]
