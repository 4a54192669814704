"""Naive PPO vs rollout-correction presets under a real mismatch: one script, one comparison plot.

    python experiments/mismatch_vs_correction.py             # 5 configurations x 2 learning rates x 3 seeds
    python experiments/mismatch_vs_correction.py --seeds 1 --lrs 0.03 --configs naive token-is
    python experiments/mismatch_vs_correction.py -- --model smollm2-135m     # main-job flags after `--`
    python experiments/mismatch_vs_correction.py --plot-only # replot the runs already in --work-dir

Each run is the real main job (`python -m slime_corr.main`: the tiny Megatron GPT by default, trained in fp32, its
embedded engine sampling in bf16, GRPO on the toy task, 16 rollouts of 4 prompts x 8 samples trained in 4 optimizer
steps each), differing only in the preset, `--async-rollout` and `--lr`. The mismatch is real, from two sources:

- the bf16 engine vs the fp32 trainer at the same weights (alone in the synchronous runs);
- asynchronous staleness: with `--async-rollout` rollout k+1 is generated with the weights before rollout k's
  updates, so its samples are 4 optimizer steps behind π_old (and 4 ... 7 behind π_θ).

The lag is fixed by the trainer (one rollout); the learning rate sets how far π moves in those 4 steps, so how
large the stale samples' mismatch is: `--lrs` (default 0.01, the main job's default, and 0.03) gives one column of
the plot each. Nothing else is scaled or injected.

The configurations (CONFIGS), all with the mismatch metrics on:

- naive PPO = the `disabled` preset: decoupled PPO that recomputes π_old and clips π_θ/π_old, with NO correction
  of π_rollout -> π_old (samples drawn from π_rollout are treated as if π_old had drawn them). This is what
  standard PPO does when the trainer recomputes the old log-probs, and what the decision guide calls wrong
  whenever π_rollout != π_old. It is run asynchronously and, as the reference, synchronously (bf16 mismatch only);
- `decoupled_token_is` and `decoupled_seq_is_rs`: the same decoupled PPO with the rollout->old IS weights
  (token-level truncated; sequence-level truncated plus sequence rejection outside [0.5, 2]);
- `ppo_is_bypass`: bypass PPO, π_rollout as π_old (the PPO ratio π_θ/π_rollout itself is the correction).

Outputs: `--out` (the comparison PNG, one column per learning rate: reward, mismatch k3, grad norm per step, clip
fraction, rejected sequences over optimizer steps, the mean over seeds with a min ... max band, and the final
reward per seed) and `--summary` (JSON: per learning rate, configuration and seed the numbers docs/experiments.md quotes,
and each run's command); the tables are printed. The runs go to `--work-dir` (metrics.jsonl, console.log;
`slime-corr report RUN_DIR` works on each); a run whose directory holds a finished run of the same command is
reused (`--force` reruns). Time: about 30 s per run on 2 CPU cores, 30 runs by default.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DONE_FILE = "experiment_run.json"


@dataclass(frozen=True)
class Config:
    label: str
    preset: str
    async_rollout: bool
    color: str
    flags_extra: tuple[str, ...] = ()  # the async variants: staleness bound, partial rollouts, π_old method

    def flags(self) -> list[str]:
        return ["--rollout-correction-preset", self.preset, *(["--async-rollout"] if self.async_rollout else []),
                *self.flags_extra]


CONFIGS = {
    "naive-sync": Config("naive PPO, synchronous (bf16 mismatch only)", "disabled", False, "0.55"),
    "naive": Config("naive PPO (disabled: π_old recomputed, no IS), async", "disabled", True, "tab:red"),
    "token-is": Config("decoupled_token_is, async", "decoupled_token_is", True, "tab:blue"),
    "seq-is-rs": Config("decoupled_seq_is_rs, async", "decoupled_seq_is_rs", True, "tab:green"),
    "bypass": Config("ppo_is_bypass, async", "ppo_is_bypass", True, "tab:purple"),
    # the async variants (not in the default set: `--configs token-is token-is-k2 ...`); K in rollouts ahead, as
    # --max-staleness steps (4 steps per rollout: A rollouts ahead = (A + 1) × 4 − 1 steps)
    "token-is-k2": Config("decoupled_token_is, 2 rollouts ahead (--max-staleness 11)", "decoupled_token_is", True,
                          "tab:cyan", ("--max-staleness", "11")),
    "token-is-k4": Config("decoupled_token_is, 4 rollouts ahead (--max-staleness 19)", "decoupled_token_is", True,
                          "tab:olive", ("--max-staleness", "19")),
    "token-is-partial": Config("decoupled_token_is, partial rollouts", "decoupled_token_is", True, "tab:orange",
                               ("--partial-rollout",)),
    "token-is-loglinear": Config("decoupled_token_is, loglinear π_old", "decoupled_token_is", True, "tab:brown",
                                 ("--prox-logp-method", "loglinear", "--prox-logp-error-interval", "1")),
    "naive-k4": Config("naive PPO, 4 rollouts ahead (--max-staleness 19)", "disabled", True, "tab:pink",
                       ("--max-staleness", "19")),
}
# the peers' losses (slime_corr/policy_losses.py), each on its own against the async mismatch: decoupled, π_old
# recomputed, no rollout IS (the `disabled` preset, as naive PPO), so what a loss does with stale tokens is its own
for _loss, _color in (("cispo", "tab:olive"), ("sapo", "tab:cyan"), ("geo_mean", "tab:brown"), ("dppo_tv", "tab:gray"),
                      ("dppo_kl", "black"), ("clip_cov", "gold"), ("kl_cov", "lime")):
    CONFIGS[_loss.replace("_", "-")] = Config(f"--policy-loss-type {_loss}, async", "disabled", True, _color,
                                              ("--policy-loss-type", _loss))
LOSS_CONFIGS = ("naive", "token-is", "cispo", "sapo", "geo-mean", "dppo-tv", "dppo-kl", "clip-cov", "kl-cov")
DEFAULT_CONFIGS = ("naive-sync", "naive", "token-is", "seq-is-rs", "bypass")
# (key, title, one point per rollout): the gradient norm per step, so that a single exploding step shows
PANELS = (
    ("rollout/reward_mean", "reward (mean over the rollout's samples)", True),
    ("rollout_corr/mismatch_k3_kl", "mismatch k3 KL (π_rollout vs the loss's π_train)", True),
    ("train/grad_norm", "gradient norm per step (before clipping at 1.0)", False),
    ("train/pg_clipfrac", "PPO clip fraction", True),
    ("rollout_corr/mis_rejected_seq_fraction", "sequences rejected (RS)", True),
)
REWARD = "rollout/reward_mean"
REACHED = 0.5  # "rollouts to reach reward 0.5"
GRAD_SPIKE = 10.0  # "steps with a gradient norm above 10" (before clipping; typical norms are below 1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(DEFAULT_CONFIGS),
                   help=f"Which to run (default: {' '.join(DEFAULT_CONFIGS)}; the async variants token-is-k2, "
                        "token-is-k4, token-is-partial, token-is-loglinear and naive-k4, and the peers' losses ("
                        f"{' '.join(LOSS_CONFIGS[2:])}) on request).")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="--seed of the runs (one run each).")
    p.add_argument("--lrs", nargs="+", type=float, default=[0.01, 0.03],
                   help="Learning rates, one column of the plot each: how far π moves per optimizer step, so how "
                        "far the stale samples are from π_old (the main job's --lr; its default is 0.01).")
    p.add_argument("--num-rollout", type=int, default=16, help="Rollouts per run (the main job's flag).")
    p.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "mismatch_vs_correction",
                   help="Where the runs go (one directory per configuration, learning rate and seed).")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "mismatch_vs_correction.png")
    p.add_argument("--summary", type=Path, default=ROOT / "experiments" / "mismatch_vs_correction.json")
    p.add_argument("--jobs", type=int, default=1, help="Runs at a time (each is one process).")
    p.add_argument("--force", action="store_true", help="Rerun finished runs.")
    p.add_argument("--plot-only", action="store_true", help="Only plot and summarize the finished runs.")
    p.add_argument("extra", nargs=argparse.REMAINDER,
                   help="After `--`: flags for every run of the main job, e.g. -- --model smollm2-135m.")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.extra[:1] == ["--"]:
        args.extra = args.extra[1:]
    for flag, value in (("--jobs", args.jobs), ("--num-rollout", args.num_rollout)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}.")
    if any(lr <= 0 for lr in args.lrs):
        parser.error(f"--lrs must be > 0, got {' '.join(map(str, args.lrs))}.")
    return args


@dataclass(frozen=True)
class Planned:
    """One run of the plan."""

    config: str
    lr: float
    seed: int
    run_dir: Path
    command: tuple[str, ...]


def plan_runs(args: argparse.Namespace) -> list[Planned]:
    plan = []
    for lr in args.lrs:
        for name in args.configs:
            for seed in args.seeds:
                run_dir = args.work_dir / f"{name}-lr{lr:g}-seed{seed}"
                command = ("-m", "slime_corr.main", *CONFIGS[name].flags(), "--lr", f"{lr:g}", "--seed", str(seed),
                           "--num-rollout", str(args.num_rollout), "--rollout-progress", "none", "--work-dir",
                           str(run_dir), *args.extra)
                plan.append(Planned(name, lr, seed, run_dir, command))
    return plan


def finished(run: Planned) -> bool:
    done = run.run_dir / DONE_FILE
    return done.is_file() and json.loads(done.read_text()).get("command") == list(run.command)


@dataclass
class Running:
    """A launched run: its process, console log and start time."""

    run: Planned
    proc: subprocess.Popen
    log: Any
    started: float


def launch(run: Planned) -> Running:
    if run.run_dir.exists():
        shutil.rmtree(run.run_dir)
    run.run_dir.mkdir(parents=True)
    log = open(run.run_dir / "console.log", "w")  # noqa: SIM115 - closed by wait()
    proc = subprocess.Popen([sys.executable, *run.command], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    return Running(run, proc, log, time.perf_counter())


def wait(running: Running) -> None:
    """Wait for a run; record it as finished (with its wall time) or exit with its log's tail."""
    run, code = running.run, running.proc.wait()
    running.log.close()
    seconds = time.perf_counter() - running.started
    if code:
        tail = (run.run_dir / "console.log").read_text()[-3000:]
        raise SystemExit(f"run {run.run_dir.name} failed (exit {code}): python {' '.join(run.command)}\n{tail}")
    shutil.rmtree(run.run_dir / "weights", ignore_errors=True)  # the engines' weight files: not needed afterwards
    (run.run_dir / DONE_FILE).write_text(json.dumps({"command": run.command, "seconds": seconds}) + "\n")
    print(f"  {run.run_dir.name}: {seconds:.0f} s", flush=True)


