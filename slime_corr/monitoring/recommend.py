"""Which preset the measured mismatch calls for, following the decision guide of the rollout-correction theory
document (reference 000, "Summary and Decision Guide"):

- negligible (same checkpoint, minor differences): `ppo_is_bypass` — π_rollout as the proximal policy, no
  recompute pass; naive PPO (π_old as behaviour policy) is wrong whenever π_rollout ≠ π_old;
- moderate (async workers, slight staleness): `decoupled_token_is` — per-token IS with a separate proximal policy;
- severe (replay buffers, old data): `decoupled_seq_is_rs` (or `decoupled_seq_is`) — sequence-level IS with
  rejection sampling.

The guide names the regimes by their cause, not by a number. The measured statistic is the token-level k3 KL
estimate `mismatch_k3_kl` (≥ 0, E[k3] = KL(π_rollout ‖ π_train)); its QUANTILE over the logged steps (a regime
holds when at least 10 % of the steps reach it) is compared with two thresholds, this project's choice,
printed with every recommendation and settable on the command line:

    negligible:  q < 1e-3        moderate:  1e-3 ≤ q < 1e-2        severe:  q ≥ 1e-2

(bf16 rollout vs fp32 training at the same weights stays well under 1e-3 per token; one-step-stale async weights
reach 1e-3 – 1e-2; k3 ≥ 1e-2 per token makes sequence-level ratios of a few hundred tokens leave any usable
range, the case the guide sends to sequence IS with rejection.)

When the recommended preset rejects whole sequences, a hint estimates the share it would drop at the measured
mismatch (`_sequence_rejection_hint`): in the README's experiment (12-token responses, k3 ≈ 0.1) that was about
two thirds, and `decoupled_token_is` trained better there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction.diagnostics import PROB_EDGES, VIEWS

METRIC = "rollout_corr/mismatch_k3_kl"
RESPONSE_LENGTH = "rollout/response_length_mean"
KL_METRIC = "rollout_corr/mismatch_kl"
PRESETS = {"negligible": "ppo_is_bypass", "moderate": "decoupled_token_is", "severe": "decoupled_seq_is_rs"}
WHY = {
    "negligible": "the rollout and training policies agree closely (same checkpoint, minor numeric differences): "
                  "bypass mode uses pi_rollout as the proximal policy, which is correct and skips the pi_old "
                  "recompute pass",
    "moderate": "the policies differ measurably (e.g. async workers, slight staleness): decoupled PPO with "
                "per-token truncated IS corrects rollout->old while PPO clips old->current",
    "severe": "the policies differ strongly (e.g. replay buffers, old data): sequence-level IS with sequence "
              "rejection sampling corrects whole trajectories and drops the ones outside [0.5, 2]",
}
LOW_PROB_EDGE = 1e-3  # "low probability" for the concentration hint: p_rollout below this
UPPER_EDGE = dict(zip(VIEWS["prob"], (*PROB_EDGES, 1.0), strict=True))  # bucket label -> its upper p edge


@dataclass(frozen=True)
class Thresholds:
    negligible_below: float = 1e-3
    severe_from: float = 1e-2
    quantile: float = 0.9

    def __post_init__(self) -> None:
        if not 0 < self.negligible_below < self.severe_from:
            raise ValueError(f"thresholds: need 0 < --negligible-below ({self.negligible_below}) < --severe-from "
                             f"({self.severe_from}).")
        if not 0 <= self.quantile <= 1:
            raise ValueError(f"--quantile must be in [0, 1], got {self.quantile}.")

    def describe(self) -> str:
        return (f"negligible: q < {self.negligible_below:g} <= moderate < {self.severe_from:g} <= severe, "
                f"q = the {self.quantile:.0%} quantile over steps of {METRIC}")


@dataclass
class Recommendation:
    regime: str
    preset: str
    statistic: float
    median: float
    maximum: float
    steps: int
    thresholds: Thresholds
    hints: list[str] = field(default_factory=list)

    @property
    def why(self) -> str:
        return WHY[self.regime]


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of finite values (numpy's default)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def classify(statistic: float, thresholds: Thresholds) -> str:
    if statistic < thresholds.negligible_below:
        return "negligible"
    return "moderate" if statistic < thresholds.severe_from else "severe"


def recommend(records: Sequence[Mapping[str, float | None]], thresholds: Thresholds | None = None
              ) -> Recommendation:
    """The regime and preset of a run's step records (`metrics.jsonl` lines). Raises ValueError when the run
    has no finite `rollout_corr/mismatch_k3_kl` (mismatch metrics were off)."""
    thresholds = thresholds or Thresholds()
    values = [float(v) for r in records if isinstance(v := r.get(METRIC), int | float) and math.isfinite(v)]
    if not values:
        raise ValueError(f"no finite {METRIC} in the run's metrics: run with --get-mismatch-metrics (or a "
                         "correction flag) so the mismatch is measured.")
    stat = quantile(values, thresholds.quantile)
    regime = classify(stat, thresholds)
    rec = Recommendation(regime, PRESETS[regime], stat, quantile(values, 0.5), max(values), len(values), thresholds)
    rec.hints = _hints(records)
    rec.hints.append(_budget_hint(values, records))
    if (hint := _sequence_rejection_hint(records, rec.preset)) is not None:
        rec.hints.insert(0, hint)
    return rec


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2))


def _sequence_rejection_hint(records: Sequence[Mapping[str, float | None]], preset: str) -> str | None:
    """How many sequences the recommended preset's sequence-level RS would reject, estimated per step from the
    token-level mismatch and the mean response length L: for small per-token log-ratios x, k3 ≈ x²/2, so
    E[x²] ≈ 2·k3 and E[x] = −mismatch_kl; with independent tokens Σx is about N(μ, σ²), μ = −L·mismatch_kl,
    σ² = L·(2·k3 − mismatch_kl²), and the share outside [log lower, log upper] follows; averaged over steps.
    Said when it is over 30 %. (On the experiment's runs it came within 4 points of the measured rejection.)"""
    config = RolloutCorrectionConfig.preset(preset)
    if not (config.use_rs and config.rs_level == "sequence"):
        return None
    lower, upper = config.rs_bounds
    shares, spreads = [], []
    for r in records:
        k3, kl, length = (r.get(k) for k in (METRIC, KL_METRIC, RESPONSE_LENGTH))
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in (k3, kl, length)) or length <= 0:
            continue
        variance = 2 * k3 - kl * kl  # per token: E[x²] ≈ 2·k3, E[x] = −mismatch_kl
        if variance <= 0:
            continue
        mu, sigma = -kl * length, math.sqrt(variance * length)
        spreads.append(sigma)
        shares.append(_normal_cdf((math.log(lower) - mu) / sigma) + 1 - _normal_cdf((math.log(upper) - mu) / sigma))
    if not shares or (outside := sum(shares) / len(shares)) <= 0.3:
        return None
    return (f"at this mismatch a sequence's log-ratio spreads about ±{quantile(spreads, 0.5):.2g} (median over "
            f"steps of √(L·(2·k3 − kl²)), L = the mean response length): about {outside:.0%} of the sequences "
            f"would fall outside {preset}'s rejection bounds [{lower:g}, {upper:g}] and be dropped; "
            "decoupled_token_is (per-token weights) keeps every sequence, if that is too many.")


