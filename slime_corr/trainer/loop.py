"""The main job's loop: torch.distributed + Megatron's parallel state, the policy, the rollout driver on rank 0,
the update loop on every rank, weight sync, checkpoints and the metrics, from ONE rank.

Per rollout k (synchronous):   driver generates k → scatter to DP ranks → K optimizer steps → sync weights.
Asynchronous (`--async-rollout`): rollout k+1 is submitted as soon as rollout k is in hand, so it is generated
(with the weights before rollout k's updates) while k trains; the weights are synced once it has finished. Every
sample is then one rollout (S optimizer steps) older than in the synchronous loop, which its weight version
records and `rollout/staleness_*`, the correction and the diagnostics see. `--max-staleness K` (optimizer steps)
lets the producer run A = (K + 1) // S − 1 rollouts ahead: at rollout k the rollouts up to k + A not yet in hand
are submitted (generated one after another with the weights of the last sync), and the weights are synced once
they are all done. Which weights sample a rollout is then fixed by (k, A), not by timing, so a slow trainer never
exceeds the bound and a resumed run samples what the uninterrupted one did. `--partial-rollout`: the weights are
synced right after training, while those rollouts are still generating (the client pauses, the engines update,
generation continues); their requests finish under the new weights, every token keeping its version (timing then
decides where a sample's versions change, so such a run is not bit-reproducible).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.device import init_distributed
from slime_corr.layout.micro_batch import TRAINABLE
from slime_corr.loss_terms import LossTermsConfig
from slime_corr.mcore import threads as mcore_threads
from slime_corr.mcore.cpu_compat import apply_cpu_compat
from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
from slime_corr.mcore.parallel_groups import destroy_model_parallel_groups
from slime_corr.mcore.pipeline import gather_stages
from slime_corr.mcore.precision import build_optimizer
from slime_corr.monitoring.config import MonitoringConfig
from slime_corr.monitoring.keys import loss_step_metrics
from slime_corr.monitoring.logger import MetricsLogger
from slime_corr.monitoring.loss_scale import SKIPPED_KEY, SkippedSteps
from slime_corr.monitoring.rollout_stats import rollout_metrics, step_sample_counts
from slime_corr.monitoring.step_diagnostics import diagnostic_metrics, top_mismatch_records
from slime_corr.samples import Sample, SampleStatus
from slime_corr.trainer import interrupts
from slime_corr.trainer.agreement import check_agreement
from slime_corr.trainer.checkpoint import TrainState, load_train_state, save_train_state
from slime_corr.trainer.config import TrainerConfig
from slime_corr.trainer.data import (
    build_micro_batches,
    mask_offpolicy_tokens,
    mask_stale_tokens,
    oldest_version_step,
    rollout_shards,
    scatter_shards,
    stale_samples,
    staleness,
)
from slime_corr.trainer.driver import RolloutDriver
from slime_corr.trainer.mismatch_gate import check_mismatch_gate
from slime_corr.trainer.policy import build_policy
from slime_corr.trainer.update import Updater
from slime_corr.trainer.watchdog import ABORT_KEY, DriverBeacon


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs, each concern validated on its own."""

    trainer: TrainerConfig
    correction: RolloutCorrectionConfig
    loss_terms: LossTermsConfig
    monitoring: MonitoringConfig
    hparams: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutRecord:
    """Wall-clock seconds of one rollout iteration, split (driver's view; `bench/e2e.py` reads them as `perf/*`)."""

    rollout_wait: float = 0.0  # waiting for the rollout's samples (async: for the in-flight one too)
    data: float = 0.0  # advantages, the DP plan, the scatter, building micro-batches
    prepare: float = 0.0  # the forward-only pass: lp_old / reference log-probs
    train: list[float] = field(default_factory=list)  # each optimizer step, without that pass
    loss: list[float] = field(default_factory=list)  # of which the loss functions' forward
    micro_batches: list[int] = field(default_factory=list)  # each step's micro-batches per DP rank
    empty_micro_batches: list[int] = field(default_factory=list)  # of which empty (packed), over all DP ranks
    stale_dropped: list[int] = field(default_factory=list)  # per step: samples over --max-staleness, dropped
    stale_regenerated: list[int] = field(default_factory=list)  # per step: samples of regenerated groups
    offpolicy_masked: list[int] = field(default_factory=list)  # per step: tokens masked by --mask-offpolicy-...
    stale_masked: list[int] = field(default_factory=list)  # per step: tokens masked by --max-token-staleness
    weight_sync: float = 0.0
    checkpoint: float = 0.0  # the save after the previous rollout (steps are logged before this rollout's save)
    wall: float = 0.0