def run_all(plan: list[Planned], jobs: int, force: bool) -> None:
    todo = [run for run in plan if force or not finished(run)]
    print(f"{len(plan) - len(todo)} run(s) reused, {len(todo)} to run, {jobs} at a time", flush=True)
    running: list[Running] = []
    start = time.perf_counter()
    try:
        for i, run in enumerate(todo):
            while len(running) >= jobs:
                wait(running.pop(0))
            print(f"[{i + 1}/{len(todo)}] {run.run_dir.name} ({time.perf_counter() - start:.0f} s so far)",
                  flush=True)
            running.append(launch(run))
        while running:
            wait(running.pop(0))
    finally:  # a failed run or Ctrl-C: stop the runs this script started
        for r in running:
            r.proc.terminate()
            r.proc.wait()
            r.log.close()
    print(f"ran {len(todo)} run(s) in {time.perf_counter() - start:.0f} s", flush=True)


# ---------------------------------------------------------------------------------------------------- numbers
def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if isinstance(v, int | float) and math.isfinite(v)]


def run_numbers(run: Any) -> dict[str, Any]:
    """One run's numbers: reward of the first and last rollout, the first rollout reaching REACHED, the largest
    drop of the reward below its best so far, the mismatch (median, max over steps), grad norm (median, max, steps
    above GRAD_SPIKE), clip fraction and rejected sequences (means over steps)."""
    _, reward = run.series(REWARD, by_rollout=True)
    reached = next((i for i, r in enumerate(reward) if r >= REACHED), None)
    drop = max(max(reward[:i + 1]) - r for i, r in enumerate(reward))

    def stats(key: str) -> list[float]:
        return _finite(run.series(key)[1])

    k3, grad, clip, rejected = (stats(k) for k in ("rollout_corr/mismatch_k3_kl", "train/grad_norm",
                                                   "train/pg_clipfrac", "rollout_corr/mis_rejected_seq_fraction"))
    return {
        "steps": len(run.records), "rollouts": len(reward),
        "reward_first": reward[0], "reward_last": reward[-1], f"rollouts_to_reward_{REACHED:g}": reached,
        "reward_max_drop": drop,
        "mismatch_k3_median": statistics.median(k3) if k3 else None, "mismatch_k3_max": max(k3, default=None),
        "grad_norm_median": statistics.median(grad) if grad else None, "grad_norm_max": max(grad, default=None),
        f"grad_norm_steps_above_{GRAD_SPIKE:g}": sum(g > GRAD_SPIKE for g in grad),
        "pg_clipfrac_mean": statistics.fmean(clip) if clip else None,
        "rejected_seq_fraction_mean": statistics.fmean(rejected) if rejected else None,
        "step_time_median": statistics.median(t) if (t := stats("perf/step_time")) else None,
        "staleness_oldest_max": max(stats("rollout/staleness_oldest_max"), default=None),
        "partial_samples_mean": statistics.fmean(p) if (p := stats("rollout/partial_samples")) else None,
        "prox_logp_abs_error_mean": statistics.fmean(e) if (e := stats("train/prox_logp_abs_error_mean")) else None,
    }


