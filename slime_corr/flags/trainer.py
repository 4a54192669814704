"""The trainer's flags (`add_trainer_args`), which build a `TrainerConfig` (slime_corr.trainer.config: its module doc
lists whose names they follow), and slime's `--sglang-X` pass-through (`split_sglang_passthrough`).

The help, defaults and choices are `TrainerConfig`'s fields' (and `PrecisionConfig`'s: `--bf16`, `--fp16`, the loss
scaling). The special cases here: `--lr` and `--task`, whose
defaults depend on the model (None on the command line, resolved by `TrainerConfig.from_args`), `--sglang-url`
(repeatable), and `--custom-function-traceback`, which only the main job's error report reads.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from slime_corr.fields import add_flags
from slime_corr.mcore.precision import PrecisionConfig
from slime_corr.trainer.config import PRETRAINED_LR, TrainerConfig
from slime_corr.trainer.task import TASKS

PARALLELISM = ("device", "tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
               "micro_batch_size", "use_dynamic_batch_size", "max_tokens_per_gpu", "global_batch_size",
               "distributed_timeout_minutes")
OPTIMIZATION = ("clip_grad", "params_dtype", "save", "save_interval", "load", "ckpt_step")
PRECISION = ("bf16", "fp16", "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window",
             "hysteresis")  # PrecisionConfig's fields
ROLLOUT = ("rollout_batch_size", "n_samples_per_prompt", "num_steps_per_rollout", "num_rollout",
           "rollout_max_response_len", "rollout_temperature", "rollout_top_p", "rollout_top_k",
           "rollout_nucleus_logprobs", "rollout_return_sampling_mask", "async_rollout", "max_staleness", "staleness_policy", "partial_rollout",
           "mask_offpolicy_in_partial_rollout", "max_token_staleness", "grpo_std_normalization")
PROX_LOGP = ("prox_logp_method", "prox_logp_error_interval")
FAILURES = ("max_failed_sample_fraction", "rollout_request_timeout")
AGREEMENT_AND_HEALTH = ("engine_agreement_check", "rollout_control_timeout", "rollout_health_check_interval",
                        "rollout_health_check_timeout")
ENGINES = ("rollout_engine", "sglang_python", "rollout_num_engines", "rollout_router", "rollout_weight_sync",
           "update_weight_buffer_size", "update_weight_master_address", "engine_dtype", "work_dir")
MOE = ("use_rollout_routing_replay", "use_routing_replay", "log_routing_mismatch")
FIELDS = (*PARALLELISM, *OPTIMIZATION, *ROLLOUT, *PROX_LOGP, *FAILURES, *AGREEMENT_AND_HEALTH, *ENGINES, *MOE)
KNOWN_SGLANG_FLAGS = ("--sglang-url", "--sglang-python")


def add_trainer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The trainer's flags (see the module doc); the model's come from `slime_corr.flags.model`."""
    g = parser.add_argument_group(title="parallelism, optimization and checkpoints (Megatron's flags)")
    add_flags(g, TrainerConfig, PARALLELISM)
    g.add_argument("--lr", type=float, default=None,
                   help=f"Adam learning rate (default: {TrainerConfig.lr:g} for the tiny model, {PRETRAINED_LR:g} "
                        "with --model / --hf-checkpoint).")
    add_flags(g, TrainerConfig, OPTIMIZATION)
    add_flags(parser.add_argument_group(title="mixed precision (Megatron's flags)"), PrecisionConfig, PRECISION)

    r = parser.add_argument_group(title="rollout (slime's flags)")
    add_flags(r, TrainerConfig, ROLLOUT)
    r.add_argument("--task", choices=sorted(TASKS), default=None,
                   help="Prompts and reward: " + "; ".join(f"{t.name}: {t.description}" for t in TASKS.values())
                        + ". Default: lowercase with the tiny model, arithmetic with --model / --hf-checkpoint.")
    r.add_argument("--sglang-url", action="append", default=None,
                   help="SGLang server or router URL (repeatable), checked at start-up. Default: embedded engines.")

    add_flags(parser.add_argument_group(title="decoupled mode's π_old"), TrainerConfig, PROX_LOGP)

    f = parser.add_argument_group(title="failures and bounded waits")
    add_flags(f, TrainerConfig, FAILURES)
    f.add_argument("--custom-function-traceback", action="store_true",
                   help="When --custom-tis-function-path raises, print its traceback after the one-line error.")
    add_flags(f, TrainerConfig, AGREEMENT_AND_HEALTH)

    add_flags(parser.add_argument_group(title="rollout engines"), TrainerConfig, ENGINES)
    add_flags(parser.add_argument_group(title="Mixture of Experts (slime's routing replay)"), TrainerConfig, MOE)
    return parser


def split_sglang_passthrough(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the trainer's own flags, slime's `--sglang-X [VALUE]` pass-through flags) of `argv`. A pass-through
    flag's value is the next word unless that starts with `--` or the flag has `=VALUE`."""
    own: list[str] = []
    passthrough: list[str] = []
    words = list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        name = word.split("=", 1)[0]
        if word.startswith("--sglang-") and name not in KNOWN_SGLANG_FLAGS:
            passthrough.append(word)
            if "=" not in word and i + 1 < len(words) and not words[i + 1].startswith("--"):
                passthrough.append(words[i + 1])
                i += 1
        else:
            own.append(word)
        i += 1
    return own, passthrough


__all__ = ["FIELDS", "KNOWN_SGLANG_FLAGS", "PRECISION", "add_trainer_args", "split_sglang_passthrough"]
