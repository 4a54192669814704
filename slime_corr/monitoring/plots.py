"""The report's PNGs (matplotlib's object API with the Agg canvas: no pyplot state, no display needed)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, PercentFormatter

from slime_corr.monitoring.recommend import METRIC, Thresholds, bucket_totals, display_label

C = "rollout_corr/"
QUANTILE_KEYS = ("p10", "p50", "p90", "p99")
REJECTION_KEYS = (
    ("mis_rejected_token_fraction", "tokens rejected (any reason)"),
    ("mis_rejected_seq_fraction", "sequences rejected (any reason)"),
    ("mis_rs_rejected_token_fraction", "tokens rejected by RS"),
    ("mis_rs_rejected_seq_fraction", "sequences rejected by RS"),
    ("mis_catastrophic_seq_fraction", "sequences vetoed"),
    ("mis_nonfinite_seq_fraction", "sequences with non-finite log-probs"),
)
COMPARE_KEYS = (
    ("rollout/reward_mean", "reward (mean)"),
    (METRIC, "mismatch k3 KL"),
    ("train/pg_clipfrac", "PPO clip fraction"),
    ("train/grad_norm", "gradient norm"),
)
VIEW_TITLES = {"prob": "rollout probability p", "pos": "position in the response", "lag": "weight lag (versions)"}


def figure(rows: int = 1, cols: int = 1, height: float = 3.6) -> tuple[Figure, Any]:
    """A constrained-layout figure on the Agg canvas and its [rows][cols] axes."""
    fig = Figure(figsize=(8.5, height * rows), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False)


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path)
    return path


def _steps_axis(ax: Any) -> None:
    if not (ax.lines or ax.collections or ax.patches):  # an empty panel keeps its message only
        return
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)


def _empty(ax: Any, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, fontsize=11, color="0.35",
            wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _compact_y(ax: Any) -> None:
    """Tick labels like 4e-06 on a linear axis, instead of an offset text that collides with the title."""
    if ax.get_yscale() == "linear":
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.3g}"))


def _wide_range_scale(ax: Any, values: Sequence[float]) -> None:
    """Values spanning more than a factor 20: a log axis, or with zeros among them (nothing measured, no update)
    a symlog one, linear up to the smallest positive value; a linear axis otherwise."""
    finite = [v for v in values if math.isfinite(v)]
    positive = [v for v in finite if v > 0]
    if not positive or min(finite) < 0 or max(positive) / min(positive) <= 20:
        return
    if min(finite) > 0:
        ax.set_yscale("log")
    else:
        ax.set_yscale("symlog", linthresh=min(positive))
        low, high = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
        every = max(1, math.ceil((high - low) / 8))  # symlog labels every decade: at most ~8 labels
        ax.yaxis.set_major_locator(FixedLocator([0.0, *(10.0**k for k in range(low + 1, high + 1, every))]))


def _line(ax: Any, run: Any, key: str, label: str | None = None, **kw: Any) -> list[float]:
    steps, values = run.series(key)
    ax.plot(steps, values, marker="o", markersize=3, label=label, **kw)
    return values


def plot_mismatch(run: Any, path: Path, thresholds: Thresholds) -> Path:
    fig, ax = figure(2, 1)
    top, bottom = ax[0][0], ax[1][0]
    if _panel(top, run, [(C + "mismatch_kl", None, {"color": "tab:blue"})],
              "mismatch KL: token mean of log π_rollout − log π_train", "mismatch_kl",
              "mismatch_kl not logged (turn on --get-mismatch-metrics)"):
        top.axhline(0.0, color="0.5", lw=0.8)
    values = _panel(bottom, run, [(METRIC, "mismatch_k3_kl", {"color": "tab:red"})],
                    "k3 KL estimate: token mean of exp(x) − x − 1, x = log π_train − log π_rollout",
                    "mismatch_k3_kl", "mismatch_k3_kl not logged (turn on --get-mismatch-metrics)")
    if values:
        bottom.axhline(thresholds.negligible_below, color="tab:green", ls="--", lw=1,
                       label=f"negligible < {thresholds.negligible_below:g}")
        bottom.axhline(thresholds.severe_from, color="tab:purple", ls="--", lw=1,
                       label=f"severe ≥ {thresholds.severe_from:g}")
        finite = [v for v in values if math.isfinite(v) and v > 0]
        if finite:
            bottom.set_yscale("log")
            bottom.set_ylim(min(min(finite), thresholds.negligible_below) / 3,
                            max(max(finite), thresholds.severe_from) * 3)
        bottom.legend(loc="best", fontsize=8)
    return _save(fig, path)


def plot_is_weights(run: Any, path: Path) -> Path:
    fig, ax = figure(height=4.2)
    a = ax[0][0]
    values = _panel(a, run, [(C + f"mis_weight_{q}", q, {}) for q in QUANTILE_KEYS],
                    "IS weights (after bounding and normalization) over contributing units", "weight",
                    "no IS weights in this run (--use-tis off)")
    if values:
        steps, lo = run.series(C + "mis_weight_min")
        _, hi = run.series(C + "mis_weight_max")
        a.fill_between(steps, lo, hi, color="tab:blue", alpha=0.12, label="min … max", zorder=0)
        a.axhline(1.0, color="0.4", lw=0.8, ls=":")
        _wide_range_scale(a, values + lo + hi)
        a.legend(loc="best", fontsize=8, ncol=5)
    return _save(fig, path)


def plot_rejection(run: Any, path: Path) -> Path:
    fig, ax = figure(height=4.2)
    _panel(ax[0][0], run, [(C + k, label, {}) for k, label in REJECTION_KEYS],
           "rejected fractions (of valid tokens / sequences)", "fraction",
           "no rejection in this run (no --use-rs / veto / correction)", fraction=True)
    return _save(fig, path)


def _fraction_axis(ax: Any, values: Sequence[float]) -> None:
    """A [0, 1] quantity: 0 at the bottom, at least 5 % of headroom, shown in percent."""
    top = max([0.0, *(v for v in values if math.isfinite(v))])
    ax.set_ylim(-0.002, max(0.05, top * 1.15))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))


def _single(run: Any, path: Path, panels: Sequence[tuple[str, str, str]]) -> Path:
    """One line per panel; a panel whose key ends in "frac" is a [0, 1] fraction."""
    fig, ax = figure(len(panels), 1, height=3.0)
    for a, (key, title, ylabel) in zip((r[0] for r in ax), panels, strict=True):
        _panel(a, run, [(key, None, {"color": "tab:blue"})], title, ylabel, f"{key} not logged",
               fraction=key.endswith("frac"))
    return _save(fig, path)


def _panel(ax: Any, run: Any, lines: Sequence[tuple[str, str | None, dict[str, Any]]], title: str, ylabel: str,
           empty: str, *, fraction: bool = False) -> list[float]:
    """The lines `(key, label, style)` the run has over the steps, or the message `empty` when it has none."""
    present = [line for line in lines if run.has(line[0])]
    values: list[float] = []
    for key, label, style in present:
        values += _line(ax, run, key, label=label, **style)
    if present and fraction:
        _fraction_axis(ax, values)
    if any(label for _, label, _ in present):
        ax.legend(loc="best", fontsize=8)
    if not present:
        _empty(ax, empty)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    _steps_axis(ax)
    return values


def _trimmed(labels: list[str], tokens: list[float], k3_sum: list[float]) -> tuple[list[str], list[float], list[float]]:
    """Drop empty buckets at both ends (positions past the longest response, lags never seen)."""
    used = [i for i, t in enumerate(tokens) if t > 0]
    if not used:
        return [], [], []
    sl = slice(used[0], used[-1] + 1)
    return labels[sl], tokens[sl], k3_sum[sl]


def plot_prob_buckets(run: Any, path: Path) -> Path:
    fig, ax = figure(2, 1, height=3.4)
    share, mean = ax[0][0], ax[1][0]
    labels, tokens, k3_sum = bucket_totals(run.records, "prob")
    if sum(tokens) > 0:
        x = list(range(len(labels)))
        total_tok, total_k3 = sum(tokens), sum(k3_sum)
        w = 0.4
        share.bar([i - w / 2 for i in x], [t / total_tok for t in tokens], w, label="share of tokens")
        share.bar([i + w / 2 for i in x], [k / total_k3 if total_k3 > 0 else 0.0 for k in k3_sum], w,
                  label="share of the mismatch (Σ k3)", color="tab:red")
        share.yaxis.set_major_formatter(PercentFormatter(1.0))
        share.legend(loc="best", fontsize=8)
        means = [k / t if t > 0 else math.nan for k, t in zip(k3_sum, tokens, strict=True)]
        mean.bar(x, [m if math.isfinite(m) else 0.0 for m in means], 0.6, color="tab:red")
        _wide_range_scale(mean, [m for m in means if math.isfinite(m)])
        _compact_y(mean)
        for a in (share, mean):
            a.set_xticks(x, [display_label(s) for s in labels], rotation=30, ha="right", fontsize=8)
            a.grid(True, axis="y", alpha=0.3)
        mean.set_xlabel("rollout probability p_rollout of the sampled token")
    else:
        for a in (share, mean):
            _empty(a, "no diagnostics in this run (--log-mismatch-diagnostics with mismatch metrics)")
    share.set_title("where the mismatch sits: tokens and k3 by rollout-probability bucket (all steps)")
    share.set_ylabel("share")
    mean.set_title("mean k3 per token in each bucket")
    mean.set_ylabel("k3 per token")
    return _save(fig, path)


def plot_diagnostics(run: Any, path: Path) -> Path:
    fig, ax = figure(3, 1, height=3.0)
    for a, view in zip((ax[0][0], ax[1][0]), ("pos", "lag"), strict=True):
        labels, tokens, k3_sum = _trimmed(*bucket_totals(run.records, view))
        if labels:
            x = list(range(len(labels)))
            means = [k / t for k, t in zip(k3_sum, tokens, strict=True)]
            a.bar(x, means, 0.6, color="tab:red")
            _wide_range_scale(a, means)  # e.g. a bf16-only lag-0 rollout beside stale ones
            _compact_y(a)
            total = sum(tokens)
            ticks = [f"{display_label(s)}\n{t / total:.0%}" for s, t in zip(labels, tokens, strict=True)]
            a.set_xticks(x, ticks, fontsize=8)
            a.set_xlim(-0.7, max(len(x), 6) - 0.3)  # a few buckets keep the width of a bar
            a.grid(True, axis="y", alpha=0.3)
        else:
            _empty(a, f"no {VIEW_TITLES[view]} diagnostics in this run")
        a.set_title(f"mean k3 per token by {VIEW_TITLES[view]} (under each bucket: its share of tokens)")
        a.set_xlabel(VIEW_TITLES[view])
        a.set_ylabel("k3 per token")
    drift = ax[2][0]
    values = _panel(drift, run, [
        ("diag/drift/rollout_to_current_k3", "rollout → current (total)", {"ls": "--", "lw": 3, "alpha": 0.4,
                                                                         "color": "0.4"}),
        ("diag/drift/rollout_to_old_k3", "rollout → old (mismatch)", {"color": "tab:red"}),
        ("diag/drift/old_to_current_k3", "old → current (update size)", {"color": "tab:blue"}),
    ], "decoupled drift split (k3 per token)", "k3 per token",
        "drift split: decoupled mode only (bypass has no separate π_old)")
    _wide_range_scale(drift, values)  # e.g. an exploding update beside bf16-only steps
    _compact_y(drift)
    return _save(fig, path)


def plot_run(run: Any, out_dir: Path, thresholds: Thresholds) -> list[Path]:
    """Every PNG of one run's report."""
    return [
        plot_mismatch(run, out_dir / "mismatch.png", thresholds),
        plot_is_weights(run, out_dir / "is_weights.png"),
        plot_rejection(run, out_dir / "rejection.png"),
        _single(run, out_dir / "reward.png", [("rollout/reward_mean", "reward (mean over trained samples)",
                                               "reward")]),
        _single(run, out_dir / "clipfrac.png", [("train/pg_clipfrac", "PPO clip fraction", "pg_clipfrac"),
                                                ("train/ppo_kl", "PPO KL: token mean of log π_old − log π_θ",
                                                 "ppo_kl")]),
        plot_prob_buckets(run, out_dir / "prob_buckets.png"),
        plot_diagnostics(run, out_dir / "diagnostics.png"),
    ]


