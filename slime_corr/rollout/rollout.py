"""The rollout driver: turn prompts into finished samples, applying the pause policy.

Pause policy (what happens to a sample whose request came back ``finish_reason: abort`` with its partial output,
which is what SGLang returns for ``/pause_generation mode=abort`` and ``/abort_request``):

* ``RESUME`` (default): keep the partial tokens and their log-probs, re-send ``prompt + partial`` as the new
  prompt with the remaining ``max_new_tokens``; the request waits on the server until generation continues.
  Tokens and log-probs are concatenated; ``Sample.weight_versions`` records the weight version of each segment
  (segments before a weight update were sampled by the old policy - the correction layer sees it), and so do
  the kept sets of a sampling mask (each segment's tokens keep theirs).
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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

import torch

from slime_corr.rollout.buffer import SampleBuffer
from slime_corr.rollout.client import GenerationError, SGLangClient
from slime_corr.rollout.nucleus import nucleus_request
from slime_corr.rollout.protocol import sampling_mask_params
from slime_corr.rollout.sampling import mix_seed
from slime_corr.routed_experts import RoutedExpertsSpec
from slime_corr.samples import Sample, SampleStatus, SampleValidationError

T = TypeVar("T")


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
    nucleus_logprobs: int = 0,
    sampling_mask: bool = False,
) -> Sample:
    """Fill ``sample``'s response by generation; returns it with a final status (never raises on faults).
    ``routed_experts``: ask for the MoE routes of this shape; they land in ``sample.routed_experts``.
    ``nucleus_logprobs``: under ``sampling_params``' top_p / top_k, ask for the engine's top-N log-probs (N = top_k,
    or this cap: `nucleus.nucleus_request`) and keep its nucleus log-mass in
    ``sample.rollout_nucleus_log_mass``; 0: not asked.
    ``sampling_mask``: under top_p / top_k, ask for every token's kept set (SGLang's ``return_sampling_mask``, with
    top_k set to `protocol.SAMPLING_MASK_MAX_TOKENS` where top-k is off) and keep it in the sample's
    ``rollout_top_p_token_ids`` / ``_offsets`` / ``rollout_top_p_log_probs``, the engine's exact mass in
    ``rollout_nucleus_log_mass`` (the top-N log-probs are then not asked for)."""
    try:
        return await _generate_sample(client, sample, sampling_params, stream, PausePolicy(pause_policy),
                                      max_resumes, stop, routed_experts, nucleus_logprobs, sampling_mask)
    except SampleValidationError as e:  # a response the sample rejects (defence in depth: protocol checks first)
        sample.status, sample.failure_reason = SampleStatus.FAILED, f"invalid response: {e}"
        return sample


async def _generate_sample(
    client: SGLangClient, sample: Sample, sampling_params: dict[str, Any], stream: bool, policy: PausePolicy,
    max_resumes: int, stop: asyncio.Event | None, routes: RoutedExpertsSpec | None = None, nucleus_logprobs: int = 0,
    sampling_mask: bool = False,
) -> Sample:
    max_new = int(sampling_params.get("max_new_tokens", 128))
    masked = sampling_mask and nucleus_request(sampling_params, 1) is not None  # truncated: the kept sets replace N
    nucleus = None if masked else nucleus_request(sampling_params, nucleus_logprobs)
    asked: dict[str, Any] = {"routed_experts": routes} if routes is not None else {}
    if nucleus is not None:
        asked["nucleus"] = nucleus
    if masked:
        asked["sampling_mask"] = True
        sampling_params = sampling_mask_params(sampling_params)
    aborts = 0
    while True:
        params = dict(sampling_params, max_new_tokens=max_new - sample.response_length)
        try:
            res = await client.generate(sample.prompt_tokens + sample.response_tokens, params, stream=stream, **asked)
        except GenerationError as e:
            sample.attempts += e.attempts
            sample.status, sample.failure_reason = SampleStatus.FAILED, e.reason
            sample.metadata.update(failure_kind=e.kind, failure_server=e.server)
            return sample
        sample.attempts += res.attempts
        segment = dict(spans=res.weight_versions, routed_experts=res.routed_experts,
                       nucleus_log_mass=res.nucleus_log_mass, kept_ids=res.kept_ids, kept_log_probs=res.kept_log_probs)
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
            sample.routed_experts = sample.rollout_nucleus_log_mass = None
            sample.rollout_top_p_token_ids = sample.rollout_top_p_token_offsets = sample.rollout_top_p_log_probs = None
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
    max_failed_fraction: float | None = None,
    routed_experts: RoutedExpertsSpec | None = None,
    nucleus_logprobs: int = 0,
    sampling_mask: bool = False,
) -> list[Sample]:
    """Generate ``n_samples_per_prompt`` samples per prompt concurrently (one request per sample).

    Sample ``index`` is global order (prompt-major), ``group_id`` is ``group_id_offset + prompt index``.
    ``reward_fn`` scores every non-failed sample. With ``buffer``, each group is put into it as soon as all its
    samples ended (awaiting when the buffer is full: backpressure). Returns all samples in index order.
    ``sampling_seed``: each request gets ``sampling_params.sampling_seed = mix_seed(sampling_seed, index)``, so the
    rollout samples the same tokens every time (an engine that honours the seed, as SGLang and the embedded engine
    do, draws per (seed, position) whatever the batching; a resumed request continues the same draws).
    ``routed_experts``: ask every request for the engine's MoE routes, ``nucleus_logprobs``: for the engine's
    top-N log-probs, ``sampling_mask``: for its kept sets (see `generate_sample`).
    ``max_failed_fraction``: raise :class:`RolloutFailedError` (cancelling the requests still running) as soon as
    more than this share of the rollout's samples failed.
    """

    def params_of(index: int) -> dict[str, Any]:
        if sampling_seed is None:
            return sampling_params
        return {**sampling_params, "sampling_seed": mix_seed(sampling_seed, index)}

    async def one_group(g: int, prompt: list[int], one_sample: Callable[[Sample], Any]) -> list[Sample]:
        samples = [Sample(prompt_tokens=list(prompt), group_id=group_id_offset + g,
                          index=g * n_samples_per_prompt + j) for j in range(n_samples_per_prompt)]
        async with asyncio.TaskGroup() as tg:  # an error cancels the group's other requests too
            for s in samples:
                tg.create_task(one_sample(s))
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

    total = len(prompts) * n_samples_per_prompt
    failed: list[Sample] = []

    def count_failures(samples: Sequence[Sample]) -> None:  # stop as soon as the rollout cannot be trained
        failed.extend(s for s in samples if s.status == SampleStatus.FAILED)
        if max_failed_fraction is not None and len(failed) > max_failed_fraction * total:
            raise RolloutFailedError(failed, total, max_failed_fraction, early=True)

    async def one_sample(s: Sample) -> Sample:
        await generate_sample(client, s, params_of(s.index), stream=stream, pause_policy=pause_policy, stop=stop,
                              routed_experts=routed_experts, nucleus_logprobs=nucleus_logprobs,
                              sampling_mask=sampling_mask)
        count_failures([s])
        return s

    async def checked_group(g: int, prompt: list[int]) -> list[Sample]:
        samples = await one_group(g, prompt, one_sample)
        count_failures([s for s in samples if s.failure_reason and s.failure_reason.startswith("reward_fn")])
        return samples

    try:
        async with asyncio.TaskGroup() as tg:  # a RolloutFailedError cancels the other requests
            tasks = [tg.create_task(checked_group(g, list(p))) for g, p in enumerate(prompts)]
    except BaseExceptionGroup as group:
        raise _unwrap(group) from None
    return [s for t in tasks for s in t.result()]


def _unwrap(group: BaseExceptionGroup) -> BaseException:
    """The error a TaskGroup's exception group stands for: the RolloutFailedError with the most failures, else
    the first leaf (a bug, or a cancellation)."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        e = stack.pop()
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        else:
            leaves.append(e)
    failed = [e for e in leaves if isinstance(e, RolloutFailedError)]
    if failed:
        return max(failed, key=lambda e: len(e.failed))
    return leaves[0]


