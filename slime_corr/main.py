"""The main job: GRPO with rollout correction on a Megatron-Core model and SGLang-protocol engines, on CPU by default.

    python -m slime_corr.main --rollout-correction-preset decoupled_seq_is_rs
    torchrun --nproc-per-node 4 -m slime_corr.main --tensor-model-parallel-size 2 ...   (TP × CP × DP processes)

One process (global rank 0) drives the rollout: it starts the embedded engines once (`--rollout-num-engines`, the
trainer's model served in bf16 on 127.0.0.1, behind sglang-router when there are several) or uses `--sglang-url`,
generates `--rollout-batch-size` prompts × `--n-samples-per-prompt` samples per rollout (one seeded request per
sample), and deals whole GRPO groups to the data-parallel ranks, balanced by tokens. Every rank then trains the
rollout in `--num-steps-per-rollout` optimizer steps through Megatron's schedule and the rollout-correction loss
(decoupled mode: lp_old from one forward-only pass before the first step, with the reference log-probs of the KL
term), the weights go to the engines (`--rollout-weight-sync disk|distributed`), and the metrics go to the console,
RUN_DIR/metrics.jsonl, TensorBoard and W&B from rank 0. `--async-rollout` generates the next rollout while one
trains. `--save`/`--load` checkpoint and resume. Every flag is checked before anything starts; `--self-check` only
prints the configuration.
"""

from __future__ import annotations

import signal

from slime_corr.trainer import interrupts  # the standard library only: before the slow imports

if __name__ == "__main__":
    interrupts.exit_at_once("slime_corr.main")  # until main() starts anything, a Ctrl-C just exits (130)
elif __name__ == "__mp_main__":  # a "spawn" child re-importing this module (Megatron's checkpoint writer manager):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the job's to handle; the job ends it

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path

from slime_corr.arguments import (
    add_loss_terms_args,
    add_rollout_correction_args,
    parse_rollout_correction_config,
)
from slime_corr.correction.proximal import check_prox_logp_method
from slime_corr.device import resolve as resolve_device
from slime_corr.engines.sglang_server import server_args
from slime_corr.errors import ConfigError
from slime_corr.loss_terms import LossTermsConfig
from slime_corr.monitoring.config import MonitoringConfig, add_monitoring_args
from slime_corr.monitoring.logger import CONFIG_FILE, METRICS_FILE
from slime_corr.trainer.agreement import precision_notice
from slime_corr.trainer.config import (
    TrainerConfig,
    check_writable_dir,
)
from slime_corr.trainer.flags import add_trainer_args, split_sglang_passthrough

# megatron-core warns on every rank, at import, that TransformerEngine and apex are missing (expected on CPU)
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
warnings.filterwarnings("ignore", message=r"full scope is deprecated")  # megatron-core 0.16's TransformerConfig
# megatron-core's tensor-parallel layers advise a CUDA setting on every TP rank, also on CPU where it means nothing
warnings.filterwarnings("ignore", message=r"When using async grad allreduce it is recommended to set the environment")
# megatron-core's dist_checkpointing loads through torch APIs that torch has deprecated (not ours to change)
warnings.filterwarnings("ignore", message=r"`load_state_dict` is deprecated and will be removed", category=FutureWarning)
warnings.filterwarnings("ignore", message=r"Please use DTensor instead and we are deprecating ShardedTensor",
                        category=FutureWarning)


