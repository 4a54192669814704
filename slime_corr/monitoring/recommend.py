"""Which preset the measured mismatch calls for, following the decision guide of the rollout-correction theory
document (reference 000, "Summary and Decision Guide"):

- negligible (same checkpoint, minor differences): `ppo_is_bypass` — π_rollout as the proximal policy, no
  recompute pass; naive PPO (π_old as behaviour policy) is wrong whenever π_rollout ≠ π_old;
- moderate (async workers, slight staleness): `decoupled_token_is` — per-token IS with a separate proximal policy;
- severe (replay buffers, old data): `decoupled_seq_is_rs` (or `decoupled_seq_is`) — sequence-level IS with
  rejection sampling.

The guide names the regimes by their cause, not by a number. The measured statistic is the token-level k3 KL
estimate `mismatch_k3_kl` (≥ 0, E[k3] = KL(π_rollout ‖ π_train)) of the rollout→old drift, the one thing a
correction corrects: every step of a decoupled run (lp_train = lp_old), and only the first optimizer step of each
rollout of a bypass run, where π_θ is still π_old — later steps of a bypass run add the policy's own updates, so
the same task would look "severe" under `ppo_is_bypass` and "negligible" under `decoupled_seq_is_rs`. Steps where
every sample failed or no token was measured are left out. Its QUANTILE over those steps (a regime holds when at
least 10 % of them reach it) is compared with two thresholds, this project's choice, printed with every
recommendation and settable on the command line:

    negligible:  q < 1e-3        moderate:  1e-3 ≤ q < 1e-2        severe:  q ≥ 1e-2

(bf16 rollout vs fp32 training at the same weights stays well under 1e-3 per token; one-step-stale async weights
reach 1e-3 – 1e-2; k3 ≥ 1e-2 per token makes sequence-level ratios of a few hundred tokens leave any usable
range, the case the guide sends to sequence IS with rejection.)

The level accounts for the response length: in the severe regime the share of sequences `decoupled_seq_is_rs`
would reject is predicted from the drift and the mean response length (`predicted_rejected_share`); above
`--max-rejected-share` (0.3) the recommendation is `decoupled_token_is` instead, as in the experiment in docs/experiments.md
(12-token responses, k3 ≈ 0.1: two thirds rejected, and token-level IS trained better).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction.diagnostics import PROB_EDGES, VIEWS

METRIC = "rollout_corr/mismatch_k3_kl"
RESPONSE_LENGTH = "rollout/response_length_mean"
KL_METRIC = "rollout_corr/mismatch_kl"
ROLLOUT_INDEX = "rollout/index"
STALENESS = "rollout/staleness_mean"
DRIFT_SPLIT = "diag/drift/rollout_to_old_k3"  # logged by decoupled runs only
VALID_TOKENS = "rollout_corr/mis_valid_token_count"
SEQUENCE_RS_PRESET = "decoupled_seq_is_rs"
PRESETS = {"negligible": "ppo_is_bypass", "moderate": "decoupled_token_is", "severe": SEQUENCE_RS_PRESET}
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
    max_rejected_share: float = 0.3

    def __post_init__(self) -> None:
        if not 0 < self.negligible_below < self.severe_from:
            raise ValueError(f"thresholds: need 0 < --negligible-below ({self.negligible_below}) < --severe-from "
                             f"({self.severe_from}).")
        if not 0 <= self.quantile <= 1:
            raise ValueError(f"--quantile must be in [0, 1], got {self.quantile}.")
        if not 0 <= self.max_rejected_share <= 1:
            raise ValueError(f"--max-rejected-share must be in [0, 1], got {self.max_rejected_share}.")

    def describe(self) -> str:
        return (f"negligible: q < {self.negligible_below:g} <= moderate < {self.severe_from:g} <= severe, "
                f"q = the {self.quantile:.0%} quantile over steps of {METRIC}")


@dataclass(frozen=True)
class RunFacts:
    """What the run's `run_config.json` (or its records) tell about it; None = unknown."""

    bypass: bool | None = None
    async_rollout: bool | None = None


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
    reason: str = ""  # why this preset; default the regime's reason
    source: str = "every step"  # which steps' mismatch_k3_kl is the rollout->old drift
    notes: list[str] = field(default_factory=list)  # what the run could not measure
    excluded_steps: int = 0  # steps where every sample failed or no token was measured
    predicted_rejected_share: float | None = None  # of decoupled_seq_is_rs at the drift (severe regime)
    response_length: float | None = None

    @property
    def why(self) -> str:
        return self.reason or WHY[self.regime]


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


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def run_facts(config: Mapping[str, Any] | None, records: Sequence[Mapping[str, Any]] = ()) -> RunFacts:
    """Bypass or decoupled, async or not: from `run_config.json` (the main job's flags; the correction config is
    rebuilt from them, preset and YAML included), else bypass=False when the records hold the decoupled drift split."""
    bypass = async_rollout = None
    if config:
        names = RolloutCorrectionConfig.field_names()
        try:
            given = argparse.Namespace(**{k: v for k, v in config.items() if k in names})
            bypass = RolloutCorrectionConfig.from_args(given).use_rollout_logprobs
        except Exception:  # a YAML file that is gone, an older config: unknown
            bypass = None
        if isinstance(config.get("async_rollout"), bool):
            async_rollout = config["async_rollout"]
    if bypass is None and any(_finite(r.get(DRIFT_SPLIT)) for r in records):
        bypass = False
    return RunFacts(bypass, async_rollout)


