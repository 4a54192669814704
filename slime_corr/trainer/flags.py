"""The trainer's command-line flags (`add_trainer_args`), which build a `TrainerConfig`
(slime_corr.trainer.config: its module doc lists whose names they follow), and slime's `--sglang-X` pass-through
(`split_sglang_passthrough`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from slime_corr.correction.proximal import PROX_LOGP_METHODS
from slime_corr.device import DEVICE_CHOICES, DEVICE_ENV
from slime_corr.rollout.control import WEIGHT_LOAD_S_PER_GB
from slime_corr.trainer.config import TrainerConfig
from slime_corr.trainer.config_checks import (
    DEFAULT_ROLLOUT_BATCH_SIZE,
    DEFAULT_STEPS_PER_ROLLOUT,
    ENGINE_DTYPES,
    ENGINE_KINDS,
    PARAMS_DTYPES,
    PRETRAINED_LR,
    ROUTER_CHOICES,
    STALENESS_POLICIES,
    WEIGHT_SYNC_MODES,
)
from slime_corr.trainer.task import TASKS


def add_trainer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The trainer's flags (see the module doc); the model's come from `mcore.model.add_tiny_model_args`."""
    d = TrainerConfig()
    g = parser.add_argument_group(title="parallelism, optimization and checkpoints (Megatron's flags)")
    g.add_argument("--device", choices=DEVICE_CHOICES, default=None,
                   help="Where the trainer and the embedded engines compute: cuda (GPU LOCAL_RANK, NCCL), cpu (gloo), "
                        f"auto (cuda when torch sees a GPU). Default: ${DEVICE_ENV}, else auto.")
    g.add_argument("--tensor-model-parallel-size", type=int, default=d.tensor_model_parallel_size)
    g.add_argument("--context-parallel-size", type=int, default=d.context_parallel_size,
                   help="On CPU, CP is emulated: each CP rank runs the full sequence and keeps its zig-zag slice.")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=d.pipeline_model_parallel_size,
                   help="Pipeline stages (must divide --num-layers); the loss and its metrics live on the last one.")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="Samples per micro-batch (padded; not used with --use-dynamic-batch-size). Default: gcd(8, "
                        "the samples a DP rank trains per step).")
    g.add_argument("--use-dynamic-batch-size", action="store_true",
                   help="Packed (THD) micro-batches of whole GRPO groups up to --max-tokens-per-gpu tokens (slime's "
                        "flag): no padding between samples; every DP rank runs as many micro-batches.")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="Token budget of a packed micro-batch per GPU (with CP, a micro-batch holds N × CP tokens).")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per optimizer step (default: the rollout's samples / --num-steps-per-rollout).")
    g.add_argument("--distributed-timeout-minutes", type=float, default=d.distributed_timeout_minutes,
                   help="How long a rank waits on the others (a collective, or the driver's rollout with no sign of "
                        "life from it) before the job stops with an error (Megatron's flag; fractions allowed).")
    g.add_argument("--lr", type=float, default=None,
                   help=f"Adam learning rate (default: {d.lr:g} for the tiny model, {PRETRAINED_LR:g} with --model / "
                        "--hf-checkpoint).")
    g.add_argument("--clip-grad", type=float, default=d.clip_grad, help="Gradient clipping by global L2 norm (0: off).")
    g.add_argument("--params-dtype", choices=PARAMS_DTYPES, default=d.params_dtype,
                   help="Dtype of the trained model (float64 makes runs comparable across parallel layouts).")
    g.add_argument("--save", default=None, help="Checkpoint directory (Megatron-LM's layout, dist_checkpointing).")
    g.add_argument("--save-interval", type=int, default=None, help="Save every N rollouts (and after the last).")
    g.add_argument("--load", default=None, help="Resume from this checkpoint directory (model, optimizer, step, "
                                                "RNG, rollout position).")
    g.add_argument("--ckpt-step", type=int, default=None, help="Load this iteration of --load (default: latest).")

    r = parser.add_argument_group(title="rollout (slime's flags)")
    r.add_argument("--rollout-batch-size", type=int, default=None,
                   help=f"Prompts per rollout (default: {DEFAULT_ROLLOUT_BATCH_SIZE}, rounded up to a multiple of DP).")
    r.add_argument("--n-samples-per-prompt", type=int, default=d.n_samples_per_prompt, help="GRPO group size.")
    r.add_argument("--num-steps-per-rollout", type=int, default=None,
                   help="Optimizer steps trained on each rollout (decoupled mode: lp_old is computed once, before "
                        "the first). Default: the rollout / --global-batch-size when given, else the largest of "
                        f"{DEFAULT_STEPS_PER_ROLLOUT}..1 that gives every DP rank whole GRPO groups in every step.")
    r.add_argument("--num-rollout", type=int, default=d.num_rollout, help="Rollouts of the run.")
    r.add_argument("--rollout-max-response-len", type=int, default=d.rollout_max_response_len,
                   help="Response length cap (SGLang's max_new_tokens).")
    r.add_argument("--rollout-temperature", type=float, default=d.rollout_temperature,
                   help="Sampling temperature (> 0); the trainer's log-probs use the same.")
    r.add_argument("--rollout-top-p", type=float, default=d.rollout_top_p,
                   help="Nucleus sampling, in (0, 1] (1.0: off). The trainer's log-probs are taken under the same "
                        "truncated, renormalized distribution, the rollout's renormalized to the trainer's nucleus.")
    r.add_argument("--rollout-top-k", type=int, default=d.rollout_top_k,
                   help="Top-k sampling (-1 or 0: off), honoured by the trainer like --rollout-top-p.")
    r.add_argument("--async-rollout", action="store_true",
                   help="Generate rollout k+1 while rollout k trains (one rollout off-policy, as slime's "
                        "train_async.py); the weights reach the engines between rollouts.")
    r.add_argument("--max-staleness", type=int, default=None,
                   help="With --async-rollout: the most optimizer steps between the weights that sampled a "
                        "sample's oldest token and the step that trains it (AReaL's max_head_offpolicyness, "
                        "Megatron-LM's --rl-generation-lag, prime-rl's max_off_policy_steps). The producer "
                        "generates A = (K + 1) // --num-steps-per-rollout − 1 rollouts ahead; >= 2 × steps per "
                        "rollout − 1. Default: one rollout ahead (2 × steps − 1).")
    r.add_argument("--staleness-policy", choices=STALENESS_POLICIES, default=None,
                   help="A sample older than --max-staleness at the step that trains it (e.g. pending in a "
                        "checkpoint resumed with a smaller bound): drop it from the loss and its group's baseline, "
                        "or regenerate its GRPO group with the engines' current weights. Default: drop.")
    r.add_argument("--partial-rollout", action="store_true",
                   help="With --async-rollout: sync the weights right after training, while the rollouts ahead are "
                        "still generating (pause -> update -> continue; slime's flag): their requests continue under "
                        "the new weights and each token keeps the version that sampled it.")
    r.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true",
                   help="With --partial-rollout (slime's flag): the tokens a sample generated before its last weight "
                        "update leave the loss.")
    r.add_argument("--max-token-staleness", type=int, default=None,
                   help="Per token: a response token sampled more than K optimizer steps before the step that trains "
                        "it leaves the loss, the sample's newer tokens stay (partial rollouts carry tokens of several "
                        "weight versions; --max-staleness bounds whole samples). >= --num-steps-per-rollout − 1. "
                        "Logged as rollout/stale_masked_tokens.")
    r.add_argument("--disable-grpo-std-normalization", dest="grpo_std_normalization", action="store_false",
                   help="GRPO advantage = reward − group mean, without dividing by the group's std (Dr. GRPO).")
    r.add_argument("--task", choices=sorted(TASKS), default=None,
                   help="Prompts and reward: " + "; ".join(f"{t.name}: {t.description}" for t in TASKS.values())
                        + ". Default: lowercase with the tiny model, arithmetic with --model / --hf-checkpoint.")
    r.add_argument("--sglang-url", action="append", default=None,
                   help="SGLang server or router URL (repeatable), checked at start-up. Default: embedded engines.")

    p = parser.add_argument_group(title="decoupled mode's π_old")
    p.add_argument("--prox-logp-method", choices=PROX_LOGP_METHODS, default=d.prox_logp_method,
                   help="recompute: a forward-only pass before each rollout's first update (exact); loglinear: "
                        "AReaL's log-linear interpolation between the behaviour and the current log-prob by weight "
                        "version (no pass; exact at a rollout's first step).")
    p.add_argument("--prox-logp-error-interval", type=int, default=d.prox_logp_error_interval,
                   help="With loglinear: every N rollouts also recompute lp_old and log "
                        "train/prox_logp_abs_error_mean and _max of the approximation against it (0: never).")

    f = parser.add_argument_group(title="failures and bounded waits")
    f.add_argument("--max-failed-sample-fraction", type=float, default=d.max_failed_sample_fraction,
                   help="Stop the run (exit 1, the failures grouped by kind and server) when more than this share of a "
                        "rollout's samples failed after their retries (0: any failure; 1: never).")
    f.add_argument("--rollout-request-timeout", type=float, default=d.rollout_request_timeout,
                   help="Seconds a /generate attempt may go without a byte from the server before it is aborted and "
                        "retried (4 attempts per sample).")
    f.add_argument("--custom-function-traceback", action="store_true",
                   help="When --custom-tis-function-path raises, print its traceback after the one-line error.")
    f.add_argument("--no-engine-agreement-check", dest="engine_agreement_check", action="store_false",
                   help="Do not stop the run when, on its first trained step (same weights on both sides), the "
                        "engine's log-probs and the trainer's disagree beyond what their precisions explain (mean "
                        "|lp_train - lp_rollout| > 0.01 nats in fp32, 0.25 with bf16/fp16 on either side).")
    f.add_argument("--rollout-control-timeout", type=float, default=d.rollout_control_timeout,
                   help="Seconds an engine may take to answer a control call (pause, continue, flush, abort, weight-"
                        "group set-up) before the run stops naming it; a weight update gets this plus "
                        f"{WEIGHT_LOAD_S_PER_GB:.0f} s per GB it carries.")
    f.add_argument("--rollout-health-check-interval", type=float, default=d.rollout_health_check_interval,
                   help="Seconds between the health checks of every engine during a rollout (slime's flag).")
    f.add_argument("--rollout-health-check-timeout", type=float, default=d.rollout_health_check_timeout,
                   help="Seconds an engine may take to answer /health_generate (/health where it has none) before "
                        "it counts as dead (slime's flag).")

    e = parser.add_argument_group(title="rollout engines")
    e.add_argument("--rollout-engine", choices=ENGINE_KINDS, default=d.rollout_engine,
                   help="Engines the trainer starts when no --sglang-url is given. sglang (default): real SGLang "
                        "servers (installed by scripts/run.sh on CPU; a GPU machine's own sglang), sampling_seed "
                        "honoured only under SGLang's deterministic inference (not on CPU), so two runs differ. "
                        "embedded: this package's engine, bit-reproducible (the same command logs the same "
                        "metrics), for tests and runs without SGLang.")
    e.add_argument("--sglang-python", default=None,
                   help="The Python that runs the SGLang servers (default: this one if it has sglang, else "
                        ".venv-sglang/ from scripts/setup_sglang.sh).")
    e.add_argument("--rollout-num-engines", type=int, default=d.rollout_num_engines,
                   help="Engines to start (no --sglang-url); several sit behind sglang-router. Any other "
                        "--sglang-X [VALUE] flag is passed to every SGLang server as its --X [VALUE] (slime's "
                        "pass-through), e.g. --sglang-mem-fraction-static 0.5, --sglang-max-total-tokens 32768.")
    e.add_argument("--rollout-router", choices=ROUTER_CHOICES, default=d.rollout_router,
                   help="sglang-router in front of several engines: auto = when installed.")
    e.add_argument("--rollout-weight-sync", choices=WEIGHT_SYNC_MODES, default=d.rollout_weight_sync,
                   help="How new weights reach the engines: a checkpoint on disk, or a broadcast over a process "
                        "group (NCCL from a GPU to --sglang-url engines, gloo otherwise).")
    e.add_argument("--update-weight-buffer-size", type=int, default=d.update_weight_buffer_size,
                   help="Bytes per bucket of the distributed weight sync.")
    e.add_argument("--engine-dtype", choices=ENGINE_DTYPES, default=d.engine_dtype,
                   help="Dtype the engines serve in (SGLang's --dtype; bfloat16 gives a real mismatch with the fp32 "
                        "trainer, float32 about 1e-5).")
    m = parser.add_argument_group(title="Mixture of Experts (slime's routing replay)")
    m.add_argument("--use-rollout-routing-replay", action="store_true",
                   help="R3 (slime's flag): the engines return the experts they routed every token to, and every "
                        "trainer forward that computes log-probs to train on (lp_old, the reference's, each "
                        "training pass) routes with them (Megatron's RouterReplay). MoE models only; logs the "
                        "routing-mismatch metrics too.")
    m.add_argument("--use-routing-replay", action="store_true",
                   help="R2 (slime's flag): the trainer's lp_old pass records the experts its routers choose, and "
                        "the reference's and every training forward of that rollout route with them. MoE models, "
                        "decoupled mode (a recomputed lp_old) only.")
    m.add_argument("--log-routing-mismatch", action="store_true",
                   help="Ask the engines for their routes and log how often the trainer's own router differs "
                        "(diag/routing_mismatch_*) without replaying them.")
    e.add_argument("--work-dir", default=None,
                   help="Where the engines' weight files go (default: a temporary folder).")
    return parser


KNOWN_SGLANG_FLAGS = ("--sglang-url", "--sglang-python")


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


__all__ = ["KNOWN_SGLANG_FLAGS", "add_trainer_args", "split_sglang_passthrough"]
