"""A rollout's samples -> every rank's micro-batches.

On the driver (rank 0): GRPO advantages over the whole rollout (trainable samples only), then the plan: step k
trains groups [k·G, (k+1)·G) of the rollout (G = groups per step; a GRPO group never straddles steps), and within a
step the groups are dealt to the DP ranks balanced by tokens (`balance_across_dp` over whole groups: a group never
straddles DP ranks), then cut into micro-batches (`plan_micro_batches`): `--micro-batch-size` samples each, or with
`--use-dynamic-batch-size` packed micro-batches of whole groups up to `--max-tokens-per-gpu` tokens per GPU
(`pack_by_tokens`), every DP rank filled up with empty micro-batches to the same count. One `scatter_object_list`
gives each rank its DP rank's share, so the TP, CP and PP ranks of a replica receive identical data. Each rank then
builds its micro-batches (`build_micro_batch`, padded or packed), CP-slices them, and adds what the loss hook and
the trainer read: `weight_lag` (trainer step − the version that sampled each token, laid out like the tokens),
per sequence `sample_ids` (the sample's index in the rollout; −1 for an empty micro-batch's padding sample),
`rewards`, `group_ids` and `trained` (to recompute GRPO baselines after rejection), `prox_lag` (the step's index
in the rollout: steps since π_old's weights, for the log-linear π_old), and under emulated CP the unsliced
`full_tokens` / `full_position_ids`.

Weight versions: the engines serve `weight_version(n)` = "step-n" after n optimizer steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from slime_corr.layout.context_parallel import slice_micro_batch_for_cp
from slime_corr.layout.groups import balance_across_dp, grpo_advantages, pack_by_tokens
from slime_corr.layout.micro_batch import (
    TRAINABLE,
    build_micro_batch,
    cp_pad_multiple,
    mask_not_trained,
    packed_length,
    padding_sample,
)
from slime_corr.routed_experts import RoutedExpertsSpec
from slime_corr.samples import Sample

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
    """What one DP rank trains of a rollout: per optimizer step, its micro-batches, each a list of samples (an empty
    list is an empty micro-batch: it keeps every DP rank at the same count)."""

    steps: list[list[list[TrainSample]]] = field(default_factory=list)


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


def plan_micro_batches(samples: Sequence[Sample], parts: Sequence[Sequence[int]], group_size: int,
                       micro_batch_size: int, max_tokens: int | None = None, cp_size: int = 1, sp_size: int = 1
                       ) -> list[list[list[int]]]:
    """One step's micro-batches [dp_rank][micro-batch] (sample indices) from its DP `parts` (whole groups, group
    after group): `micro_batch_size` samples each, or with `max_tokens` (per GPU; a micro-batch holds
    max_tokens · CP, each CP rank 1/CP) whole groups packed by `pack_by_tokens`, each sample taking its packed
    length under CP (and sequence parallelism over `sp_size` TP ranks). Every DP rank gets the same number of
    micro-batches (empty ones, [], at the end)."""
    if max_tokens is None:
        return [[list(part[i:i + micro_batch_size]) for i in range(0, len(part), micro_batch_size)]
                for part in parts]
    out = []
    for part in parts:
        groups = [list(part[i:i + group_size]) for i in range(0, len(part), group_size)]
        sizes = [sum(packed_length(samples[i].total_length, cp_size, sp_size) for i in g) for g in groups]
        out.append([[i for g in b for i in groups[g]] for b in pack_by_tokens(sizes, max_tokens * cp_size)])
    count = max(len(mbs) for mbs in out)
    return [mbs + [[] for _ in range(count - len(mbs))] for mbs in out]


def rollout_shards(samples: Sequence[Sample], group_size: int, num_steps: int, dp_size: int,
                   normalize_std: bool = True, *, micro_batch_size: int, max_tokens: int | None = None,
                   cp_size: int = 1, sp_size: int = 1) -> list[RankShard]:
    """Per DP rank, its `RankShard` of the rollout (micro-batches by `plan_micro_batches`), with GRPO advantages
    over the trainable samples (the others get 0 and are masked out of the loss)."""
    trained = [i for i, s in enumerate(samples) if s.status in TRAINABLE]
    advantages = [0.0] * len(samples)
    for i, a in zip(trained, grpo_advantages([samples[i] for i in trained], normalize_std), strict=True):
        advantages[i] = a
    shards = [RankShard() for _ in range(dp_size)]
    for step in plan_rollout(samples, group_size, num_steps, dp_size):
        plan = plan_micro_batches(samples, step, group_size, micro_batch_size, max_tokens, cp_size, sp_size)
        for shard, micro_batches in zip(shards, plan, strict=True):
            shard.steps.append([[TrainSample(samples[i], advantages[i], i) for i in mb] for mb in micro_batches])
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


def _with_routes(samples: list[Sample], routes: RoutedExpertsSpec | None) -> list[Sample]:
    """MoE (`routes`: the engine's routes were asked for): samples without them (failed or untrained ones, whose
    tokens are masked out of the loss, or an empty micro-batch's padding sample) get filler routes (experts
    0..k-1, as `layout.micro_batch` pads), so that every micro-batch has the same layout; a trained sample without
    routes is an error."""
    if routes is None:
        return samples
    shaped = torch.zeros(0, routes.num_layers, routes.top_k, dtype=routes.dtype)
    out = []
    for s in samples:
        if s.routed_experts is None or s.routed_experts.shape[0] != s.total_length - 1:
            if s.status in TRAINABLE and s.response_length:
                raise ValueError(f"routed_experts: trained sample {s.index} has no routes for its "
                                 f"{s.total_length - 1} input tokens (ask every request for them)")
            _, layers, k = shaped.shape
            fill = torch.arange(k, dtype=shaped.dtype).expand(max(0, s.total_length - 1), layers, k).clone()
            s = dataclasses.replace(s, routed_experts=fill)
        out.append(s)
    return out


def build_micro_batches(shard: RankShard, first_step: int, *, cp_rank: int = 0, cp_size: int = 1,
                        pad_token_id: int = 0, packed: bool = False, routes: RoutedExpertsSpec | None = None,
                        sp_size: int = 1, kept_sets: bool = False) -> list[list[dict[str, torch.Tensor]]]:
    """This rank's micro-batches of the rollout, per optimizer step (`first_step` = the optimizer step the rollout's
    first update makes; the weight lag of step k is measured against `first_step + k`); `packed`: THD rows.
    `routes`: the MoE shape of the engine's routes (`Sample.routed_experts`), when they were asked for: every
    micro-batch then carries them, whole under CP (emulated CP runs whole sequences). `sp_size`: the TP size
    under sequence parallelism (rows padded to a multiple of it). `kept_sets`: every micro-batch carries the engine's
    kept sets (`layout.kept_sets`; --rollout-return-sampling-mask), an empty one too."""
    steps = []
    for k, micro_batches in enumerate(shard.steps):
        out = []
        for part in micro_batches:
            part = part or [TrainSample(padding_sample(pad_token_id), 0.0, -1)]  # an empty micro-batch
            samples = _with_routes([t.sample for t in part], routes)
            batch = build_micro_batch(samples, [t.advantage for t in part],
                                      pad_to_multiple=cp_pad_multiple(cp_size, sp_size), pad_token_id=pad_token_id,
                                      packed=packed, weight_lag=[token_lags(s, first_step + k) for s in samples],
                                      kept_sets=kept_sets or None)
            mask_not_trained(batch, samples)
            batch["rewards"] = torch.tensor([float(s.reward or 0.0) for s in samples], dtype=torch.float64)
            batch["group_ids"] = torch.tensor([s.group_id for s in samples])
            batch["sample_ids"] = torch.tensor([t.sample_id for t in part])
            batch["trained"] = torch.tensor([s.status in TRAINABLE and sum(s.loss_mask or ()) > 0 for s in samples])
            batch["prox_lag"] = torch.tensor(k)  # steps since π_old's weights (--prox-logp-method loglinear)
            local = slice_micro_batch_for_cp(batch, cp_rank, cp_size)
            if cp_size > 1:  # emulated CP: the model runs the full sequence (see mcore.model.emulated_cp_forward)
                local["full_tokens"], local["full_position_ids"] = batch["tokens"], batch["position_ids"]
            out.append(local)
        steps.append(out)
    return steps


def oldest_version_step(sample: Sample) -> int | None:
    """The optimizer step of the oldest weights that sampled a token of `sample` (its `weight_version` and every
    `weight_versions` span; None when none is this trainer's)."""
    steps = [v for name in (sample.weight_version, *(span[0] for span in sample.weight_versions))
             if (v := version_step(name)) is not None]
    return min(steps) if steps else None


def stale_samples(samples: Sequence[Sample], first_step: int, num_steps: int, max_staleness: int) -> list[int]:
    """Indices of the trainable samples whose oldest token is more than `max_staleness` optimizer steps old at the
    step that trains it: step k of the rollout (`plan_rollout`: the k-th slice of whole groups) is made from
    `first_step + k` steps."""
    per_step = max(1, len(samples) // num_steps)
    return [i for i, s in enumerate(samples)
            if s.status in TRAINABLE and (v := oldest_version_step(s)) is not None
            and first_step + i // per_step - v > max_staleness]


def mask_offpolicy_tokens(sample: Sample) -> tuple[Sample, int]:
    """`--mask-offpolicy-in-partial-rollout`: `sample` with the loss mask of every token before its last
    `weight_versions` span zeroed (generated before the last weight update reached the request), and how many
    trained tokens that took out; the sample itself when it holds one version."""
    if len(sample.weight_versions) < 2:
        return sample, 0
    start = max(begin for _, begin, _ in sample.weight_versions)
    mask = list(sample.loss_mask or [1] * sample.response_length)
    masked = sum(mask[:start])
    return replace(sample, loss_mask=[0] * start + mask[start:]), masked


def mask_stale_tokens(sample: Sample, step: int, bound: int) -> tuple[Sample, int]:
    """`--max-token-staleness`: `sample` with the loss mask of every response token sampled more than `bound`
    optimizer steps before `step` (the step that trains it: `token_lags`) zeroed, and how many trained tokens that
    took out; the sample itself when none."""
    mask = list(sample.loss_mask or [1] * sample.response_length)
    kept = [m if lag <= bound else 0 for m, lag in zip(mask, token_lags(sample, step), strict=True)]
    masked = sum(mask) - sum(kept)
    return (replace(sample, loss_mask=kept), masked) if masked else (sample, 0)


def staleness(samples: Sequence[Sample], step: int) -> tuple[float, int]:
    """(mean, max) over the trainable samples of `step` − the step of the weights that sampled them (the last
    version of a sample resumed across an update)."""
    lags = [step - v for s in samples if s.status in TRAINABLE and (v := version_step(s.weight_version)) is not None]
    return (sum(lags) / len(lags), max(lags)) if lags else (0.0, 0)


__all__ = ["RankShard", "TrainSample", "build_micro_batches", "mask_offpolicy_tokens", "mask_stale_tokens",
           "oldest_version_step", "plan_micro_batches",
           "plan_rollout", "rollout_shards", "scatter_shards", "stale_samples", "staleness", "token_lags", "version_step", "weight_version"]