async def with_health_watch(client: SGLangClient, aw: Awaitable[T], interval: float, timeout: float,
                            generate: bool = True) -> T:
    """Await ``aw`` while ``client.control.watch_health(interval, timeout, generate)`` checks the engines: when none
    is left, ``aw`` is cancelled and :class:`~slime_corr.rollout.control.EnginesDownError` raised, so a dead or
    stopped engine ends the wait within about ``interval + timeout`` seconds."""
    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(client.control.watch_health(interval, timeout, generate))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            watch.result()  # raises EnginesDownError
        return work.result()
    finally:
        for task in (work, watch):
            task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)


class RolloutFailedError(RuntimeError):
    """More than `max_fraction` of a rollout's `total` samples failed: the message groups the failures by kind and
    server, with an example reason and what to check."""

    def __init__(self, failed: Sequence[Sample], total: int, max_fraction: float, early: bool = False,
                 rollout: int | None = None) -> None:
        self.failed, self.total, self.max_fraction, self.early = list(failed), total, max_fraction, early
        super().__init__(failure_summary(failed, total, max_fraction, early=early, rollout=rollout))


# failure kind -> what to check ({server}: the server the failures came from)
FAILURE_HINTS = {
    "connection refused": "is the server (or router) at {server} still running? `curl {server}/health`; its log "
                          "says why it stopped",
    "connection broken": "{server} dropped connections mid-answer: its log (a crash, out of memory, a restart)",
    "timeout": "{server} accepted the requests but sent nothing for --rollout-request-timeout seconds: is it stuck "
               "or overloaded (its log, its accelerator)? Raise --rollout-request-timeout for slow generations",
    "bad response": "{server} answers /generate with something that is not SGLang's JSON (or without per-token "
                    "log-probs): is it an SGLang server (not a proxy or another service), returning "
                    "meta_info.output_token_logprobs?",
    "non-finite log-prob": "{server} returned a NaN, inf or null log-prob for a sampled token: its forward "
                           "overflowed (in bfloat16/float16: try --engine-dtype float32), or it serves another model "
                           "than the trainer's (a tied-embedding checkpoint, a config key read otherwise): its log",
    "HTTP 5xx": "{server} failed the requests: its log",
    "HTTP 4xx": "{server} refused the requests as invalid: its version and log (which field it rejects)",
    "stream error event": "{server} reported an error inside the stream: its log",
    "aborted by server": "{server} aborted the requests with an error status: its log (memory, scheduler)",
    "paused": "the engines were paused for a weight update and never continued",
    "engine dead": "{server} stopped answering its health check: is the process alive (and not stopped)?",
    "reward_fn": "the task's reward function raised on these responses (see the example)",
    "invalid response": "the server's output does not fit the sample (see the example)",
}


