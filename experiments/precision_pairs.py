"""How much of the mismatch is precision: every engine x trainer precision pair, measured, then trained.

    python experiments/precision_pairs.py                         # the tiny model: 9 pairs measured, 3 trained
    python experiments/precision_pairs.py --model smollm2-135m    # SmolLM2: 9 pairs + 3 on the SGLang server, 2 trained
    python experiments/precision_pairs.py --plot-only             # replot the runs already in --work-dir

Each run is the real main job (`python -m slime_corr.main`), differing only in the precisions: the trainer in fp32
(plain Adam), `--bf16` or `--fp16` (Megatron's mixed precision: 16-bit weights and forward, fp32 main weights), the
engine in `--engine-dtype` float32, bfloat16 or float16. The engine serves the trainer's own weights after every
rollout, so the only difference between the two sides' log-probs is the precision of their forwards, and their
kernels: the tiny model's embedded engine runs the trainer's own module, SmolLM2's runs Hugging Face transformers,
and the real SGLang server (`SETUPS[...].on_sglang`, the main job's default engine) its own.

1. **Measured** (`--measure-rollouts`; all 9 pairs on the embedded engine, the setup's pairs on SGLang too):
   decoupled PPO with the metrics on and a token-level IS in clip mode at U = `--bound`, whose
   `mis_clip_fraction_low/high` are the shares of tokens whose ratio π_old/π_rollout is below 1/U / above U. Per
   pair: mean |Δlog p| (`train_rollout_logprob_abs_diff`), k3 (`mismatch_k3_kl`), those shares and the share with
   |Δlog p| > 0.1 (`diag/large_lr_frac`), averaged over the run's steps; k3 per step too.
2. **Trained** (`--train-rollouts`, the setup's `trained` pairs): naive decoupled PPO (the `disabled` preset) against
   `decoupled_token_is`; the final reward (mean of the last `final_steps` steps) and k3, per step and its mean.

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
CORRECTIONS = {"naive": "disabled", "token IS": "decoupled_token_is"}
DONE_FILE = "experiment_run.json"


@dataclass(frozen=True)
class Setup:
    """One model's experiment: the flags of its runs, what it measures where, and what it trains."""

    flags: tuple[str, ...] = ()  # main-job flags of every run
    measure_rollouts: int = 2
    fp16_measure_flags: tuple[str, ...] = ()  # last in the measured runs with an fp16 side: CPU fp16 is slow
    bound: float = 1.001
    on_sglang: tuple[tuple[str, str], ...] = ()  # (trainer, engine) pairs measured on the real SGLang server too
    train_flags: tuple[str, ...] = ()
    train_rollouts: int = 16
    final_steps: int = 8  # the final reward is the mean of the last ones
    trained: tuple[tuple[str, str], ...] = (("fp32", "bf16"), ("bf16", "bf16"), ("fp16", "fp16"))  # the default, matched
    jobs: int = 2  # runs at a time (--jobs)


# SmolLM2: 2 prompts x 4 samples x 12 tokens, one update per rollout (~1 min a run). fp16 runs on this CPU at 1/30 of
# fp32's speed (a 64x576x1536 matmul: 39 ms against 1.3 ms), so the pairs with an fp16 side measure one rollout of
# one prompt (0.5-2 min a run here). U = 2 is the default IS bound; the tiny model's 1.001 would count nearly every
# token of SmolLM2. Training follows docs/models.md's recipe (temperature 0.7, lr 2e-5), short.
SMOLLM2 = ("--model", "smollm2-135m", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
           "--num-steps-per-rollout", "1", "--rollout-max-response-len", "12")
SETUPS = {
    "tiny": Setup(),
    "smollm2-135m": Setup(flags=SMOLLM2, fp16_measure_flags=("--num-rollout", "1", "--rollout-batch-size", "1"),
                          bound=2.0, on_sglang=(("fp32", "bf16"), ("bf16", "bf16"), ("fp16", "fp16")),
                          train_flags=("--num-steps-per-rollout", "2", "--rollout-temperature", "0.7", "--lr", "2e-5"),
                          train_rollouts=3, final_steps=2, trained=(("fp32", "bf16"), ("bf16", "bf16")),
                          jobs=1),  # one SmolLM2 job (and SGLang server) at a time on a small machine
}


