"""The rollout driver: the one process (global rank 0) that talks to the rollout engines.

It starts the embedded engine group once (or checks and uses `--sglang-url`), runs one `SGLangClient` on a
background event loop, generates rollouts (GRPO groups of the `--task`'s prompts, one seeded request per sample,
scored by the task's reward on the decoded response), and pushes new weights to every engine
(`--rollout-weight-sync`: a checkpoint on disk, or a broadcast over a process group).
`submit(k)` starts rollout k and returns a future: the loop waits on it at once (synchronous) or lets it run while
the previous rollout trains (asynchronous; up to `--max-staleness` allows several ahead, generated one after
another). The engines never change weights during a rollout: the trainer syncs only once the rollouts in flight
have finished, so every sample carries exactly one weight version.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from torch import Tensor

from slime_corr.device import engine_device, weight_sync_backend
from slime_corr.engines.embedded.model import ByteTokenizer, Tokenizer
from slime_corr.engines.launch import ROUTES_FLAG, EngineSpec, start_engines
from slime_corr.monitoring.progress import ProgressSampleBuffer, RolloutProgress
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.data_iterator import CANCEL_TIMEOUT, background_event_loop, cancel_pending_tasks
from slime_corr.rollout.rollout import (
    RolloutFailedError,
    RolloutReport,
    generate_group_samples,
    rollout_report,
    with_health_watch,
)
from slime_corr.rollout.sampling import mix_seed
from slime_corr.rollout.weight_calls import weight_call_timeout
from slime_corr.rollout.weight_sync import DistributedWeightSync, SyncReport, sync_weights_from_disk
from slime_corr.samples import Sample
from slime_corr.trainer.config import TrainerConfig
from slime_corr.trainer.data import VERSION_PREFIX, weight_version
from slime_corr.trainer.task import TASKS, Response, encode_prompt

WAIT_NOTICE_S = 30.0  # a rollout that takes longer says so this often (no silence over ~30 s)


class RolloutDriver:
    """Rank 0's rollout side (see the module doc). Use as a context manager; `start` before the first rollout.

    `tokenizer` encodes the task's prompts (with its chat template when it has one) and decodes responses for the
    reward (default: byte-level); the embedded engines tokenize `text` with `engine_tokenizer` and serve the model
    as `served_model_name`."""

    def __init__(self, config: TrainerConfig, engine_module: Callable[[str], Any], weights_dir: Path,
                 progress_mode: str = "auto", *, tokenizer: Any = None, engine_tokenizer: Tokenizer | None = None,
                 served_model_name: str = "slime-corr-tiny", log_dir: Path | None = None) -> None:
        self.config = config
        self.engine_module = engine_module
        self.task = TASKS[config.task]
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.engine_tokenizer = engine_tokenizer
        self.served_model_name = served_model_name
        self.weights_dir = weights_dir
        self.log_dir = log_dir if log_dir is not None else weights_dir.parent / "engine_logs"
        self.progress_mode = progress_mode
        self._stack = contextlib.ExitStack()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client: SGLangClient | None = None
        self.syncer: DistributedWeightSync | None = None
        self.description = ""
        self._counters: dict[int, tuple[int, int]] = {}
        self._lock: asyncio.Lock | None = None  # one rollout generates at a time (made on the loop)  # rollout -> the client's (failovers, events) at submit

    def __enter__(self) -> RolloutDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    # ------------------------------------------------------------------ engines
    def start(self, weights: dict[str, Tensor], step: int, save: Callable[[dict[str, Tensor], Path], str]) -> str:
        """Start the engines with the policy's `weights` (after `step` optimizer steps), or push them to the
        `--sglang-url` engines; returns a description for the log. `save(weights, dir)` writes an engine
        checkpoint."""
        cfg = self.config
        version = weight_version(step)
        if cfg.sglang_url:
            urls = list(cfg.sglang_url)
            kind = "SGLang" if cfg.rollout_engine == "sglang" else "embedded engines"
            self.description = f"{kind} at {', '.join(urls)}"
        else:
            spec = EngineSpec(kind=cfg.rollout_engine, num_engines=cfg.rollout_num_engines, router=cfg.rollout_router,
                              dtype=cfg.engine_dtype, served_model_name=self.served_model_name, seed=cfg.seed,
                              log_dir=self.log_dir, sglang_python=cfg.sglang_python,
                              sglang_args=(*cfg.sglang_server_args,
                                           *((ROUTES_FLAG,) if cfg.asks_routes else ())),
                              skip_tokenizer_init=self.engine_tokenizer is None, device=engine_device(),
                              embedded_module=self.engine_module, tokenizer=self.engine_tokenizer)
            group = self._stack.enter_context(start_engines(spec, save(weights, self.weights_dir / version), version))
            urls = group.urls
            kind = "SGLang servers" if cfg.rollout_engine == "sglang" else "embedded engines"
            logs = f"; logs in {self.log_dir}" if cfg.rollout_engine == "sglang" else ""
            self.description = f"{kind} ({cfg.engine_dtype}; trainer in {cfg.trainer_dtype}): {group.describe()}{logs}"
        self.loop = self._stack.enter_context(background_event_loop())
        self.client = self._run(_open_client(urls, cfg))
        self._stack.callback(self._close_client)
        if cfg.rollout_weight_sync == "distributed":  # engines this job starts share its device
            self.syncer = DistributedWeightSync(
                self.client, bucket_bytes=cfg.update_weight_buffer_size,
                master_address=cfg.update_weight_master_address,
                backend=weight_sync_backend(engines_share_device=not cfg.sglang_url),
                timeout=weight_call_timeout(cfg.rollout_control_timeout, cfg.update_weight_buffer_size))
            self._stack.callback(self._leave_weight_group)
        if cfg.sglang_url:  # the servers start with their own weights: serve the trainer's policy
            # an embedded engine may serve another architecture than the trainer's: its first weights come as a
            # checkpoint that names its module (later updates by name fit it); SGLang serves the same model
            self.sync_weights(weights, step, save, from_disk=cfg.rollout_engine == "embedded")
        return self.description

    def _watched(self, aw: Any, generate: bool = True) -> Any:
        """`aw` under the engines' health checks (`--rollout-health-check-interval` / `-timeout`; `generate=False`:
        `/health` only, for weight updates, which pause the engines)."""
        assert self.client is not None
        return with_health_watch(self.client, aw, self.config.rollout_health_check_interval,
                                 self.config.rollout_health_check_timeout, generate)

    def _leave_weight_group(self) -> None:
        """The engines outlive the job (`--sglang-url`): leave them without the job's weight-update group
        (bounded, best effort: an engine that does not answer does not hold up the exit)."""
        assert self.loop is not None and self.syncer is not None
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.syncer.disconnect(), self.loop).result(timeout=CANCEL_TIMEOUT)
        self.syncer.close()

    def _close_client(self) -> None:
        """Cancel the rollouts still running (a Ctrl-C or an error mid-rollout), then close the client's
        session: nothing reopens one after it (bounded: a stuck request does not hold up the exit)."""
        assert self.loop is not None and self.client is not None

        async def close(client: SGLangClient) -> None:
            await cancel_pending_tasks()
            await client.close()

        with contextlib.suppress(TimeoutError):  # the loop's own exit cancels what is left
            asyncio.run_coroutine_threadsafe(close(self.client), self.loop).result(timeout=CANCEL_TIMEOUT)

    def _run(self, coro: Any) -> Any:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # ------------------------------------------------------------------ rollouts
    def submit(self, rollout: int) -> Future[list[Sample]]:
        """Start rollout number `rollout` on the background loop; the future gives its samples in group order.
        Rollouts submitted ahead generate one after another (in submission order), each alone on the engines."""
        assert self.client is not None
        self._counters[rollout] = self.client.failovers, len(self.client.control.events)
        return self._generate(rollout, None)

    def regenerate(self, rollout: int, groups: Sequence[int]) -> Future[list[Sample]]:
        """Generate again the GRPO `groups` (indices within rollout `rollout`) with the engines' current weights
        (`--staleness-policy regenerate`); the future gives their samples, group after group, indexed as in the
        rollout. Their sampling seeds differ from the first generation's (a new draw, not a replay)."""
        return self._generate(rollout, list(groups))

    def _generate(self, rollout: int, groups: list[int] | None) -> Future[list[Sample]]:
        assert self.loop is not None and self.client is not None
        cfg = self.config
        count = cfg.samples_per_rollout if groups is None else len(groups) * cfg.n_samples_per_prompt
        progress = RolloutProgress(count, step=rollout, mode=self.progress_mode)
        buffer = ProgressSampleBuffer(count, progress)  # only counts: never full, never read
        params = {"max_new_tokens": cfg.rollout_max_response_len, "temperature": cfg.rollout_temperature,
                  **cfg.truncation.sampling_params()}
        client = self.client
        routes = cfg.routed_experts_spec()  # MoE: ask every request for the engine's routes
        prompts = self.task.prompts(cfg.seed, rollout, cfg.rollout_batch_size)
        offset = rollout * cfg.rollout_batch_size
        n = cfg.n_samples_per_prompt

        def reward(sample: Sample) -> float:  # on the decoded response, special tokens skipped
            text = self.tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
            return self.task.reward(Response(text, sample.response_tokens, prompts[sample.group_id - offset].label))

        def one(prompt_groups: list[int], seed: int, group_offset: int) -> Any:
            return generate_group_samples(
                client, [encode_prompt(self.tokenizer, prompts[g]) for g in prompt_groups], n, params,
                stream=True, reward_fn=reward, buffer=buffer, group_id_offset=group_offset, sampling_seed=seed,
                max_failed_fraction=cfg.max_failed_sample_fraction, routed_experts=routes,
                nucleus_logprobs=cfg.rollout_nucleus_logprobs, sampling_mask=cfg.replays_kept_sets)

        async def generate() -> list[Sample]:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                try:
                    if groups is None:
                        return await self._watched(one(list(range(len(prompts))), mix_seed(cfg.seed, rollout), offset))
                    out = []
                    for g in groups:  # one group at a time keeps its group id and seeds its own
                        fresh = await self._watched(one([g], mix_seed(mix_seed(cfg.seed, rollout), -1 - g),
                                                        offset + g))
                        for j, sample in enumerate(fresh):
                            sample.index = g * n + j
                        out.extend(fresh)
                    return out
                except RolloutFailedError as e:  # the same, naming the rollout
                    raise RolloutFailedError(e.failed, e.total, e.max_fraction, e.early, rollout) from None
                finally:
                    progress.close()

        return asyncio.run_coroutine_threadsafe(generate(), self.loop)  # type: ignore[return-value]

    def wait(self, future: Future[list[Sample]], rollout: int, say: Callable[[str], None]) -> list[Sample]:
        """The samples of `future` (rollout `rollout`), with a line to `say` every WAIT_NOTICE_S seconds it takes:
        which engines, how long so far, what bounds it."""
        assert self.client is not None
        start = time.monotonic()
        while True:
            try:
                return future.result(timeout=WAIT_NOTICE_S)
            except TimeoutError:
                if future.done():  # the rollout's own TimeoutError, not the wait's
                    raise
            cfg = self.config
            say(f"slime_corr.main: waiting for rollout {rollout} from {', '.join(self.client.urls)}: "
                f"{time.monotonic() - start:.0f} s so far (a /generate attempt ends after "
                f"{cfg.rollout_request_timeout:g} s without a byte, --rollout-request-timeout; 4 attempts per sample)")

    def report(self, rollout: int, samples: list[Sample]) -> RolloutReport:
        """What rollout `rollout` went through: sample statuses, retries, failovers, dead engines (the client's
        counters since it was submitted; with an asynchronous rollout they include the overlapping one's)."""
        assert self.client is not None
        return rollout_report(samples, self.client, *self._counters.pop(rollout, (0, 0)))

    # ------------------------------------------------------------------ weights
    def sync_weights(self, weights: dict[str, Tensor], step: int,
                     save: Callable[[dict[str, Tensor], Path], str], from_disk: bool = False) -> SyncReport:
        """Every engine serves `weights` as `weight_version(step)` once this returns (no rollout may be running);
        through a checkpoint on disk with `from_disk`, else as `--rollout-weight-sync` says."""
        version = weight_version(step)
        if self.syncer is not None and not from_disk:
            return self._run(self._watched(self.syncer.sync(weights.items(), version), generate=False))
        assert self.client is not None
        report = self._run(self._watched(sync_weights_from_disk(self.client, save(weights, self.weights_dir / version),
                                                                version), generate=False))
        for old in self.weights_dir.glob(f"{VERSION_PREFIX}*"):  # the engines no longer read older files
            if old.name != version:
                shutil.rmtree(old, ignore_errors=True)
        return report


async def _open_client(urls: list[str], cfg: TrainerConfig) -> SGLangClient:
    # no total cap on an attempt (a long generation streams for long): silence is what times out
    client = SGLangClient(urls, request_timeout=None, read_timeout=cfg.rollout_request_timeout,
                          control_timeout=cfg.rollout_control_timeout)
    try:
        await client.control.wait_healthy()
    except BaseException:  # an engine that never became healthy, or a Ctrl-C: no session left open
        await client.close()
        raise
    return client


__all__ = ["RolloutDriver"]