def _budget_hint(k3: Sequence[float], records: Sequence[Mapping[str, float | None]]) -> str:
    """Budgets instead of constant bounds (`correction/budget.py`), from this run's own statistics: the median
    per-token k3 as the mean-divergence budget of token-level k3 rejection (a typical step keeps all its tokens, a
    step whose mismatch spikes drops its most divergent tokens until their mean is back at the median), and the
    median logged `mis_ess` as the ESS target (the truncation a constant bound gave on a typical step, adapted per
    step)."""
    hint = (f"budgets instead of constants: --rs-metric k3 --rs-agg token --rs-divergence-budget "
            f"{quantile(k3, 0.5):.2g} (this run's median per-token k3; its {0.9:.0%} quantile is "
            f"{quantile(k3, 0.9):.2g}, so steps above the median drop their most divergent tokens until the kept "
            "mean is back at it)")
    ess = [v for r in records if isinstance(v := r.get("rollout_corr/mis_ess"), int | float) and math.isfinite(v)]
    if ess:
        target = min(max(quantile(ess, 0.5), 0.05), 1.0)
        hint += (f"; --tis-ess-target {math.floor(target * 100) / 100:.2f} instead of --tis-upper-bound (the median "
                 "logged mis_ess: each step's truncation bound keeps at least that effective sample size)")
    return hint + "."


