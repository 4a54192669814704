"""`MetricsLogger`: one call per step sends the step's metrics to every sink.

    logger = MetricsLogger(MonitoringConfig.from_args(args), hparams=vars(args), enabled=is_logging_rank())
    for step in ...:
        metrics = hook.train_step(...)
        logger.log(step, {**loss_step_metrics(metrics), **with_prefix("rollout", {...}), ...})
    logger.close()                                    # or `with MetricsLogger(...) as logger:`

Sinks (on the logging rank only; elsewhere the logger does nothing):
- console: one line per `--log-interval` steps, `step N: samples=.. reward=.. loss=.. ...` (keys.CONSOLE_KEYS);
- `RUN_DIR/metrics.jsonl`: every metric of every step, one JSON object per line (`{"step": N, "time": unix
  seconds, key: value, ...}`; a non-finite value is written as null), flushed per line;
- TensorBoard (`--tensorboard-dir`): `SummaryWriter.add_scalar` per key every `--tensorboard-log-interval` steps;
- W&B (`--wandb-project`): `wandb.log(metrics, step=N)` at the same interval; `--wandb-mode offline` keeps
  everything on the machine (W&B's error reporter, which resolves a server name even offline, is switched off).
`log_samples` writes per-sample records (the top-mismatch table) to `RUN_DIR/top_mismatch.jsonl` and TensorBoard.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from slime_corr.disk import append_line, write_text
from slime_corr.integrations.slime.names import slime_named
from slime_corr.monitoring.config import MonitoringConfig
from slime_corr.monitoring.keys import CONSOLE_KEYS

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "top_mismatch.jsonl"
CONFIG_FILE = "run_config.json"


def is_logging_rank() -> bool:
    """Megatron's choice: the last rank logs (it holds the loss under pipeline parallelism)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank() == dist.get_world_size() - 1


