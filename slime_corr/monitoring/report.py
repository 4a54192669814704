"""`slime-corr report RUN_DIR [RUN_DIR ...]`: PNG plots and a text summary with a preset recommendation.

For each run directory (what the trainer's `--run-dir` holds: metrics.jsonl, top_mismatch.jsonl, run_config.json)
it writes into RUN_DIR/report/ (or `--out`/<run name>/ for several runs): mismatch.png (mismatch KL and k3 with
the regime thresholds), is_weights.png (IS weight quantiles and extremes), rejection.png (rejected fractions),
reward.png, clipfrac.png (pg_clipfrac and ppo_kl), prob_buckets.png (the mismatch by rollout-probability bucket),
diagnostics.png (by response position, by weight lag, the decoupled drift split), and summary.txt (also printed).
With several runs it also writes `--out`/comparison.png, one line per run. Needs matplotlib (`.[plot]`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime_corr.disk import write_failure, write_text
from slime_corr.errors import DiskWriteError
from slime_corr.extras import install_hint
from slime_corr.monitoring.keys import CORRECTION, ROLLOUT
from slime_corr.monitoring.logger import CONFIG_FILE, METRICS_FILE, SAMPLES_FILE
from slime_corr.monitoring.loss_scale import summary_of_records as skipped_steps_summary
from slime_corr.monitoring.recommend import (
    METRIC,
    Recommendation,
    Thresholds,
    bucket_totals,
    display_label,
    recommend,
)

ROLLOUT_INDEX = f"{ROLLOUT}/index"


@dataclass
class Run:
    """A run directory's records: one dict per step (the last line wins for a repeated step)."""

    path: Path
    records: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0

    @property
    def name(self) -> str:
        return self.path.resolve().name

    @property
    def steps(self) -> list[int]:
        return [int(r["step"]) for r in self.records]

    def has(self, key: str) -> bool:
        return any(_finite(r.get(key)) for r in self.records)

    def series(self, key: str, *, by_rollout: bool = False) -> tuple[list[int], list[float]]:
        """(steps, values) of `key` with NaN where a step lacks it (a gap in a plot). `by_rollout`: one point per
        rollout (the steps sharing `rollout/index`), at its last step, the mean of its steps' finite values."""
        values = [float(v) if _finite(v := r.get(key)) else math.nan for r in self.records]
        if not by_rollout:
            return self.steps, values
        groups: dict[Any, list[tuple[int, float]]] = {}
        for r, step, value in zip(self.records, self.steps, values, strict=True):
            groups.setdefault(r.get(ROLLOUT_INDEX, ("step", step)), []).append((step, value))
        points = sorted((max(s for s, _ in part), _mean([v for _, v in part])) for part in groups.values())
        return [s for s, _ in points], [v for _, v in points]


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _mean(values: Sequence[float]) -> float:
    """Mean of the finite values; NaN when there is none."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    rows, bad = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # e.g. a line cut by a crash mid-write
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def load_run(run_dir: str | Path) -> Run:
    path = Path(run_dir)
    metrics = path / METRICS_FILE
    if not metrics.is_file():
        raise FileNotFoundError(f"RUN_DIR {path}: no {METRICS_FILE} there. Pass the directory the trainer wrote "
                                "(--run-dir, default the --work-dir of the main job).")
    rows, bad = _read_jsonl(metrics)
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        if isinstance(row.get("step"), int):
            by_step[row["step"]] = row
        else:
            bad += 1
    if not by_step:
        raise ValueError(f"RUN_DIR {path}: {METRICS_FILE} has no step records.")
    config_path = path / CONFIG_FILE
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    samples = _read_jsonl(path / SAMPLES_FILE)[0] if (path / SAMPLES_FILE).is_file() else []
    return Run(path, [by_step[s] for s in sorted(by_step)], config, samples, bad)


def summary_text(run: Run, rec: Recommendation | None, error: str | None = None) -> str:
    """The short text summary: what was measured, the thresholds, the regime and the preset, hints."""
    preset = run.config.get("rollout_correction_preset")
    lines = [f"slime-corr report: {run.path} ({len(run.records)} steps"
             + (f", preset {preset}" if preset else "") + ")"]
    if run.skipped_lines:
        lines.append(f"note: {run.skipped_lines} unreadable line(s) in {METRICS_FILE} were skipped")
    if skipped := skipped_steps_summary(run.records):
        lines.append(f"warning: {skipped}")
    if rec is None:
        lines.append(f"no recommendation: {error}")
        return "\n".join(lines) + "\n"
    t = rec.thresholds
    lines += [
        f"measured mismatch ({METRIC}, {rec.steps} steps): median {rec.median:.3g}, "
        f"p{t.quantile * 100:.0f} {rec.statistic:.3g}, max {rec.maximum:.3g}",
        f"  the rollout->old drift: {rec.source}"
        + (f"; {rec.excluded_steps} step(s) left out (every sample failed or no token measured)"
           if rec.excluded_steps else ""),
        f"thresholds: {t.describe()}",
        f"regime: {rec.regime} -> recommended preset: {rec.preset}",
        f"  why: {rec.why}" + ("." if rec.reason else " (decision guide of the rollout-correction theory document)."),
    ]
    if rec.predicted_rejected_share is not None:
        lines.append(f"  sequence-level RS at this drift: about {rec.predicted_rejected_share:.0%} of the sequences "
                     f"rejected (predicted, mean response length {rec.response_length:.3g} tokens; "
                     f"--max-rejected-share {t.max_rejected_share:g})")
    lines.append(f"  use: --rollout-correction-preset {rec.preset}  (or --custom-config-path "
                 f"arguments/{rec.preset}.yaml)")
    if preset and preset != rec.preset:
        lines.append(f"  this run used {preset}.")
    lines += [f"note: {n}" for n in rec.notes]
    if rec.hints:
        lines.append("observations:")
        lines += [f"  - {h}" for h in rec.hints]
    lines += diagnostic_lines(run)
    lines += rejection_lines(run)
    if run.samples:
        worst = max(run.samples, key=lambda s: abs(s.get("seq_log_ratio", 0.0)))
        text = f", response {worst['response']!r}" if "response" in worst else ""
        lines.append(f"largest sequence mismatch: step {worst.get('step')}, sum of log-ratios "
                     f"{worst.get('seq_log_ratio', 0.0):.3g} over {worst.get('tokens')} tokens{text}")
    return "\n".join(lines) + "\n"


def diagnostic_lines(run: Run) -> list[str]:
    """The `diag/` metrics in a few lines: where the mismatch sits by rollout probability, k3 by weight lag,
    and the decoupled drift split (means over steps)."""
    lines = []
    labels, tokens, k3 = bucket_totals(run.records, "prob")
    if sum(tokens) > 0 and sum(k3) > 0:
        top = max(range(len(labels)), key=lambda i: k3[i])
        dense = max((i for i, t in enumerate(tokens) if t > 0), key=lambda i: k3[i] / tokens[i])
        lines.append(f"  by rollout probability: {k3[top] / sum(k3):.0%} of the mismatch (sum of k3) on p in "
                     f"{display_label(labels[top])} ({tokens[top] / sum(tokens):.0%} of the tokens); the most per "
                     f"token on p in {display_label(labels[dense])} ({k3[dense] / tokens[dense]:.3g})")
    labels, tokens, k3 = bucket_totals(run.records, "lag")
    if used := [i for i, t in enumerate(tokens) if t > 0]:
        lines.append("  k3 per token by weight lag (versions): "
                     + ", ".join(f"{display_label(labels[i])}: {k3[i] / tokens[i]:.3g}" for i in used))
    if run.has("diag/drift/rollout_to_old_k3"):
        a, b, c = (_mean(run.series(f"diag/drift/{k}_k3")[1]) for k in ("rollout_to_old", "old_to_current",
                                                                          "rollout_to_current"))
        lines.append(f"  decoupled drift (k3 per token, mean over steps): rollout->old (the mismatch) {a:.3g}, "
                     f"old->current (the update) {b:.3g}, rollout->current {c:.3g}")
    return ["diagnostics (all steps):", *lines] if lines else []


MOSTLY_GOOD = 0.5  # share of the rejected sequences with a positive advantage above which the report says so


def rejection_lines(run: Run) -> list[str]:
    """On whom the rejection fell (`correction.rejection_outcomes`), over all steps: the rejected sequences'
    advantage signs and mean reward against the kept ones', the positive / negative advantage tokens removed; a
    warning when most rejected sequences had a positive advantage."""
    key = f"{CORRECTION}/mis_rejected_seq_pos_adv_fraction"
    rows = [r for r in run.records if _finite(r.get(key)) and _finite(r.get(f"{CORRECTION}/mis_rejected_seq_fraction"))
            and _finite(r.get(f"{CORRECTION}/mis_valid_seq_count"))]
    if not rows:
        return []
    rejected = [r[f"{CORRECTION}/mis_rejected_seq_fraction"] * r[f"{CORRECTION}/mis_valid_seq_count"] for r in rows]
    total = sum(rejected)
    if total <= 0:
        return ["rejection (all steps): no sequence rejected"]

    def weighted(name: str) -> float:
        return sum(n * r.get(f"{CORRECTION}/{name}", 0.0) for n, r in zip(rejected, rows, strict=True)) / total

    good = weighted("mis_rejected_seq_pos_adv_fraction")
    line = (f"rejection (all steps): {total:.0f} sequences rejected, {good:.0%} with a positive advantage, "
            f"{weighted('mis_rejected_seq_neg_adv_fraction'):.0%} negative")
    if run.has(f"{CORRECTION}/mis_rejected_seq_reward_mean"):
        kept = _mean(run.series(f"{CORRECTION}/mis_kept_seq_reward_mean")[1])
        line += f"; mean reward {weighted('mis_rejected_seq_reward_mean'):.3g} rejected vs {kept:.3g} kept"
    pos, neg = (_mean(run.series(f"{CORRECTION}/mis_rejected_{s}_adv_token_fraction")[1]) for s in ("pos", "neg"))
    lines = [line, f"  tokens removed: {pos:.0%} of the positive-advantage ones, {neg:.0%} of the negative"]
    if good > MOSTLY_GOOD:
        lines.append("  note: the rejection falls mostly on samples with a positive advantage: besides removing "
                     "off-policy samples it steers what the policy learns. Check the mismatch's source first "
                     "(precision, stale weights), or loosen the bound / reject per token.")
    return lines


def report_run(run: Run, out_dir: Path, thresholds: Thresholds) -> tuple[list[Path], str]:
    """Write the PNGs and summary.txt of one run into `out_dir`; returns (written files, summary text)."""
    from slime_corr.monitoring import plots  # lazily: matplotlib is the optional `plot` extra

    try:
        rec, error = recommend(run.records, thresholds, run.config), None
    except ValueError as e:
        rec, error = None, str(e)
    text = summary_text(run, rec, error)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        written = plots.plot_run(run, out_dir, thresholds)
    except OSError as e:  # a full disk: one named error (a half-written PNG is the plot library's to leave)
        raise write_failure(getattr(e, "filename", None) or out_dir, e) from None
    write_text(out_dir / "summary.txt", text)
    return [*written, out_dir / "summary.txt"], text


def build_parser() -> argparse.ArgumentParser:
    d = Thresholds()
    parser = argparse.ArgumentParser(prog="slime-corr report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="Run directories (with metrics.jsonl).")
    parser.add_argument("--out", default=None,
                        help="Output directory (default: RUN_DIR/report; required with several runs).")
    parser.add_argument("--negligible-below", type=float, default=d.negligible_below,
                        help=f"k3 quantile below which the mismatch is negligible (default {d.negligible_below:g}).")
    parser.add_argument("--severe-from", type=float, default=d.severe_from,
                        help=f"k3 quantile from which the mismatch is severe (default {d.severe_from:g}).")
    parser.add_argument("--quantile", type=float, default=d.quantile,
                        help=f"Quantile over steps compared with the thresholds (default {d.quantile:g}).")
    parser.add_argument("--max-rejected-share", type=float, default=d.max_rejected_share,
                        help="In the severe regime, recommend sequence-level RS only while it is predicted to "
                             f"reject at most this share of the sequences (default {d.max_rejected_share:g}).")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        thresholds = Thresholds(args.negligible_below, args.severe_from, args.quantile, args.max_rejected_share)
    except ValueError as e:
        parser.error(str(e))
    if len(args.run_dirs) > 1 and not args.out:
        parser.error("several RUN_DIRs: pass --out DIR for the comparison plot and the per-run reports.")
    try:
        runs = [load_run(d) for d in args.run_dirs]
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error(f"the report's plots need matplotlib: {install_hint('plot')}.")
    out = Path(args.out) if args.out else None
    names = [run.name for run in runs]
    labels = [name if names.count(name) == 1 else f"{i}-{name}" for i, name in enumerate(names)]  # a/run, b/run
    for run, sub in zip(runs, labels, strict=True):
        target = (out / sub if len(runs) > 1 else out) if out else run.path / "report"
        try:
            written, text = report_run(run, target, thresholds)
        except DiskWriteError as e:
            print(f"slime-corr report: error: {e}", file=sys.stderr)
            return 1
        print(text, end="")
        print(f"wrote {len(written)} files to {target}\n")
    if len(runs) > 1:
        from slime_corr.monitoring.plots import plot_comparison  # lazily: the optional `plot` extra

        assert out is not None
        path = plot_comparison({sub: [run] for sub, run in zip(labels, runs, strict=True)}, out / "comparison.png")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
