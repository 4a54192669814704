"""The checks of `RolloutCorrectionConfig` (slime_corr.config) across its fields, with the choices they check: the
IS and RS bounds, the divergence filter and its budgets, the loss and its clip range, the preset. Every check raises
`ConfigError` naming the flags and the fix; `RolloutCorrectionConfig` inherits them (`RolloutCorrectionChecks`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from slime_corr.errors import ConfigError
from slime_corr.presets import PRESETS

LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
TIS_MODES: tuple[str, ...] = ("truncate", "clip", "mask")
LOSS_TYPES: tuple[str, ...] = ("ppo", "reinforce", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl", "clip_cov",
                               "kl_cov")
SAPO_TAUS = (1.0, 1.05)  # verl's (and AReaL's) default tau_pos, tau_neg
CLIP_COV_DEFAULTS = (0.0002, 1.0, 5.0)  # verl's clip_cov_ratio, clip_cov_lb, clip_cov_ub
KL_COV_DEFAULTS = (0.0002, 0.1)  # verl's kl_cov_ratio, ppo_kl_coef (its ActorConfig's defaults)
DUAL_CLIP_LOSSES = ("ppo", "dppo_tv", "dppo_kl")  # the losses --eps-clip-c applies to (DPPO: its truncation)
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
RS_METRICS: tuple[str, ...] = ("ratio", "k2", "k3", "binary_kl")
RS_AGGS: tuple[str, ...] = ("token", "mean", "sum", "max")
POLICY_RATIO_LEVELS: tuple[str, ...] = ("token", "sequence")
KERNEL_BACKENDS: tuple[str, ...] = ("torch", "triton")
DEFAULT_TIS_UPPER_BOUND = 2.0


def flag_of(name: str) -> str:
    """Field name -> command-line flag (`tis_mode` -> `--tis-mode`; `loss_type` -> `--policy-loss-type`)."""
    return "--policy-loss-type" if name == "loss_type" else "--" + name.replace("_", "-")


class RolloutCorrectionChecks:
    """`RolloutCorrectionConfig`'s checks (a mixin: they read the config's fields and derived values)."""

    def _validate(self) -> None:
        def fail(msg: str) -> None:
            raise ConfigError(msg)

        def check_choice(name: str, choices: tuple[str, ...]) -> None:
            value = getattr(self, name)
            if value not in choices:
                fail(f"{flag_of(name)}={value!r} is not one of {', '.join(choices)}.")

        check_choice("tis_mode", TIS_MODES)
        check_choice("tis_level", LEVELS)
        check_choice("rs_level", LEVELS)
        check_choice("loss_type", LOSS_TYPES)
        check_choice("loss_agg_mode", LOSS_AGG_MODES)
        check_choice("rs_metric", RS_METRICS)
        check_choice("policy_ratio_level", POLICY_RATIO_LEVELS)
        check_choice("logprobs_backend", KERNEL_BACKENDS)
        check_choice("rollout_correction_backend", KERNEL_BACKENDS)
        if self.rs_agg is not None:
            check_choice("rs_agg", RS_AGGS)

        for name in ("tis_lower_bound", "tis_upper_bound", "tis_clip", "rs_lower_bound", "rs_upper_bound"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                fail(f"{flag_of(name)}={value} must be a finite number > 0.")
        if self.tis_clip_low is not None and not (math.isfinite(self.tis_clip_low) and self.tis_clip_low >= 0):
            fail(f"--tis-clip-low={self.tis_clip_low} must be a finite number >= 0.")

        uses_tis_clip = self.tis_clip is not None or self.tis_clip_low is not None
        if uses_tis_clip and (self.tis_upper_bound is not None or self.tis_lower_bound is not None):
            fail(
                "--tis-clip/--tis-clip-low (slime's flags) and --tis-upper-bound/--tis-lower-bound set the same "
                "bounds; use one pair."
            )
        if uses_tis_clip and self.tis_mode != "truncate":
            fail(
                f"--tis-clip/--tis-clip-low always clamp to [tis_clip_low, tis_clip]; drop --tis-mode "
                f"{self.tis_mode} or use --tis-lower-bound/--tis-upper-bound instead."
            )
        if not self.use_tis:
            given = [n for n in ("tis_lower_bound", "tis_upper_bound", "tis_clip", "tis_clip_low")
                     if getattr(self, n) is not None]
            if given:
                fail(f"{', '.join(flag_of(n) for n in given)} set but --use-tis is not; add --use-tis or drop "
                     f"{'it' if len(given) == 1 else 'them'}.")
        if uses_tis_clip:
            if self.tis_clip is not None and self.tis_clip_low is not None and self.tis_clip_low > self.tis_clip:
                fail(f"--tis-clip-low {self.tis_clip_low} > --tis-clip {self.tis_clip}; swap them.")
        elif self.effective_tis_mode != "truncate":  # truncate uses no lower bound
            _check_bounds(fail, "tis", self.tis_lower_bound, self.tis_upper_bound, DEFAULT_TIS_UPPER_BOUND)
        if self.tis_lower_bound is not None and self.tis_mode == "truncate":
            fail("--tis-lower-bound has no effect with --tis-mode truncate; use --tis-mode clip or mask.")
        if self.tis_batch_normalize and not self.use_tis:
            fail("--tis-batch-normalize needs --use-tis.")

        if self.use_rs and self.rs_upper_bound is None:
            fail("--use-rs needs --rs-upper-bound (e.g. 2.0 for token/sequence, 1.001 for geometric).")
        if not self.use_rs and (self.rs_upper_bound is not None or self.rs_lower_bound is not None):
            fail("--rs-upper-bound/--rs-lower-bound are set but --use-rs is not; add --use-rs or drop them.")
        self._validate_budgets(fail)
        self._validate_peer_losses(fail)
        if self.rs_upper_bound is not None:
            if self.rejects_divergence and self.rs_upper_bound < 1.0 and self.rs_lower_bound is None:
                fail(f"--rs-upper-bound {self.rs_upper_bound} is the ratio filter's (--use-rs) bound, below 1; "
                     f"the --rs-metric {self.rs_metric} bound is --rs-divergence-bound. Drop --use-rs and give "
                     f"--rs-divergence-bound {self.rs_upper_bound}, or give the ratio bounds you meant.")
            _check_bounds(fail, "rs", self.rs_lower_bound, self.rs_upper_bound, None)
        if self.rs_veto_threshold is not None and not (0.0 < self.rs_veto_threshold < 1.0):
            fail(
                f"--rs-veto-threshold={self.rs_veto_threshold} must be in (0, 1): it is the smallest allowed "
                "token ratio pi_train/pi_rollout (typical 1e-4 to 1e-6)."
            )
        if self.rs_keep_loss_denominator and not (self.use_rs or self.rs_veto_threshold is not None
                                                  or self.rejects_divergence):
            fail("--rs-keep-loss-denominator needs --use-rs or --rs-veto-threshold (or --rs-metric k2|k3).")

        if self.use_rollout_correction and not self.requests_correction:
            fail(
                "--use-rollout-correction enables nothing by itself: add --use-tis and/or --use-rs "
                "(or --rs-veto-threshold), or use --get-mismatch-metrics to only measure."
            )

        if self.custom_tis_function_path and not self.requests_correction:
            fail(
                "--custom-tis-function-path is only called when correction is on; add --use-tis (and/or "
                "--use-rs or --rs-veto-threshold), or drop the path."
            )

        if self.loss_type == "reinforce" and not self.use_rollout_logprobs:
            fail(
                "--policy-loss-type reinforce is pure policy gradient on rollout data and needs --use-rollout-logprobs "
                "(bypass mode); for a recomputed pi_old use --policy-loss-type ppo."
            )
        if self.loss_type != "reinforce" and self.use_rollout_logprobs and self.use_tis:
            fail(
                f"--use-tis with --use-rollout-logprobs and --policy-loss-type {self.loss_type} corrects twice: the "
                f"{'PPO' if self.loss_type == 'ppo' else self.loss_type} ratio is already pi_theta/pi_rollout. Drop "
                "--use-tis (keep --use-rs if wanted), or use --policy-loss-type reinforce for pg_is."
            )

        if not (math.isfinite(self.eps_clip) and 0.0 < self.eps_clip < 1.0):
            fail(f"--eps-clip={self.eps_clip} must be in (0, 1).")
        if self.eps_clip_high is not None and not (math.isfinite(self.eps_clip_high) and self.eps_clip_high > 0):
            fail(f"--eps-clip-high={self.eps_clip_high} must be a finite number > 0.")
        if self.eps_clip_c is not None and not (math.isfinite(self.eps_clip_c) and self.eps_clip_c > 1.0):
            fail(f"--eps-clip-c={self.eps_clip_c} must be > 1 (dual clip lower bound on -A*ratio).")
        if not (math.isfinite(self.opsm_delta) and self.opsm_delta >= 0):
            fail(f"--opsm-delta={self.opsm_delta} must be a finite number >= 0 (nats: a sequence's mean "
                 "lp_old - lp above it is masked where its advantage is negative).")
        if self.loss_type not in DUAL_CLIP_LOSSES and self.eps_clip_c is not None:
            fail(f"--eps-clip-c (dual clip) applies to the PPO loss only (and is DPPO's truncation of its ratio); drop "
                 f"it with --policy-loss-type {self.loss_type}.")
        if self.policy_ratio_level == "sequence" and self.loss_type != "ppo":
            fail("--policy-ratio-level sequence (GSPO) is a PPO ratio; it needs --policy-loss-type ppo (REINFORCE has "
                 "no ratio).")

        if self.rollout_correction_preset is not None and self.rollout_correction_preset not in PRESETS:
            fail(
                f"--rollout-correction-preset {self.rollout_correction_preset!r} is unknown; choose one of "
                f"{', '.join(PRESETS)}."
            )

    def _settings_of(self, loss_type: str, names: tuple[str, ...], fail: Callable[[str], None]) -> None:
        """Refuse the settings `names` of `loss_type` given with another --policy-loss-type."""
        given = [n for n in names if getattr(self, n) is not None]
        if given and self.loss_type != loss_type:
            one = len(given) == 1
            fail(f"{', '.join(flag_of(n) for n in given)} set but --policy-loss-type is {self.loss_type}; "
                 f"{'it is' if one else 'they are'} --policy-loss-type {loss_type}'s: add that or drop "
                 f"{'it' if one else 'them'}.")

    def _validate_peer_losses(self, fail: Callable[[str], None]) -> None:
        """The peers' losses' settings (SAPO, Clip-Cov, KL-Cov), their masks (--m2-threshold,
        --seq-logprob-error-threshold) and the mismatch gate: each a finite number in its range, and a loss's
        settings only with that loss."""
        self._settings_of("sapo", ("tau_pos", "tau_neg"), fail)
        self._settings_of("clip_cov", ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"), fail)
        self._settings_of("kl_cov", ("kl_cov_ratio", "ppo_kl_coef"), fail)
        positive = ("tau_pos", "tau_neg", "m2_threshold", "max_train_rollout_logprob_abs_diff", "max_mismatch_k3_kl")
        for name in positive:
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                fail(f"{flag_of(name)}={value} must be a finite number > 0.")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and 0.0 < value <= 1.0):
                fail(f"{flag_of(name)}={value} must be in (0, 1]: a fraction of the micro-batch's tokens.")
        for name in ("clip_cov_lb", "clip_cov_ub", "ppo_kl_coef"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                fail(f"{flag_of(name)}={value} must be a finite number.")
        if self.ppo_kl_coef is not None and self.ppo_kl_coef < 0:
            fail(f"--ppo-kl-coef={self.ppo_kl_coef} must be >= 0 (a penalty on |lp - lp_old|).")
        if self.loss_type == "clip_cov":
            _, lower, upper = self.clip_cov_settings
            if not lower < upper:
                fail(f"--clip-cov-lb {lower} must be below --clip-cov-ub {upper}: the covariances between them are "
                     "the candidates for a cut.")
        threshold = self.seq_logprob_error_threshold
        if threshold is not None and not (math.isfinite(threshold) and threshold >= 1.0):
            fail(f"--seq-logprob-error-threshold={threshold} must be a finite number >= 1: it bounds a sequence's "
                 "mean exp(|lp_train - lp_rollout|), which is 1 without mismatch (NeMo-RL's recipes use 2.0).")

    def _validate_budgets(self, fail: Callable[[str], None]) -> None:
        """The divergence filter (--rs-metric, --rs-agg, --rs-divergence-bound/-budget) and --tis-ess-target."""
        div_given = [n for n in ("rs_agg", "rs_divergence_bound", "rs_divergence_budget") if getattr(self, n) is not None]
        if not self.rejects_divergence and div_given:
            fail(f"{', '.join(flag_of(n) for n in div_given)} set but --rs-metric is ratio; add --rs-metric k2 or k3 "
                 f"(a divergence filter), or drop {'it' if len(div_given) == 1 else 'them'}.")
        for name in ("rs_divergence_bound", "rs_divergence_budget"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                fail(f"{flag_of(name)}={value} must be a finite number > 0 (an upper bound on a divergence >= 0).")
        if self.rejects_divergence:
            if self.rs_agg is None:
                fail(f"--rs-metric {self.rs_metric} needs --rs-agg: token (each token on its own), mean, sum or "
                     "max (of the sequence's token divergences; the whole sequence is rejected).")
            if (self.rs_divergence_bound is None) == (self.rs_divergence_budget is None):
                fail(f"--rs-metric {self.rs_metric} needs exactly one of --rs-divergence-bound (a fixed upper bound "
                     f"in {self.rs_metric} units, e.g. 0.005 for k3 with --rs-agg mean) and --rs-divergence-budget "
                     "(the bound of each optimizer step is set so that the mean of its kept units is at most this).")
            if self.rs_divergence_budget is not None and self.rs_agg == "max":
                fail("--rs-divergence-budget works with --rs-agg token, mean or sum: a sequence's max over "
                     "context-parallel ranks is not a sum; give --rs-divergence-bound with --rs-agg max.")
        if self.tis_ess_target is not None:
            t = self.tis_ess_target
            if not (math.isfinite(t) and 0.0 < t <= 1.0):
                fail(f"--tis-ess-target={t} must be in (0, 1]: the normalized effective sample size "
                     "(sum w)^2 / (N sum w^2) the truncated weights must keep (e.g. 0.9).")
            if not self.use_tis:
                fail("--tis-ess-target needs --use-tis.")
            if self.effective_tis_mode != "truncate" or self.tis_upper_bound is not None or self.tis_clip is not None:
                fail("--tis-ess-target sets the truncation bound U of each step: it needs --tis-mode truncate and "
                     "no --tis-upper-bound/--tis-clip.")
            if self.custom_tis_function_path:
                fail("--tis-ess-target bounds the built-in weights; a --custom-tis-function-path makes its own.")


def _check_bounds(fail: Callable[[str], None], prefix: str, lower: float | None, upper: float | None,
                  default_upper: float | None) -> None:
    """L <= U, with a message that names only the bounds the user gave (L defaults to 1/U)."""
    lo, up = flag_of(f"{prefix}_lower_bound"), flag_of(f"{prefix}_upper_bound")
    u = upper if upper is not None else default_upper
    if lower is not None and lower > u:
        given_u = f"{up} {u}" if upper is not None else f"the default upper bound {u} ({up})"
        fail(f"{lo} {lower} > {given_u}; give {lo} <= {up}.")
    if lower is None and u < 1.0:
        fail(f"{up} {u} is below 1, so the default lower bound 1/U = {1.0 / u:g} is above it; give {lo} "
             f"(<= {u}) explicitly, or an upper bound >= 1.")