def measured_steps(records: Sequence[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], int]:
    """(the steps that measured the mismatch, how many were left out): a step counts when its mismatch_k3_kl is
    finite, it measured at least one token, and not every sample of its rollout failed."""
    kept, excluded = [], 0
    for r in records:
        samples, failed = r.get("rollout/samples"), r.get("rollout/not_trained")
        all_failed = _finite(samples) and _finite(failed) and samples > 0 and failed >= samples
        no_token = _finite(r.get(VALID_TOKENS)) and r[VALID_TOKENS] <= 0
        untrained = _finite(den := r.get("train/loss_denominator")) and den <= 0 and not _finite(r.get(METRIC))
        if all_failed or no_token or untrained:
            excluded += 1
        elif _finite(r.get(METRIC)):
            kept.append(r)
    return kept, excluded


def _first_steps(records: Sequence[Mapping[str, Any]], measured: Sequence[Mapping[str, Any]]
                 ) -> list[Mapping[str, Any]] | None:
    """The measured records that are the first optimizer step of their rollout (by `rollout/index`); None when
    the records do not say which rollout a step belongs to."""
    if not records or not all(_finite(r.get(ROLLOUT_INDEX)) for r in records):
        return None
    first: dict[float, Any] = {}
    for r in records:
        idx = r[ROLLOUT_INDEX]
        if idx not in first or r["step"] < first[idx]:
            first[idx] = r["step"]
    firsts = set(first.values())
    return [r for r in measured if r["step"] in firsts]


def drift_steps(records: Sequence[Mapping[str, Any]], measured: Sequence[Mapping[str, Any]], facts: RunFacts
                ) -> tuple[list[Mapping[str, Any]], str, list[str]]:
    """(the measured steps whose mismatch_k3_kl is the rollout->old drift, which they are, notes)."""
    if facts.bypass is False:
        return list(measured), "every step (decoupled: lp_old vs lp_rollout)", []
    firsts = _first_steps(records, measured)
    mode = "bypass run" if facts.bypass else "mode unknown (no run_config.json), read as a bypass run"
    if firsts:
        return firsts, "the first step of each rollout (pi_theta = pi_old there)", [
            f"{mode}: from a rollout's second optimizer step on, its mismatch_k3_kl also holds the policy's own "
            "updates (pi_theta moves away from pi_rollout), so it cannot separate drift from mismatch there; the "
            f"regime reads the first step of each rollout ({len(firsts)} of {len(measured)} steps)."]
    return list(measured), "every step (includes the policy's own updates)", [
        f"this run cannot separate drift from mismatch ({mode}): a bypass run's mismatch_k3_kl includes "
        "the policy's own updates after a rollout's first step, and no rollout/index says which steps are first. "
        "The regime below is an upper bound; a decoupled run (e.g. --rollout-correction-preset disabled) measures "
        "the rollout->old drift at every step."]


