"""verl's rejection-sampling spelling (`rollout_rs`, `rollout_rs_threshold`) as this project's settings.

verl 0.9 chains criteria with commas (`token_k1,seq_max_k2`) and gives their thresholds the same way (one per option,
or one for all). A k1 option takes `lower_upper`, or an upper U meaning [1/U, U]; a k2/k3 option an upper bound. A
token is kept when every criterion keeps it. Each criterion is one of this project's two filters, which apply
together:

| verl option, threshold | here |
|---|---|
| `token_k1` [lo, hi] | `--use-rs --rs-level token --rs-lower-bound 1/hi --rs-upper-bound 1/lo` |
| `seq_sum_k1`, `seq_mean_k1` | the same at `--rs-level sequence`, `geometric` |
| `token_k2` U (k3 alike) | `--rs-metric k2 --rs-agg token --rs-divergence-bound U` |
| `seq_sum_k2`, `seq_mean_k2`, `seq_max_k2` | `--rs-agg sum`, `mean`, `max` |

verl's k1 is lp_rollout − lp_old, the negative of the log-ratio the ratio filter bounds: hence the reciprocal
bounds. So a chain holds at most one k1 option and one k2/k3 option; a longer one is refused with the reason. verl
clamps the log-ratio to ±20 before k2/k3; here they are unclamped (a bound above 200 for k2 is the only place where
that differs). Pure Python: no torch.
"""

from __future__ import annotations

from typing import Any

from slime_corr.errors import ConfigError

RATIO_LEVELS = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}
DIVERGENCE_AGGS = {"token": "token", "seq_sum": "sum", "seq_mean": "mean", "seq_max": "max"}
OPTIONS = (*RATIO_LEVELS, *(f"{agg}_{m}" for agg in DIVERGENCE_AGGS for m in ("k2", "k3")))
FLAGS = "--rollout-rs / --rollout-rs-threshold"


def _number(text: str, option: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--rollout-rs-threshold: {text!r} (for {option}) is not a number.") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"--rollout-rs-threshold: {text!r} (for {option}) must be a finite number > 0.")
    return value


def _thresholds(options: list[str], spec: str | float) -> list[str]:
    parts = [str(spec)] if isinstance(spec, int | float) else [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise ConfigError(f"--rollout-rs-threshold {spec!r}: {len(parts)} thresholds for {len(options)} options "
                          f"({','.join(options)}); give one for all, or one per option, comma separated.")
    return parts * len(options) if len(parts) == 1 else parts


def rollout_rs_settings(rollout_rs: str, threshold: str | float | None) -> dict[str, Any]:
    """The `RolloutCorrectionConfig` fields of verl's `rollout_rs` chain with its `rollout_rs_threshold` (see the
    module doc); `ConfigError` naming the flag for what cannot be expressed or parsed."""
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))  # verl dedupes too
    if not options:
        raise ConfigError(f"--rollout-rs {rollout_rs!r}: no option; choose from {', '.join(OPTIONS)}.")
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        raise ConfigError(f"--rollout-rs: {', '.join(unknown)} is not one of verl's options ({', '.join(OPTIONS)}).")
    if threshold is None:
        raise ConfigError("--rollout-rs needs --rollout-rs-threshold (verl requires it too): e.g. --rollout-rs "
                          "token_k1,seq_max_k2 --rollout-rs-threshold 0.5_2.0,2.0.")
    ratio = [o for o in options if o in RATIO_LEVELS]
    divergence = [o for o in options if o not in RATIO_LEVELS]
    for group, what in ((ratio, "k1 (ratio) options"), (divergence, "k2/k3 (divergence) options")):
        if len(group) > 1:
            raise ConfigError(f"--rollout-rs {rollout_rs!r}: {len(group)} {what} ({', '.join(group)}); this project "
                              "applies one ratio filter and one divergence filter together, so a chain holds at most "
                              "one k1 option and one k2/k3 option.")
    settings: dict[str, Any] = {}
    for option, spec in zip(options, _thresholds(options, threshold), strict=True):
        if option in RATIO_LEVELS:
            if "_" in spec:
                low_text, high_text = spec.split("_", 1)
                low, high = _number(low_text, option), _number(high_text, option)
            else:
                high = _number(spec, option)
                low = 1.0 / high
            if low > high:
                raise ConfigError(f"--rollout-rs-threshold {spec!r} for {option}: lower {low} > upper {high}.")
            settings.update(use_rs=True, rs_level=RATIO_LEVELS[option], rs_lower_bound=1.0 / high,
                            rs_upper_bound=1.0 / low)
        else:
            if "_" in spec:
                raise ConfigError(f"--rollout-rs-threshold {spec!r} for {option}: a k2/k3 option takes one upper "
                                  "bound, not lower_upper.")
            agg, metric = option.rsplit("_", 1)
            settings.update(rs_metric=metric, rs_agg=DIVERGENCE_AGGS[agg],
                            rs_divergence_bound=_number(spec, option))
    return settings


__all__ = ["FLAGS", "OPTIONS", "rollout_rs_settings"]