@dataclass
class RunProgress:
    """How far a run got (rank 0's view), for the line a Ctrl-C or an error ends with."""

    rollout: int = 0  # rollouts done
    step: int = 0  # optimizer steps done
    checkpoint: str | None = None  # the last checkpoint saved (or loaded)


def _is_exporting_rank() -> bool:
    """The ranks whose TP shards (and PP stages) make the full weights the driver sends: DP and CP rank 0."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0


def run(config: RunConfig, progress: RunProgress | None = None) -> list[RolloutRecord]:
    """The whole job (see the module doc); every rank calls it. Returns the driver's timing records; `progress`
    follows how far it got."""
    from megatron.core import parallel_state as ps

    cfg = config.trainer
    created = init_distributed(cfg.distributed_timeout_minutes, cfg.device)
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tensor_model_parallel_size,
                                 context_parallel_size=cfg.context_parallel_size,
                                 pipeline_model_parallel_size=cfg.pipeline_model_parallel_size)
    apply_cpu_compat()
    mcore_threads.install()  # the embedded engine's forwards (other threads under --async-rollout) get their own
    try:
        with contextlib.ExitStack() as stack:
            return _Job(config, stack, progress or RunProgress()).run()
    finally:
        destroy_model_parallel_groups(world=created)  # destroyed, not only forgotten: nothing left running


class _Job:
    """One run's state on one rank; `run` is the loop."""

    def __init__(self, config: RunConfig, stack: contextlib.ExitStack, progress: RunProgress) -> None:
        from megatron.core import parallel_state as ps


        cfg, corr = config.trainer, config.correction
        self.config, self.cfg, self.progress = config, cfg, progress
        self.is_driver = dist.get_rank() == 0
        self.beacon = DriverBeacon(cfg.distributed_timeout_minutes * 60)
        stack.callback(self.beacon.close)
        self._checkpoint_carry = 0.0  # a save's seconds, logged with the next rollout's steps
        self._agreement_checked = False  # the start-up agreement check (trainer.agreement) is done
        self.skipped_steps = SkippedSteps()  # the fp16 loss scaler's (monitoring/loss_scale.py)
        dp_ranks: list[int | None] = [None] * dist.get_world_size()
        dist.all_gather_object(dp_ranks, ps.get_data_parallel_rank())
        self.dp_rank_of = [int(r) for r in dp_ranks]  # type: ignore[arg-type]
        self.policy = build_policy(cfg, with_reference=config.loss_terms.uses_reference)
        self.routes = cfg.routed_experts_spec()  # MoE: the shape of the engine's routes (None: not asked)
        mixed = cfg.precision.mixed  # --bf16 / --fp16: Megatron's optimizer (fp32 main params, loss scaling)
        self.optimizer = build_optimizer([self.policy.model], cfg.precision, lr=cfg.lr, clip_grad=cfg.clip_grad) \
            if mixed else torch.optim.Adam(self.policy.model.parameters(), lr=cfg.lr)
        monitoring = config.monitoring
        diagnostics = monitoring.log_mismatch_diagnostics and corr.computes_metrics
        self.hook = RolloutCorrectionLoss(
            corr, temperature=cfg.rollout_temperature, truncation=cfg.truncation, model_forward=self.policy.forward,
            seq_length_for_norm=cfg.rollout_max_response_len,
            loss_terms=config.loss_terms, ref_model=self.policy.reference,
            diagnostics_top_k=monitoring.log_top_mismatch_samples if diagnostics else None,
            prox_logp_method=cfg.prox_logp_method)
        # loglinear has no lp_old before the update: baselines stay as sampled (as in bypass mode)
        rebaseline = not corr.use_rollout_logprobs and corr.use_rollout_correction and \
            cfg.prox_logp_method == "recompute"
        self.updater = Updater(self.policy.model, self.optimizer, self.hook, clip_grad=cfg.clip_grad,
                               rebaseline=rebaseline, normalize_std=cfg.grpo_std_normalization)
        self.state = load_train_state(cfg, self.policy.module, self.optimizer) if cfg.load else TrainState()
        progress.rollout, progress.step = self.state.rollout, self.state.step
        progress.checkpoint = cfg.load if cfg.load else None
        hidden = {key for key, on in (("rollout/staleness_mean", cfg.async_rollout),
                                      ("train/entropy", config.loss_terms.uses_entropy)) if not on}
        self.logger = stack.enter_context(MetricsLogger(monitoring, hparams=config.hparams, enabled=self.is_driver,
                                                        console_hidden=hidden, append=bool(cfg.load)))
        self.driver: RolloutDriver | None = None
        if self.is_driver:
            weights_dir = Path(cfg.work_dir) / "weights" if cfg.work_dir else \
                Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="slime_corr_weights_")))
            self.driver = stack.enter_context(RolloutDriver(
                cfg, self.policy.engine_module, weights_dir, monitoring.rollout_progress,
                tokenizer=self.policy.tokenizer, engine_tokenizer=self.policy.engine_tokenizer,
                served_model_name=self.policy.name,
                log_dir=self.logger.run_dir / "engine_logs" if self.logger.run_dir else None))
        self.say(f"metrics: {self.logger.run_dir / 'metrics.jsonl'}" if self.logger.run_dir else "")
        self.say(f"parallel: TP={cfg.tensor_model_parallel_size} CP={cfg.context_parallel_size} "
                 f"PP={cfg.pipeline_model_parallel_size} DP={cfg.data_parallel_size} ({cfg.world_size} process(es)); "
                 f"micro-batches: {cfg.micro_batching}; rollout: {cfg.rollout_batch_size} "
                 f"prompts × {cfg.n_samples_per_prompt} samples in {cfg.num_steps_per_rollout} step(s) of "
                 f"{cfg.global_batch_size}; {'asynchronous' if cfg.async_rollout else 'synchronous'}")

    def say(self, line: str) -> None:
        """Console output: the driver's only."""
        if self.is_driver and line:
            print(line, flush=True)

    def _weights(self) -> dict[str, torch.Tensor] | None:
        """The full weights on the driver (collective on the exporting ranks: each stage's TP group, then the
        stages' gather to the first); None elsewhere."""

        if not _is_exporting_rank():
            return None
        weights = gather_stages(self.policy.full_weights())
        return weights if self.is_driver else None

    # ------------------------------------------------------------------ the loop
    def run(self) -> list[RolloutRecord]:
        try:
            return self._run()
        except Exception as e:  # the other ranks stop with it instead of waiting for the driver
            if self.is_driver:
                self.beacon.publish(ABORT_KEY, str(e) or type(e).__name__)
            raise

    def _driver_done(self, key: str, what: str) -> None:
        """The driver has done `key` (it publishes it); the other ranks wait for it, bounded (see watchdog)."""
        if self.is_driver:
            self.beacon.publish(key)
        else:
            self.beacon.wait(key, what)

    def _run(self) -> list[RolloutRecord]:
        cfg, state = self.cfg, self.state
        weights = self._weights()
        if self.driver is not None:
            assert weights is not None
            self.say(self.driver.start(weights, state.step, self.policy.save_engine_checkpoint))
        if state.rollout:
            self.say(f"resumed from {cfg.load}: rollout {state.rollout}, step {state.step}")
        ahead: list[Future[list[Sample]]] = []  # the driver's rollouts submitted after the one training, in order
        records = []
        for rollout in range(state.rollout, cfg.num_rollout):
            interrupts.raise_if_interrupted()  # a Ctrl-C whose KeyboardInterrupt was dropped on its way
            record = RolloutRecord()
            start = time.perf_counter()
            samples: list[Sample] = []
            if self.driver is not None:
                samples = self._next_rollout(rollout, ahead, record)
            self._driver_done(f"rollout/{rollout}", f"starting the engines and generating rollout {rollout}")
            record.rollout_wait = time.perf_counter() - start
            first_step = state.step
            results = self._train(samples, first_step, record)
            state.step += len(results)
            if self.driver is not None and ahead and (not cfg.partial_rollout or self._saves_after(rollout)):
                # the engines may change weights once they are done (partial rollouts: at once, mid-request;
                # a checkpoint still takes them whole)
                waited = time.perf_counter()
                state.pending.extend(self.driver.wait(f, rollout + 1 + i, self.say) for i, f in enumerate(ahead))
                ahead.clear()
                record.rollout_wait += time.perf_counter() - waited
            if cfg.async_rollout and (not cfg.partial_rollout or self._saves_after(rollout)) and \
                    (rollout + 1 < cfg.num_rollout or self._saves_after(rollout)):
                self._driver_done(f"rollout/{rollout + 1}", f"generating rollout {rollout + 1}")
            sync = self._sync_weights(record)
            state.rollout = rollout + 1
            self.progress.rollout, self.progress.step = state.rollout, state.step
            record.checkpoint, self._checkpoint_carry = self._checkpoint_carry, 0.0  # the previous rollout's save
            record.wall = time.perf_counter() - start + record.checkpoint
            self._log(rollout, samples, first_step, results, record, sync)  # before the save: never lost to it
            if self._saves_after(rollout):
                self._driver_done(f"synced/{rollout}", f"sending the weights of rollout {rollout} to the engines")
                self._checkpoint_carry = self._save()
            records.append(record)
        if summary := self.skipped_steps.summary():
            self.say(f"slime_corr.main: warning: {summary}")
        return records

    def _saves_after(self, rollout: int) -> bool:
        cfg = self.cfg
        done = rollout + 1
        return bool(cfg.save) and (done % (cfg.save_interval or cfg.num_rollout) == 0 or done == cfg.num_rollout)

    def _next_rollout(self, rollout: int, ahead: list[Future[list[Sample]]], record: RolloutRecord) -> list[Sample]:
        """The driver's samples of `rollout` (already generated when pending), its stale samples dropped or
        regenerated (`_bound_staleness`); in asynchronous mode the rollouts up to `rollout + A` not yet in hand
        are submitted now (appended to `ahead`), generated with the engines' current weights: A = the config's
        `rollouts_ahead` (1 by default; more under `--max-staleness`). Also past the last rollout when the run saves
        checkpoints, which then hold them, so that a resumed run trains what the uninterrupted one would."""
        assert self.driver is not None
        cfg, state = self.cfg, self.state
        if state.pending:
            samples = state.pending.pop(0)
        elif ahead:  # partial rollouts: still in flight across the last sync
            samples = self.driver.wait(ahead.pop(0), rollout, self.say)
        else:
            samples = self.driver.wait(self.driver.submit(rollout), rollout, self.say)
        if cfg.async_rollout:
            for later in range(rollout + len(state.pending) + len(ahead) + 1, rollout + cfg.rollouts_ahead + 1):
                if later < cfg.num_rollout or cfg.save:
                    ahead.append(self.driver.submit(later))
            samples = self._bound_staleness(rollout, samples, record)
        return self._mask_old_tokens(samples, record)

    def _mask_old_tokens(self, samples: list[Sample], record: RolloutRecord) -> list[Sample]:
        """`--mask-offpolicy-in-partial-rollout` and `--max-token-staleness`: the tokens they take out of the loss,
        counted per step (step k of the rollout trains samples[k·per_step : (k+1)·per_step])."""
        cfg = self.cfg
        if not cfg.mask_offpolicy_in_partial_rollout and cfg.max_token_staleness is None:
            return samples
        steps = cfg.num_steps_per_rollout
        assert isinstance(steps, int)
        per_step = max(1, len(samples) // steps)
        if cfg.mask_offpolicy_in_partial_rollout:
            record.offpolicy_masked = [0] * steps
        if cfg.max_token_staleness is not None:
            record.stale_masked = [0] * steps
        for i, sample in enumerate(samples):
            k = min(i // per_step, steps - 1)
            if cfg.mask_offpolicy_in_partial_rollout:
                sample, masked = mask_offpolicy_tokens(sample)
                record.offpolicy_masked[k] += masked
            if cfg.max_token_staleness is not None:
                sample, masked = mask_stale_tokens(sample, self.state.step + k, cfg.max_token_staleness)
                record.stale_masked[k] += masked
            samples[i] = sample
        return samples

    def _bound_staleness(self, rollout: int, samples: list[Sample], record: RolloutRecord) -> list[Sample]:
        """Samples older than `--max-staleness` at the step that trains them (`stale_samples`; only a rollout
        pending in a checkpoint resumed with a smaller bound can hold them: the producer never runs further ahead)
        are dropped (marked aborted: out of the loss and of their group's baseline) or their GRPO groups
        regenerated with the engines' current weights (`--staleness-policy`); counted per step in `record`."""
        from dataclasses import replace


        assert self.driver is not None
        cfg = self.cfg
        steps, n = cfg.num_steps_per_rollout, cfg.n_samples_per_prompt
        assert isinstance(steps, int)
        per_step = max(1, len(samples) // steps)
        record.stale_dropped, record.stale_regenerated = [0] * steps, [0] * steps
        stale = stale_samples(samples, self.state.step, steps, cfg.staleness_bound)
        if not stale:
            return samples
        samples = list(samples)
        if cfg.staleness_policy == "regenerate":
            groups = sorted({i // n for i in stale})
            fresh = self.driver.regenerate(rollout, groups).result()
            for g, start in zip(groups, range(0, len(fresh), n), strict=True):
                samples[g * n:(g + 1) * n] = fresh[start:start + n]
                record.stale_regenerated[g * n // per_step] += n
            return samples
        for i in stale:
            lag = self.state.step + i // per_step - (oldest_version_step(samples[i]) or 0)
            samples[i] = replace(samples[i], status=SampleStatus.ABORTED,
                                 failure_reason=f"stale: {lag} steps old > --max-staleness {cfg.staleness_bound}")
            record.stale_dropped[i // per_step] += 1
        return samples

    def _train(self, samples: list[Sample], first_step: int, record: RolloutRecord) -> list[Any]:
        """Deal the driver's rollout to the ranks and train it (collective); times go to `record`."""
        from megatron.core import parallel_state as ps


        cfg = self.cfg
        start = time.perf_counter()
        shards = rollout_shards(samples, cfg.n_samples_per_prompt, cfg.num_steps_per_rollout, cfg.data_parallel_size,
                                cfg.grpo_std_normalization, micro_batch_size=cfg.micro_batch_size,
                                max_tokens=cfg.max_tokens_per_gpu if cfg.use_dynamic_batch_size else None,
                                cp_size=cfg.context_parallel_size, sp_size=cfg.sequence_parallel_size
                                ) if self.is_driver else None
        if shards is not None:
            record.micro_batches = [len(step) for step in shards[0].steps]
            record.empty_micro_batches = [sum(not mb for shard in shards for mb in shard.steps[k])
                                          for k in range(len(record.micro_batches))]
        shard = scatter_shards(shards, self.dp_rank_of)
        micro_batches = build_micro_batches(shard, first_step, cp_rank=ps.get_context_parallel_rank(),
                                            cp_size=cfg.context_parallel_size, pad_token_id=self.policy.pad_token_id,
                                            packed=cfg.use_dynamic_batch_size, routes=self.routes,
                                            sp_size=cfg.sequence_parallel_size, kept_sets=cfg.replays_kept_sets)
        record.data = time.perf_counter() - start
        interval = cfg.prox_logp_error_interval
        self.hook.measure_prox_error = bool(interval) and self.state.rollout % interval == 0
        results, times = self.updater.train_rollout(micro_batches)
        record.prepare, record.train, record.loss = times.prepare, times.steps, times.loss
        return results

    def _sync_weights(self, record: RolloutRecord) -> Any:
        start = time.perf_counter()
        weights = self._weights()
        report = None
        if self.driver is not None:
            assert weights is not None
            report = self.driver.sync_weights(weights, self.state.step, self.policy.save_engine_checkpoint)
        record.weight_sync = time.perf_counter() - start
        return report

    def _save(self) -> float:

        start = time.perf_counter()
        with interrupts.deferred():  # a Ctrl-C during the write ends the run once the checkpoint is whole
            path = save_train_state(self.cfg, self.state, self.policy.module, self.optimizer)
            self.progress.checkpoint = str(path)
            seconds = time.perf_counter() - start
            self.say(f"  checkpoint: {path} ({seconds:.2f}s)")
        return seconds

    # ------------------------------------------------------------------ metrics
    def _log(self, rollout: int, samples: list[Sample], first_step: int, results: list[Any], record: RolloutRecord,
             sync: Any) -> None:
        """Each optimizer step's metrics (driver only): the loss's, the rollout's, staleness, time."""
        if not self.is_driver:
            return

        assert self.driver is not None
        cfg = self.cfg
        self.say(f"rollout {rollout}: {self.driver.report(rollout, samples).line()}; weight sync "
                 f"({cfg.rollout_weight_sync}): step-{self.state.step} on {len(sync.workers)} engine(s) in "
                 f"{sync.seconds:.3f}s")
        rollout_part = rollout_metrics(samples)
        overhead = record.wall - sum(record.train)
        per_step = len(samples) // max(1, len(results))  # step k trains the rollout's k-th slice of whole groups
        for k, result in enumerate(results):
            step = first_step + k + 1
            counts = step_sample_counts(samples[k * per_step:(k + 1) * per_step])
            lag_mean, lag_max = staleness(samples, first_step + k)
            bound = {}
            if cfg.async_rollout:  # the bound's quantity: the oldest token of each sample this step trains
                trained = [first_step + k - v for s in samples[k * per_step:(k + 1) * per_step]
                           if s.status in TRAINABLE and (v := oldest_version_step(s)) is not None]
                part = samples[k * per_step:(k + 1) * per_step]
                bound = {"rollout/staleness_oldest_max": float(max(trained, default=0)),
                         "rollout/partial_samples": float(sum(len({v for v, _, _ in s.weight_versions}) > 1
                                                              for s in part if s.status in TRAINABLE)),
                         "rollout/offpolicy_masked_tokens":
                             float(record.offpolicy_masked[k] if record.offpolicy_masked else 0),
                         "rollout/staleness_dropped": float(record.stale_dropped[k] if record.stale_dropped else 0),
                         "rollout/staleness_regenerated":
                             float(record.stale_regenerated[k] if record.stale_regenerated else 0)}
            if cfg.max_token_staleness is not None:
                bound["rollout/stale_masked_tokens"] = float(record.stale_masked[k] if record.stale_masked else 0)
            # a step that trained no token has no loss or correction metric (absent, not 0)
            loss_part = loss_step_metrics(result.metrics) if counts["rollout/trained_samples"] else {}
            metrics = {**loss_part, **rollout_part, **counts,
                       "rollout/index": float(rollout), "rollout/staleness_mean": lag_mean,
                       "rollout/staleness_max": float(lag_max), **bound,
                       "perf/step_time": record.train[k] + overhead / len(results),
                       "perf/train_time": record.train[k], "perf/loss_time": record.loss[k],
                       "perf/rollout_time": record.rollout_wait, "perf/prepare_time": record.prepare,
                       "perf/data_time": record.data, "perf/weight_sync_time": record.weight_sync,
                       "perf/checkpoint_time": record.checkpoint,
                       "perf/micro_batches": float(record.micro_batches[k]),
                       "perf/empty_micro_batches": float(record.empty_micro_batches[k]),
                       **(diagnostic_metrics(result.diagnostics) if loss_part else {})}
            if metrics.get(SKIPPED_KEY, 0.0) >= 1:  # the loss scaler dropped this step's update: nothing trained
                metrics["rollout/trained_samples"] = 0.0
            if notice := self.skipped_steps.observe(step, metrics):
                self.say(f"slime_corr.main: note: {notice}")
            self.logger.log(step, metrics)
            # the start-up agreement check (trainer.agreement), on the first trained step whose every token (partial
            # rollouts too) came from the weights now trained: the same weights on both sides
            fresh = lag_max == 0 and not bound.get("rollout/staleness_oldest_max")
            if loss_part and fresh and not self._agreement_checked:
                self._agreement_checked = True
                if cfg.engine_agreement_check:
                    check_agreement(metrics, cfg.engine_dtype, cfg.trainer_dtype, step)
            if loss_part:  # the mismatch gate (--max-train-rollout-logprob-abs-diff, --max-mismatch-k3-kl)
                check_mismatch_gate(metrics, self.config.correction.mismatch_gates, step)
            if loss_part and result.diagnostics.top:
                self.logger.log_samples(step, top_mismatch_records(result.diagnostics, samples,
                                                                   self.policy.tokenizer.decode))


__all__ = ["RolloutRecord", "RunConfig", "RunProgress", "run"]