def recommend(records: Sequence[Mapping[str, float | None]], thresholds: Thresholds | None = None,
              config: Mapping[str, Any] | None = None) -> Recommendation:
    """The regime and preset of a run's step records (`metrics.jsonl` lines) and its `run_config.json` (`config`,
    optional: bypass or decoupled, async or not; inferred from the records when absent). Raises ValueError when
    the run has no step with a finite `rollout_corr/mismatch_k3_kl` (mismatch metrics off, or every step failed)."""
    thresholds = thresholds or Thresholds()
    measured, excluded = measured_steps(records)
    if not measured:
        if excluded:
            raise ValueError(f"none of the run's {len(records)} steps measured the mismatch: in {excluded} every "
                             "sample failed or no token was measured. Fix the rollout first (the run's log says "
                             "why its samples failed).")
        raise ValueError(f"no finite {METRIC} in the run's metrics: run with --get-mismatch-metrics (or a "
                         "correction flag) so the mismatch is measured.")
    facts = run_facts(config, records)
    drift, source, notes = drift_steps(records, measured, facts)
    values = [float(r[METRIC]) for r in drift]
    stat = quantile(values, thresholds.quantile)
    regime = classify(stat, thresholds)
    rec = Recommendation(regime, PRESETS[regime], stat, quantile(values, 0.5), max(values), len(values), thresholds,
                         source=source, notes=notes, excluded_steps=excluded)
    if regime == "severe":
        rec.predicted_rejected_share, spread, rec.response_length = predicted_rejected_share(drift)
        share = rec.predicted_rejected_share
        if share is not None and share > thresholds.max_rejected_share:
            rec.preset = PRESETS["moderate"]
            lower, upper = RolloutCorrectionConfig.preset(SEQUENCE_RS_PRESET).rs_bounds
            rec.reason = (f"the policies differ strongly, but at responses of {rec.response_length:.3g} tokens a "
                          f"sequence's log-ratio spreads about ±{spread:.2g}: {SEQUENCE_RS_PRESET} would reject "
                          f"about {share:.0%} of the sequences (outside [{lower:g}, {upper:g}]; more than "
                          f"--max-rejected-share {thresholds.max_rejected_share:g}); per-token truncated IS keeps "
                          "every sequence and bounds each token's weight (in the experiment in docs/experiments.md, at k3 ≈ 0.1 "
                          "and 12 tokens, it trained better than sequence-level RS; the spread is the median over "
                          "steps of √(L·(2·k3 − kl²)), L = the mean response length)")
        elif share is None:
            rec.notes.append(f"the share of sequences {SEQUENCE_RS_PRESET} would reject could not be predicted (no "
                             f"finite {RESPONSE_LENGTH} / {KL_METRIC}); at long responses it may be most of them.")
    rec.hints += _hints(measured, drift, records, facts)
    rec.hints.append(_budget_hint(values, records))
    return rec


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2))


