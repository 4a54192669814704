"""Cross-checks with Megatron-LM's own flags (megatron/training/arguments.py), and MoE rollout routing replay (R3)
in Megatron-LM's own training loop.

RL flags. Megatron-LM's GRPO loss has its own importance-sampling correction against the inference engine's
log-probs: `--rl-inference-logprobs-is-correction` turns it on and `--rl-importance-sampling-truncation-coef`
truncates its ratio. With slime_corr's correction on as well, the loss would be corrected twice. The check reads
the parsed namespace only (the flags are absent from namespaces that Megatron-LM did not parse) and imports nothing.

Routing replay. A pretrain_gpt.py-style script trains a MoE GPT (`--num-experts`, `--moe-router-topk`, ...) and
replays the experts the rollout engine routed each token to: Megatron-Core's `RouterReplay` forces them, and it
exists only in routers built with `--moe-enable-routing-replay`. slime_corr adds slime's two flags
(`--use-rollout-routing-replay`: replay; `--log-routing-mismatch`: only compare) and refuses, when the config is
built, a replay asked without `--moe-enable-routing-replay` (else the first forward would fail):

    args = parse_and_validate_args(extra_args_provider=add_megatron_lm_args)
    config = config_from_args(args)                                  # the checks run here
    hook = RolloutCorrectionLoss(config, model_forward=routed_model_forward(args))

    def forward_step(data_iterator, model):                          # pretrain_gpt.py's, run by train_step
        batch = hook.next_micro_batch(data_iterator, model)          # lp_old pre-pass: hook.model_forward too
        return hook.model_forward(model, batch), partial(hook.loss_func, batch, model=model)

Each micro-batch carries the engine's routes as `batch["routed_experts"]` (`slime_corr.rollout.batching.ROUTE_KEY`,
`[B, S, layers, top_k]` expert ids, any small int dtype, aligned with `batch["tokens"]`: the same DP rows, and the
same CP slice when the model sees one). The lp_old pre-pass and the training pass then route with those experts;
`loss_func` adds the routing-mismatch pairs (`routing_mismatch_frac`, ..., the trainer's own top-k vs the engine's)
to the loss dict that Megatron-LM's `train_step` reduces and `training_log` prints.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from slime_corr.config import ConfigError, RolloutCorrectionConfig

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


def add_megatron_lm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's `extra_args_provider`: slime_corr's correction flags plus slime's routing flags (those the
    parser lacks). Returns the parser."""
    from slime_corr.arguments import add_rollout_correction_args

    add_rollout_correction_args(parser)
    if "--use-rollout-routing-replay" in parser._option_string_actions:  # the host's own (slime's parser)
        return parser
    g = parser.add_argument_group(title="MoE rollout routing replay (slime_corr)")
    g.add_argument("--use-rollout-routing-replay", action="store_true",
                   help="R3 (slime's flag): the lp_old pre-pass and every training pass route each token to the "
                        "experts the rollout engine chose (batch['routed_experts']); needs "
                        "--moe-enable-routing-replay. Logs the routing-mismatch metrics too.")
    g.add_argument("--log-routing-mismatch", action="store_true",
                   help="Compare the trainer's routes with the engine's (routing_mismatch_* in the loss dict) "
                        "without replaying them.")
    parser.set_defaults(**{ROUTING_FLAGS_ATTR: True})
    return parser


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


def routed_model_forward(args: argparse.Namespace, inner: Callable | None = None) -> Callable:
    """The hook's `model_forward` for the parsed flags: `slime_corr.mcore.routing.routed_forward(inner, replay=...)`
    with a routing flag on (a micro-batch without routes runs `inner` as is), else `inner` itself. `inner`: how the
    model runs (default: `loss_hook.default_model_forward`, GPTModel on tokens / position_ids). Checks the flags
    first, for scripts that build their config otherwise than with `config_from_args`."""
    from slime_corr.mcore.loss_hook import default_model_forward
    from slime_corr.mcore.routing import routed_forward

    check_megatron_lm_routing_flags(args)
    inner = inner or default_model_forward
    replay = bool(getattr(args, "use_rollout_routing_replay", False))
    if not (replay or getattr(args, "log_routing_mismatch", False)):
        return inner
    return routed_forward(inner, replay=replay)


__all__ = ["ROUTING_FLAGS_ATTR", "check_megatron_lm_rl_flags", "add_megatron_lm_args",
           "check_megatron_lm_routing_flags", "routed_model_forward"]
