"""The one typed configuration object for rollout correction.

Flags (`slime_corr.flags.correction`; each field carries its flag's help), YAML files (`--custom-config-path`,
`arguments/*.yaml`) and named presets all produce a `RolloutCorrectionConfig`. Every invalid combination fails at
construction with a `ConfigError` that names the offending flags and the fix.

Precedence when several sources are combined (`from_args`): explicit command-line flag > YAML file >
preset > built-in default.
"""

from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from slime_corr.config_checks import (  # noqa: F401  (the choices and their Literal types: public here too)
    CLIP_COV_DEFAULTS,
    DEFAULT_TIS_UPPER_BOUND,
    KL_COV_DEFAULTS,
    LEVELS,
    LOSS_AGG_MODES,
    LOSS_TYPES,
    POLICY_RATIO_LEVELS,
    RS_AGGS,
    RS_METRICS,
    SAPO_TAUS,
    TIS_MODES,
    KernelBackend,
    Level,
    LossAggMode,
    LossType,
    RatioLevel,
    RSAgg,
    RSMetric,
    TISMode,
    check_config,
    flag_of,
)
from slime_corr.config_yaml import read_yaml, slime_yaml_meaning
from slime_corr.errors import ConfigError  # (public here too: slime_corr.config.ConfigError)
from slime_corr.fields import flag
from slime_corr.presets import PRESETS


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Rollout-correction settings. Field names are the flag names with `-` replaced by `_`. A config is checked
    when made: each field's type (`_check_types`), then `config_checks.check_config` (every check across fields).

    Notation: lr = lp_train - lp_rollout, with lp_train = lp_old (decoupled) or lp.detach() (bypass).
    """

    # --- importance sampling (IS) weights ---
    use_tis: bool = flag(False, help="Multiply the policy loss by importance-sampling weights pi_train/pi_rollout.")
    tis_mode: TISMode = flag("truncate", help="How IS weights are bounded: truncate (min(w,U)), clip (clamp to "
                             "[L,U]), mask (0 outside).")
    tis_level: Level = flag("token", help="IS aggregation: token ratio, sequence product, or geometric mean per "
                            "sequence.")
    tis_lower_bound: float | None = flag(None, help="Lower bound L for clip/mask modes (default 1/U).")  # truncate: unused
    tis_upper_bound: float | None = flag(None, help="Upper bound U for IS weights (default 2.0).")
    tis_batch_normalize: bool = flag(False, help="Divide IS weights by their mean over the step (micro-batches, DP and "
                                     "CP ranks).")
    # slime's original TIS flags: the weight is clamped to [tis_clip_low, tis_clip].
    tis_clip: float | None = flag(None, help="slime's TIS upper clamp C: weight clamped to [tis_clip_low, C].")
    tis_clip_low: float | None = flag(None, help="slime's TIS lower clamp c (default 0 when --tis-clip is given).")

    # --- rejection sampling (RS) and veto ---
    use_rs: bool = flag(False, help="Rejection sampling: drop tokens/sequences whose ratio is outside [L, U] from "
                        "the loss.")
    rs_level: Level = flag("token", help="RS aggregation: token, sequence (product) or geometric (mean log-ratio).")
    rs_lower_bound: float | None = flag(None, help="RS lower bound L on the ratio (default 1/U).")
    rs_upper_bound: float | None = flag(None, help="RS upper bound U on the ratio (required with --use-rs).")
    rs_veto_threshold: float | None = flag(None, help="Veto: reject a whole sequence if any token ratio is below "
                                           "this (0<C<1, e.g. 1e-4).")  # works with or without use_rs
    rs_keep_loss_denominator: bool = flag(False, help="Rejected tokens still count in the loss denominator.")

    # --- divergence rejection (`divergence.py`): k2 = lr²/2, k3 = exp(lr) - 1 - lr, an upper bound only ---
    rs_metric: RSMetric = flag("ratio", help="Divergence rejection: k2 = lr^2/2, k3 = exp(lr)-1-lr, or binary_kl = "
                               "the KL between {token, rest} under pi_rollout and pi_train, per token, rejected above "
                               "--rs-divergence-bound (with --use-rs, the veto and IS); ratio (default): none.")
    rs_agg: RSAgg | None = flag(None, help="Divergence rejection level: token (each token), or mean / sum / max over "
                                "the sequence (rejects the sequence).")
    rs_divergence_bound: float | None = flag(None, help="Upper bound on the --rs-metric divergence, in its own units "
                                             "(e.g. k3 0.005).")
    rs_divergence_budget: float | None = flag(None, help="Instead of a fixed bound: each optimizer step's bound is the "
                                              "largest that keeps the mean divergence of the step's kept units <= "
                                              "this (M2PO's second-moment budget with k2).")
    tis_ess_target: float | None = flag(None, help="Instead of --tis-upper-bound: each optimizer step's truncation "
                                        "bound U is the largest that keeps the step's effective sample size of "
                                        "min(w, U) >= this fraction (0, 1].")

    # --- which policy the loss anchors on, and the loss ---
    use_rollout_logprobs: bool = flag(False, help="Bypass: use the rollout engine's log-probs as pi_old (no "
                                      "recompute forward pass).")
    use_rollout_correction: bool = flag(False, help="Apply the configured IS/RS to the loss (implied by --use-tis, "
                                        "--use-rs, --rs-veto-threshold).")
    get_mismatch_metrics: bool = flag(False, help="Log mismatch metrics without changing the loss.")
    # a host parser (slime's) owns `loss_type`: the flag's attribute is `policy_loss_type`
    loss_type: LossType = flag("ppo", option="--policy-loss-type", dest="policy_loss_type", help="Policy loss: ppo (clipped surrogate) or "
                               "reinforce (pure policy gradient, bypass only).")
    eps_clip: float = flag(0.2, help="PPO clip epsilon: ratio clipped to [1-eps, 1+eps_high].")
    eps_clip_high: float | None = flag(None, help="PPO upper clip epsilon (default: --eps-clip).")
    eps_clip_c: float | None = flag(None, help="Dual-clip constant c > 1 capping negative-advantage token losses at "
                                    "-A*c.")  # off by default
    loss_agg_mode: LossAggMode = flag("token-mean", help="How token losses are averaged into the micro-batch loss.")
    policy_ratio_level: RatioLevel = flag("token", help="PPO ratio per token, or sequence: GSPO's exp(mean_t(lp - "
                                          "lp_old)) (slime's --advantage-estimator gspo, verl's loss_mode gspo); set "
                                          "--eps-clip in its units, e.g. 3e-4.")
    use_opsm: bool = flag(False, help="Off-policy sequence masking (DeepSeek-V3.2, slime's flag): the tokens of a "
                          "sequence whose mean lp_old - lp exceeds --opsm-delta leave the loss's numerator where their "
                          "advantage is negative.")  # see slime_corr/opsm.py
    opsm_delta: float = flag(1e-4, help="OPSM's bound on a sequence's mean lp_old - lp, in nats (slime's default "
                             "1e-4).")

    # --- the peers' losses and masks (slime_corr/policy_losses.py, slime_corr/mismatch_masks.py) and the gate ---
    tau_pos: float | None = flag(None, help="SAPO's gate temperature where A > 0 (verl's tau_pos; default 1.0); with "
                                 "--policy-loss-type sapo.")
    tau_neg: float | None = flag(None, help="SAPO's gate temperature where A <= 0 (verl's tau_neg; default 1.05); with "
                                 "--policy-loss-type sapo.")
    clip_cov_ratio: float | None = flag(None, help="Clip-Cov: the fraction of the micro-batch's tokens whose gradient "
                                        "is cut (verl's clip_cov_ratio; default 0.0002).")
    clip_cov_lb: float | None = flag(None, help="Clip-Cov: the lower bound of the covariance of the tokens it may cut "
                                     "(verl's clip_cov_lb; default 1.0).")
    clip_cov_ub: float | None = flag(None, help="Clip-Cov: the upper bound of the covariance of the tokens it may cut "
                                     "(verl's clip_cov_ub; default 5.0).")
    kl_cov_ratio: float | None = flag(None, help="KL-Cov: the fraction of the micro-batch's tokens, those of the "
                                      "largest covariance, that get the |lp - lp_old| penalty (verl's kl_cov_ratio; "
                                      "default 0.0002).")
    ppo_kl_coef: float | None = flag(None, help="KL-Cov: the coefficient of its |lp - lp_old| penalty (verl's "
                                     "ppo_kl_coef; default 0.1).")
    m2_threshold: float | None = flag(None, help="M2PO's mask (AReaL's actor.m2_threshold): per micro-batch, the "
                                      "tokens of the largest (lp_train - lp_rollout)^2 leave the loss until the mean "
                                      "of the rest is below this.")
    seq_logprob_error_threshold: float | None = flag(None, help="NeMo-RL's sequence mask (grpo.seq_logprob_error_"
                                                     "threshold): a sequence whose mean exp(|lp_train - lp_rollout|) "
                                                     "is above this (>= 1, e.g. 2.0) leaves the loss.")
    max_train_rollout_logprob_abs_diff: float | None = flag(None, help="Mismatch gate for CI: stop the run with an "
                                                            "error naming the step when a step's "
                                                            "train_rollout_logprob_abs_diff is above this (nats).")
    max_mismatch_k3_kl: float | None = flag(None, help="Mismatch gate for CI: stop the run with an error naming the "
                                            "step when a step's mismatch_k3_kl is above this.")

    # --- where settings and custom code come from ---
    rollout_correction_preset: str | None = flag(None, choices=list(PRESETS), help="Start from a named preset: "
                                                 + ", ".join(PRESETS) + ".")
    custom_config_path: str | None = flag(None, help="YAML file of rollout-correction settings (overridden by "
                                          "explicit flags).")
    custom_tis_function_path: str | None = flag(None, help="Your weighting function: pkg.mod.fn, pkg.mod:fn or "
                                                "path/file.py:fn (see docs/usage.md).")

    # --- how it runs ---
    rollout_correction_compile: bool = flag(False, help="torch.compile the per-token work of correction + loss (fused "
                                            "kernels; the first step compiles).")
    rollout_correction_cuda_graph: bool = flag(False, help="On CUDA: capture the correction once per input shape into "
                                               "a CUDA graph and replay it (one launch instead of ~200; pad "
                                               "micro-batches to a few lengths). Calls with DP/CP groups or packed "
                                               "rows run eager.")
    rollout_correction_backend: KernelBackend = flag("torch", help="The correction's token pass (log-ratio, the "
                                                     "mismatch terms and their per-sequence sums): torch, or triton "
                                                     "(one kernel per call; CUDA, padded rows; opt-in until "
                                                     "scripts/gpu_check.sh has passed it on a GPU; a kernel that cannot "
                                                     "compile or launch falls back to torch with one warning).")
    logprobs_backend: KernelBackend = flag("torch", help="Log-probs and entropy from the logits: torch (token "
                                             "chunks, every device) or triton (one fused kernel over vocabulary "
                                             "tiles; CUDA, opt-in until scripts/gpu_check.sh has passed it on a GPU; "
                                             "a kernel that cannot compile or launch falls back to torch with one "
                                             "warning).")
    warn_invalid_inputs: bool = flag(False, help="Impossible input values (loss mask outside {0,1} or NaN, log-prob > "
                                     "0 or NaN, advantage NaN/inf in the mask) warn and are counted "
                                     "(mis_invalid_mask_count, mis_positive_logprob_count, mis_nan_logprob_count, "
                                     "pg_nonfinite_advantage_count) instead of stopping the run.")

    PRESETS: ClassVar[dict[str, dict[str, Any]]]

    def __post_init__(self) -> None:
        self._check_types()
        check_config(self)
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
        return self.get_mismatch_metrics or self.use_rollout_correction or bool(self.mismatch_gates)

    @property
    def mismatch_gates(self) -> dict[str, float]:
        """The mismatch gate's bounds by metric name (`--max-train-rollout-logprob-abs-diff`,
        `--max-mismatch-k3-kl`); empty when no gate is set. A gate turns the mismatch metrics on."""
        gates = {"train_rollout_logprob_abs_diff": self.max_train_rollout_logprob_abs_diff,
                 "mismatch_k3_kl": self.max_mismatch_k3_kl}
        return {name: bound for name, bound in gates.items() if bound is not None}

    @property
    def sapo_taus(self) -> tuple[float, float]:
        """SAPO's (tau_pos, tau_neg), verl's defaults where not given."""
        pos, neg = SAPO_TAUS
        return (self.tau_pos if self.tau_pos is not None else pos, self.tau_neg if self.tau_neg is not None else neg)

    @property
    def clip_cov_settings(self) -> tuple[float, float, float]:
        """Clip-Cov's (ratio, lower bound, upper bound), verl's defaults where not given."""
        given = (self.clip_cov_ratio, self.clip_cov_lb, self.clip_cov_ub)
        return tuple(v if v is not None else d for v, d in zip(given, CLIP_COV_DEFAULTS, strict=True))

    @property
    def kl_cov_settings(self) -> tuple[float, float]:
        """KL-Cov's (ratio, penalty coefficient), verl's defaults where not given."""
        given = (self.kl_cov_ratio, self.ppo_kl_coef)
        return tuple(v if v is not None else d for v, d in zip(given, KL_COV_DEFAULTS, strict=True))

    @property
    def uses_mismatch_masks(self) -> bool:
        """Whether a peer's mask (`--m2-threshold`, `--seq-logprob-error-threshold`) may take tokens out of the
        loss after the correction (its denominators are then recounted)."""
        return self.m2_threshold is not None or self.seq_logprob_error_threshold is not None

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
                    raise ConfigError(f"{flag_of(f.name)} ({f.name}) must be true or false, got {got}.")
            elif kind == "float":
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    hint = "; write the number without quotes" if isinstance(value, str) else ""
                    raise ConfigError(f"{flag_of(f.name)} ({f.name}) must be a number, got {got}{hint}.")
                value = float(value)
            elif not isinstance(value, str):
                raise ConfigError(f"{flag_of(f.name)} ({f.name}) must be a string, got {got}.")
            object.__setattr__(self, f.name, value)

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


def _check_keys(values: Mapping[str, Any], source: str) -> None:
    unknown = sorted(set(values) - set(RolloutCorrectionConfig.field_names()))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(unknown)}; valid keys are the flag names with '_': "
            f"{', '.join(RolloutCorrectionConfig.field_names())}."
        )


def _field_kind(annotation: Any) -> str:
    """A field's type as `read_yaml` and `_check_types` name it: "bool", "float" or "str" (a `Literal` of strings),
    with a trailing "?" when it may be None."""
    kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    base = kinds[0] if optional else annotation
    return {bool: "bool", float: "float"}.get(base, "str") + ("?" if optional else "")


_ANNOTATIONS = typing.get_type_hints(RolloutCorrectionConfig)
FIELD_KINDS: dict[str, str] = {f.name: _field_kind(_ANNOTATIONS[f.name]) for f in fields(RolloutCorrectionConfig)}
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