@dataclass(frozen=True)
class Run:
    name: str
    trainer: str
    engine: str
    flags: tuple[str, ...]
    server: str = "embedded"  # the --rollout-engine: embedded, or sglang (the real server)

    @property
    def pair(self) -> str:
        """The summary's key: trainer/engine, and the server when it is not the embedded engine."""
        return f"{self.trainer}/{self.engine}" + ("" if self.server == "embedded" else f" {self.server}")

    def command(self, work_dir: Path) -> list[str]:
        return ["-m", "slime_corr.main", "--rollout-engine", self.server, *TRAINERS[self.trainer],
                "--engine-dtype", ENGINES[self.engine], "--rollout-progress", "none", "--run-dir",
                str(work_dir / self.name), *self.flags]


def plan(args: argparse.Namespace) -> tuple[list[Run], list[Run]]:
    """(the measured runs, the trained runs) of `args.model`'s setup; later flags win, so per-run ones go last."""
    setup = SETUPS[args.model]
    rollouts = args.measure_rollouts or setup.measure_rollouts
    bound = args.bound or setup.bound

    def measure(t: str, e: str, server: str = "embedded") -> Run:
        fp16_flags = setup.fp16_measure_flags if "fp16" in (t, e) else ()
        flags = (*setup.flags, "--num-rollout", str(rollouts), "--get-mismatch-metrics", "--use-tis", "--tis-mode",
                 "clip", "--tis-upper-bound", str(bound), *fp16_flags)
        suffix = "" if server == "embedded" else f"-{server}"
        return Run(f"measure-{t}-{e}{suffix}", t, e, flags, server)

    measured = [measure(t, e) for t in TRAINERS for e in ENGINES]
    measured += [measure(t, e, "sglang") for t, e in setup.on_sglang]
    trained = [Run(f"train-{t}-{e}-{preset}", t, e, (*setup.flags, *setup.train_flags, "--num-rollout",
                                                      str(args.train_rollouts or setup.train_rollouts),
                                                      "--rollout-correction-preset", preset))
               for t, e in setup.trained for preset in CORRECTIONS.values()]
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
    """`key` of a metrics.jsonl record, with or without its namespace (`rollout_corr/mismatch_k3_kl`); a full key
    (`diag/large_lr_frac`) matches itself, not the per-bucket keys that end like it."""
    if key in record:
        return float(record[key])
    found = [v for k, v in record.items() if k.endswith("/" + key)]
    return float(found[0]) if found else None


def _mean(records: Sequence[dict], key: str) -> float:
    values = [v for v in (_value(r, key) for r in records) if v is not None]
    if not values:
        raise SystemExit(f"no {key} in the runs' metrics.jsonl")
    return statistics.fmean(values)


def summarize(measured: Sequence[Run], trained: Sequence[Run], work_dir: Path, final_steps: int = 8) -> dict:
    out: dict = {"measured": {}, "trained": {}}
    for run in measured:
        rs = _records(run, work_dir)
        abs_diff, k3 = _mean(rs, "train_rollout_logprob_abs_diff"), _mean(rs, "mismatch_k3_kl")
        low, high = _mean(rs, "mis_clip_fraction_low"), _mean(rs, "mis_clip_fraction_high")
        out["measured"][run.pair] = {
            "abs_diff": abs_diff, "k3": k3, "outside_bound": low + high, "below_bound": low, "above_bound": high,
            "large_log_ratio": _mean(rs, "diag/large_lr_frac"), "k3_per_step": [_value(r, "mismatch_k3_kl") for r in rs],
            "tokens": sum(_value(r, "mis_valid_token_count") or 0 for r in rs), "steps": len(rs),
            "command": run.command(work_dir)}
    for run in trained:
        rs = _records(run, work_dir)
        label = next(k for k, v in CORRECTIONS.items() if v in run.flags)
        out["trained"][f"{run.pair}/{label}"] = {
            "final_reward": _mean(rs[-final_steps:], "reward_mean"), "k3": _mean(rs, "mismatch_k3_kl"),
            "reward": [_value(r, "reward_mean") for r in rs], "k3_per_step": [_value(r, "mismatch_k3_kl") for r in rs],
            "command": run.command(work_dir)}
    return out


