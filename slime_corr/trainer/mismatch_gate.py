"""The mismatch gate for CI: a bound on a step's logged train/rollout mismatch that ends the run when passed.

`--max-train-rollout-logprob-abs-diff X` (the name a slime fork gives its fail-fast check of the same metric) bounds
`train_rollout_logprob_abs_diff` = the token mean of |lp_train − lp_rollout|, `--max-mismatch-k3-kl X` bounds
`mismatch_k3_kl` = the token mean of exp(lr) − lr − 1. After each optimizer step's metrics are logged (so the failing
step is in metrics.jsonl), a step whose value is above its bound, or NaN, ends the run with `MismatchGateError`
naming the step, the metric, its value and the bound: what a CI job of an RL recipe needs to catch an engine
regression (a kernel, a weight-conversion or a precision change) at the step it shows. A step that trained no
token logs no such metric and passes. Unlike the start-up agreement check (trainer.agreement), it holds at every
step, staleness and policy drift included: set the bound above what the recipe's healthy runs log.
"""

from __future__ import annotations

from collections.abc import Mapping

from slime_corr.monitoring.keys import CORRECTION

GATE_FLAGS = {"train_rollout_logprob_abs_diff": "--max-train-rollout-logprob-abs-diff",
              "mismatch_k3_kl": "--max-mismatch-k3-kl"}


class MismatchGateError(RuntimeError):
    """A step's train/rollout mismatch passed the bound of the mismatch gate."""


def check_mismatch_gate(metrics: Mapping[str, float], gates: Mapping[str, float], step: int) -> None:
    """Raise MismatchGateError when a step's logged metric (`rollout_corr/<name>`) is above its bound in `gates`
    ({name: bound}, `RolloutCorrectionConfig.mismatch_gates`) or NaN; nothing for a metric the step did not log."""
    for name, bound in gates.items():
        value = metrics.get(f"{CORRECTION}/{name}")
        if value is None or value <= bound:
            continue
        raise MismatchGateError(
            f"step {step}: {name} = {value:.6g}, above the mismatch gate's bound {bound:g} ({GATE_FLAGS[name]}): the "
            "engine's log-probs and the trainer's disagree more than this run allows. Look at what changed on either "
            "side (engine version or kernels, weight conversion or sync, precision, sampling settings); the step's "
            "metrics are in the run's metrics.jsonl.")


__all__ = ["GATE_FLAGS", "MismatchGateError", "check_mismatch_gate"]
