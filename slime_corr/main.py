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

import gc
import signal

from slime_corr import startup_gc  # the standard library only
from slime_corr.mcore import import_warnings  # noqa: F401  (megatron-core's import-time warnings filtered, first)
from slime_corr.trainer import interrupts  # the standard library only: before the slow imports

if __name__ == "__main__":
    interrupts.exit_at_once("slime_corr.main")  # until main() starts anything, a Ctrl-C just exits (130)
    # no cyclic garbage collection while the imports below run (slime_corr/startup_gc.py), unless this process was
    # forked from one that has frozen its imports already: it keeps its parent's state
    if not gc.get_freeze_count():
        gc.disable()
elif __name__ == "__mp_main__":  # a "spawn" child re-importing this module (an asynchronous Megatron save's manager):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the job's to handle; the job ends it

import argparse
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from slime_corr.correction.checks import CustomFunctionError, InputValueError
from slime_corr.engines.sglang_server import SGLangLaunchError, server_args
from slime_corr.errors import ConfigError, DiskWriteError
from slime_corr.flags import main_job
from slime_corr.flags.checks import check_run
from slime_corr.flags.correction import parse_rollout_correction_config
from slime_corr.flags.trainer import split_sglang_passthrough
from slime_corr.loss_terms import LossTermsConfig
from slime_corr.mcore.checkpoint import CheckpointError
from slime_corr.monitoring.config import MonitoringConfig
from slime_corr.monitoring.logger import METRICS_FILE
from slime_corr.monitoring.run_lock import RunDirLock
from slime_corr.rollout.client import probe_health
from slime_corr.rollout.control import ControlError
from slime_corr.rollout.rollout import RolloutFailedError
from slime_corr.trainer.agreement import EngineAgreementError, precision_notice
from slime_corr.trainer.config import TrainerConfig
from slime_corr.trainer.loop import RunConfig, RunProgress, run
from slime_corr.trainer.mismatch_gate import MismatchGateError
from slime_corr.trainer.watchdog import PeerError, StuckRankError, collective_error

if __name__ == "__main__" and not gc.isenabled():  # turned off above
    startup_gc.freeze_imports()


def build_parser() -> argparse.ArgumentParser:
    """The main job's parser (every flag: `slime_corr.flags`)."""
    return main_job.build_parser(description=__doc__)


def parse_run_config(argv: Sequence[str] | None = None, *, check_urls: bool = True):  # -> RunConfig
    """Parse and validate every flag, each config and then the configs together (`flags.checks.check_run`); any
    error exits through `parser.error` naming the flag (exit code 2)."""

    parser = build_parser()
    own, passthrough = split_sglang_passthrough(sys.argv[1:] if argv is None else argv)
    args, correction = parse_rollout_correction_config(parser, own)
    args.sglang_server_args = server_args(passthrough)
    try:
        trainer = TrainerConfig.from_args(args)
        loss_terms = LossTermsConfig.from_args(args)
        monitoring = MonitoringConfig.from_args(args, run_dir=args.run_dir or args.work_dir or _new_run_dir())
        check_run(args, trainer, correction, monitoring)
    except ConfigError as e:
        parser.error(str(e))
    if check_urls and int(os.environ.get("RANK", "0")) == 0:  # the driver alone talks to the engines
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


def _check_sglang_urls(parser: argparse.ArgumentParser, urls: Sequence[str]) -> None:
    for url in urls:
        reason = probe_health(url)
        if reason is not None:
            parser.error(f"--sglang-url {url} is not reachable: {reason}. Start that SGLang server (or router) "
                         "first, or drop --sglang-url: the job then starts its own engines (real SGLang servers, "
                         "--rollout-engine sglang, the default; or this package's, --rollout-engine embedded).")


def main(argv: Sequence[str] | None = None) -> int:
    run_config = parse_run_config(argv)
    if int(os.environ.get("RANK", "0")) == 0:  # the console is rank 0's
        print("rollout correction config:")
        print(run_config.correction.describe())
        notice = precision_notice(run_config.trainer.engine_dtype, run_config.trainer.trainer_dtype,
                                  run_config.correction.use_rollout_correction)
        if notice:
            print(f"slime_corr.main: note: {notice}", flush=True)
    if run_config.hparams.get("self_check"):
        return 0

    rank = int(os.environ.get("RANK", "0"))
    progress = RunProgress()
    interrupts.install()  # Ctrl-C, and torchrun's SIGTERM to its workers: one KeyboardInterrupt, never mid-save
    lock = None
    try:
        if rank == 0:  # the run directory's one writer holds it for the job's life (monitoring/run_lock.py)
            flag = "--run-dir" if run_config.hparams.get("run_dir") else "--work-dir" \
                if run_config.hparams.get("work_dir") else "the run directory"
            lock = RunDirLock.acquire(run_config.monitoring.run_dir, flag)
            if lock.notice:
                print(f"slime_corr.main: note: {lock.notice}", flush=True)
        run(run_config, progress)
    except KeyboardInterrupt:
        if rank == 0:
            print(_interrupted_line(run_config, progress), file=sys.stderr, flush=True)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun SIGKILLs ranks still alive 30 s after its SIGINT:
            sys.stdout.flush()  # `run` closed everything; the interpreter's teardown of a loaded machine could not
            if lock is not None:  # be counted on to fit
                lock.release()
            os._exit(130)
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
            FileExistsError, InputValueError, SGLangLaunchError, EngineAgreementError, DiskWriteError,
            MismatchGateError) as e:  # a clear message, not a traceback
        print(f"slime_corr.main: error{_on_rank(rank)}: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:
        line = collective_error(e, run_config.trainer.distributed_timeout_minutes)
        if line is None:
            raise
        print(f"slime_corr.main: error{_on_rank(rank)}: {line}", file=sys.stderr, flush=True)
        return 1
    finally:
        if lock is not None:
            lock.release()
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