def predicted_rejected_share(records: Sequence[Mapping[str, Any]], preset: str = SEQUENCE_RS_PRESET
                             ) -> tuple[float | None, float, float | None]:
    """(share, median spread, mean response length): how many sequences `preset`'s sequence-level RS would
    reject, estimated per step from the token-level drift and the mean response length L: for small per-token
    log-ratios x, k3 ≈ x²/2, so E[x²] ≈ 2·k3 and E[x] = −mismatch_kl; with independent tokens Σx is about
    N(μ, σ²), μ = −L·mismatch_kl, σ² = L·(2·k3 − mismatch_kl²), and the share outside [log lower, log upper]
    follows; averaged over steps. (On the experiment's runs it came within 4 points of the measured rejection.)
    Share None when no step has the three metrics."""
    lower, upper = RolloutCorrectionConfig.preset(preset).rs_bounds
    shares, spreads, lengths = [], [], []
    for r in records:
        k3, kl, length = (r.get(k) for k in (METRIC, KL_METRIC, RESPONSE_LENGTH))
        if not all(_finite(v) for v in (k3, kl, length)) or length <= 0:
            continue
        lengths.append(length)
        variance = 2 * k3 - kl * kl  # per token: E[x²] ≈ 2·k3, E[x] = −mismatch_kl
        if variance <= 0:
            shares.append(0.0)
            continue
        mu, sigma = -kl * length, math.sqrt(variance * length)
        spreads.append(sigma)
        shares.append(_normal_cdf((math.log(lower) - mu) / sigma) + 1 - _normal_cdf((math.log(upper) - mu) / sigma))
    if not shares:
        return None, 0.0, None
    return sum(shares) / len(shares), quantile(spreads, 0.5) if spreads else 0.0, sum(lengths) / len(lengths)


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


def _hints(measured: Sequence[Mapping[str, Any]], drift: Sequence[Mapping[str, Any]],
           records: Sequence[Mapping[str, Any]], facts: RunFacts) -> list[str]:
    """Observations beyond the regime, each only where it applies: low-probability concentration of the drift
    (-> veto), stale samples (async runs only), rejection, IS tails."""
    hints: list[str] = []
    labels, tokens, k3_sum = bucket_totals(drift, "prob")
    low = [i for i, label in enumerate(labels) if UPPER_EDGE[label] <= LOW_PROB_EDGE]
    if sum(k3_sum) > 0 and sum(tokens) > 0:
        share = sum(k3_sum[i] for i in low) / sum(k3_sum)
        tok = sum(tokens[i] for i in low) / sum(tokens)
        if share >= 0.5 and share > 2 * tok:
            hints.append(f"{share:.0%} of the mismatch (k3) sits on tokens with p_rollout < {LOW_PROB_EDGE:g} "
                         f"({tok:.1%} of the tokens): a veto (--rs-veto-threshold 1e-4) drops the sequences "
                         "those tokens would blow up.")
    if (lag := _staleness(records, measured, facts)) > 0:
        hints.append(f"samples are stale (async rollout): a rollout's first step trains on samples up to {lag:.2f} "
                     "weight versions behind pi_old; the rollout->old mismatch above includes it.")
    rejected = [v for r in measured if _finite(v := r.get("rollout_corr/mis_rejected_seq_fraction"))]
    if rejected and max(rejected) > 0.2:
        hints.append(f"up to {max(rejected):.0%} of the sequences were rejected in a step: the bounds may be too "
                     "tight for this mismatch, or the mismatch is severe.")
    truncated = [v for r in measured if _finite(v := r.get("rollout_corr/mis_truncate_fraction"))]
    if truncated and max(truncated) > 0.05:
        hints.append(f"up to {max(truncated):.0%} of the IS weights were truncated in a step: the tail of the "
                     "weights is heavy.")
    return hints


def _staleness(records: Sequence[Mapping[str, Any]], measured: Sequence[Mapping[str, Any]], facts: RunFacts) -> float:
    """How many weight versions a rollout's samples lag behind pi_old at its first step (the lag of later steps is
    the policy's own updates, not staleness): 0 for a synchronous run."""
    if facts.async_rollout is False:
        return 0.0
    firsts = _first_steps(records, measured) or []
    return max((float(v) for r in firsts if _finite(v := r.get(STALENESS))), default=0.0)


__all__ = ["METRIC", "PRESETS", "Recommendation", "RunFacts", "Thresholds", "bucket_totals", "classify",
           "display_label", "drift_steps", "measured_steps", "predicted_rejected_share", "quantile", "recommend",
           "run_facts"]