def summarize(runs: dict[Planned, Any], work_dir: Path) -> dict[str, Any]:
    """{"lr=<lr>": {config: {label, preset, async_rollout, reward_last_mean/min/max, seeds: {seed: numbers}}}}."""
    out: dict[str, Any] = {}
    for planned, run in runs.items():
        done = json.loads((run.path / DONE_FILE).read_text())
        config = CONFIGS[planned.config]
        entry = out.setdefault(f"lr={planned.lr:g}", {}).setdefault(planned.config, {
            "label": config.label, "preset": config.preset, "async_rollout": config.async_rollout, "seeds": {}})
        entry["seeds"][str(planned.seed)] = {
            **run_numbers(run), "seconds": round(done["seconds"], 1),
            "command": "python " + " ".join(done["command"]).replace(str(work_dir), "WORK")}
    for regime in out.values():
        for entry in regime.values():
            last = [s["reward_last"] for s in entry["seeds"].values()]
            entry.update(reward_last_mean=statistics.fmean(last), reward_last_min=min(last), reward_last_max=max(last))
    return out


def table(regime: dict[str, Any]) -> str:
    """A Markdown table of one learning rate's configurations (over seeds)."""
    def over_seeds(entry: dict[str, Any], key: str, fmt: str, how: Any = statistics.fmean) -> str:
        values = _finite([s[key] for s in entry["seeds"].values() if s[key] is not None])
        return format(how(values), fmt) if values else "–"

    rows = ["| configuration | final reward: mean (min–max) | rollouts to reward 0.5 | largest reward drop | "
            "mismatch k3, median | grad norm: median / max | steps with grad norm > 10 | clip fraction | "
            "rejected seqs | s/step, median | oldest token, steps |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for entry in regime.values():
        seeds = entry["seeds"].values()
        reached = ", ".join("never" if (r := v[f"rollouts_to_reward_{REACHED:g}"]) is None else str(r) for v in seeds)
        spikes = sum(v[f"grad_norm_steps_above_{GRAD_SPIKE:g}"] for v in seeds)
        rows.append(f"| {entry['label']} | {entry['reward_last_mean']:.2f} ({entry['reward_last_min']:.2f}–"
                    f"{entry['reward_last_max']:.2f}) | {reached} | {over_seeds(entry, 'reward_max_drop', '.2f', max)} "
                    f"| {over_seeds(entry, 'mismatch_k3_median', '.2g')} | "
                    f"{over_seeds(entry, 'grad_norm_median', '.2f')} / {over_seeds(entry, 'grad_norm_max', '.3g', max)} "
                    f"| {spikes} | {over_seeds(entry, 'pg_clipfrac_mean', '.2f')} | "
                    f"{over_seeds(entry, 'rejected_seq_fraction_mean', '.2f')} | "
                    f"{over_seeds(entry, 'step_time_median', '.2f')} | "
                    f"{over_seeds(entry, 'staleness_oldest_max', '.0f', max)} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------------- the plot
def plot(runs: dict[Planned, Any], summary: dict[str, Any], path: Path, lrs: Sequence[float], subtitle: str) -> Path:
    """Rows: PANELS and the final reward per seed; columns: the learning rates (shared y range per row)."""
    from slime_corr.monitoring.plots import draw_groups, figure

    fig, ax = figure(len(PANELS) + 1, len(lrs), height=2.6)
    fig.set_size_inches(6.5 * len(lrs), 2.6 * (len(PANELS) + 1) + 0.8)
    for col, lr in enumerate(lrs):
        groups: dict[str, list[Any]] = {}
        colors: dict[str, str] = {}
        for planned, run in runs.items():
            if planned.lr == lr:
                label = f"{planned.config}: {CONFIGS[planned.config].label}"
                groups.setdefault(label, []).append(run)
                colors[label] = CONFIGS[planned.config].color
        for row, (key, title, by_rollout) in enumerate(PANELS):
            draw_groups(ax[row][col], groups, key, f"lr {lr:g}: {title}", by_rollout=by_rollout, colors=colors)
        final = ax[len(PANELS)][col]
        regime = summary[f"lr={lr:g}"]
        for i, (name, entry) in enumerate(regime.items()):
            values = [v["reward_last"] for v in entry["seeds"].values()]
            final.scatter([i] * len(values), values, color=CONFIGS[name].color, s=30, zorder=3)
            final.hlines(statistics.fmean(values), i - 0.3, i + 0.3, color=CONFIGS[name].color, lw=2)
        final.set_xticks(range(len(regime)), list(regime), fontsize=9)
        final.set_xlim(-0.6, len(regime) - 0.4)
        final.set_title(f"lr {lr:g}: reward of the last rollout (dots: seeds, bar: mean)")
        final.set_ylabel("reward")
        final.grid(True, axis="y", alpha=0.3)
    for row, (key, _, _) in zip(ax, PANELS, strict=False):
        for a in row:
            if key == "train/grad_norm":  # linear up to 1 (zero: no signal), then decades up to the spikes
                a.set_yscale("symlog", linthresh=1.0)
            elif any(b.get_yscale() == "log" for b in row):
                a.set_yscale("log")
    for row in ax:  # one y range per row, so the columns compare at a glance
        low, high = min(a.get_ylim()[0] for a in row), max(a.get_ylim()[1] for a in row)
        for a in row:
            a.set_ylim(low, high)
    handles, labels = ax[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=2, fontsize=9, frameon=False)
    fig.suptitle("naive PPO vs rollout correction under a real mismatch: " + subtitle, fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72)
    from PIL import Image  # a matplotlib dependency

    with Image.open(path) as image:  # 128 colours: a third of the size, the same picture (it goes in docs/experiments.md)
        small = image.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = plan_runs(args)
    if not args.plot_only:
        run_all(plan, args.jobs, args.force)
    from slime_corr.monitoring.report import load_run

    missing = [run.run_dir for run in plan if not finished(run)]
    if missing:
        raise SystemExit(f"no finished run of this command in {', '.join(map(str, missing))}; run without "
                         "--plot-only.")
    runs = {planned: load_run(planned.run_dir) for planned in plan}
    summary = summarize(runs, args.work_dir)
    extra = f"; flags {' '.join(args.extra)}" if args.extra else ""
    subtitle = f"bf16 engine, async rollout; {len(args.seeds)} seed(s): mean and min–max band{extra}"
    path = plot(runs, summary, args.out, args.lrs, subtitle)
    args.summary.parent.mkdir(parents=True, exist_ok=True)
    args.summary.write_text(json.dumps({"extra_flags": args.extra, "num_rollout": args.num_rollout,
                                        "seeds": args.seeds, "regimes": summary}, indent=1) + "\n")
    for regime, entries in summary.items():
        print(f"\n{regime}\n{table(entries)}")
    print(f"\nwrote {path} and {args.summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
