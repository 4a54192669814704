"""A rollout's samples -> every rank's micro-batches.

On the driver (rank 0): GRPO advantages over the whole rollout (trainable samples only), then the plan: step k
trains groups [k·G, (k+1)·G) of the rollout (G = groups per step; a GRPO group never straddles steps), and within a
step the groups are dealt to the DP ranks balanced by tokens (`balance_across_dp` over whole groups: a group never
straddles DP ranks). One `scatter_object_list` gives each rank its DP rank's share, so the TP and CP ranks of a
replica receive identical data. Each rank then builds its micro-batches (`build_micro_batch`), CP-slices them, and
adds what the loss hook and the trainer read: `weight_lag` [B, S] (trainer step − the version that sampled each
token), `sample_ids` [B] (the sample's index in the rollout), `rewards` [B] and `group_ids` [B] (to recompute GRPO
baselines after rejection), and under emulated CP the unsliced `full_tokens` / `full_position_ids`.

Weight versions: the engines serve `weight_version(n)` = "step-n" after n optimizer steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from slime_corr.rollout.batching import (
    balance_across_dp,
    build_micro_batch,
    cp_pad_multiple,
    grpo_advantages,
    slice_micro_batch_for_cp,
)
from slime_corr.rollout.data_iterator import TRAINABLE, mask_not_trained
from slime_corr.rollout.sample import Sample

VERSION_PREFIX = "step-"


def weight_version(step: int) -> str:
    """The engines' weight version after `step` optimizer steps."""
    return f"{VERSION_PREFIX}{step}"


def version_step(version: str | None) -> int | None:
    """The optimizer step of a `weight_version` name (None for a name this trainer did not give)."""
    if version and version.startswith(VERSION_PREFIX) and version[len(VERSION_PREFIX):].isdigit():
        return int(version[len(VERSION_PREFIX):])
    return None


def token_lags(sample: Sample, step: int) -> list[int]:
    """Per response token: `step` − the optimizer step of the weights that sampled it (0 when unknown)."""
    def lag(version: str | None) -> int:
        v = version_step(version)
        return 0 if v is None else step - v

    out = [lag(sample.weight_version)] * sample.response_length
    for version, start, end in sample.weight_versions:
        out[start:end] = [lag(version)] * (end - start)
    return out


@dataclass
class TrainSample:
    """One sample as a rank trains it: the sample, its GRPO advantage and its index in the rollout."""

    sample: Sample
    advantage: float
    sample_id: int


@dataclass
class RankShard:
    """What one DP rank trains of a rollout: per optimizer step, its samples."""

    steps: list[list[TrainSample]] = field(default_factory=list)


def plan_rollout(samples: Sequence[Sample], group_size: int, num_steps: int, dp_size: int) -> list[list[list[int]]]:
    """Sample indices [step][dp_rank] (see the module doc). `samples` are in rollout order (group-major)."""
    if len(samples) % (group_size * num_steps):
        raise ValueError(f"{len(samples)} samples do not split into {num_steps} steps of whole groups of {group_size}")
    groups = [list(range(g, g + group_size)) for g in range(0, len(samples), group_size)]
    per_step = len(groups) // num_steps
    plan = []
    for k in range(num_steps):
        step_groups = groups[k * per_step:(k + 1) * per_step]
        tokens = [sum(samples[i].total_length for i in g) for g in step_groups]
        plan.append([[i for j in part for i in step_groups[j]] for part in balance_across_dp(tokens, dp_size)])
    return plan


def rollout_shards(samples: Sequence[Sample], group_size: int, num_steps: int, dp_size: int,
                   normalize_std: bool = True) -> list[RankShard]:
    """Per DP rank, its `RankShard` of the rollout, with GRPO advantages over the trainable samples (the others
    get 0 and are masked out of the loss)."""
    trained = [i for i, s in enumerate(samples) if s.status in TRAINABLE]
    advantages = [0.0] * len(samples)
    for i, a in zip(trained, grpo_advantages([samples[i] for i in trained], normalize_std), strict=True):
        advantages[i] = a
    shards = [RankShard() for _ in range(dp_size)]
    for step in plan_rollout(samples, group_size, num_steps, dp_size):
        for shard, indices in zip(shards, step, strict=True):
            shard.steps.append([TrainSample(samples[i], advantages[i], i) for i in indices])
    return shards


def scatter_shards(shards: list[RankShard] | None, dp_rank_of: Sequence[int]) -> RankShard:
    """Rank 0 passes every DP rank's shard, the others None; each rank receives its DP rank's (collective over
    the world). `dp_rank_of[g]` is global rank g's DP rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert shards is not None
        return shards[0]
    payload = [shards[d] for d in dp_rank_of] if dist.get_rank() == 0 and shards is not None else None
    out: list[RankShard | None] = [None]
    dist.scatter_object_list(out, payload, src=0)
    assert out[0] is not None
    return out[0]


def build_micro_batches(shard: RankShard, micro_batch_size: int, first_step: int, *, cp_rank: int = 0,
                        cp_size: int = 1, pad_token_id: int = 0) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of the rollout, step after step (`first_step` = the optimizer step the rollout's
    first update makes; the weight lag of step k is measured against `first_step + k`)."""
    out = []
    for k, step_samples in enumerate(shard.steps):
        for start in range(0, len(step_samples), micro_batch_size):
            part = step_samples[start:start + micro_batch_size]
            samples = [t.sample for t in part]
            batch = build_micro_batch(samples, [t.advantage for t in part], pad_to_multiple=cp_pad_multiple(cp_size),
                                      pad_token_id=pad_token_id,
                                      weight_lag=[token_lags(s, first_step + k) for s in samples])
            mask_not_trained(batch, samples)
            batch["rewards"] = torch.tensor([float(s.reward or 0.0) for s in samples], dtype=torch.float64)
            batch["group_ids"] = torch.tensor([s.group_id for s in samples])
            batch["sample_ids"] = torch.tensor([t.sample_id for t in part])
            local = slice_micro_batch_for_cp(batch, cp_rank, cp_size)
            if cp_size > 1:  # emulated CP: the model runs the full sequence (see mcore.model.emulated_cp_forward)
                local["full_tokens"], local["full_position_ids"] = batch["tokens"], batch["position_ids"]
            out.append(local)
    return out


def staleness(samples: Sequence[Sample], step: int) -> tuple[float, int]:
    """(mean, max) over the trainable samples of `step` − the step of the weights that sampled them (the last
    version of a sample resumed across an update)."""
    lags = [step - v for s in samples if s.status in TRAINABLE and (v := version_step(s.weight_version)) is not None]
    return (sum(lags) / len(lags), max(lags)) if lags else (0.0, 0)


__all__ = ["RankShard", "TrainSample", "build_micro_batches", "plan_rollout", "rollout_shards", "scatter_shards",
           "staleness", "token_lags", "version_step", "weight_version"]
