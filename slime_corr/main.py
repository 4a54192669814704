"""The main job: a small end-to-end RL run with rollout correction, on CPU by default.

    python -m slime_corr.main --rollout-correction-preset decoupled_seq_is_rs --num-steps 3

Each step: prompts -> rollout (an SGLang server or router given by `--sglang-url`, else `--rollout-num-engines`
embedded engines serving the same Megatron GPTModel in bf16 on 127.0.0.1, behind sglang-router when there are
several) on a background event loop, each finished GRPO group streaming into a bounded buffer -> the trainer's
data iterator takes micro-batches from it as they fill (GRPO advantages, padding) -> `get_forward_backward_func`
with the rollout-correction loss (fp32 training forward) -> optimizer step -> checkpoint -> weight sync to every
engine (`--rollout-weight-sync`: `/update_weights_from_disk`, or a broadcast over a process group). The mismatch
metrics are real: the engine's bf16 log-probs differ from the trainer's fp32 ones. `--self-check` only builds and
prints the configuration.
Each step's metrics go to the console, RUN_DIR/metrics.jsonl, TensorBoard and W&B (`slime_corr.monitoring`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slime_corr.arguments import add_rollout_correction_args, parse_rollout_correction_config
from slime_corr.config import ConfigError, RolloutCorrectionConfig
from slime_corr.monitoring.config import MonitoringConfig, add_monitoring_args


def build_parser() -> argparse.ArgumentParser:
    from slime_corr.mcore.model import add_tiny_model_args

    parser = argparse.ArgumentParser(prog="slime_corr.main", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    run = parser.add_argument_group(title="run")
    run.add_argument("--self-check", action="store_true", help="Parse flags, build the config, print it, exit.")
    run.add_argument("--num-steps", type=int, default=3, help="Training steps (rollout + update each).")
    run.add_argument("--prompts-per-step", type=int, default=4, help="Prompts sampled per step.")
    run.add_argument("--n-samples-per-prompt", type=int, default=4, help="GRPO group size.")
    run.add_argument("--micro-batch-size", type=int, default=8,
                     help="Samples per Megatron micro-batch (a multiple of --n-samples-per-prompt).")
    run.add_argument("--rollout-buffer-size", type=int, default=None,
                     help="Samples the rollout may run ahead of training (default: 2 micro-batches).")
    run.add_argument("--max-new-tokens", type=int, default=24, help="Response length cap.")
    run.add_argument("--rollout-temperature", type=float, default=1.0,
                     help="Sampling temperature; the trainer's log-probs use the same.")
    run.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate.")
    run.add_argument("--sglang-url", action="append", default=None,
                     help="SGLang server or router URL (repeatable). Default: the embedded local engine.")
    run.add_argument("--engine-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                     help="Numeric path of the embedded engine (bfloat16 gives a real mismatch).")
    run.add_argument("--rollout-num-engines", type=int, default=1,
                     help="Embedded engines to start (no --sglang-url); several sit behind sglang-router.")
    run.add_argument("--rollout-router", choices=("auto", "on", "off"), default="auto",
                     help="sglang-router in front of several engines: auto = when installed (else the client "
                          "balances over the engines).")
    run.add_argument("--rollout-weight-sync", choices=("disk", "distributed"), default="disk",
                     help="How new weights reach the engines: a checkpoint on disk, or a broadcast over a "
                          "process group (gloo on CPU).")
    run.add_argument("--update-weight-buffer-size", type=int, default=512 * 1024**2,
                     help="Bytes per bucket of the distributed weight sync.")
    run.add_argument("--work-dir", default=None, help="Where checkpoints go (default: a temporary folder).")
    add_tiny_model_args(parser)
    add_monitoring_args(parser)
    parser.set_defaults(vocab_size=256)  # byte-level tokens, as the embedded engine uses
    return add_rollout_correction_args(parser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, config = parse_rollout_correction_config(parser, argv)
    if args.vocab_size < 128:
        parser.error("--vocab-size must be >= 128: prompts and rewards use ASCII byte tokens.")
    if args.micro_batch_size % args.n_samples_per_prompt:
        parser.error(f"--micro-batch-size {args.micro_batch_size} must be a multiple of --n-samples-per-prompt "
                     f"{args.n_samples_per_prompt}: GRPO groups are not split across micro-batches.")
    if args.rollout_num_engines < 1:
        parser.error(f"--rollout-num-engines must be >= 1, got {args.rollout_num_engines}.")
    if args.rollout_buffer_size is not None and args.rollout_buffer_size < args.micro_batch_size:
        parser.error(f"--rollout-buffer-size {args.rollout_buffer_size} must be >= --micro-batch-size "
                     f"{args.micro_batch_size}.")
    try:
        monitoring = MonitoringConfig.from_args(args, run_dir=args.run_dir or args.work_dir
                                                or time.strftime("runs/%Y%m%d-%H%M%S"))
    except ConfigError as e:
        parser.error(str(e))
    print("rollout correction config:")
    print(config.describe())
    if args.self_check:
        return 0
    if args.work_dir:
        run(args, config, Path(args.work_dir), monitoring)
    else:
        with tempfile.TemporaryDirectory(prefix="slime_corr_run_") as d:
            run(args, config, Path(d), monitoring)
    return 0


# ---------------------------------------------------------------------------------------------- the toy task
def make_prompts(step: int, n: int) -> list[list[int]]:
    rng = random.Random(step)
    words = ["hello", "count", "write", "spell", "lower", "story"]
    return [list(f"{rng.choice(words)} {rng.randint(0, 99)}: ".encode()) for _ in range(n)]


def reward_lowercase(sample: Any) -> float:
    """Fraction of response tokens that are lowercase ASCII letters (the policy learns to write words)."""
    return sum(97 <= t <= 122 for t in sample.response_tokens) / max(1, len(sample.response_tokens))


# ---------------------------------------------------------------------------------------------- the run
def _init_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("gloo")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_checkpoint(module: Any, directory: Path) -> str:
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    torch.save(module.state_dict(), directory / "model.pt")
    return str(directory)


class MegatronEngineModule:
    """The trainer's GPTModel architecture, loaded from a checkpoint, as the embedded engine's model."""

    def __init__(self, model_args: Any, checkpoint_dir: str) -> None:
        import torch

        from slime_corr.mcore.model import build_tiny_gpt

        self.module = build_tiny_gpt(model_args, ddp=False)
        self.module.load_state_dict(torch.load(Path(checkpoint_dir) / "model.pt", weights_only=True))
        self.cfg = argparse.Namespace(vocab_size=model_args.vocab_size, eos_token_id=None,
                                      max_seq_len=model_args.max_position_embeddings)

    def to(self, dtype: Any) -> MegatronEngineModule:
        self.module = self.module.to(dtype)
        return self

    def eval(self) -> MegatronEngineModule:
        self.module.eval()
        return self

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def __call__(self, input_ids: Any) -> Any:
        import torch

        position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)
        return self.module(input_ids=input_ids, position_ids=position_ids, attention_mask=None)


def run(args: argparse.Namespace, config: RolloutCorrectionConfig, work_dir: Path, monitoring: MonitoringConfig
        ) -> None:
    import contextlib

    import torch
    from megatron.core import parallel_state as ps

    from slime_corr.mcore.cpu_compat import apply_cpu_compat
    from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
    from slime_corr.mcore.model import build_tiny_gpt
    from slime_corr.monitoring.logger import MetricsLogger, is_logging_rank
    from slime_corr.monitoring.rollout_stats import rollout_metrics
    from slime_corr.monitoring.step_diagnostics import ScheduleDiagnostics
    from slime_corr.rollout.data_iterator import background_event_loop
    from slime_corr.rollout.engine_group import start_engine_group
    from slime_corr.rollout.engine_model import ByteTokenizer, TorchEngineModel
    from slime_corr.rollout.local_engine import start_local_engine
    from slime_corr.rollout.rollout import rollout_report
    from slime_corr.rollout.weight_sync import DistributedWeightSync, sync_weights_from_disk

    _init_distributed()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    apply_cpu_compat()
    model = build_tiny_gpt(args, ddp=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    diag = None
    if monitoring.log_mismatch_diagnostics and config.computes_metrics:
        diag = ScheduleDiagnostics(top_k=monitoring.log_top_mismatch_samples, detokenize=ByteTokenizer().decode)
    hook = RolloutCorrectionLoss(config, temperature=args.rollout_temperature,
                                 **({"model_forward": diag.model_forward} if diag else {}))
    if diag:
        diag.bind(hook)
    ckpt = save_checkpoint(model.module, work_dir / "step-0")

    with contextlib.ExitStack() as stack:
        logger = stack.enter_context(MetricsLogger(monitoring, hparams=vars(args), enabled=is_logging_rank()))
        print(f"metrics: {logger.run_dir / 'metrics.jsonl'}")
        if args.sglang_url:
            urls = args.sglang_url
        else:
            dtype = getattr(torch, args.engine_dtype)

            def make_engine(i: int) -> Any:
                engine_model = TorchEngineModel(ckpt, factory=lambda d: MegatronEngineModule(args, d), dtype=dtype)
                return start_local_engine(ckpt, model=engine_model, weight_version="step-0")

            group = stack.enter_context(start_engine_group(args.rollout_num_engines, make_engine,
                                                           router=args.rollout_router))
            urls = group.urls
            print(f"embedded engines ({args.engine_dtype}; trainer in float32): {group.describe()}")
        loop = stack.enter_context(background_event_loop())
        client = asyncio.run_coroutine_threadsafe(_open_client(urls), loop).result()
        stack.callback(lambda: asyncio.run_coroutine_threadsafe(client.close(), loop).result())
        syncer = DistributedWeightSync(client, bucket_bytes=args.update_weight_buffer_size) \
            if args.rollout_weight_sync == "distributed" else None
        if syncer is not None:
            stack.callback(syncer.close)
        for step in range(1, args.num_steps + 1):
            start = time.perf_counter()
            before = client.failovers, len(client.events)
            metrics, samples, skipped = _step(model, optimizer, hook, client, loop, args, step, diag)
            if skipped:
                print(f"step {step}: {len(skipped)} sample(s) not trained ({skipped[0].failure_reason})", flush=True)
            print(f"  rollout: {rollout_report(samples, client, *before).line()}", flush=True)
            ckpt = save_checkpoint(model.module, work_dir / f"step-{step}")
            version = f"step-{step}"
            if syncer is not None:
                named = [(k, v) for k, v in model.module.state_dict().items() if isinstance(v, torch.Tensor)]
                sync = syncer.sync(named, version)
            else:
                sync = sync_weights_from_disk(client, ckpt, version)
            report = asyncio.run_coroutine_threadsafe(sync, loop).result()
            print(f"  weight sync ({args.rollout_weight_sync}): {version} on {len(report.workers)} engine(s) "
                  f"in {report.seconds:.3f}s", flush=True)
            if diag:
                diag_metrics, top = diag.end_step()
                metrics.update(diag_metrics)
                logger.log_samples(step, top)
            metrics.update(rollout_metrics(samples))
            metrics["perf/step_time"] = time.perf_counter() - start
            logger.log(step, metrics)
    ps.destroy_model_parallel()


def _step(model: Any, optimizer: Any, hook: Any, client: Any, loop: Any, args: argparse.Namespace,
          step: int, diag: Any = None) -> tuple[dict[str, float], list[Any], list[Any]]:
    """One RL step: the rollout streams samples into a buffer while the data iterator builds micro-batches.
    Returns the step's `train/` and `rollout_corr/` metrics, its samples and the ones not trained."""
    import torch

    from slime_corr.monitoring.keys import loss_step_metrics
    from slime_corr.monitoring.progress import ProgressSampleBuffer, RolloutProgress
    from slime_corr.monitoring.step_diagnostics import version_lag
    from slime_corr.rollout.buffer import BufferClosed
    from slime_corr.rollout.data_iterator import BufferMicroBatchIterator

    num_samples = args.prompts_per_step * args.n_samples_per_prompt
    progress = RolloutProgress(num_samples, step=step, mode=args.rollout_progress)
    buffer = ProgressSampleBuffer(args.rollout_buffer_size or 2 * args.micro_batch_size, progress)
    rollout = asyncio.run_coroutine_threadsafe(_rollout(client, args, step, buffer), loop)
    data = BufferMicroBatchIterator(buffer, loop, num_samples, args.micro_batch_size,
                                    group_size=args.n_samples_per_prompt)
    if diag:  # the engine samples with "step-{k}" weights; the trainer is at step - 1 before this update
        diag.begin_step(data.samples, args.micro_batch_size,
                        weight_lag=version_lag({f"step-{k}": k for k in range(step)}, step - 1))
    model.zero_grad_buffer()
    optimizer.zero_grad(set_to_none=True)
    try:
        # Bypass mode reads the stream once: Megatron's schedule trains each micro-batch as soon as the rollout
        # has filled it. Decoupled mode (pi_old recompute) and step-wide normalization need a first pass: keep them.
        metrics = hook.train_step(model, data if hook.can_stream(len(data)) else list(data))
    except BufferClosed:  # the rollout ended early: raise its own error
        rollout.result()
        raise
    finally:
        progress.close()
    rollout.result()
    for p in model.parameters():  # Megatron DDP accumulates into main_grad; torch.optim reads .grad
        p.grad = p.main_grad.to(p.dtype)
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    optimizer.step()
    return {**loss_step_metrics(metrics), "train/grad_norm": float(grad_norm)}, data.samples, data.skipped


async def _open_client(urls: list[str]) -> Any:
    from slime_corr.rollout.client import SGLangClient

    client = SGLangClient(urls)
    await client.wait_healthy()
    return client


async def _rollout(client: Any, args: argparse.Namespace, step: int, buffer: Any) -> None:
    from slime_corr.rollout.rollout import generate_group_samples

    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.rollout_temperature}
    try:
        await generate_group_samples(
            client, make_prompts(step, args.prompts_per_step), args.n_samples_per_prompt, params, stream=True,
            reward_fn=reward_lowercase, group_id_offset=step * args.prompts_per_step, buffer=buffer,
        )
    finally:
        await buffer.close()  # a trainer still waiting for samples then fails instead of hanging


if __name__ == "__main__":
    sys.exit(main())
