"""Command-line flags for rollout correction, usable as Megatron's `extra_args_provider`.

    parser = add_rollout_correction_args(argparse.ArgumentParser())
    args, config = parse_rollout_correction_config(parser, argv)

Flags record which of them were given explicitly, so `RolloutCorrectionConfig.from_args` can apply the
precedence explicit flag > YAML (`--custom-config-path`) > preset (`--rollout-correction-preset`) > default.

Composition with a host parser (slime's, Megatron-LM's): only the flags the host lacks are added. A flag the host
already defines is reused when its meaning is slime_corr's (`SHARED_FLAGS`, slime's names, or the same choices /
type), else adding the extension fails naming both definitions. The REINFORCE/PPO choice is `--policy-loss-type`
(slime's `--loss-type` picks policy/sft/custom loss); `--loss-type ppo|reinforce` still works, with a deprecation
note, on a parser that does not define `--loss-type`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from slime_corr.config import (
    LEVELS,
    LOSS_AGG_MODES,
    LOSS_TYPES,
    POLICY_RATIO_LEVELS,
    PRESETS,
    RS_AGGS,
    RS_METRICS,
    TIS_MODES,
    RolloutCorrectionConfig,
)
from slime_corr.errors import ConfigError
from slime_corr.loss_terms import KL_LOSS_TYPES, LossTermsConfig
from slime_corr.megatron_lm_flags import check_megatron_lm_rl_flags
from slime_corr.verl_rollout_rs import OPTIONS as VERL_RS_OPTIONS
from slime_corr.verl_rollout_rs import rollout_rs_settings

EXPLICIT_ATTR = "_rollout_correction_explicit"
HOST_FLAGS_ATTR = "_rollout_correction_host_flags"  # {dest: the host's default} of the reused host flags
# Flags slime defines with slime_corr's meaning (slime/utils/arguments.py); a host's definition is reused.
SHARED_FLAGS = frozenset({
    "--use-tis", "--tis-clip", "--tis-clip-low", "--custom-tis-function-path", "--custom-config-path",
    "--use-rollout-logprobs", "--get-mismatch-metrics", "--eps-clip", "--eps-clip-high", "--eps-clip-c",
    "--use-kl-loss", "--kl-loss-coef", "--kl-coef", "--kl-loss-type", "--entropy-coef",
})
# A host's --custom-tis-function-path has the host's signature (slime's: `slime_corr.integrations.slime`), not a
# slime_corr weighting function's: it does not configure `config_from_args`.
_HOST_SIGNATURE_FIELDS = frozenset({"custom_tis_function_path"})
_FIELD_OF_DEST = {"policy_loss_type": "loss_type"}
_DEFAULTS = {f: getattr(RolloutCorrectionConfig, f, None) for f in RolloutCorrectionConfig.field_names()}


def _record(namespace: argparse.Namespace, dest: str) -> None:
    explicit = getattr(namespace, EXPLICIT_ATTR, None)
    if explicit is None:
        explicit = set()
        setattr(namespace, EXPLICIT_ATTR, explicit)
    explicit.add(_FIELD_OF_DEST.get(dest, dest))


class _Store(argparse._StoreAction):
    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        super().__call__(parser, namespace, values, option_string)
        _record(namespace, self.dest)


class _StoreTrue(argparse._StoreTrueAction):
    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        super().__call__(parser, namespace, values, option_string)
        _record(namespace, self.dest)


class _DeprecatedLossType(_Store):
    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        print(f"slime_corr: --loss-type {values} is deprecated: use --policy-loss-type {values} (slime's "
              "--loss-type chooses policy_loss / sft_loss / custom_loss).", file=sys.stderr)
        super().__call__(parser, namespace, values, option_string)


def _same_shape(host: argparse.Action, kw: dict[str, Any]) -> bool:
    """Whether the host's flag takes the same values as ours (then it is one flag defined twice)."""
    ours_switch = kw.get("action") in (_StoreTrue, "store_true")
    host_switch = isinstance(host, argparse._StoreTrueAction)
    return ours_switch == host_switch and (ours_switch or (
        kw.get("type") == host.type and list(kw.get("choices") or []) == list(host.choices or [])))


