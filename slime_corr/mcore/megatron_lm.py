"""Cross-checks with Megatron-LM's own flags (megatron/training/arguments.py), and MoE rollout routing replay (R3)
in Megatron-LM's own training loop.

RL flags. Megatron-LM's GRPO loss has its own importance-sampling correction against the inference engine's
log-probs: `--rl-inference-logprobs-is-correction` turns it on and `--rl-importance-sampling-truncation-coef`
truncates its ratio. With slime_corr's correction on as well, the loss would be corrected twice. The check reads
the parsed namespace only and lives in the flag layer (`slime_corr.flags.checks`, run by `config_from_args`).

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

Each micro-batch carries the engine's routes as `batch["routed_experts"]` (`slime_corr.layout.micro_batch.ROUTE_KEY`,
`[B, S, layers, top_k]` expert ids, any small int dtype, aligned with `batch["tokens"]`: the same DP rows, and the
same CP slice when the model sees one). The lp_old pre-pass and the training pass then route with those experts;
`loss_func` adds the routing-mismatch pairs (`routing_mismatch_frac`, ..., the trainer's own top-k vs the engine's)
to the loss dict that Megatron-LM's `train_step` reduces and `training_log` prints.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from slime_corr.flags.checks import (  # noqa: F401  (their home is the flag layer; importable from here too)
    ROUTING_FLAGS_ATTR,
    check_megatron_lm_rl_flags,
    check_megatron_lm_routing_flags,
)
from slime_corr.flags.megatron_lm import add_megatron_lm_args
from slime_corr.mcore.loss_hook import default_model_forward
from slime_corr.mcore.routing import routed_forward


def routed_model_forward(args: argparse.Namespace, inner: Callable | None = None) -> Callable:
    """The hook's `model_forward` for the parsed flags: `slime_corr.mcore.routing.routed_forward(inner, replay=...)`
    with a routing flag on (a micro-batch without routes runs `inner` as is), else `inner` itself. `inner`: how the
    model runs (default: `loss_hook.default_model_forward`, GPTModel on tokens / position_ids). Checks the flags
    first, for scripts that build their config otherwise than with `config_from_args`."""
    check_megatron_lm_routing_flags(args)
    inner = inner or default_model_forward
    replay = bool(getattr(args, "use_rollout_routing_replay", False))
    if not (replay or getattr(args, "log_routing_mismatch", False)):
        return inner
    return routed_forward(inner, replay=replay)


__all__ = ["ROUTING_FLAGS_ATTR", "check_megatron_lm_rl_flags", "add_megatron_lm_args",
           "check_megatron_lm_routing_flags", "routed_model_forward"]
