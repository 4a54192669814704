"""Every check across configs, on the parsed flags: what one config cannot check alone.

- `check_run`: the main job's configs together (`slime_corr.main.parse_run_config` builds them, then calls it):
  decoupled mode's π_old against the correction and the sampling, the CUDA-graph correction against the device,
  routing replay against bypass mode, and the run directory against the checkpoint it resumes;
- `check_megatron_lm_rl_flags`: Megatron-LM's GRPO importance sampling (`--rl-inference-logprobs-is-correction`,
  `--rl-importance-sampling-truncation-coef`) with slime_corr's correction would correct the loss twice
  (`slime_corr.flags.correction.config_from_args` calls it, for any host parser);
- `check_megatron_lm_routing_flags`: slime's routing flags (`--use-rollout-routing-replay`, `--log-routing-mismatch`,
  added by `slime_corr.flags.megatron_lm.add_megatron_lm_args`) need a MoE model built with
  `--moe-enable-routing-replay` and no recompute of the routers in backward.

The Megatron-LM checks read the namespace only (nothing of Megatron is imported); the flags absent from a namespace
Megatron-LM did not parse are left alone. Every check raises `ConfigError` naming the flags.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction.proximal import check_prox_logp_method
from slime_corr.device import resolve as resolve_device
from slime_corr.errors import ConfigError
from slime_corr.monitoring.config import MonitoringConfig
from slime_corr.monitoring.logger import CONFIG_FILE, METRICS_FILE
from slime_corr.trainer.config_checks import check_writable_dir

if TYPE_CHECKING:  # the trainer's config imports the model code; the checks only read its fields
    from slime_corr.trainer.config import TrainerConfig


def check_run(args: argparse.Namespace, trainer: TrainerConfig, correction: RolloutCorrectionConfig,
              monitoring: MonitoringConfig) -> None:
    """The main job's checks across its configs (`args`: the parsed flags, for the flag that chose the run dir)."""
    try:
        check_prox_logp_method(trainer.prox_logp_method, correction, trainer.truncation.active)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    placement = resolve_device(trainer.device)
    if correction.rollout_correction_cuda_graph and not placement.is_cuda:
        raise ConfigError(f"--rollout-correction-cuda-graph replays CUDA graphs, and this run is on "
                          f"{placement.device}: leave it off, or run on a GPU (--device cuda).")
    if trainer.use_routing_replay and correction.use_rollout_logprobs:
        raise ConfigError("--use-routing-replay replays the routes of the recomputed lp_old pass, which bypass "
                          "mode (--use-rollout-logprobs) skips: use a decoupled preset, or "
                          "--use-rollout-routing-replay (the engines' routes).")
    flag = "--run-dir" if args.run_dir else "--work-dir" if args.work_dir else "the default run directory"
    check_run_dir(monitoring.run_dir, flag, resuming=trainer.load)