def _describe(action: argparse.Action) -> str:
    what = "a switch" if isinstance(action, argparse._StoreTrueAction) else (
        f"choices {list(action.choices)}" if action.choices else f"type {getattr(action.type, '__name__', 'str')}")
    return f"{what}, default {action.default!r}: {action.help or 'no help'}"


def compose_flag(parser: argparse.ArgumentParser, group: Any, option: str, **kw: Any) -> bool:
    """Add `option` to `group`, or reuse the host parser's definition when it means the same (`SHARED_FLAGS`, or the
    same values); where meanings differ, raise `ConfigError` naming both. Returns whether it was added."""
    host = parser._option_string_actions.get(option)
    if host is None:
        group.add_argument(option, **kw)
        return True
    if option not in SHARED_FLAGS and not _same_shape(host, kw):
        raise ConfigError(
            f"{option} is defined twice with different meanings: the parser's ({_describe(host)}) and "
            f"slime_corr's ({kw.get('help')}). Rename one of them; slime_corr does not redefine a host flag.")
    hosted = dict(parser._defaults.get(HOST_FLAGS_ATTR, {}))
    hosted[host.dest] = host.default
    parser.set_defaults(**{HOST_FLAGS_ATTR: hosted})
    return False


def add_rollout_correction_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the rollout-correction flags (a Megatron `extra_args_provider`; only those the parser lacks, see the
    module doc). Returns the parser."""
    g = parser.add_argument_group(title="rollout correction (slime_corr)")

    def switch(name: str, help: str) -> None:
        compose_flag(parser, g, name, action=_StoreTrue, default=False, help=help)

    def value(name: str, help: str, **kw: Any) -> None:
        dest = kw.pop("dest", name[2:].replace("-", "_"))
        compose_flag(parser, g, name, action=kw.pop("action", _Store), dest=dest,
                     default=_DEFAULTS[_FIELD_OF_DEST.get(dest, dest)], help=help, **kw)

    switch("--use-tis", "Multiply the policy loss by importance-sampling weights pi_train/pi_rollout.")
    value("--tis-mode", "How IS weights are bounded: truncate (min(w,U)), clip (clamp to [L,U]), mask (0 outside).",
          choices=TIS_MODES)
    value("--tis-level", "IS aggregation: token ratio, sequence product, or geometric mean per sequence.",
          choices=LEVELS)
    value("--tis-lower-bound", "Lower bound L for clip/mask modes (default 1/U).", type=float)
    value("--tis-upper-bound", "Upper bound U for IS weights (default 2.0).", type=float)
    switch("--tis-batch-normalize", "Divide IS weights by their mean over the step (micro-batches, DP and CP ranks).")
    value("--tis-clip", "slime's TIS upper clamp C: weight clamped to [tis_clip_low, C].", type=float)
    value("--tis-clip-low", "slime's TIS lower clamp c (default 0 when --tis-clip is given).",
          type=float)

    switch("--use-rs", "Rejection sampling: drop tokens/sequences whose ratio is outside [L, U] from the loss.")
    value("--rs-level", "RS aggregation: token, sequence (product) or geometric (mean log-ratio).",
          choices=LEVELS)
    value("--rs-lower-bound", "RS lower bound L on the ratio (default 1/U).", type=float)
    value("--rs-upper-bound", "RS upper bound U on the ratio (required with --use-rs).", type=float)
    value("--rs-veto-threshold",
          "Veto: reject a whole sequence if any token ratio is below this (0<C<1, e.g. 1e-4).",
          type=float)
    switch("--rs-keep-loss-denominator", "Rejected tokens still count in the loss denominator.")
    value("--rs-metric", "Divergence rejection: k2 = lr^2/2, k3 = exp(lr)-1-lr, or binary_kl = the KL between "
          "{token, rest} under pi_rollout and pi_train, per token, rejected above --rs-divergence-bound (with "
          "--use-rs, the veto and IS); ratio (default): none.", choices=RS_METRICS)
    value("--rs-agg", "Divergence rejection level: token (each token), or mean / sum / max over the sequence (rejects "
          "the sequence).", choices=RS_AGGS)
    value("--rs-divergence-bound", "Upper bound on the --rs-metric divergence, in its own units (e.g. k3 0.005).",
          type=float)
    compose_flag(parser, g, "--rollout-rs", default=None, metavar="OPTIONS",
                 help="verl's spelling of rejection: comma-separated criteria (" + ", ".join(VERL_RS_OPTIONS) +
                      "), at most one k1 and one k2/k3; sets --use-rs/--rs-level/bounds and --rs-metric/--rs-agg/"
                      "--rs-divergence-bound (see slime_corr/verl_rollout_rs.py).")
    compose_flag(parser, g, "--rollout-rs-threshold", default=None, metavar="SPEC",
                 help="verl's thresholds of --rollout-rs: one for all or one per option, comma separated; a k1 "
                      "option takes lower_upper or U (= [1/U, U]).")
    value("--rs-divergence-budget", "Instead of a fixed bound: each optimizer step's bound is the largest that keeps "
          "the mean divergence of the step's kept units <= this (M2PO's second-moment budget with k2).", type=float)
    value("--tis-ess-target", "Instead of --tis-upper-bound: each optimizer step's truncation bound U is the largest that "
          "keeps the step's effective sample size of min(w, U) >= this fraction (0, 1].", type=float)

    switch("--use-rollout-logprobs",
           "Bypass: use the rollout engine's log-probs as pi_old (no recompute forward pass).")
    switch("--use-rollout-correction",
           "Apply the configured IS/RS to the loss (implied by --use-tis, --use-rs, --rs-veto-threshold).")
    switch("--get-mismatch-metrics", "Log mismatch metrics without changing the loss.")
    value("--policy-loss-type", "Policy loss: ppo (clipped surrogate) or reinforce (pure policy gradient, bypass "
          "only).", choices=LOSS_TYPES, dest="policy_loss_type")
    if "--loss-type" not in parser._option_string_actions:  # slime's parser has its own --loss-type
        value("--loss-type", "Deprecated spelling of --policy-loss-type.", choices=LOSS_TYPES,
              dest="policy_loss_type", action=_DeprecatedLossType)
    value("--eps-clip", "PPO clip epsilon: ratio clipped to [1-eps, 1+eps_high].", type=float)
    value("--eps-clip-high", "PPO upper clip epsilon (default: --eps-clip).", type=float)
    value("--eps-clip-c", "Dual-clip constant c > 1 capping negative-advantage token losses at -A*c.",
          type=float)
    value("--loss-agg-mode", "How token losses are averaged into the micro-batch loss.", choices=LOSS_AGG_MODES)
    value("--policy-ratio-level", "PPO ratio per token, or sequence: GSPO's exp(mean_t(lp - lp_old)) (slime's "
          "--advantage-estimator gspo, verl's loss_mode gspo); set --eps-clip in its units, e.g. 3e-4.",
          choices=POLICY_RATIO_LEVELS)

    switch("--use-opsm", "Off-policy sequence masking (DeepSeek-V3.2, slime's flag): the tokens of a sequence whose "
           "mean lp_old - lp exceeds --opsm-delta leave the loss's numerator where their advantage is negative.")
    value("--opsm-delta", "OPSM's bound on a sequence's mean lp_old - lp, in nats (slime's default 1e-4).",
          type=float)

    switch("--rollout-correction-compile",
           "torch.compile the per-token work of correction + loss (fused kernels; the first step compiles).")
    switch("--rollout-correction-cuda-graph",
           "On CUDA: capture the correction once per input shape into a CUDA graph and replay it (one launch "
           "instead of ~200; pad micro-batches to a few lengths). Calls with DP/CP groups or packed rows run eager.")
    switch("--warn-invalid-inputs",
           "Impossible input values (loss mask outside {0,1} or NaN, log-prob > 0 or NaN, advantage NaN/inf in "
           "the mask) warn and are counted (mis_invalid_mask_count, mis_positive_logprob_count, "
           "mis_nan_logprob_count, pg_nonfinite_advantage_count) instead of stopping the run.")
    value("--rollout-correction-preset", "Start from a named preset: " + ", ".join(PRESETS) + ".",
          choices=list(PRESETS))
    value("--custom-config-path", "YAML file of rollout-correction settings (overridden by explicit flags).")
    value("--custom-tis-function-path",
          "Your weighting function: pkg.mod.fn, pkg.mod:fn or path/file.py:fn (see docs/usage.md).")
    return parser


def parse_rollout_correction_config(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> tuple[argparse.Namespace, RolloutCorrectionConfig]:
    """Parse `argv`, build and validate the config; any error exits through `parser.error`."""
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as e:
        parser.error(str(e))
    return args, config


def add_loss_terms_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """slime's KL-loss and entropy flags (see the module doc). Returns the parser."""
    g = parser.add_argument_group(title="KL and entropy loss terms (slime's flags)")
    d = LossTermsConfig()
    compose_flag(parser, g, "--use-kl-loss", action="store_true", default=d.use_kl_loss,
                 help="KL to a frozen reference policy (the initial model); logged as kl_loss, added to the loss "
                      "with --kl-loss-coef.")
    compose_flag(parser, g, "--kl-loss-coef", type=float, default=d.kl_loss_coef,
                 help="Coefficient of the KL loss (> 0 implies --use-kl-loss).")
    compose_flag(parser, g, "--kl-coef", type=float, default=0.0,
                 help="slime's KL penalty on the reward (before the advantages): not implemented by slime_corr's "
                      "trainer, so only 0 is accepted; use --kl-loss-coef for a KL term in the loss.")
    compose_flag(parser, g, "--kl-loss-type", choices=KL_LOSS_TYPES, default=d.kl_loss_type,
                 help="KL estimator per token, x = lp - lp_ref: k1 = x, k2 = x^2/2, k3 = exp(-x) - 1 + x, "
                      "low_var_kl = k3 clamped to [-10, 10].")
    compose_flag(parser, g, "--use-unbiased-kl", action="store_true", default=d.use_unbiased_kl,
                 help="Weight each token's KL by exp(lp - lp_old) (DeepSeek-V3.2's unbiased estimate on pi_old's "
                      "samples; the gradient flows through the weight too).")
    compose_flag(parser, g, "--entropy-coef", type=float, default=d.entropy_coef,
                 help="Entropy bonus: loss -= coef * entropy of the policy (token level).")
    return parser