def jsonable(values: Mapping[str, Any]) -> dict[str, Any]:
    """Flags/hparams as JSON: scalars and lists of scalars kept, other values as str, private keys dropped."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key.startswith("_"):
            continue
        if value is None or isinstance(value, bool | int | float | str):
            out[key] = value
        elif isinstance(value, list | tuple) and all(isinstance(v, bool | int | float | str) for v in value):
            out[key] = list(value)
        else:
            out[key] = str(value)
    return out


class Sink(Protocol):
    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def write_samples(self, step: int, records: Sequence[Mapping[str, Any]]) -> None: ...
    def close(self) -> None: ...


class ConsoleSink:
    def __init__(self, interval: int, stream: TextIO | None = None, hidden: Collection[str] = ()) -> None:
        self.interval, self.stream, self.hidden = interval, stream, frozenset(hidden)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if step % self.interval == 0:
            shown = {k: v for k, v in metrics.items() if k not in self.hidden}
            print(console_line(step, shown), file=self.stream or sys.stdout, flush=True)

    def write_samples(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass


def console_line(step: int, metrics: Mapping[str, float]) -> str:
    """`step N: samples=16 reward=0.438 loss=-0.0123 ...` with the keys of CONSOLE_KEYS the step has."""
    shown = " ".join(f"{label}={metrics[key]:.4g}" for key, label in CONSOLE_KEYS if key in metrics)
    return f"step {step}: {shown}"


class JsonlSink:
    """RUN_DIR/metrics.jsonl (one line per step) and top_mismatch.jsonl: each record written whole or not at all
    (`slime_corr.disk.append_line`: a full disk is one DiskWriteError, never a partial last line)."""

    def __init__(self, run_dir: Path, append: bool = False) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / METRICS_FILE
        if not append and self.path.is_file() and self.path.stat().st_size:
            raise FileExistsError(f"{self.path} already holds another run's metrics: pass a new --run-dir (a run "
                                  "never appends to another's; a resumed run with --load continues its own).")
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.samples_path = run_dir / SAMPLES_FILE

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, "time": time.time()}
        record.update({k: v if math.isfinite(v) else None for k, v in metrics.items()})
        append_line(self.fd, self.path, json.dumps(record) + "\n")

    def write_samples(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        fd = os.open(self.samples_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            for r in records:
                append_line(fd, self.samples_path, json.dumps({"step": step, **r}) + "\n")
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class TensorBoardSink:
    def __init__(self, log_dir: str, interval: int, queue_size: int, hparams: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)
        self.interval = interval
        if hparams:
            self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in jsonable(hparams).items()), 0)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if step % self.interval == 0:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)

    def write_samples(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        if records:
            keys = list(records[0])
            table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            table += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in records]
            self.writer.add_text("diag/top_mismatch", "\n".join(table), step)

    def close(self) -> None:
        self.writer.close()


def _cell(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", "\\n")


class WandbSink:
    def __init__(self, config: MonitoringConfig, save_dir: Path, name: str, hparams: Mapping[str, Any]) -> None:
        mode = config.wandb_mode or os.environ.get("WANDB_MODE")
        if mode in ("offline", "disabled"):
            # W&B's error reporter resolves its server's name even offline: nothing may leave the machine.
            os.environ["WANDB_ERROR_REPORTING"] = "false"
        import wandb

        save_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=config.wandb_project, name=name, dir=str(save_dir), entity=config.wandb_entity,
                              mode=config.wandb_mode, config=jsonable(hparams))
        self.interval = config.tensorboard_log_interval

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if step % self.interval == 0:
            self.run.log(dict(metrics), step=step)

    def write_samples(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Sends each step's metrics (`{"prefix/key": float}`, see `keys`) to the configured sinks.

    `run_dir` is used when `config.run_dir` is unset; one of them is required on the logging rank.
    `hparams` (e.g. `vars(args)`) go to RUN_DIR/run_config.json, TensorBoard's text tab and W&B's config.
    `enabled=False` (every rank but the logging one) makes every call a no-op. `console` / `stream`: the step line;
    `console_hidden`: keys left off it (still in the other sinks). RUN_DIR/metrics.jsonl must be new or empty
    (FileExistsError) unless `append` (a resumed run continuing its own).
    """

    def __init__(
        self,
        config: MonitoringConfig,
        *,
        run_dir: str | Path | None = None,
        hparams: Mapping[str, Any] | None = None,
        enabled: bool = True,
        console: bool = True,
        stream: TextIO | None = None,
        console_hidden: Collection[str] = (),
        append: bool = False,
    ) -> None:
        self.config = config
        self.sinks: list[Sink] = []
        chosen = config.run_dir or run_dir
        self.run_dir = Path(chosen) if chosen else None
        if not enabled:
            return
        if self.run_dir is None:
            raise ValueError("MetricsLogger: no run directory: pass --run-dir (or run_dir=...).")
        hparams = dict(hparams or {})
        try:
            if console:
                self.sinks.append(ConsoleSink(config.log_interval, stream, console_hidden))
            self.sinks.append(JsonlSink(self.run_dir, append))
            write_text(self.run_dir / CONFIG_FILE, json.dumps(jsonable(hparams), indent=1) + "\n")
            if config.tensorboard_dir:
                self.sinks.append(TensorBoardSink(config.tensorboard_dir, config.tensorboard_log_interval,
                                                  config.tensorboard_queue_size, hparams))
            if config.uses_wandb:
                save_dir = Path(config.wandb_save_dir) if config.wandb_save_dir else self.run_dir / "wandb"
                self.sinks.append(WandbSink(config, save_dir, config.wandb_exp_name or self.run_dir.name, hparams))
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Send one step's metrics; values must be numbers (Python or 0-dim tensors already on the host)."""
        if not self.sinks:
            return
        values: dict[str, float] = {}
        for key, value in metrics.items():
            try:
                values[key] = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"metric {key!r}: expected a number, got {type(value).__name__} {value!r}") from None
        named = slime_named(values, self.config.metric_names)  # slime's names too (--metric-names)
        for sink in self.sinks:
            sink.write(step, values if isinstance(sink, ConsoleSink) else named)

    def log_samples(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Per-sample records of the step (e.g. the sequences with the largest mismatch, with text)."""
        for sink in self.sinks:
            sink.write_samples(step, records)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CONFIG_FILE", "METRICS_FILE", "SAMPLES_FILE", "MetricsLogger", "console_line", "is_logging_rank",
           "jsonable"]
