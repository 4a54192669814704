"""The one typed configuration object for rollout correction.

Flags (`slime_corr.arguments`), YAML files (`--custom-config-path`, `arguments/*.yaml`) and named presets all
produce a `RolloutCorrectionConfig`. Every invalid combination fails at construction with a `ConfigError` that
names the offending flags and the fix.

Precedence when several sources are combined (`from_args`): explicit command-line flag > YAML file >
preset > built-in default.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

from slime_corr.config_yaml import read_yaml, slime_yaml_meaning
from slime_corr.errors import ConfigError  # (public here too: slime_corr.config.ConfigError)
from slime_corr.presets import PRESETS

Level = Literal["token", "sequence", "geometric"]
TISMode = Literal["truncate", "clip", "mask"]
LossType = Literal["ppo", "reinforce"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
RSMetric = Literal["ratio", "k2", "k3", "binary_kl"]
RSAgg = Literal["token", "mean", "sum", "max"]
RatioLevel = Literal["token", "sequence"]

LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
TIS_MODES: tuple[str, ...] = ("truncate", "clip", "mask")
LOSS_TYPES: tuple[str, ...] = ("ppo", "reinforce")
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
RS_METRICS: tuple[str, ...] = ("ratio", "k2", "k3", "binary_kl")
RS_AGGS: tuple[str, ...] = ("token", "mean", "sum", "max")
POLICY_RATIO_LEVELS: tuple[str, ...] = ("token", "sequence")
DEFAULT_TIS_UPPER_BOUND = 2.0


def flag(name: str) -> str:
    """Field name -> command-line flag (`tis_mode` -> `--tis-mode`; `loss_type` -> `--policy-loss-type`)."""
    return "--policy-loss-type" if name == "loss_type" else "--" + name.replace("_", "-")


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Rollout-correction settings. Field names are the flag names with `-` replaced by `_`.

    Notation: lr = lp_train - lp_rollout, with lp_train = lp_old (decoupled) or lp.detach() (bypass).
    """

    # --- importance sampling (IS) weights ---
    use_tis: bool = False
    tis_mode: TISMode = "truncate"
    tis_level: Level = "token"
    tis_lower_bound: float | None = None  # clip/mask: defaults to 1 / upper; unused by truncate
    tis_upper_bound: float | None = None  # defaults to 2.0
    tis_batch_normalize: bool = False
    # slime's original TIS flags: the weight is clamped to [tis_clip_low, tis_clip].
    tis_clip: float | None = None
    tis_clip_low: float | None = None

    # --- rejection sampling (RS) and veto ---
    use_rs: bool = False
    rs_level: Level = "token"
    rs_lower_bound: float | None = None  # defaults to 1 / upper
    rs_upper_bound: float | None = None  # required with use_rs
    rs_veto_threshold: float | None = None  # in (0, 1); works with or without use_rs
    rs_keep_loss_denominator: bool = False  # rejected tokens still count in loss denominators

    # --- divergence rejection (`divergence.py`): k2 = lr²/2, k3 = exp(lr) - 1 - lr, an upper bound only ---
    rs_metric: RSMetric = "ratio"  # ratio: only --use-rs's bounds; k2/k3: reject where the divergence is too high
    rs_agg: RSAgg | None = None  # token: each token; mean/sum/max: of the sequence's token divergences
    rs_divergence_bound: float | None = None  # the upper bound, in the metric's own units
    rs_divergence_budget: float | None = None  # or: the bound of each step, so its kept units' mean is <= this
    tis_ess_target: float | None = None  # truncate: U of each step, the largest with ESS(min(w, U)) >= this

    # --- which policy the loss anchors on, and the loss ---
    use_rollout_logprobs: bool = False  # bypass: lp_old := lp_rollout, no recompute forward
    use_rollout_correction: bool = False  # apply IS/RS to the loss; implied by use_tis / use_rs / veto
    get_mismatch_metrics: bool = False  # metrics only, the loss is untouched
    loss_type: LossType = "ppo"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # defaults to eps_clip
    eps_clip_c: float | None = None  # dual clip, > 1; off by default
    loss_agg_mode: LossAggMode = "token-mean"
    policy_ratio_level: RatioLevel = "token"  # sequence: GSPO's ratio exp(mean_t(lp - lp_old)), per token
    use_opsm: bool = False  # off-policy sequence masking (DeepSeek-V3.2; slime's --use-opsm): see slime_corr/opsm.py
    opsm_delta: float = 1e-4  # OPSM's bound on a sequence's mean lp_old - lp (slime's --opsm-delta default)

    # --- where settings and custom code come from ---
    rollout_correction_preset: str | None = None
    custom_config_path: str | None = None
    custom_tis_function_path: str | None = None

    # --- how it runs ---
    rollout_correction_compile: bool = False  # torch.compile the per-token work of correction + loss
    rollout_correction_cuda_graph: bool = False  # replay the correction from a CUDA graph per input shape
    warn_invalid_inputs: bool = False  # impossible inputs (mask not 0/1, log-prob > 0 or NaN, advantage NaN/inf): warn

    PRESETS: ClassVar[dict[str, dict[str, Any]]]

    def __post_init__(self) -> None:
        self._check_types()
        self._validate()
        if self.requests_correction:
            object.__setattr__(self, "use_rollout_correction", True)

    # ------------------------------------------------------------------ derived values
    @property
    def requests_correction(self) -> bool:
        """Whether any correction is asked for (IS, RS or veto); `use_rollout_correction` follows it."""
        return self.use_tis or self.use_rs or self.rs_veto_threshold is not None or self.rejects_divergence

    @property
    def rejects_divergence(self) -> bool:
        """Whether the divergence filter (`--rs-metric k2|k3`) is on."""
        return self.rs_metric != "ratio"

    @property
    def rejects(self) -> bool:
        """Whether the correction may take tokens out of the loss beyond non-finite ones: RS (bounds or divergence),
        the veto, mask mode, or a custom weighting function's own mask."""
        return self.use_rollout_correction and (
            self.use_rs or self.rs_veto_threshold is not None or self.rejects_divergence
            or (self.use_tis and self.effective_tis_mode == "mask") or self.custom_tis_function_path is not None)

    @property
    def tis_bounds(self) -> tuple[float, float]:
        """(L, U) used by the IS weight; slime's --tis-clip/--tis-clip-low win when given."""
        if self.tis_clip is not None or self.tis_clip_low is not None:
            upper = self.tis_clip if self.tis_clip is not None else DEFAULT_TIS_UPPER_BOUND
            return (self.tis_clip_low if self.tis_clip_low is not None else 0.0), upper
        upper = self.tis_upper_bound if self.tis_upper_bound is not None else DEFAULT_TIS_UPPER_BOUND
        lower = self.tis_lower_bound if self.tis_lower_bound is not None else 1.0 / upper
        return lower, upper

    @property
    def effective_tis_mode(self) -> str:
        """slime's --tis-clip/--tis-clip-low mean a two-sided clamp."""
        if self.tis_clip is not None or self.tis_clip_low is not None:
            return "clip"
        return self.tis_mode

    @property
    def rs_bounds(self) -> tuple[float, float]:
        assert self.rs_upper_bound is not None, "rs_bounds needs rs_upper_bound"
        lower = self.rs_lower_bound if self.rs_lower_bound is not None else 1.0 / self.rs_upper_bound
        return lower, self.rs_upper_bound

    @property
    def bypass(self) -> bool:
        return self.use_rollout_logprobs

    @property
    def clip_range(self) -> tuple[float, float]:
        """PPO ratio clip range (1 - eps_clip, 1 + eps_clip_high)."""
        high = self.eps_clip_high if self.eps_clip_high is not None else self.eps_clip
        return 1.0 - self.eps_clip, 1.0 + high

    @property
    def computes_metrics(self) -> bool:
        return self.get_mismatch_metrics or self.use_rollout_correction

    # ------------------------------------------------------------------ validation
    def _check_types(self) -> None:
        """Each field has its type: bools are bools (no string or number turns a flag on), numbers are real numbers
        (ints and numpy scalars are stored as float), names and paths are strings."""
        for f in fields(self):
            value = getattr(self, f.name)
            kind = FIELD_KINDS[f.name]
            if value is None and kind.endswith("?"):
                continue
            kind = kind.rstrip("?")
            got = f"{value!r} ({type(value).__name__})"
            if kind == "bool":
                if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
                    value = bool(value)
                if not isinstance(value, bool):
                    raise ConfigError(f"{flag(f.name)} ({f.name}) must be true or false, got {got}.")
            elif kind == "float":
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    hint = "; write the number without quotes" if isinstance(value, str) else ""
                    raise ConfigError(f"{flag(f.name)} ({f.name}) must be a number, got {got}{hint}.")
                value = float(value)
            elif not isinstance(value, str):
                raise ConfigError(f"{flag(f.name)} ({f.name}) must be a string, got {got}.")
            object.__setattr__(self, f.name, value)

    def _validate(self) -> None:
        def fail(msg: str) -> None:
            raise ConfigError(msg)

        def check_choice(name: str, choices: tuple[str, ...]) -> None:
            value = getattr(self, name)
            if value not in choices:
                fail(f"{flag(name)}={value!r} is not one of {', '.join(choices)}.")

        check_choice("tis_mode", TIS_MODES)
        check_choice("tis_level", LEVELS)
        check_choice("rs_level", LEVELS)
        check_choice("loss_type", LOSS_TYPES)
        check_choice("loss_agg_mode", LOSS_AGG_MODES)
        check_choice("rs_metric", RS_METRICS)
        check_choice("policy_ratio_level", POLICY_RATIO_LEVELS)
        if self.rs_agg is not None:
            check_choice("rs_agg", RS_AGGS)

        for name in ("tis_lower_bound", "tis_upper_bound", "tis_clip", "rs_lower_bound", "rs_upper_bound"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                fail(f"{flag(name)}={value} must be a finite number > 0.")
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
                fail(f"{', '.join(flag(n) for n in given)} set but --use-tis is not; add --use-tis or drop "
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
        if self.loss_type == "ppo" and self.use_rollout_logprobs and self.use_tis:
            fail(
                "--use-tis with --use-rollout-logprobs and --policy-loss-type ppo corrects twice: the PPO ratio is "
                "already pi_theta/pi_rollout. Drop --use-tis (keep --use-rs if wanted), or use "
                "--policy-loss-type reinforce for pg_is."
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
        if self.loss_type == "reinforce" and self.eps_clip_c is not None:
            fail("--eps-clip-c (dual clip) applies to the PPO loss only; drop it with --policy-loss-type reinforce.")
        if self.policy_ratio_level == "sequence" and self.loss_type != "ppo":
            fail("--policy-ratio-level sequence (GSPO) is a PPO ratio; it needs --policy-loss-type ppo (REINFORCE has "
                 "no ratio).")

        if self.rollout_correction_preset is not None and self.rollout_correction_preset not in PRESETS:
            fail(
                f"--rollout-correction-preset {self.rollout_correction_preset!r} is unknown; choose one of "
                f"{', '.join(PRESETS)}."
            )

    def _validate_budgets(self, fail: Callable[[str], None]) -> None:
        """The divergence filter (--rs-metric, --rs-agg, --rs-divergence-bound/-budget) and --tis-ess-target."""
        div_given = [n for n in ("rs_agg", "rs_divergence_bound", "rs_divergence_budget") if getattr(self, n) is not None]
        if not self.rejects_divergence and div_given:
            fail(f"{', '.join(flag(n) for n in div_given)} set but --rs-metric is ratio; add --rs-metric k2 or k3 "
                 f"(a divergence filter), or drop {'it' if len(div_given) == 1 else 'them'}.")
        for name in ("rs_divergence_bound", "rs_divergence_budget"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                fail(f"{flag(name)}={value} must be a finite number > 0 (an upper bound on a divergence >= 0).")
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

    # ------------------------------------------------------------------ constructors
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> RolloutCorrectionConfig:
        """Build from a mapping; unknown keys are an error that lists the valid ones."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: expected a mapping of field names to values, got {type(values).__name__}.")
        _check_keys(values, source)
        return cls(**dict(values))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> RolloutCorrectionConfig:
        """A named preset of the references (`decoupled_token_is`, ..., `disabled`), optionally overridden."""
        if not isinstance(name, str):
            raise ConfigError(f"preset name must be a string (one of {', '.join(PRESETS)}), got {name!r}.")
        return cls._layered(preset=name, yaml_path=None, overrides=overrides, source="preset")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> RolloutCorrectionConfig:
        """Load a YAML mapping of field names (a `preset:` / `rollout_correction_preset:` key applies first)."""
        if not isinstance(path, str | Path):
            raise ConfigError(f"from_yaml: path must be a str or pathlib.Path, got {type(path).__name__}.")
        return cls._layered(preset=None, yaml_path=path, overrides=overrides, source=f"--custom-config-path {path}")

    @classmethod
    def from_args(
        cls, args: Any, *, explicit: set[str] | None = None
    ) -> RolloutCorrectionConfig:
        """Build from an argparse namespace made by `add_rollout_correction_args`.

        Precedence: explicit flag > YAML (`--custom-config-path`) > preset (`--rollout-correction-preset`)
        > default. `explicit` is the set of field names given on the command line; by default it is taken from
        the namespace (the parser records it), else every non-default value counts as explicit.
        """
        if isinstance(args, Mapping) or not hasattr(args, "__dict__"):
            raise ConfigError(f"from_args expects an argparse.Namespace, got {type(args).__name__}; use "
                              "RolloutCorrectionConfig.from_dict for a mapping.")
        given = {n: getattr(args, n) for n in cls.field_names() if hasattr(args, n) and n != "loss_type"}
        # --policy-loss-type's attribute (a host parser such as slime's owns `loss_type`); a hand-made namespace
        # may still carry `loss_type`
        loss_type = getattr(args, "policy_loss_type", None)
        if loss_type is None and getattr(args, "loss_type", None) in LOSS_TYPES:
            loss_type = args.loss_type
        if loss_type is not None:
            given["loss_type"] = loss_type
        if explicit is None:
            explicit = getattr(args, "_rollout_correction_explicit", None)
        if explicit is None:
            defaults = {f.name: f.default for f in fields(cls)}
            explicit = {n for n, v in given.items() if v != defaults.get(n)}
        return cls._layered(
            preset=given.get("rollout_correction_preset"),
            yaml_path=given.get("custom_config_path"),
            overrides={n: given[n] for n in explicit if n in given},
            source="command line",
        )

    @classmethod
    def _layered(
        cls, *, preset: str | None, yaml_path: str | Path | None, overrides: Mapping[str, Any], source: str
    ) -> RolloutCorrectionConfig:
        """The one merge of all sources: built-in default < preset < YAML file < `overrides`.

        The preset is `preset`, else the YAML file's `preset:` / `rollout_correction_preset:` key.
        """
        yaml_values: dict[str, Any] = {}
        preset_source = "--rollout-correction-preset"
        if yaml_path:
            yaml_values = read_yaml(yaml_path, FIELD_KINDS)
            yaml_preset = yaml_values.pop("preset", None) or yaml_values.get("rollout_correction_preset")
            if not preset and yaml_preset:
                preset, preset_source = yaml_preset, f"--custom-config-path {yaml_path}: preset"
            _check_keys(yaml_values, f"--custom-config-path {yaml_path}")
        if preset and preset not in PRESETS:
            raise ConfigError(f"{preset_source} {preset!r} is unknown; choose one of {', '.join(PRESETS)}.")
        preset_values = dict(PRESETS.get(preset or "", {}))
        merged = {**preset_values, **yaml_values, **overrides}
        if yaml_values:
            slime_yaml_meaning(merged, yaml_values, overrides, str(yaml_path), DEFAULT_TIS_UPPER_BOUND)
        for switch, keys in _BOUNDS_OF.items():  # a preset's bounds go when its switch is turned off
            if not merged.get(switch) or merged.get(switch) == "ratio":
                for key in keys:
                    if key in preset_values and key not in yaml_values and key not in overrides:
                        merged.pop(key)
        if preset:
            merged["rollout_correction_preset"] = preset
        if yaml_path:
            merged.setdefault("custom_config_path", str(yaml_path))
        return cls.from_dict(merged, source=source)

    def replace(self, **changes: Any) -> RolloutCorrectionConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line per non-default field, for logs."""
        lines = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value != f.default or f.name in ("loss_type", "loss_agg_mode"):
                lines.append(f"  {f.name} = {value!r}")
        return "\n".join(lines)


def _check_bounds(fail: Callable[[str], None], prefix: str, lower: float | None, upper: float | None,
                  default_upper: float | None) -> None:
    """L <= U, with a message that names only the bounds the user gave (L defaults to 1/U)."""
    lo, up = flag(f"{prefix}_lower_bound"), flag(f"{prefix}_upper_bound")
    u = upper if upper is not None else default_upper
    if lower is not None and lower > u:
        given_u = f"{up} {u}" if upper is not None else f"the default upper bound {u} ({up})"
        fail(f"{lo} {lower} > {given_u}; give {lo} <= {up}.")
    if lower is None and u < 1.0:
        fail(f"{up} {u} is below 1, so the default lower bound 1/U = {1.0 / u:g} is above it; give {lo} "
             f"(<= {u}) explicitly, or an upper bound >= 1.")


def _check_keys(values: Mapping[str, Any], source: str) -> None:
    unknown = sorted(set(values) - set(RolloutCorrectionConfig.field_names()))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(unknown)}; valid keys are the flag names with '_': "
            f"{', '.join(RolloutCorrectionConfig.field_names())}."
        )


_FLOAT_FIELDS = ("tis_lower_bound", "tis_upper_bound", "tis_clip", "tis_clip_low", "rs_lower_bound", "rs_upper_bound",
                 "rs_veto_threshold", "eps_clip_high", "eps_clip_c", "rs_divergence_bound", "rs_divergence_budget",
                 "tis_ess_target")
FIELD_KINDS: dict[str, str] = {  # the type of each field ("?": None allowed)
    **{f.name: "bool" for f in fields(RolloutCorrectionConfig) if isinstance(f.default, bool)},
    **{name: "str" for name in ("tis_mode", "tis_level", "rs_level", "loss_type", "loss_agg_mode", "rs_metric",
                                "policy_ratio_level")},
    **{name: "str?" for name in ("rollout_correction_preset", "custom_config_path", "custom_tis_function_path",
                                 "rs_agg")},
    **{name: "float?" for name in _FLOAT_FIELDS},
    "eps_clip": "float",
    "opsm_delta": "float",
}
_BOUNDS_OF = {"use_tis": ("tis_lower_bound", "tis_upper_bound", "tis_clip", "tis_clip_low"),
              "use_rs": ("rs_lower_bound", "rs_upper_bound"),
              "rs_metric": ("rs_agg", "rs_divergence_bound", "rs_divergence_budget")}

RolloutCorrectionConfig.PRESETS = PRESETS


def preset_constructor(name: str) -> Callable[..., RolloutCorrectionConfig]:
    def build(**overrides: Any) -> RolloutCorrectionConfig:
        return RolloutCorrectionConfig.preset(name, **overrides)

    build.__name__ = name
    build.__doc__ = f"The `{name}` preset: {PRESETS[name]}"
    return build


decoupled_token_is = preset_constructor("decoupled_token_is")
decoupled_seq_is = preset_constructor("decoupled_seq_is")
decoupled_seq_is_rs = preset_constructor("decoupled_seq_is_rs")
decoupled_geo_rs = preset_constructor("decoupled_geo_rs")
ppo_is_bypass = preset_constructor("ppo_is_bypass")
pg_is = preset_constructor("pg_is")
pg_rs = preset_constructor("pg_rs")
decoupled_k3_rs = preset_constructor("decoupled_k3_rs")
decoupled_token_is_k3_rs = preset_constructor("decoupled_token_is_k3_rs")
decoupled_token_is_max_k2_rs = preset_constructor("decoupled_token_is_max_k2_rs")
ppo_k3_rs_bypass = preset_constructor("ppo_k3_rs_bypass")
disabled = preset_constructor("disabled")

__all__ = [
    "ConfigError",
    "RolloutCorrectionConfig",
    "PRESETS",
    "LEVELS",
    "TIS_MODES",
    "LOSS_TYPES",
    "LOSS_AGG_MODES",
    "RS_METRICS",
    "RS_AGGS",
    "POLICY_RATIO_LEVELS",
]
