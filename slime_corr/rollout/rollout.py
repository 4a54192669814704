"""The rollout driver: turn prompts into finished samples, applying the pause policy.

Pause policy (what happens to a sample whose request came back ``finish_reason: abort`` with its partial output,
which is what SGLang returns for ``/pause_generation mode=abort`` and ``/abort_request``):

* ``RESUME`` (default): keep the partial tokens and their log-probs, re-send ``prompt + partial`` as the new
  prompt with the remaining ``max_new_tokens``; the request waits on the server until generation continues.
  Tokens and log-probs are concatenated; ``Sample.weight_versions`` records the weight version of each segment
  (segments before a weight update were sampled by the old policy - the correction layer sees it).
* ``RESAMPLE``: drop the partial output and generate the whole response again (all tokens from one version).
* ``KEEP``: end the sample as ``ABORTED`` with its partial output (not trained by default).

At most ``max_resumes`` aborts are absorbed per sample, after that it ends ``ABORTED``. When ``stop`` (an
``asyncio.Event``) is set, aborted samples end ``ABORTED`` whatever the policy. A call that exhausts the client's
retries ends the sample ``FAILED`` with the reason, and so does a response that does not fit the sample or a
``reward_fn`` that raises. Every sample ends exactly once.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from slime_corr.rollout.buffer import SampleBuffer
from slime_corr.rollout.client import GenerationError, SGLangClient
from slime_corr.rollout.routing import RoutedExpertsSpec
from slime_corr.rollout.sample import Sample, SampleStatus, SampleValidationError
from slime_corr.rollout.sampling import mix_seed


class PausePolicy(StrEnum):
    RESUME = "resume"
    RESAMPLE = "resample"
    KEEP = "keep"


async def generate_sample(
    client: SGLangClient,
    sample: Sample,
    sampling_params: dict[str, Any],
    *,
    stream: bool = False,
    pause_policy: PausePolicy | str = PausePolicy.RESUME,
    max_resumes: int = 8,
    stop: asyncio.Event | None = None,
    routed_experts: RoutedExpertsSpec | None = None,
) -> Sample:
    """Fill ``sample``'s response by generation; returns it with a final status (never raises on faults).
    ``routed_experts``: ask for the MoE routes of this shape; they land in ``sample.routed_experts``."""
    try:
        return await _generate_sample(client, sample, sampling_params, stream, PausePolicy(pause_policy),
                                      max_resumes, stop, routed_experts)
    except SampleValidationError as e:  # a response the sample rejects (defence in depth: protocol checks first)
        sample.status, sample.failure_reason = SampleStatus.FAILED, f"invalid response: {e}"
        return sample


async def _generate_sample(
    client: SGLangClient, sample: Sample, sampling_params: dict[str, Any], stream: bool, policy: PausePolicy,
    max_resumes: int, stop: asyncio.Event | None, routes: RoutedExpertsSpec | None = None,
) -> Sample:
    max_new = int(sampling_params.get("max_new_tokens", 128))
    aborts = 0
    while True:
        params = dict(sampling_params, max_new_tokens=max_new - sample.response_length)
        try:
            res = await client.generate(sample.prompt_tokens + sample.response_tokens, params, stream=stream,
                                        **({"routed_experts": routes} if routes is not None else {}))
        except GenerationError as e:
            sample.attempts += e.attempts
            sample.status, sample.failure_reason = SampleStatus.FAILED, e.reason
            return sample
        sample.attempts += res.attempts
        segment = dict(spans=res.weight_versions, routed_experts=res.routed_experts)
        if res.finish_type != "abort":
            sample.append_segment(res.output_ids, res.log_probs, res.weight_version, **segment)
            sample.status = SampleStatus.COMPLETED if res.finish_type == "stop" else SampleStatus.TRUNCATED
            return sample
        aborts += 1
        if policy == PausePolicy.KEEP or aborts > max_resumes or (stop is not None and stop.is_set()):
            sample.append_segment(res.output_ids, res.log_probs, res.weight_version, **segment)
            sample.status = SampleStatus.ABORTED
            sample.failure_reason = f"aborted: {(res.finish_reason or {}).get('message')}"
            return sample
        if policy == PausePolicy.RESUME:
            sample.append_segment(res.output_ids, res.log_probs, res.weight_version, **segment)
            if sample.response_length >= max_new:
                sample.status = SampleStatus.TRUNCATED
                return sample
        else:  # RESAMPLE: start over
            sample.response_tokens, sample.loss_mask, sample.weight_versions = [], [], []
            sample.routed_experts = None
            sample.rollout_log_probs = torch.zeros(0, dtype=torch.float32)


async def generate_group_samples(
    client: SGLangClient,
    prompts: Sequence[list[int]],
    n_samples_per_prompt: int,
    sampling_params: dict[str, Any],
    *,
    stream: bool = False,
    pause_policy: PausePolicy | str = PausePolicy.RESUME,
    reward_fn: Callable[[Sample], float] | None = None,
    buffer: SampleBuffer | None = None,
    group_id_offset: int = 0,
    stop: asyncio.Event | None = None,
    sampling_seed: int | None = None,
    routed_experts: RoutedExpertsSpec | None = None,
) -> list[Sample]:
    """Generate ``n_samples_per_prompt`` samples per prompt concurrently (one request per sample).

    Sample ``index`` is global order (prompt-major), ``group_id`` is ``group_id_offset + prompt index``.
    ``reward_fn`` scores every non-failed sample. With ``buffer``, each group is put into it as soon as all its
    samples ended (awaiting when the buffer is full: backpressure). Returns all samples in index order.
    ``sampling_seed``: each request gets ``sampling_params.sampling_seed = mix_seed(sampling_seed, index)``, so the
    rollout samples the same tokens every time (an engine that honours the seed, as SGLang and the embedded engine
    do, draws per (seed, position) whatever the batching; a resumed request continues the same draws).
    """

    def params_of(index: int) -> dict[str, Any]:
        if sampling_seed is None:
            return sampling_params
        return {**sampling_params, "sampling_seed": mix_seed(sampling_seed, index)}

    async def one_group(g: int, prompt: list[int]) -> list[Sample]:
        samples = [Sample(prompt_tokens=list(prompt), group_id=group_id_offset + g,
                          index=g * n_samples_per_prompt + j) for j in range(n_samples_per_prompt)]
        await asyncio.gather(*(generate_sample(client, s, params_of(s.index), stream=stream,
                                               pause_policy=pause_policy, stop=stop, routed_experts=routed_experts)
                               for s in samples))
        if reward_fn is not None:
            for s in samples:
                if s.status != SampleStatus.FAILED:
                    try:
                        s.reward = float(reward_fn(s))
                        s.validate()  # e.g. a NaN reward
                    except Exception as e:  # noqa: BLE001 - the sample fails with the reason; the others go on
                        s.reward = None
                        s.status, s.failure_reason = SampleStatus.FAILED, f"reward_fn: {e!r}"
        if buffer is not None:
            await buffer.put_group(samples)
        return samples

    groups = await asyncio.gather(*(one_group(g, list(p)) for g, p in enumerate(prompts)))
    return [s for grp in groups for s in grp]


@dataclass
class RolloutReport:
    """What a rollout step went through: sample outcomes, retries, and engines found dead (with why)."""

    statuses: dict[str, int]
    retried_samples: int  # samples that needed more than one request (a fault, an engine lost, a resume)
    failovers: int  # requests retried because their engine failed or died
    dead_engines: dict[str, str] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)

    def line(self) -> str:
        """One line for the step's log."""
        parts = [" ".join(f"{k}={v}" for k, v in sorted(self.statuses.items()))]
        if self.retried_samples or self.failovers:
            parts.append(f"retried_samples={self.retried_samples} failovers={self.failovers}")
        if self.dead_engines:
            parts.append(f"dead_engines={sorted(self.dead_engines)}")
        return " ".join(parts)


def rollout_report(samples: Sequence[Sample], client: SGLangClient, failovers_before: int = 0,
                   events_before: int = 0) -> RolloutReport:
    """Summarize a step's samples and what ``client`` did since the counters ``*_before`` were read."""
    return RolloutReport(dict(Counter(str(s.status) for s in samples)), sum(s.attempts > 1 for s in samples),
                         client.failovers - failovers_before, dict(client.dead), client.events[events_before:])
