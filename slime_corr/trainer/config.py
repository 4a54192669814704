"""The trainer's flags and the one typed, validated `TrainerConfig` they build.

Names follow the ecosystem: Megatron's for parallelism, batches, optimization and checkpoints
(`--tensor-model-parallel-size`, `--context-parallel-size`, `--pipeline-model-parallel-size`,
`--micro-batch-size`, `--global-batch-size`, `--seed`, `--lr`, `--clip-grad`, `--save`, `--save-interval`,
`--load`, `--ckpt-step`), slime's for the rollout (`--rollout-batch-size`, `--n-samples-per-prompt`,
`--num-steps-per-rollout`, `--num-rollout`, `--rollout-max-response-len`, `--rollout-temperature`,
`--disable-grpo-std-normalization`, `--update-weight-buffer-size`). slime runs the asynchronous loop as a separate
script (`train_async.py`); here it is `--async-rollout`.

Batch arithmetic (slime's): a rollout is `--rollout-batch-size` prompts × `--n-samples-per-prompt` samples, trained in
`--num-steps-per-rollout` optimizer steps of `--global-batch-size` samples (default: the rollout divided by the
steps); each DP rank trains global / DP samples per step in micro-batches of `--micro-batch-size`, or with slime's
`--use-dynamic-batch-size --max-tokens-per-gpu N` in packed (THD) micro-batches of whole GRPO groups holding up to N
tokens per GPU (as many per step on every DP rank; `--micro-batch-size` is then not used).
`--save-interval` counts rollouts (as slime's loop does); checkpoint directories are named by optimizer step
(Megatron's iteration), which `--ckpt-step` selects.

Every check runs at parse time and names the flag; the process count is `WORLD_SIZE` (torchrun's), checked against
TP × CP × PP.

Where it lives: this module holds the dataclass, its batch defaults, derived values, the checks of batches, the
rollout loop (async, π_old) and `from_args`; `config_checks` the checks of the engines, the model, PP and packing,
MoE routes, staleness and `--load` (functions of the config) with the shared choices. Each field that is a flag carries its help
(`slime_corr.fields.flag`); `slime_corr.flags.trainer` adds them to a parser (`add_trainer_args`).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field

import torch

from slime_corr.correction.proximal import PROX_LOGP_METHODS
from slime_corr.device import DEVICE_CHOICES, DEVICE_ENV, resolve
from slime_corr.engines.router import router_available
from slime_corr.errors import ConfigError, DeviceError
from slime_corr.fields import flag, flag_fields
from slime_corr.mcore.model import TinyGPTArgs
from slime_corr.mcore.nucleus import Truncation
from slime_corr.mcore.precision import PrecisionConfig
from slime_corr.models.hf_checkpoint import CheckpointError
from slime_corr.models.selection import ModelSource
from slime_corr.rollout.nucleus import DEFAULT_NUCLEUS_LOGPROBS
from slime_corr.rollout.protocol import sampling_mask_params
from slime_corr.rollout.weight_calls import WEIGHT_LOAD_S_PER_GB
from slime_corr.routed_experts import RoutedExpertsSpec
from slime_corr.trainer.config_checks import (  # noqa: F401  (the choices and defaults, importable from here too)
    CHAT_TEMPLATE_ALLOWANCE,
    DEFAULT_MICRO_BATCH_SIZE,
    DEFAULT_ROLLOUT_BATCH_SIZE,
    DEFAULT_STEPS_PER_ROLLOUT,
    ENGINE_DTYPES,
    ENGINE_KINDS,
    MOE_FLAGS,
    PARAMS_DTYPES,
    PRETRAINED_LR,
    ROUTER_CHOICES,
    SGLANG_DTYPES,
    STALENESS_POLICIES,
    TINY_MOE_LR,
    WEIGHT_SYNC_MODES,
    check_engine,
    check_load,
    check_pipeline_and_packing,
    check_precision,
    check_pretrained,
    check_routing,
    check_staleness,
    check_tiny_model,
    check_writable_dir,
    flag_name,
)
from slime_corr.trainer.task import TASKS


@dataclass(frozen=True)
class TrainerConfig:
    """What the trainer runs. Field names are the flag names with `-` replaced by `_` (`sglang_url` is a tuple)."""

    # where it computes (slime_corr.device: None = $SLIME_CORR_DEVICE, else auto) and parallelism (Megatron)
    device: str | None = flag(None, choices=DEVICE_CHOICES, help="Where the trainer and the embedded engines compute: "
                              "cuda (GPU LOCAL_RANK, NCCL), cpu (gloo), auto (cuda when torch sees a GPU). Default: "
                              f"${DEVICE_ENV}, else auto.")
    tensor_model_parallel_size: int = flag(1, help="Tensor-parallel size: the ranks that split each layer.")
    context_parallel_size: int = flag(1, help="On CPU, CP is emulated: each CP rank runs the full sequence and keeps "
                                      "its zig-zag slice.")
    pipeline_model_parallel_size: int = flag(1, help="Pipeline stages (must divide --num-layers); the loss and its "
                                             "metrics live on the last one.")
    world_size: int = 1
    # batches (slime / Megatron)
    rollout_batch_size: int | None = flag(None, help=f"Prompts per rollout (default: {DEFAULT_ROLLOUT_BATCH_SIZE}, "
                                          "rounded up to a multiple of DP).")
    n_samples_per_prompt: int = flag(8, help="GRPO group size.")
    num_steps_per_rollout: int | None = flag(None, help="Optimizer steps trained on each rollout (decoupled mode: "
                                             "lp_old is computed once, before the first). Default: the rollout / "
                                             "--global-batch-size when given, else the largest of "
                                             f"{DEFAULT_STEPS_PER_ROLLOUT}..1 that gives every DP rank whole GRPO "
                                             "groups in every step.")
    global_batch_size: int | None = flag(None, help="Samples per optimizer step (default: the rollout's samples / "
                                         "--num-steps-per-rollout).")
    micro_batch_size: int | None = flag(None, help="Samples per micro-batch (padded; not used with "
                                        "--use-dynamic-batch-size). Default: gcd(8, the samples a DP rank trains per "
                                        "step).")
    num_rollout: int = flag(16, help="Rollouts of the run.")
    # packed micro-batches (slime's dynamic batch size)
    use_dynamic_batch_size: bool = flag(False, help="Packed (THD) micro-batches of whole GRPO groups up to "
                                        "--max-tokens-per-gpu tokens (slime's flag): no padding between samples; "
                                        "every DP rank runs as many micro-batches.")
    max_tokens_per_gpu: int | None = flag(None, help="Token budget of a packed micro-batch per GPU (with CP, a "
                                          "micro-batch holds N × CP tokens).")
    # rollout
    rollout_max_response_len: int = flag(12, help="Response length cap (SGLang's max_new_tokens).")
    rollout_temperature: float = flag(1.0, help="Sampling temperature (> 0); the trainer's log-probs use the same.")
    # top-p / top-k sampling (slime's flags; the trainer takes its log-probs under the same truncation)
    rollout_top_p: float = flag(1.0, help="Nucleus sampling, in (0, 1] (1.0: off). The trainer's log-probs are taken "
                                "under the same truncated, renormalized distribution, the rollout's renormalized to "
                                "the trainer's nucleus.")
    rollout_top_k: int = flag(-1, help="Top-k sampling (-1 or 0: off), honoured by the trainer like --rollout-top-p.")
    rollout_nucleus_logprobs: int = flag(DEFAULT_NUCLEUS_LOGPROBS, metavar="N", help="Under --rollout-top-p / "
                                         "--rollout-top-k: ask the engines for their N largest log-probs per token "
                                         "(SGLang's top_logprobs_num; top-k alone, or top_k <= N, asks for top_k) "
                                         "and renormalize the rollout log-probs by the engine's own nucleus mass "
                                         "where its boundary lies within them (exact IS ratio π_old_trunc / "
                                         "μ_trunc), by the trainer's elsewhere (counted: "
                                         "rollout_corr/mismatch_nucleus_engine_share). 0: the trainer's mass always.")
    rollout_return_sampling_mask: bool = flag(False, help="Under --rollout-top-p / --rollout-top-k: ask the engines "
                                              "for the kept set of every sampled token (SGLang's "
                                              "return_sampling_mask, with its support log-probs; top-k off is sent "
                                              "as top_k 4096, the most SGLang 0.5.23 returns) and replay it in the "
                                              "trainer: lp_old, lp and the policy gradient over the engine's own "
                                              "kept set, the IS ratio exactly π_old_trunc / μ_trunc; the KL and "
                                              "entropy terms over the full distribution. Replaces "
                                              "--rollout-nucleus-logprobs. No effect without truncation.")
    async_rollout: bool = flag(False, help="Generate rollout k+1 while rollout k trains (one rollout off-policy, as "
                               "slime's train_async.py); the weights reach the engines between rollouts.")
    max_staleness: int | None = flag(None, help="With --async-rollout: the most optimizer steps between the weights "
                                     "that sampled a sample's oldest token and the step that trains it (AReaL's "
                                     "max_head_offpolicyness, Megatron-LM's --rl-generation-lag, prime-rl's "
                                     "max_off_policy_steps). The producer generates A = (K + 1) // "
                                     "--num-steps-per-rollout − 1 rollouts ahead; >= 2 × steps per rollout − 1. "
                                     "Default: one rollout ahead (2 × steps − 1).")
    staleness_policy: str | None = flag(None, choices=STALENESS_POLICIES, help="A sample older than --max-staleness "
                                        "at the step that trains it (e.g. pending in a checkpoint resumed with a "
                                        "smaller bound): drop it from the loss and its group's baseline, or "
                                        "regenerate its GRPO group with the engines' current weights. Default: drop.")
    # slime's: weight updates reach the engines mid-request (pause -> update -> continue)
    partial_rollout: bool = flag(False, help="With --async-rollout: sync the weights right after training, while the "
                                 "rollouts ahead are still generating (pause -> update -> continue; slime's flag): "
                                 "their requests continue under the new weights and each token keeps the version "
                                 "that sampled it.")
    mask_offpolicy_in_partial_rollout: bool = flag(False, help="With --partial-rollout (slime's flag): the tokens a "
                                                   "sample generated before its last weight update leave the loss.")
    max_token_staleness: int | None = flag(None, help="Per token: a response token sampled more than K optimizer "
                                           "steps before the step that trains it leaves the loss, the sample's newer "
                                           "tokens stay (partial rollouts carry tokens of several weight versions; "
                                           "--max-staleness bounds whole samples). >= --num-steps-per-rollout − 1. "
                                           "Logged as rollout/stale_masked_tokens.")
    sglang_url: tuple[str, ...] = ()
    rollout_engine: str = flag("sglang", choices=ENGINE_KINDS, help="Engines the trainer starts when no --sglang-url "
                               "is given. sglang (default): real SGLang servers (installed by scripts/run.sh on CPU; "
                               "a GPU machine's own sglang), sampling_seed honoured only under SGLang's deterministic "
                               "inference (not on CPU), so two runs differ. embedded: this package's engine, "
                               "bit-reproducible (the same command logs the same metrics), for tests and runs "
                               "without SGLang.")
    sglang_python: str | None = flag(None, help="The Python that runs the SGLang servers (default: this one if it has "
                                     "sglang, else .venv-sglang/ from scripts/setup_sglang.sh).")
    sglang_server_args: tuple[str, ...] = ()  # slime's --sglang-X pass-through, as SGLang's own --X
    rollout_num_engines: int = flag(1, help="Engines to start (no --sglang-url); several sit behind sglang-router. Any "
                                    "other --sglang-X [VALUE] flag is passed to every SGLang server as its --X [VALUE] "
                                    "(slime's pass-through), e.g. --sglang-mem-fraction-static 0.5, "
                                    "--sglang-max-total-tokens 32768.")
    rollout_router: str = flag("auto", choices=ROUTER_CHOICES, help="sglang-router in front of several engines: auto "
                               "= when installed.")
    rollout_weight_sync: str = flag("disk", choices=WEIGHT_SYNC_MODES, help="How new weights reach the engines: a "
                                    "checkpoint on disk, or a broadcast over a process group (NCCL from a GPU to "
                                    "--sglang-url engines, gloo otherwise).")
    update_weight_buffer_size: int = flag(512 * 1024**2, help="Bytes per bucket of the distributed weight sync.")
    update_weight_master_address: str | None = flag(None, metavar="ADDRESS", help="The trainer's address that the "
                                                    "engines join the distributed weight sync's group at (SGLang's "
                                                    "master_address); an address of rank 0's host that they reach. "
                                                    "Default: its address on the interface that routes to the "
                                                    "engines, else MASTER_ADDR (docs/scaling.md).")
    engine_dtype: str = flag("bfloat16", choices=ENGINE_DTYPES, help="Dtype the engines serve in (SGLang's --dtype; "
                             "bfloat16 gives a real mismatch with the fp32 trainer, float32 about 1e-5).")
    # failures and bounded waits
    max_failed_sample_fraction: float = flag(0.5, help="Stop the run (exit 1, the failures grouped by kind and "
                                             "server) when more than this share of a rollout's samples failed after "
                                             "their retries (0: any failure; 1: never).")
    rollout_request_timeout: float = flag(60.0, help="Seconds a /generate attempt may go without a byte from the "
                                          "server before it is aborted and retried (4 attempts per sample).")
    rollout_control_timeout: float = flag(60.0, help="Seconds an engine may take to answer a control call (pause, "
                                          "continue, flush, abort, weight-group set-up) before the run stops naming "
                                          f"it; a weight update gets this plus {WEIGHT_LOAD_S_PER_GB:.0f} s per GB it "
                                          "carries.")
    # the first trained step's engine-trainer agreement (trainer.agreement)
    engine_agreement_check: bool = flag(True, option="--no-engine-agreement-check", help="Do not stop the run when, on "
                                        "its first trained step (same weights on both sides), the engine's log-probs "
                                        "and the trainer's disagree beyond what their precisions explain (mean "
                                        "|lp_train - lp_rollout| > 0.01 nats in fp32, 0.25 with bf16/fp16 on either "
                                        "side).")
    rollout_health_check_interval: float = flag(30.0, help="Seconds between the health checks of every engine during "
                                                "a rollout (slime's flag).")
    rollout_health_check_timeout: float = flag(30.0, help="Seconds an engine may take to answer /health_generate "
                                               "(/health where it has none) before it counts as dead (slime's flag).")
    distributed_timeout_minutes: float = flag(10.0, help="How long a rank waits on the others (a collective, or the "
                                              "driver's rollout with no sign of life from it) before the job stops "
                                              "with an error (Megatron's flag; fractions allowed).")
    # decoupled mode's π_old (AReaL's names): the forward-only recompute, or the log-linear approximation
    prox_logp_method: str = flag("recompute", choices=PROX_LOGP_METHODS, help="recompute: a forward-only pass before "
                                 "each rollout's first update (exact); loglinear: AReaL's log-linear interpolation "
                                 "between the behaviour and the current log-prob by weight version (no pass; exact at "
                                 "a rollout's first step).")
    prox_logp_error_interval: int = flag(10, help="With loglinear: every N rollouts also recompute lp_old and log "
                                         "train/prox_logp_abs_error_mean and _max of the approximation against it (0: "
                                         "never).")
    # optimization
    lr: float = 1e-2  # the tiny model's; the flag's default is None (`from_args`: the model's default)
    clip_grad: float = flag(1.0, help="Gradient clipping by global L2 norm (0: off).")
    seed: int = 1234  # the flag is the model's (`TinyGPTArgs.seed`)
    grpo_std_normalization: bool = flag(True, option="--disable-grpo-std-normalization", help="GRPO advantage = "
                                        "reward − group mean, without dividing by the group's std (Dr. GRPO).")
    params_dtype: str = flag("float32", choices=PARAMS_DTYPES, help="Dtype of the trained model (float64 makes runs "
                             "comparable across parallel layouts; --bf16 / --fp16 train in 16 bits).")
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)  # --bf16 / --fp16 and the loss scaling
    # checkpoints
    save: str | None = flag(None, help="Checkpoint directory (Megatron-LM's layout, dist_checkpointing).")
    save_interval: int | None = flag(None, help="Save every N rollouts (and after the last).")
    load: str | None = flag(None, help="Resume from this checkpoint directory (model, optimizer, step, RNG, rollout "
                            "position).")
    ckpt_step: int | None = flag(None, help="Load this iteration of --load (default: latest).")
    work_dir: str | None = flag(None, help="Where the engines' weight files go (default: a temporary folder); for "
                                "engines on other hosts loading them from disk, a folder on storage they see at the "
                                "same path.")
    # the model: the tiny GPT of `model`, or a pretrained one (`--model` / `--hf-checkpoint`)
    model: TinyGPTArgs = field(default_factory=lambda: TinyGPTArgs(vocab_size=256))
    model_source: ModelSource = field(default_factory=ModelSource)
    task: str = "lowercase"  # the flag's default is None (`from_args`: the model's default)
    # Mixture of Experts (slime's --use-rollout-routing-replay, R3, and --use-routing-replay, R2;
    # --log-routing-mismatch is slime_corr's)
    use_rollout_routing_replay: bool = flag(False, help="R3 (slime's flag): the engines return the experts they routed "
                                            "every token to, and every trainer forward that computes log-probs to "
                                            "train on (lp_old, the reference's, each training pass) routes with them "
                                            "(Megatron's RouterReplay; in Megatron-LM's own loop the routes come as "
                                            "batch['routed_experts'] and it needs --moe-enable-routing-replay). MoE "
                                            "models only; logs the routing-mismatch metrics too.")
    log_routing_mismatch: bool = flag(False, help="Ask the engines for their routes and log how often the trainer's "
                                      "own router differs (diag/routing_mismatch_*; routing_mismatch_* in "
                                      "Megatron-LM's loss dict) without replaying them.")
    use_routing_replay: bool = flag(False, help="R2 (slime's flag): the trainer's lp_old pass records the experts its "
                                    "routers choose, and the reference's and every training forward of that rollout "
                                    "route with them. MoE models, decoupled mode (a recomputed lp_old) only.")

    def __post_init__(self) -> None:
        self._derive_batch_defaults()
        object.__setattr__(self, "sglang_url", tuple(self.sglang_url))
        object.__setattr__(self, "sglang_server_args", tuple(self.sglang_server_args))
        self._validate()

    def _derive_batch_defaults(self) -> None:
        """Defaults valid at any DP size (each DP rank then trains what one process trains by default):
        `--rollout-batch-size` 4 rounded up to a multiple of DP; `--num-steps-per-rollout` the rollout's samples /
        `--global-batch-size` when that is given, else the largest of 4, 3, 2, 1 that leaves every DP rank whole
        groups in every step; `--global-batch-size` the rollout / the steps; `--micro-batch-size` gcd(8, the
        samples a DP rank trains per step). Explicit values are kept (and checked by `_validate`)."""
        mp = self.tensor_model_parallel_size * self.context_parallel_size * self.pipeline_model_parallel_size
        dp = max(1, self.world_size // mp) if isinstance(mp, int) and mp > 0 else 1
        def put(name: str, value: int) -> None:
            object.__setattr__(self, name, value)
        if self.rollout_batch_size is None:
            put("rollout_batch_size", -(-DEFAULT_ROLLOUT_BATCH_SIZE // dp) * dp)
        rbs, n = self.rollout_batch_size, self.n_samples_per_prompt
        if not (isinstance(rbs, int) and isinstance(n, int) and rbs > 0 and n > 0):
            return  # `_validate` names the flag
        if self.num_steps_per_rollout is None:
            gbs = self.global_batch_size
            if isinstance(gbs, int) and gbs > 0:
                if (rbs * n) % gbs:
                    raise ConfigError(f"--global-batch-size {gbs} must divide the rollout's {rbs * n} samples "
                                      f"(--rollout-batch-size {rbs} × --n-samples-per-prompt {n}): each optimizer "
                                      "step trains the same number of samples.")
                put("num_steps_per_rollout", rbs * n // gbs)
            else:
                groups = rbs // dp if rbs % dp == 0 else rbs
                put("num_steps_per_rollout", max(s for s in range(1, DEFAULT_STEPS_PER_ROLLOUT + 1) if groups % s == 0))
        steps = self.num_steps_per_rollout
        if self.global_batch_size is None and isinstance(steps, int) and steps > 0:
            put("global_batch_size", rbs * n // steps)
        gbs = self.global_batch_size
        if self.micro_batch_size is None:
            per_rank = gbs // dp if isinstance(gbs, int) and gbs > 0 else DEFAULT_MICRO_BATCH_SIZE
            put("micro_batch_size", math.gcd(DEFAULT_MICRO_BATCH_SIZE, per_rank) or DEFAULT_MICRO_BATCH_SIZE)

    # ------------------------------------------------------------------ derived values
    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.context_parallel_size
                                   * self.pipeline_model_parallel_size)

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def samples_per_rank_step(self) -> int:
        """Samples one DP rank trains per optimizer step."""
        return self.global_batch_size // self.data_parallel_size  # type: ignore[operator]

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step on each DP rank."""
        return self.samples_per_rank_step // self.micro_batch_size

    @property
    def micro_batching(self) -> str:
        """How the micro-batches are made, in words."""
        if self.use_dynamic_batch_size:
            return f"packed, up to {self.max_tokens_per_gpu} tokens per GPU"
        return f"{self.micro_batch_size} samples, padded"

    @property
    def truncation(self) -> Truncation:
        """The rollout's top-p / top-k (sent to the engines, honoured by the trainer's log-probs). With
        --rollout-return-sampling-mask and top-k off, the top_k the engines are sent for the mask
        (`rollout.protocol.sampling_mask_params`)."""
        truncation = Truncation(top_p=self.rollout_top_p, top_k=self.rollout_top_k)
        if self.rollout_return_sampling_mask and truncation.active:
            return Truncation(**sampling_mask_params(truncation.sampling_params()))
        return truncation

    @property
    def replays_kept_sets(self) -> bool:
        """The rollout asks for the engine's kept sets and the trainer replays them (--rollout-return-sampling-mask
        under top-p / top-k)."""
        return self.rollout_return_sampling_mask and self.truncation.active

    @property
    def sequence_parallel_size(self) -> int:
        """The TP size when the model runs with sequence parallelism (an MoE model at TP > 1, as Megatron requires:
        `models.bridge`), else 1: micro-batch rows are padded to a multiple of it."""
        tp = self.tensor_model_parallel_size
        if tp > 1 and self.model_source.is_pretrained and self.model_source.spec().is_moe:
            return tp
        return 1

    @property
    def replays_routes(self) -> bool:
        """The trainer's forwards replay routes: the engines' (R3) or its own lp_old pass's (R2)."""
        return self.use_rollout_routing_replay or self.use_routing_replay

    @property
    def asks_routes(self) -> bool:
        """The rollout asks the engines for the routed experts (replay, or the routing-mismatch metrics)."""
        return self.use_rollout_routing_replay or self.log_routing_mismatch

    def routed_experts_spec(self) -> RoutedExpertsSpec | None:
        """The MoE shape the engines' routes are checked against (None when no routes are asked for)."""

        if not self.asks_routes:
            return None
        spec = self.model_source.spec()
        assert spec is not None and spec.is_moe
        return RoutedExpertsSpec(spec.num_layers, spec.num_experts_per_tok, spec.num_experts)

    @property
    def torch_params_dtype(self) -> torch.dtype:
        return getattr(torch, self.params_dtype)

    @property
    def trainer_dtype(self) -> str:
        """What the trained model computes in: bfloat16 / float16 under --bf16 / --fp16, else --params-dtype."""
        return self.precision.dtype_name or self.params_dtype

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        def fail(msg: str) -> None:
            raise ConfigError(msg)

        if self.device is not None:  # the device module owns the rule (cuda needs a GPU); $SLIME_CORR_DEVICE: from_args
            try:
                resolve(self.device)
            except DeviceError as e:
                fail(str(e))
        positive = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
                    "rollout_batch_size", "n_samples_per_prompt", "num_steps_per_rollout", "micro_batch_size",
                    "num_rollout", "rollout_max_response_len", "rollout_num_engines", "update_weight_buffer_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                fail(f"--{flag_name(name)} {value} must be an integer >= 1.")
        if not (math.isfinite(self.rollout_temperature) and self.rollout_temperature > 0):
            fail(f"--rollout-temperature {self.rollout_temperature} must be > 0: temperature 0 is greedy decoding, "
                 "not a policy to train (the log-probs are log_softmax(logits / T)); e.g. 1.0.")
        n = self.rollout_nucleus_logprobs
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            fail(f"--rollout-nucleus-logprobs {n} must be an integer >= 0 (0: the trainer's nucleus mass only).")
        try:  # top-p / top-k: the one owner of their checks is the truncation the hook takes
            object.__setattr__(self, "rollout_top_k", Truncation(self.rollout_top_p, self.rollout_top_k).top_k)
        except ValueError as e:
            fail(str(e))
        if not (math.isfinite(self.lr) and self.lr > 0):
            fail(f"--lr {self.lr} must be a finite number > 0 (e.g. 1e-2 for the tiny model, 1e-6 for an LLM).")
        if not (math.isfinite(self.clip_grad) and self.clip_grad >= 0):
            fail(f"--clip-grad {self.clip_grad} must be >= 0 (0 turns clipping off).")
        if self.n_samples_per_prompt < 2:
            fail(f"--n-samples-per-prompt {self.n_samples_per_prompt}: GRPO's advantage (reward − group mean) is 0 "
                 "for every sample of a group of one; use >= 2.")
        model_parallel = (self.tensor_model_parallel_size * self.context_parallel_size
                          * self.pipeline_model_parallel_size)
        if self.world_size % model_parallel:
            fail(f"{self.world_size} processes (WORLD_SIZE) are not a multiple of --tensor-model-parallel-size "
                 f"{self.tensor_model_parallel_size} × --context-parallel-size {self.context_parallel_size} × "
                 f"--pipeline-model-parallel-size {self.pipeline_model_parallel_size}: launch TP × CP × PP × DP "
                 "processes (torchrun --nproc-per-node).")
        dp = self.data_parallel_size
        gbs = self.global_batch_size
        if not isinstance(gbs, int) or gbs < 1:
            fail(f"--global-batch-size {gbs} must be an integer >= 1.")
        assert isinstance(gbs, int)
        if gbs * self.num_steps_per_rollout != self.samples_per_rollout:
            fail(f"--global-batch-size {gbs} × --num-steps-per-rollout {self.num_steps_per_rollout} must equal the "
                 f"rollout's {self.samples_per_rollout} samples (--rollout-batch-size {self.rollout_batch_size} × "
                 f"--n-samples-per-prompt {self.n_samples_per_prompt}); drop one of the two flags.")
        if gbs % (self.n_samples_per_prompt * dp):
            fail(f"--global-batch-size {gbs} must be a multiple of --n-samples-per-prompt {self.n_samples_per_prompt} "
                 f"× {dp} data-parallel rank(s): every DP rank trains whole GRPO groups in each step.")
        if not self.use_dynamic_batch_size and self.samples_per_rank_step % self.micro_batch_size:
            fail(f"--micro-batch-size {self.micro_batch_size} must divide the {self.samples_per_rank_step} samples "
                 f"each of the {dp} data-parallel rank(s) trains per step (--global-batch-size {gbs} / DP).")
        for name, choices in (("rollout_router", ROUTER_CHOICES), ("rollout_weight_sync", WEIGHT_SYNC_MODES),
                              ("engine_dtype", ENGINE_DTYPES), ("params_dtype", PARAMS_DTYPES)):
            if getattr(self, name) not in choices:
                fail(f"--{flag_name(name)} {getattr(self, name)!r} is not one of {', '.join(choices)}.")
        if self.rollout_router == "on" and not self.sglang_url and not router_available():
            fail("--rollout-router on: sglang-router is not installed here (pip install sglang-router); use "
                 "--rollout-router auto (a router when it is installed) or off (the client balances the engines).")
        if not (isinstance(self.max_failed_sample_fraction, int | float)
                and 0.0 <= self.max_failed_sample_fraction <= 1.0):
            fail(f"--max-failed-sample-fraction {self.max_failed_sample_fraction} must be in [0, 1]: the share of a "
                 "rollout's samples that may fail before the run stops (0: any failure stops it; 1: never stops).")
        for name in ("rollout_request_timeout", "rollout_control_timeout", "rollout_health_check_interval",
                     "rollout_health_check_timeout", "distributed_timeout_minutes"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                fail(f"--{flag_name(name)} {value} must be a finite number > 0.")
        for name in ("save", "work_dir"):
            if getattr(self, name):
                check_writable_dir(f"--{flag_name(name)}", getattr(self, name))
        if self.sglang_url and self.rollout_num_engines != 1:
            fail("--rollout-num-engines starts engines; with --sglang-url the engines are yours: drop one.")
        check_engine(self)
        check_precision(self)
        if self.task not in TASKS:
            fail(f"--task {self.task!r} is not one of {', '.join(TASKS)}.")
        if self.model_source.is_pretrained:
            check_pretrained(self)
        else:
            check_tiny_model(self)
        check_pipeline_and_packing(self)
        check_routing(self)
        if self.save_interval is not None:
            if self.save_interval < 1:
                fail(f"--save-interval {self.save_interval} must be >= 1 (rollouts between checkpoints).")
            if not self.save:
                fail("--save-interval needs --save DIR (where the checkpoints go).")
        check_staleness(self)
        if self.prox_logp_method not in PROX_LOGP_METHODS:
            fail(f"--prox-logp-method {self.prox_logp_method!r} is not one of {', '.join(PROX_LOGP_METHODS)}.")
        if not isinstance(self.prox_logp_error_interval, int) or self.prox_logp_error_interval < 0:
            fail(f"--prox-logp-error-interval {self.prox_logp_error_interval} must be an integer >= 0 (rollouts; 0: "
                 "never).")
        if self.ckpt_step is not None and not self.load:
            fail("--ckpt-step selects a checkpoint of --load DIR: add --load.")
        if self.load:
            check_load(self)

    @property
    def staleness_bound(self) -> int:
        """The bound in optimizer steps (`--max-staleness`; default with --async-rollout: one rollout ahead,
        2·S − 1 for S steps per rollout; synchronous: S − 1)."""
        steps = self.num_steps_per_rollout
        assert isinstance(steps, int)
        if self.max_staleness is not None:
            return self.max_staleness
        return 2 * steps - 1 if self.async_rollout else steps - 1

    @property
    def rollouts_ahead(self) -> int:
        """How many rollouts the producer generates ahead of the one training: the most A with
        (A + 1)·S − 1 <= the bound (a rollout generated A rollouts ahead is trained from A·S to (A + 1)·S − 1
        steps after its weights); 0 when synchronous."""
        steps = self.num_steps_per_rollout
        assert isinstance(steps, int)
        return (self.staleness_bound + 1) // steps - 1 if self.async_rollout else 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_args(cls, args: argparse.Namespace, *, world_size: int | None = None) -> TrainerConfig:
        """From parsed flags (`slime_corr.flags.trainer`, `slime_corr.flags.model`); `world_size`
        defaults to WORLD_SIZE. `--task` and `--lr` default to the model's: lowercase and 1e-2 for the tiny one,
        arithmetic and PRETRAINED_LR for a pretrained one."""
        names = [f for f in cls.__dataclass_fields__ if f not in ("world_size", "model", "sglang_url", "model_source",
                                                                  "task", "lr", "sglang_server_args", "device",
                                                                  "precision", *MOE_FLAGS)]
        values = {n: getattr(args, n) for n in names}
        values.update({n: bool(getattr(args, n, False)) for n in MOE_FLAGS})
        model = TinyGPTArgs(num_layers=args.num_layers, hidden_size=args.hidden_size,
                            num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                            max_position_embeddings=args.max_position_embeddings, seed=args.seed,
                            params_dtype=getattr(torch, args.params_dtype))
        world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        try:
            source = ModelSource.from_args(args)
        except CheckpointError as e:
            raise ConfigError(str(e)) from None
        text_model = source.is_pretrained and not source.byte_tokens
        task = args.task or ("arithmetic" if text_model else "lowercase")
        try:  # the flag, else $SLIME_CORR_DEVICE: checked at parse time too
            resolve(getattr(args, "device", None))
        except DeviceError as e:
            raise ConfigError(str(e)) from None
        lr = args.lr if args.lr is not None else PRETRAINED_LR if text_model else \
            TINY_MOE_LR if source.byte_tokens else cls.lr
        precision = PrecisionConfig(**{n: getattr(args, n) for n in flag_fields(PrecisionConfig) if hasattr(args, n)})
        return cls(**values, device=getattr(args, "device", None), world_size=world, precision=precision,
                   sglang_url=tuple(args.sglang_url or ()), model=model,
                   model_source=source, task=task, lr=lr,
                   sglang_server_args=tuple(getattr(args, "sglang_server_args", None) or ()))


__all__ = ["TrainerConfig", "check_writable_dir"]