def build_parser() -> argparse.ArgumentParser:
    from slime_corr.mcore.model import add_tiny_model_args
    from slime_corr.models.selection import add_model_args

    parser = argparse.ArgumentParser(prog="slime_corr.main", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--self-check", action="store_true", help="Parse flags, build the config, print it, exit.")
    add_trainer_args(parser)
    add_loss_terms_args(parser)
    add_tiny_model_args(parser)
    add_model_args(parser)
    add_monitoring_args(parser)
    parser.set_defaults(vocab_size=256)  # byte-level tokens, as the embedded engine uses
    return add_rollout_correction_args(parser)


def parse_run_config(argv: Sequence[str] | None = None, *, check_urls: bool = True):  # -> RunConfig
    """Parse and validate every flag; any error exits through `parser.error` naming the flag (exit code 2)."""
    from slime_corr.trainer.loop import RunConfig

    parser = build_parser()
    own, passthrough = split_sglang_passthrough(sys.argv[1:] if argv is None else argv)
    args, correction = parse_rollout_correction_config(parser, own)
    args.sglang_server_args = server_args(passthrough)
    try:
        trainer = TrainerConfig.from_args(args)
        try:
            check_prox_logp_method(trainer.prox_logp_method, correction, trainer.truncation.active)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        placement = resolve_device(trainer.device)
        if correction.rollout_correction_cuda_graph and not placement.is_cuda:
            raise ConfigError(f"--rollout-correction-cuda-graph replays CUDA graphs, and this run is on "
                              f"{placement.device}: leave it off, or run on a GPU (--device cuda).")
        if trainer.use_routing_replay and correction.use_rollout_logprobs:
            raise ConfigError("--use-routing-replay replays the routes of the recomputed lp_old pass, which bypass "
                              "mode (--use-rollout-logprobs) skips: use a decoupled preset, or "
                              "--use-rollout-routing-replay (the engines' routes).")
        loss_terms = LossTermsConfig.from_args(args)
        monitoring = MonitoringConfig.from_args(args, run_dir=args.run_dir or args.work_dir or _new_run_dir())
        _check_run_dir(monitoring.run_dir, "--run-dir" if args.run_dir else "--work-dir" if args.work_dir else
                       "the default run directory", resuming=trainer.load)
    except ConfigError as e:
        parser.error(str(e))
    if check_urls:
        _check_sglang_urls(parser, trainer.sglang_url)
    return RunConfig(trainer=trainer, correction=correction, loss_terms=loss_terms, monitoring=monitoring,
                     hparams=vars(args))


def _new_run_dir() -> str:
    """runs/YYYYmmdd-HHMMSS, with -2, -3, ... when a run of the same second has it (the ranks of one torchrun
    launch agree: they read the same clock second, and the directory is made only by rank 0, later)."""
    base = time.strftime("runs/%Y%m%d-%H%M%S")
    path, n = base, 1
    while (Path(path) / METRICS_FILE).exists():
        n += 1
        path = f"{base}-{n}"
    return path


def _check_run_dir(run_dir: str | None, flag: str, resuming: str | None) -> None:
    """Writable, and not holding another run's metrics: a resumed run (`resuming`: its --load) continues only the
    metrics of the run that saved (or resumed from) that checkpoint directory."""
    if not run_dir:
        return
    check_writable_dir(flag, run_dir)
    metrics = Path(run_dir) / METRICS_FILE
    if not (metrics.is_file() and metrics.stat().st_size):
        return
    if not resuming:
        raise ConfigError(f"{flag} {run_dir} already holds a run's {METRICS_FILE}: a run never appends to another "
                          "run's metrics. Pass a new --run-dir (or none: a new runs/DATE-TIME), or add --load to resume "
                          "that run.")
    try:
        saved = json.loads((Path(run_dir) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        saved = {}
    ckpts = {str(Path(p).resolve()) for p in (saved.get("save"), saved.get("load")) if isinstance(p, str) and p}
    if str(Path(resuming).resolve()) not in ckpts:
        raise ConfigError(f"{flag} {run_dir} holds the metrics of another run (its {CONFIG_FILE} names the "
                          f"checkpoints {sorted(ckpts) or 'of no run'}, and this run resumes from --load {resuming}): a "
                          "run never appends to another run's metrics. Pass the --run-dir of the run that saved "
                          f"{resuming}, or a new one.")


def _check_sglang_urls(parser: argparse.ArgumentParser, urls: Sequence[str]) -> None:
    from slime_corr.rollout.client import probe_health

    for url in urls:
        reason = probe_health(url)
        if reason is not None:
            parser.error(f"--sglang-url {url} is not reachable: {reason}. Start the SGLang server (or router) "
                         "first, or drop --sglang-url to run the embedded engine.")


def main(argv: Sequence[str] | None = None) -> int:
    run_config = parse_run_config(argv)
    if int(os.environ.get("RANK", "0")) == 0:  # the console is rank 0's
        print("rollout correction config:")
        print(run_config.correction.describe())
        notice = precision_notice(run_config.trainer.engine_dtype, run_config.trainer.params_dtype,
                                  run_config.correction.use_rollout_correction)
        if notice:
            print(f"slime_corr.main: note: {notice}", flush=True)
    if run_config.hparams.get("self_check"):
        return 0
    from slime_corr.correction.checks import CustomFunctionError, InputValueError
    from slime_corr.engines.sglang_server import SGLangLaunchError
    from slime_corr.mcore.checkpoint import CheckpointError
    from slime_corr.rollout.control import ControlError
    from slime_corr.rollout.rollout import RolloutFailedError
    from slime_corr.trainer.agreement import EngineAgreementError
    from slime_corr.trainer.loop import RunProgress, run
    from slime_corr.trainer.watchdog import PeerError, StuckRankError, collective_error

    rank = int(os.environ.get("RANK", "0"))
    progress = RunProgress()
    interrupts.install()  # Ctrl-C, and torchrun's SIGTERM to its workers: one KeyboardInterrupt, never mid-save
    try:
        run(run_config, progress)
    except KeyboardInterrupt:
        if rank == 0:
            print(_interrupted_line(run_config, progress), file=sys.stderr, flush=True)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun SIGKILLs ranks still alive 30 s after its SIGINT:
            sys.stdout.flush()  # `run` closed everything; the interpreter's teardown of a loaded machine could not
            os._exit(130)  # be counted on to fit
        return 130
    except CustomFunctionError as e:  # the user's function: one line, its own traceback on request
        show = e.__cause__ is not None and run_config.hparams.get("custom_function_traceback")
        hint = " (its traceback: --custom-function-traceback)" if e.__cause__ is not None and not show else ""
        print(f"slime_corr.main: error{_on_rank(rank)}: {e}{hint}", file=sys.stderr, flush=True)
        if show:
            traceback.print_exception(e.__cause__, file=sys.stderr)
        return 1
    except PeerError as e:
        if e.reported:  # the driver failed, says why and exits 1: the launcher names it as the failure
            return 0
        print(f"slime_corr.main: error{_on_rank(rank)}: {e}", file=sys.stderr, flush=True)
        return 1
    except (ConfigError, CheckpointError, ControlError, TimeoutError, RolloutFailedError, StuckRankError,
            FileExistsError, InputValueError, SGLangLaunchError, EngineAgreementError) as e:  # a clear message, not a traceback
        print(f"slime_corr.main: error{_on_rank(rank)}: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:
        line = collective_error(e, run_config.trainer.distributed_timeout_minutes)
        if line is None:
            raise
        print(f"slime_corr.main: error{_on_rank(rank)}: {line}", file=sys.stderr, flush=True)
        return 1
    return 0


def _on_rank(rank: int) -> str:
    return f" (rank {rank})" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""


def _interrupted_line(run_config, progress) -> str:  # noqa: ANN001 - RunConfig, RunProgress (imported lazily)
    """One line: where the run stopped, its last checkpoint and how to resume."""
    cfg = run_config.trainer
    where = f"interrupted after rollout {progress.rollout} of {cfg.num_rollout} (step {progress.step})"
    if progress.checkpoint and cfg.save:
        how = f"last checkpoint {progress.checkpoint}; resume: the same command with --load {cfg.save}"
    elif progress.checkpoint:
        how = f"last checkpoint {progress.checkpoint} (loaded); resume: the same command"
    elif cfg.save:
        how = "no checkpoint saved yet (--save-interval counts rollouts): nothing to resume from"
    else:
        how = "no checkpoint saved (add --save DIR --save-interval N to be able to resume)"
    return f"slime_corr.main: {where}; {how}."


if __name__ == "__main__":
    sys.exit(main())
