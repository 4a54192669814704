"""How much of the mismatch is precision: every engine x trainer precision pair, measured, then trained.

    python experiments/precision_pairs.py                    # 9 pairs measured, 3 pairs trained with / without IS
    python experiments/precision_pairs.py --plot-only        # replot the runs already in --work-dir

Each run is the real main job (`python -m slime_corr.main`, the tiny Megatron GPT on the toy task, its embedded
engine), differing only in the precisions: the trainer in fp32 (plain Adam), `--bf16` or `--fp16` (Megatron's
mixed precision: 16-bit weights and forward, fp32 main weights), the engine in `--engine-dtype` float32, bfloat16
or float16. The engine serves the trainer's own weights after every rollout, so the only difference between the two
sides' log-probs is the precision of their forwards.

1. **Measured** (`--measure-rollouts`, default 2, all 9 pairs): decoupled PPO with the metrics on and a token-level
   IS in clip mode at U = `--bound` (default 1.001), whose `mis_clip_fraction_low/high` are the shares of tokens whose
   ratio π_old/π_rollout is outside [1/U, U]. Per pair: mean |Δlog p| (`train_rollout_logprob_abs_diff`), k3
   (`mismatch_k3_kl`) and that share, averaged over the run's steps.
2. **Trained** (`--train-rollouts`, default 16, the pairs of `TRAINED`): naive decoupled PPO (the `disabled`
   preset) against `decoupled_token_is`; the final reward (mean of the last 8 steps) and the mean k3.

Outputs: `--summary` (JSON, every number and each run's command) and `--out` (the plot); the tables are printed.
A run whose directory holds a finished run of the same command is reused (`--force` reruns).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# fp16 starts its loss scale at 2**16: from Megatron's default 2**32 the scaler halves through ~16 skipped steps here
TRAINERS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16", "--initial-loss-scale", "65536"]}
ENGINES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TRAINED = (("fp32", "bf16"), ("bf16", "bf16"), ("fp16", "fp16"))  # (trainer, engine): the default and the matched
CORRECTIONS = {"naive": "disabled", "token IS": "decoupled_token_is"}
DONE_FILE = "experiment_run.json"


@dataclass(frozen=True)
class Run:
    name: str
    trainer: str
    engine: str
    flags: tuple[str, ...]

    def command(self, work_dir: Path) -> list[str]:
        return ["-m", "slime_corr.main", "--rollout-engine", "embedded", *TRAINERS[self.trainer],
                "--engine-dtype", ENGINES[self.engine], "--rollout-progress", "none", "--run-dir",
                str(work_dir / self.name), *self.flags]


def plan(args: argparse.Namespace) -> tuple[list[Run], list[Run]]:
    """(the measured runs, the trained runs)."""
    measured = [Run(f"measure-{t}-{e}", t, e, ("--num-rollout", str(args.measure_rollouts), "--get-mismatch-metrics",
                                               "--use-tis", "--tis-mode", "clip", "--tis-upper-bound", str(args.bound)))
                for t in TRAINERS for e in ENGINES]
    trained = [Run(f"train-{t}-{e}-{preset}", t, e, ("--num-rollout", str(args.train_rollouts),
                                                      "--rollout-correction-preset", preset))
               for t, e in TRAINED for preset in CORRECTIONS.values()]
    return measured, trained


def run_all(runs: Sequence[Run], work_dir: Path, jobs: int, force: bool) -> None:
    """Each run not already finished with the same command, `jobs` at a time; a failed run stops the experiment."""
    todo = [r for r in runs if force or not _finished(r, work_dir)]
    for i in range(0, len(todo), jobs):
        procs = []
        for run in todo[i:i + jobs]:
            (work_dir / run.name).mkdir(parents=True, exist_ok=True)
            (work_dir / run.name / "metrics.jsonl").unlink(missing_ok=True)
            log = open(work_dir / run.name / "console.log", "w")  # noqa: SIM115 - closed below
            procs.append((run, log, subprocess.Popen([sys.executable, *run.command(work_dir)], stdout=log,
                                                     stderr=subprocess.STDOUT, cwd=ROOT)))
        for run, log, proc in procs:
            code = proc.wait(timeout=1800)
            log.close()
            if code != 0:
                tail = (work_dir / run.name / "console.log").read_text()[-2000:]
                raise SystemExit(f"{run.name} exited {code}:\n{tail}")
            (work_dir / run.name / DONE_FILE).write_text(json.dumps({"command": run.command(work_dir)}))
            print(f"done: {run.name}", flush=True)


def _finished(run: Run, work_dir: Path) -> bool:
    done = work_dir / run.name / DONE_FILE
    return done.is_file() and json.loads(done.read_text()).get("command") == run.command(work_dir)


def _records(run: Run, work_dir: Path) -> list[dict]:
    lines = (work_dir / run.name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _value(record: dict, key: str) -> float | None:
    """`key` of a metrics.jsonl record, with or without its namespace (`rollout_corr/mismatch_k3_kl`)."""
    found = [v for k, v in record.items() if k == key or k.endswith("/" + key)]
    return float(found[0]) if found else None


def _mean(records: Sequence[dict], key: str) -> float:
    values = [v for v in (_value(r, key) for r in records) if v is not None]
    if not values:
        raise SystemExit(f"no {key} in the runs' metrics.jsonl")
    return statistics.fmean(values)


def summarize(measured: Sequence[Run], trained: Sequence[Run], work_dir: Path) -> dict:
    out: dict = {"measured": {}, "trained": {}}
    for run in measured:
        rs = _records(run, work_dir)
        out["measured"][f"{run.trainer}/{run.engine}"] = {
            "abs_diff": _mean(rs, "train_rollout_logprob_abs_diff"), "k3": _mean(rs, "mismatch_k3_kl"),
            "outside_bound": _mean(rs, "mis_clip_fraction_low") + _mean(rs, "mis_clip_fraction_high"),
            "steps": len(rs), "command": run.command(work_dir)}
    for run in trained:
        rs = _records(run, work_dir)
        label = next(k for k, v in CORRECTIONS.items() if v in run.flags)
        out["trained"][f"{run.trainer}/{run.engine}/{label}"] = {
            "final_reward": _mean(rs[-8:], "reward_mean"), "k3": _mean(rs, "mismatch_k3_kl"),
            "reward": [_value(r, "reward_mean") for r in rs], "command": run.command(work_dir)}
    return out


def print_tables(summary: dict, bound: float) -> None:
    print(f"\ntrainer/engine   mean |dlogp|      k3         share outside [1/{bound:g}, {bound:g}]")
    for pair, m in summary["measured"].items():
        print(f"{pair:<16} {m['abs_diff']:<17.3g} {m['k3']:<10.3g} {m['outside_bound']:.3%}")
    print("\ntrainer/engine/correction   final reward   mean k3")
    for key, t in summary["trained"].items():
        print(f"{key:<27} {t['final_reward']:<14.3f} {t['k3']:.3g}")


def plot(summary: dict, out: Path) -> None:
    from matplotlib.backends.backend_agg import (
        FigureCanvasAgg,  # lazily: matplotlib is the optional plot extra
    )
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    for ax, key, title in ((axes[0], "abs_diff", "mean |Δlog p| (nats)"), (axes[1], "k3", "k3 KL")):
        pairs = list(summary["measured"])
        ax.bar(range(len(pairs)), [summary["measured"][p][key] for p in pairs])
        ax.set_xticks(range(len(pairs)), pairs, rotation=60, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title + " by trainer/engine")
    for key, t in summary["trained"].items():
        axes[2].plot(range(1, len(t["reward"]) + 1), t["reward"], label=key,
                     linestyle="-" if key.endswith("token IS") else "--")
    axes[2].set_title("reward per step")
    axes[2].set_xlabel("optimizer step")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "precision_pairs")
    p.add_argument("--summary", type=Path, default=ROOT / "experiments" / "precision_pairs.json")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "precision_pairs.png")
    p.add_argument("--measure-rollouts", type=int, default=2)
    p.add_argument("--train-rollouts", type=int, default=16)
    p.add_argument("--bound", type=float, default=1.001, help="U of the clip-mode IS whose clip fractions are measured")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--force", action="store_true")
    p.add_argument("--plot-only", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    measured, trained = plan(args)
    if not args.plot_only:
        run_all([*measured, *trained], args.work_dir, args.jobs, args.force)
    summary = summarize(measured, trained, args.work_dir)
    args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    print_tables(summary, args.bound)
    plot(summary, args.out)
    print(f"\nwrote {args.summary} and {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