def _kind_and_server(sample: Sample) -> tuple[str, str]:
    reason = sample.failure_reason or ""
    kind = sample.metadata.get("failure_kind") or ("reward_fn" if reason.startswith("reward_fn") else
                                                   "invalid response" if reason.startswith("invalid response")
                                                   else "other")
    return kind, sample.metadata.get("failure_server") or "-"


def failure_summary(failed: Sequence[Sample], total: int, max_fraction: float, *, early: bool = False,
                    rollout: int | None = None) -> str:
    """Why a rollout stopped: the failed share against --max-failed-sample-fraction, then one line per
    (kind, server) with the count and an example reason, then what to check."""
    groups: dict[tuple[str, str], list[Sample]] = {}
    for s in failed:
        groups.setdefault(_kind_and_server(s), []).append(s)
    name = "the rollout" if rollout is None else f"rollout {rollout}"
    when = " before it finished (the other requests were cancelled)" if early else ""
    lines = [f"{name}: {len(failed)} of {total} samples failed{when}, more than --max-failed-sample-fraction "
             f"{max_fraction:g}: the run stops rather than train on what is left. Failures by kind and server:"]
    for (kind, server), samples in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        example = (samples[0].failure_reason or "")[:400]
        lines.append(f"  {len(samples)} x {kind} @ {server}: e.g. {example}")
    lines.append("What to check:")
    for kind, server in dict.fromkeys(k for k in sorted(groups, key=lambda k: -len(groups[k]))):
        hint = FAILURE_HINTS.get(kind, "the example reason above")
        lines.append(f"  {kind}: {hint.format(server=server)}")
    return "\n".join(lines)


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
                         client.failovers - failovers_before, dict(client.control.dead),
                         client.control.events[events_before:])
