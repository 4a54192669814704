"""The `rollout/` metrics of a step, from its samples."""

from __future__ import annotations

from collections.abc import Sequence

from slime_corr.monitoring.keys import ROLLOUT, with_prefix
from slime_corr.rollout.data_iterator import TRAINABLE
from slime_corr.rollout.sample import Sample, SampleStatus


def rollout_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """`rollout/samples`, `not_trained` (failed or aborted), `reward_mean` and `response_length_mean` over the
    trained samples, `truncated_fraction` (hit the length cap) of the trained samples."""
    trained = [s for s in samples if s.status in TRAINABLE]
    n = max(1, len(trained))
    return with_prefix(ROLLOUT, {
        "samples": len(samples),
        "not_trained": len(samples) - len(trained),
        "reward_mean": sum(s.reward or 0.0 for s in trained) / n,
        "response_length_mean": sum(s.response_length for s in trained) / n,
        "truncated_fraction": sum(s.status == SampleStatus.TRUNCATED for s in trained) / n,
    })


__all__ = ["rollout_metrics"]
