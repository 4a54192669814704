"""The `rollout/` metrics of a step, from its samples."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from slime_corr.layout.micro_batch import TRAINABLE
from slime_corr.monitoring.keys import ROLLOUT, with_prefix
from slime_corr.samples import Sample, SampleStatus


def rollout_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """`rollout/samples`, `not_trained` (failed or aborted), `failed`, and over the trained samples (absent when
    there is none) `reward_mean`, `response_length_mean` and `truncated_fraction` (hit the length cap); with the
    engine's kept sets (`kept_set_metrics`), their sizes."""
    trained = [s for s in samples if s.status in TRAINABLE]
    out = {"samples": len(samples), "not_trained": len(samples) - len(trained),
           "failed": sum(s.status == SampleStatus.FAILED for s in samples)}
    if trained:
        n = len(trained)
        out.update(reward_mean=sum(s.reward or 0.0 for s in trained) / n,
                   response_length_mean=sum(s.response_length for s in trained) / n,
                   truncated_fraction=sum(s.status == SampleStatus.TRUNCATED for s in trained) / n)
        out.update(kept_set_metrics(trained))
    return with_prefix(ROLLOUT, out)


def kept_set_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """The sizes |N| of the engine's kept sets (`Sample.rollout_top_p_token_offsets`) of the trained tokens (loss
    mask 1) of `samples`: `kept_set_size_mean`, `kept_set_size_p50` and `_p99` (the smallest size s with a share
    >= q of the sizes <= s), `kept_set_singleton_share` (|N| = 1: the token had probability 1 under the engine's
    truncation, and its replayed log-prob is 0 with no gradient). {} when no sample carries kept sets."""
    sizes = [s.rollout_top_p_token_offsets.diff()[torch.tensor(s.loss_mask, dtype=torch.bool)]
             for s in samples if s.rollout_top_p_token_offsets is not None and s.response_length]
    flat = torch.cat(sizes).sort().values if sizes else torch.zeros(0)
    if not flat.numel():
        return {}
    n = flat.numel()

    def quantile(q: float) -> float:
        return float(flat[max(0, math.ceil(q * n) - 1)])

    return {"kept_set_size_mean": float(flat.double().mean()), "kept_set_size_p50": quantile(0.5),
            "kept_set_size_p99": quantile(0.99), "kept_set_singleton_share": float((flat == 1).double().mean())}


def step_sample_counts(samples: Sequence[Sample]) -> dict[str, float]:
    """One optimizer step's samples: `rollout/trained_samples` (finished, with at least one response token in the
    loss) and `rollout/failed_samples` (failed after their retries; aborted ones are neither)."""
    return with_prefix(ROLLOUT, {
        "trained_samples": sum(s.status in TRAINABLE and sum(s.loss_mask or ()) > 0 for s in samples),
        "failed_samples": sum(s.status == SampleStatus.FAILED for s in samples),
    })


__all__ = ["kept_set_metrics", "rollout_metrics", "step_sample_counts"]
