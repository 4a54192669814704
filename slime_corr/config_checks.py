"""The checks of `RolloutCorrectionConfig` (slime_corr.config) across its fields, and the choices they check.

Each check is a function of the config that raises `ConfigError` naming the flags and the fix; `check_config` runs
them in order when a config is made (its `__post_init__`). A check reads the config's fields and derived values only
(`effective_tis_mode`, `requests_correction`, `rejects_divergence`, `clip_cov_settings`), so each can be tried alone
on any object that has those. The choices are single-sourced: each tuple is read from the `Literal` the config's
field is annotated with.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, get_args

from slime_corr.errors import ConfigError
from slime_corr.presets import PRESETS

Level = Literal["token", "sequence", "geometric"]
TISMode = Literal["truncate", "clip", "mask"]
LossType = Literal["ppo", "reinforce", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
RSMetric = Literal["ratio", "k2", "k3", "binary_kl"]
RSAgg = Literal["token", "mean", "sum", "max"]
RatioLevel = Literal["token", "sequence"]
KernelBackend = Literal["torch", "triton"]  # --logprobs-backend, --rollout-correction-backend (kernel_fallback.py)

LEVELS: tuple[str, ...] = get_args(Level)
TIS_MODES: tuple[str, ...] = get_args(TISMode)
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
RS_METRICS: tuple[str, ...] = get_args(RSMetric)
RS_AGGS: tuple[str, ...] = get_args(RSAgg)
POLICY_RATIO_LEVELS: tuple[str, ...] = get_args(RatioLevel)
KERNEL_BACKENDS: tuple[str, ...] = get_args(KernelBackend)
CHOICES: dict[str, tuple[str, ...]] = {  # the fields with choices, in the order they are checked
    "tis_mode": TIS_MODES, "tis_level": LEVELS, "rs_level": LEVELS, "loss_type": LOSS_TYPES,
    "loss_agg_mode": LOSS_AGG_MODES, "rs_metric": RS_METRICS, "policy_ratio_level": POLICY_RATIO_LEVELS,
    "logprobs_backend": KERNEL_BACKENDS, "rollout_correction_backend": KERNEL_BACKENDS, "rs_agg": RS_AGGS}

SAPO_TAUS = (1.0, 1.05)  # verl's (and AReaL's) default tau_pos, tau_neg
CLIP_COV_DEFAULTS = (0.0002, 1.0, 5.0)  # verl's clip_cov_ratio, clip_cov_lb, clip_cov_ub
KL_COV_DEFAULTS = (0.0002, 0.1)  # verl's kl_cov_ratio, ppo_kl_coef (its ActorConfig's defaults)
DUAL_CLIP_LOSSES = ("ppo", "dppo_tv", "dppo_kl")  # the losses --eps-clip-c applies to (DPPO: its truncation)
DEFAULT_TIS_UPPER_BOUND = 2.0

# What a check reads: a RolloutCorrectionConfig (not imported here: its module imports this one), or any object with
# the fields and derived values the check reads.
Settings = Any


def flag_of(name: str) -> str:
    """Field name -> command-line flag (`tis_mode` -> `--tis-mode`; `loss_type` -> `--policy-loss-type`)."""
    return "--policy-loss-type" if name == "loss_type" else "--" + name.replace("_", "-")


def _given(config: Settings, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if getattr(config, n) is not None]


def _them(names: list[str]) -> str:
    return "it" if len(names) == 1 else "them"


def _check_range(config: Settings, names: tuple[str, ...], inside: Callable[[float], bool], needs: str) -> None:
    """`--flag=value {needs}` for the first of `names` that is given and not `inside`."""
    for name in names:
        value = getattr(config, name)
        if value is not None and not inside(value):
            raise ConfigError(f"{flag_of(name)}={value} {needs}")


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def check_choices(config: Settings) -> None:
    """Each field with choices holds one of them (`rs_agg` may be None)."""
    for name, choices in CHOICES.items():
        value = getattr(config, name)
        if value not in choices and not (name == "rs_agg" and value is None):
            raise ConfigError(f"{flag_of(name)}={value!r} is not one of {', '.join(choices)}.")


def check_is_weights(config: Settings) -> None:
    """The IS and RS bounds are finite and > 0 (slime's --tis-clip-low >= 0); one pair of IS bounds, given with
    --use-tis, L <= U; --tis-batch-normalize with --use-tis."""
    _check_range(config, ("tis_lower_bound", "tis_upper_bound", "tis_clip", "rs_lower_bound", "rs_upper_bound"),
                 _positive, "must be a finite number > 0.")
    _check_range(config, ("tis_clip_low",), lambda v: math.isfinite(v) and v >= 0, "must be a finite number >= 0.")
    uses_tis_clip = config.tis_clip is not None or config.tis_clip_low is not None
    if uses_tis_clip and (config.tis_upper_bound is not None or config.tis_lower_bound is not None):
        raise ConfigError("--tis-clip/--tis-clip-low (slime's flags) and --tis-upper-bound/--tis-lower-bound set "
                          "the same bounds; use one pair.")
    if uses_tis_clip and config.tis_mode != "truncate":
        raise ConfigError(f"--tis-clip/--tis-clip-low always clamp to [tis_clip_low, tis_clip]; drop --tis-mode "
                          f"{config.tis_mode} or use --tis-lower-bound/--tis-upper-bound instead.")
    given = _given(config, ("tis_lower_bound", "tis_upper_bound", "tis_clip", "tis_clip_low"))
    if not config.use_tis and given:
        raise ConfigError(f"{', '.join(flag_of(n) for n in given)} set but --use-tis is not; add --use-tis or drop "
                          f"{_them(given)}.")
    if uses_tis_clip:
        if config.tis_clip is not None and config.tis_clip_low is not None and config.tis_clip_low > config.tis_clip:
            raise ConfigError(f"--tis-clip-low {config.tis_clip_low} > --tis-clip {config.tis_clip}; swap them.")
    elif config.effective_tis_mode != "truncate":  # truncate uses no lower bound
        _check_bounds("tis", config.tis_lower_bound, config.tis_upper_bound, DEFAULT_TIS_UPPER_BOUND)
    if config.tis_lower_bound is not None and config.tis_mode == "truncate":
        raise ConfigError("--tis-lower-bound has no effect with --tis-mode truncate; use --tis-mode clip or mask.")
    if config.tis_batch_normalize and not config.use_tis:
        raise ConfigError("--tis-batch-normalize needs --use-tis.")


def check_rs_switch(config: Settings) -> None:
    """--use-rs comes with its upper bound, and the RS bounds with --use-rs."""
    if config.use_rs and config.rs_upper_bound is None:
        raise ConfigError("--use-rs needs --rs-upper-bound (e.g. 2.0 for token/sequence, 1.001 for geometric).")
    if not config.use_rs and (config.rs_upper_bound is not None or config.rs_lower_bound is not None):
        raise ConfigError("--rs-upper-bound/--rs-lower-bound are set but --use-rs is not; add --use-rs or drop them.")


def check_divergence_filter(config: Settings) -> None:
    """The divergence filter (--rs-metric, --rs-agg, --rs-divergence-bound/-budget) and --tis-ess-target."""
    given = _given(config, ("rs_agg", "rs_divergence_bound", "rs_divergence_budget"))
    if not config.rejects_divergence and given:
        raise ConfigError(f"{', '.join(flag_of(n) for n in given)} set but --rs-metric is ratio; add --rs-metric k2 "
                          f"or k3 (a divergence filter), or drop {_them(given)}.")
    _check_range(config, ("rs_divergence_bound", "rs_divergence_budget"), _positive,
                 "must be a finite number > 0 (an upper bound on a divergence >= 0).")
    if config.rejects_divergence:
        metric = config.rs_metric
        if config.rs_agg is None:
            raise ConfigError(f"--rs-metric {metric} needs --rs-agg: token (each token on its own), mean, sum or "
                              "max (of the sequence's token divergences; the whole sequence is rejected).")
        if (config.rs_divergence_bound is None) == (config.rs_divergence_budget is None):
            raise ConfigError(f"--rs-metric {metric} needs exactly one of --rs-divergence-bound (a fixed upper bound "
                              f"in {metric} units, e.g. 0.005 for k3 with --rs-agg mean) and --rs-divergence-budget "
                              "(the bound of each optimizer step is set so that the mean of its kept units is at "
                              "most this).")
        if config.rs_divergence_budget is not None and config.rs_agg == "max":
            raise ConfigError("--rs-divergence-budget works with --rs-agg token, mean or sum: a sequence's max over "
                              "context-parallel ranks is not a sum; give --rs-divergence-bound with --rs-agg max.")
    if config.tis_ess_target is not None:
        _check_range(config, ("tis_ess_target",), lambda t: math.isfinite(t) and 0.0 < t <= 1.0,
                     "must be in (0, 1]: the normalized effective sample size (sum w)^2 / (N sum w^2) the truncated "
                     "weights must keep (e.g. 0.9).")
        if not config.use_tis:
            raise ConfigError("--tis-ess-target needs --use-tis.")
        if config.effective_tis_mode != "truncate" or config.tis_upper_bound is not None or config.tis_clip is not None:
            raise ConfigError("--tis-ess-target sets the truncation bound U of each step: it needs --tis-mode "
                              "truncate and no --tis-upper-bound/--tis-clip.")
        if config.custom_tis_function_path:
            raise ConfigError("--tis-ess-target bounds the built-in weights; a --custom-tis-function-path makes its "
                              "own.")


def check_peer_losses(config: Settings) -> None:
    """The peers' losses' settings (SAPO, Clip-Cov, KL-Cov), their masks (--m2-threshold,
    --seq-logprob-error-threshold) and the mismatch gate: each a finite number in its range, and a loss's settings
    only with that loss."""
    for loss_type, names in (("sapo", ("tau_pos", "tau_neg")), ("clip_cov", ("clip_cov_ratio", "clip_cov_lb",
                             "clip_cov_ub")), ("kl_cov", ("kl_cov_ratio", "ppo_kl_coef"))):
        given = _given(config, names)
        if given and config.loss_type != loss_type:
            raise ConfigError(f"{', '.join(flag_of(n) for n in given)} set but --policy-loss-type is "
                              f"{config.loss_type}; {'it is' if len(given) == 1 else 'they are'} --policy-loss-type "
                              f"{loss_type}'s: add that or drop {_them(given)}.")
    _check_range(config, ("tau_pos", "tau_neg", "m2_threshold", "max_train_rollout_logprob_abs_diff",
                          "max_mismatch_k3_kl"), _positive, "must be a finite number > 0.")
    _check_range(config, ("clip_cov_ratio", "kl_cov_ratio"), lambda v: math.isfinite(v) and 0.0 < v <= 1.0,
                 "must be in (0, 1]: a fraction of the micro-batch's tokens.")
    _check_range(config, ("clip_cov_lb", "clip_cov_ub", "ppo_kl_coef"), math.isfinite, "must be a finite number.")
    _check_range(config, ("ppo_kl_coef",), lambda v: v >= 0, "must be >= 0 (a penalty on |lp - lp_old|).")
    if config.loss_type == "clip_cov":
        _, lower, upper = config.clip_cov_settings
        if not lower < upper:
            raise ConfigError(f"--clip-cov-lb {lower} must be below --clip-cov-ub {upper}: the covariances between "
                              "them are the candidates for a cut.")
    _check_range(config, ("seq_logprob_error_threshold",), lambda v: math.isfinite(v) and v >= 1.0,
                 "must be a finite number >= 1: it bounds a sequence's mean exp(|lp_train - lp_rollout|), which is 1 "
                 "without mismatch (NeMo-RL's recipes use 2.0).")


def check_rejection(config: Settings) -> None:
    """The RS bounds (not a divergence bound given as a ratio bound; L <= U), the veto threshold in (0, 1), and
    --rs-keep-loss-denominator with something that rejects."""
    if config.rs_upper_bound is not None:
        if config.rejects_divergence and config.rs_upper_bound < 1.0 and config.rs_lower_bound is None:
            raise ConfigError(f"--rs-upper-bound {config.rs_upper_bound} is the ratio filter's (--use-rs) bound, "
                              f"below 1; the --rs-metric {config.rs_metric} bound is --rs-divergence-bound. Drop "
                              f"--use-rs and give --rs-divergence-bound {config.rs_upper_bound}, or give the ratio "
                              "bounds you meant.")
        _check_bounds("rs", config.rs_lower_bound, config.rs_upper_bound, None)
    _check_range(config, ("rs_veto_threshold",), lambda v: 0.0 < v < 1.0, "must be in (0, 1): it is the smallest "
                 "allowed token ratio pi_train/pi_rollout (typical 1e-4 to 1e-6).")
    if config.rs_keep_loss_denominator and not (config.use_rs or config.rs_veto_threshold is not None
                                                or config.rejects_divergence):
        raise ConfigError("--rs-keep-loss-denominator needs --use-rs or --rs-veto-threshold (or --rs-metric k2|k3).")


def check_correction_switches(config: Settings) -> None:
    """--use-rollout-correction and --custom-tis-function-path only with a correction to apply."""
    if config.use_rollout_correction and not config.requests_correction:
        raise ConfigError("--use-rollout-correction enables nothing by itself: add --use-tis and/or --use-rs "
                          "(or --rs-veto-threshold), or use --get-mismatch-metrics to only measure.")
    if config.custom_tis_function_path and not config.requests_correction:
        raise ConfigError("--custom-tis-function-path is only called when correction is on; add --use-tis (and/or "
                          "--use-rs or --rs-veto-threshold), or drop the path.")


def check_loss(config: Settings) -> None:
    """The policy loss: REINFORCE in bypass only, no IS on top of a ratio against pi_rollout, the clip range, OPSM's
    delta, dual clip with the PPO-like losses and GSPO's sequence ratio with PPO."""
    loss_type = config.loss_type
    if loss_type == "reinforce" and not config.use_rollout_logprobs:
        raise ConfigError("--policy-loss-type reinforce is pure policy gradient on rollout data and needs "
                          "--use-rollout-logprobs (bypass mode); for a recomputed pi_old use --policy-loss-type ppo.")
    if loss_type != "reinforce" and config.use_rollout_logprobs and config.use_tis:
        raise ConfigError(f"--use-tis with --use-rollout-logprobs and --policy-loss-type {loss_type} corrects "
                          f"twice: the {'PPO' if loss_type == 'ppo' else loss_type} ratio is already "
                          "pi_theta/pi_rollout. Drop --use-tis (keep --use-rs if wanted), or use --policy-loss-type "
                          "reinforce for pg_is.")
    _check_range(config, ("eps_clip",), lambda v: math.isfinite(v) and 0.0 < v < 1.0, "must be in (0, 1).")
    _check_range(config, ("eps_clip_high",), _positive, "must be a finite number > 0.")
    _check_range(config, ("eps_clip_c",), lambda v: math.isfinite(v) and v > 1.0,
                 "must be > 1 (dual clip lower bound on -A*ratio).")
    _check_range(config, ("opsm_delta",), lambda v: math.isfinite(v) and v >= 0, "must be a finite number >= 0 "
                 "(nats: a sequence's mean lp_old - lp above it is masked where its advantage is negative).")
    if loss_type not in DUAL_CLIP_LOSSES and config.eps_clip_c is not None:
        raise ConfigError(f"--eps-clip-c (dual clip) applies to the PPO loss only (and is DPPO's truncation of its "
                          f"ratio); drop it with --policy-loss-type {loss_type}.")
    if config.policy_ratio_level == "sequence" and loss_type != "ppo":
        raise ConfigError("--policy-ratio-level sequence (GSPO) is a PPO ratio; it needs --policy-loss-type ppo "
                          "(REINFORCE has no ratio).")


def check_preset(config: Settings) -> None:
    preset = config.rollout_correction_preset
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"--rollout-correction-preset {preset!r} is unknown; choose one of {', '.join(PRESETS)}.")


CHECKS = (check_choices, check_is_weights, check_rs_switch, check_divergence_filter, check_peer_losses,
          check_rejection, check_correction_switches, check_loss, check_preset)


def check_config(config: Settings) -> None:
    """Every check, in order: the first that fails raises its `ConfigError`."""
    for check in CHECKS:
        check(config)


def _check_bounds(prefix: str, lower: float | None, upper: float | None, default_upper: float | None) -> None:
    """L <= U, with a message that names only the bounds the user gave (L defaults to 1/U)."""
    lo, up = flag_of(f"{prefix}_lower_bound"), flag_of(f"{prefix}_upper_bound")
    u = upper if upper is not None else default_upper
    if lower is not None and lower > u:
        given_u = f"{up} {u}" if upper is not None else f"the default upper bound {u} ({up})"
        raise ConfigError(f"{lo} {lower} > {given_u}; give {lo} <= {up}.")
    if lower is None and u < 1.0:
        raise ConfigError(f"{up} {u} is below 1, so the default lower bound 1/U = {1.0 / u:g} is above it; give {lo} "
                          f"(<= {u}) explicitly, or an upper bound >= 1.")