def seed_band(runs: Sequence[Any], key: str, *, by_rollout: bool = False
              ) -> tuple[list[int], list[float], list[float], list[float]]:
    """(x, mean, min, max) of `key` over `runs` (e.g. the seeds of one configuration) at each step (or rollout,
    see `Run.series`), from the runs that have a finite value there; x where none has one are left out."""
    at: dict[int, list[float]] = {}
    for run in runs:
        for x, v in zip(*run.series(key, by_rollout=by_rollout), strict=True):
            if math.isfinite(v):
                at.setdefault(x, []).append(v)
    xs = sorted(at)
    return xs, [sum(at[x]) / len(at[x]) for x in xs], [min(at[x]) for x in xs], [max(at[x]) for x in xs]


def draw_groups(ax: Any, groups: Mapping[str, Sequence[Any]], key: str, title: str, *, by_rollout: bool = False,
                colors: Mapping[str, str] | None = None) -> bool:
    """One line per group (its runs' mean) with a min … max band when it has several runs; False (and a
    message in the panel) when no run has `key`."""
    values: list[float] = []
    for i, (label, runs) in enumerate(groups.items()):
        xs, mean, lo, hi = seed_band(runs, key, by_rollout=by_rollout)
        if not xs:
            continue
        color = (colors or {}).get(label, f"C{i % 10}")
        ax.plot(xs, mean, marker="o", markersize=3, label=label, color=color)
        if len(runs) > 1:
            ax.fill_between(xs, lo, hi, color=color, alpha=0.15, lw=0)
        values += lo + hi
    if not values:
        _empty(ax, f"{key} not logged by any run")
    elif key.endswith("frac") or key.endswith("fraction"):
        _fraction_axis(ax, values)
    else:
        _wide_range_scale(ax, values)
    ax.set_title(title)
    ax.set_ylabel(key.split("/")[-1])
    _steps_axis(ax)
    return bool(values)


def plot_comparison(groups: Mapping[str, Sequence[Any]], path: Path, keys: Sequence[tuple[str, str]] = COMPARE_KEYS,
                    *, by_rollout: bool = False) -> Path:
    """One panel per key, one line per group of runs (`{label: runs}`: one run each, or a configuration's
    seeds, drawn as their mean and min … max band), e.g. naive PPO vs corrected presets."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = figure(len(keys), 1, height=2.8)
    for a, (key, title) in zip((r[0] for r in ax), keys, strict=True):
        if draw_groups(a, groups, key, title, by_rollout=by_rollout):
            a.legend(loc="best", fontsize=8)
    return _save(fig, path)


__all__ = ["draw_groups", "figure", "plot_comparison", "plot_run", "seed_band"]