def bucket_totals(records: Sequence[Mapping[str, float | None]], view: str
                  ) -> tuple[list[str], list[float], list[float]]:
    """Over all steps, per bucket of the diagnostics view `view` ("prob", "pos", "lag"): (labels, tokens, Σ k3),
    from each step's `diag/<view>/<bucket>/k3` (a mean) and `token_frac` and `diag/tokens`."""
    labels = VIEWS[view]
    tokens = [0.0] * len(labels)
    k3_sum = [0.0] * len(labels)
    for r in records:
        n = r.get("diag/tokens") or 0.0
        for i, label in enumerate(labels):
            frac = r.get(f"diag/{view}/{label}/token_frac") or 0.0
            tokens[i] += frac * n
            k3_sum[i] += (r.get(f"diag/{view}/{label}/k3") or 0.0) * frac * n
    return labels, tokens, k3_sum


def display_label(label: str) -> str:
    """Bucket key label -> axis label: "lt_1e-06" -> "<1e-06", "1e-06_1e-05" -> "1e-06–1e-05", "ge_4" -> "≥4"."""
    if label.startswith("lt_"):
        return "<" + label[3:]
    if label.startswith("ge_"):
        return "≥" + label[3:]
    return label.replace("_", "–")


def _hints(records: Sequence[Mapping[str, float | None]]) -> list[str]:
    """Observations beyond the regime: low-probability concentration (-> veto), staleness, rejection, IS tails."""
    hints: list[str] = []
    labels, tokens, k3_sum = bucket_totals(records, "prob")
    low = [i for i, label in enumerate(labels) if UPPER_EDGE[label] <= LOW_PROB_EDGE]
    if sum(k3_sum) > 0 and sum(tokens) > 0:
        share = sum(k3_sum[i] for i in low) / sum(k3_sum)
        tok = sum(tokens[i] for i in low) / sum(tokens)
        if share >= 0.5 and share > 2 * tok:
            hints.append(f"{share:.0%} of the mismatch (k3) sits on tokens with p_rollout < {LOW_PROB_EDGE:g} "
                         f"({tok:.1%} of the tokens): a veto (--rs-veto-threshold 1e-4) drops the sequences "
                         "those tokens would blow up.")
    lags = [v for r in records if isinstance(v := r.get("diag/lag/mean"), int | float)]
    if lags and max(lags) > 0:
        hints.append(f"samples are stale: mean weight lag up to {max(lags):.2f} versions (async rollout); "
                     "the mismatch above includes it.")
    rejected = [v for r in records if isinstance(v := r.get("rollout_corr/mis_rejected_seq_fraction"), int | float)]
    if rejected and max(rejected) > 0.2:
        hints.append(f"up to {max(rejected):.0%} of the sequences were rejected in a step: the bounds may be too "
                     "tight for this mismatch, or the mismatch is severe.")
    truncated = [v for r in records if isinstance(v := r.get("rollout_corr/mis_truncate_fraction"), int | float)]
    if truncated and max(truncated) > 0.05:
        hints.append(f"up to {max(truncated):.0%} of the IS weights were truncated in a step: the tail of the "
                     "weights is heavy.")
    return hints


__all__ = ["METRIC", "PRESETS", "Recommendation", "Thresholds", "bucket_totals", "classify", "display_label",
           "quantile", "recommend"]