def _apply_verl_rollout_rs(args: argparse.Namespace, explicit: set[str] | None) -> set[str]:
    """`--rollout-rs` / `--rollout-rs-threshold` (verl's spelling) written into the namespace as this project's
    fields, which then count as given; refused next to an explicit flag that sets the same field."""
    if getattr(args, "rollout_rs", None) is None:
        raise ConfigError("--rollout-rs-threshold without --rollout-rs: name the criteria it bounds, e.g. --rollout-rs "
                          "token_k1.")
    settings = rollout_rs_settings(args.rollout_rs, args.rollout_rs_threshold)
    given = set(explicit or ())
    clash = sorted(given & set(settings))
    if clash:
        flags = ", ".join("--" + name.replace("_", "-") for name in clash)
        raise ConfigError(f"--rollout-rs {args.rollout_rs} sets {flags} itself; give either verl's spelling or "
                          "this project's flags, not both.")
    for name, value in settings.items():
        setattr(args, name, value)
    return given | set(settings)


def explicit_fields(args: argparse.Namespace) -> set[str] | None:
    """The fields given on the command line: recorded by slime_corr's flags, plus the reused host flags whose value
    differs from the host's default (None: the namespace was not made by `add_rollout_correction_args`)."""
    recorded = getattr(args, EXPLICIT_ATTR, None)
    hosted = getattr(args, HOST_FLAGS_ATTR, None)
    if recorded is None and hosted is None:
        return None
    explicit = set(recorded or ())
    explicit.update(dest for dest, default in (hosted or {}).items()
                    if dest in _DEFAULTS and dest not in _HOST_SIGNATURE_FIELDS and getattr(args, dest, default) != default)
    return explicit


def config_from_args(args: argparse.Namespace) -> RolloutCorrectionConfig:
    """Build the config and load the custom weighting function now, so a bad path fails at start-up."""
    explicit = explicit_fields(args)
    if getattr(args, "rollout_rs", None) is not None or getattr(args, "rollout_rs_threshold", None) is not None:
        explicit = _apply_verl_rollout_rs(args, explicit)
    config = RolloutCorrectionConfig.from_args(args, explicit=explicit)
    check_megatron_lm_rl_flags(args, config)  # Megatron-LM's own IS flags, when its parser is used
    if config.custom_tis_function_path:
        import slime_corr.correction  # noqa: F401  (registers the built-in weighting functions)
        from slime_corr.registry import WEIGHT_FUNCTIONS

        WEIGHT_FUNCTIONS.get(config.custom_tis_function_path, flag="--custom-tis-function-path")
    return config