def print_tables(summary: dict, bound: float) -> None:
    print(f"\ntrainer/engine          mean |dlogp|  k3         k3 first -> last     tokens  "
          f"below 1/{bound:g}  above {bound:g}  |dlogp| > 0.1")
    for pair, m in summary["measured"].items():
        first_last = f"{m['k3_per_step'][0]:.3g} -> {m['k3_per_step'][-1]:.3g}"
        print(f"{pair:<23} {m['abs_diff']:<13.3g} {m['k3']:<10.3g} {first_last:<20} {m['tokens']:<7.0f} "
              f"{m['below_bound']:<10.2%} {m['above_bound']:<10.2%} {m['large_log_ratio']:.2%}")
    print("\ntrainer/engine/correction   final reward   mean k3    k3 first -> last")
    for key, t in summary["trained"].items():
        print(f"{key:<27} {t['final_reward']:<14.3f} {t['k3']:<10.3g} "
              f"{t['k3_per_step'][0]:.3g} -> {t['k3_per_step'][-1]:.3g}")


def plot(summary: dict, out: Path) -> None:
    from matplotlib.backends.backend_agg import (
        FigureCanvasAgg,  # lazily: matplotlib is the optional plot extra
    )
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 4)
    for ax, key, title in ((axes[0], "abs_diff", "mean |Δlog p| (nats)"), (axes[1], "k3", "k3 KL")):
        pairs = list(summary["measured"])
        ax.bar(range(len(pairs)), [summary["measured"][p][key] for p in pairs],
               color=["tab:orange" if " " in p else "tab:blue" for p in pairs])  # orange: a real server
        ax.set_xticks(range(len(pairs)), pairs, rotation=60, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title + " by trainer/engine")
    for key, t in summary["trained"].items():
        axes[2].plot(range(1, len(t["reward"]) + 1), t["reward"], label=key,
                     linestyle="-" if key.endswith("token IS") else "--")
        axes[3].plot(range(1, len(t["k3_per_step"]) + 1), t["k3_per_step"], label=key,
                     linestyle="-" if key.endswith("token IS") else "--")
    axes[2].set_title("reward per step")
    axes[3].set_title("k3 KL per step (trained runs)")
    axes[3].set_yscale("log")
    for ax in axes[2:]:
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(SETUPS), default="tiny", help="the tiny GPT on the toy task, or SmolLM2 "
                   "(the main job's --model) on arithmetic")
    p.add_argument("--work-dir", type=Path, help="default: runs/precision_pairs, runs/precision_pairs_MODEL")
    p.add_argument("--summary", type=Path, help="default: experiments/precision_pairs.json, _MODEL.json")
    p.add_argument("--out", type=Path, help="default: experiments/precision_pairs.png, _MODEL.png")
    p.add_argument("--measure-rollouts", type=int, help="default: the setup's (2)")
    p.add_argument("--train-rollouts", type=int, help="default: the setup's (16 tiny, 3 SmolLM2)")
    p.add_argument("--bound", type=float, help="U of the clip-mode IS whose clip fractions are measured (default: "
                   "1.001 tiny, 2 SmolLM2)")
    p.add_argument("--jobs", type=int, help="runs at a time (default: the setup's, 2 tiny, 1 SmolLM2)")
    p.add_argument("--force", action="store_true")
    p.add_argument("--plot-only", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tail = "" if args.model == "tiny" else f"_{args.model}"
    args.work_dir = args.work_dir or ROOT / "runs" / f"precision_pairs{tail}"
    args.summary = args.summary or ROOT / "experiments" / f"precision_pairs{tail}.json"
    args.out = args.out or ROOT / "experiments" / f"precision_pairs{tail}.png"
    setup = SETUPS[args.model]
    measured, trained = plan(args)
    if not args.plot_only:
        run_all([*measured, *trained], args.work_dir, args.jobs or setup.jobs, args.force)
    summary = summarize(measured, trained, args.work_dir, setup.final_steps)
    args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    print_tables(summary, args.bound or setup.bound)
    plot(summary, args.out)
    print(f"\nwrote {args.summary} and {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