def check_run_dir(run_dir: str | None, flag: str, resuming: str | None) -> None:
    """Writable, and not holding another run's metrics: a resumed run (`resuming`: its --load) continues only the
    metrics of the run that saved (or resumed from) that checkpoint directory."""
    if not run_dir:
        return
    check_writable_dir(flag, run_dir)
    metrics = Path(run_dir) / METRICS_FILE
    if not (metrics.is_file() and metrics.stat().st_size):
        return
    if not resuming:
        raise ConfigError(f"{flag} {run_dir} already holds a run's {METRICS_FILE}: a run never appends to another "
                          "run's metrics. Pass a new --run-dir (or none: a new runs/DATE-TIME), or add --load to resume "
                          "that run.")
    try:
        saved = json.loads((Path(run_dir) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        saved = {}
    ckpts = {str(Path(p).resolve()) for p in (saved.get("save"), saved.get("load")) if isinstance(p, str) and p}
    if str(Path(resuming).resolve()) not in ckpts:
        raise ConfigError(f"{flag} {run_dir} holds the metrics of another run (its {CONFIG_FILE} names the "
                          f"checkpoints {sorted(ckpts) or 'of no run'}, and this run resumes from --load {resuming}): a "
                          "run never appends to another run's metrics. Pass the --run-dir of the run that saved "
                          f"{resuming}, or a new one.")


# Set (as a parser default) by `add_megatron_lm_args` when it added the routing flags: the routing checks apply to
# such namespaces only (slime's parser and slime_corr's trainer define the flags with their own model building).
ROUTING_FLAGS_ATTR = "_slime_corr_megatron_lm_routing"


def _our_correction_flags(config: RolloutCorrectionConfig) -> str:
    """The slime_corr flags that turned the loss correction on, as the user would type them."""
    flags = [name for name, on in (("--use-tis", config.use_tis), ("--use-rs", config.use_rs),
                                   ("--rs-veto-threshold", config.rs_veto_threshold is not None)) if on]
    return " / ".join(flags) or "--use-rollout-correction"


def check_megatron_lm_rl_flags(args: argparse.Namespace, config: RolloutCorrectionConfig) -> None:
    """Raise `ConfigError` naming both flags when Megatron-LM's own IS correction is configured together with
    slime_corr's correction (the loss would be corrected twice), or when the routing flags do not fit the model
    (`check_megatron_lm_routing_flags`)."""
    if getattr(args, "rl_inference_logprobs_is_correction", False) and config.use_rollout_correction:
        raise ConfigError(
            f"--rl-inference-logprobs-is-correction (Megatron-LM's GRPO importance sampling) with "
            f"{_our_correction_flags(config)} (slime_corr) corrects the loss twice against the rollout "
            "log-probs. Keep one: drop --rl-inference-logprobs-is-correction to use slime_corr's correction, or "
            "drop the slime_corr correction flags."
        )
    coef = getattr(args, "rl_importance_sampling_truncation_coef", None)
    if coef is not None and config.use_tis:
        raise ConfigError(
            f"--rl-importance-sampling-truncation-coef {coef} (Megatron-LM's IS truncation) with --use-tis "
            "(slime_corr) configures two IS truncations. Set the bound with --tis-upper-bound (--tis-mode "
            "truncate) and drop --rl-importance-sampling-truncation-coef."
        )
    check_megatron_lm_routing_flags(args)


def check_megatron_lm_routing_flags(args: argparse.Namespace) -> None:
    """Raise `ConfigError` when `--use-rollout-routing-replay` comes without `--moe-enable-routing-replay` (the
    routers would have no `RouterReplay`) or with an activation recompute that re-runs the routers in backward
    (`routed_forward` does not keep the routes for it), or a routing flag with a dense model. Namespaces whose
    routing flags `add_megatron_lm_args` did not add are left alone."""
    if not getattr(args, ROUTING_FLAGS_ATTR, False):
        return
    replay = bool(getattr(args, "use_rollout_routing_replay", False))
    flag = "--use-rollout-routing-replay" if replay else (
        "--log-routing-mismatch" if getattr(args, "log_routing_mismatch", False) else None)
    if flag is None:
        return
    if not getattr(args, "num_experts", None):
        raise ConfigError(f"{flag}: the model is dense (no --num-experts): routing replay and the routing-mismatch "
                          "metrics need a Mixture-of-Experts model (--num-experts N --moe-router-topk K).")
    if replay and not getattr(args, "moe_enable_routing_replay", False):
        raise ConfigError(
            "--use-rollout-routing-replay (slime_corr: route with the rollout engine's experts) needs "
            "--moe-enable-routing-replay (Megatron-Core builds its routers' RouterReplay only with it). Add "
            "--moe-enable-routing-replay to the launch, or drop --use-rollout-routing-replay (--log-routing-mismatch "
            "compares the routes without replaying them).")
    recompute = _router_recompute_flag(args)
    if replay and recompute:
        raise ConfigError(
            f"--use-rollout-routing-replay with {recompute}: the backward pass recomputes the routers after "
            "slime_corr's replay of the forward has ended, so they would pick their own experts there and the "
            "gradients would not be those of the replayed forward. Drop that recompute (e.g. --recompute-granularity "
            "selective --recompute-modules core_attn), or drop --use-rollout-routing-replay.")


def _router_recompute_flag(args: argparse.Namespace) -> str | None:
    """The activation-recompute flag under which the backward runs the MoE routers again (None: none)."""
    granularity = getattr(args, "recompute_granularity", None)
    if granularity == "full":
        return "--recompute-granularity full"
    if granularity == "selective" and "moe" in (getattr(args, "recompute_modules", None) or ()):
        return "--recompute-modules moe"
    return "--moe-layer-recompute" if getattr(args, "moe_layer_recompute", False) else None


__all__ = ["ROUTING_FLAGS_ATTR", "check_megatron_lm_rl_flags", "check_megatron_lm_routing_flags", "check_run",
           "check_run_dir"]
