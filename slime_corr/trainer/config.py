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
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from slime_corr.config import ConfigError
from slime_corr.correction.proximal import PROX_LOGP_METHODS
from slime_corr.mcore.model import TinyGPTArgs
from slime_corr.mcore.nucleus import Truncation
from slime_corr.models.hf_checkpoint import CheckpointError, check_tensor_parallel
from slime_corr.models.selection import ModelSource
from slime_corr.trainer.task import TASKS

ENGINE_KINDS = ("sglang", "embedded")  # slime_corr.engines.launch.ENGINE_KINDS (not imported: no engine code here)
SGLANG_DTYPES = ("bfloat16", "float32")
WEIGHT_SYNC_MODES = ("disk", "distributed")
ROUTER_CHOICES = ("auto", "on", "off")
STALENESS_POLICIES = ("drop", "regenerate")
ENGINE_DTYPES = ("bfloat16", "float32", "float64")
PARAMS_DTYPES = ("float32", "float64")
MOE_FLAGS = ("use_rollout_routing_replay", "log_routing_mismatch")
TINY_MOE_LR = 1e-3  # --lr's default with --model tiny-moe
PRETRAINED_LR = 1e-5  # --lr's default with a pretrained model (the tiny model's, 1e-2, would wreck it at once)
CHAT_TEMPLATE_ALLOWANCE = 128  # tokens a chat template may add around the user message (system prompt, headers)
DEFAULT_ROLLOUT_BATCH_SIZE, DEFAULT_STEPS_PER_ROLLOUT, DEFAULT_MICRO_BATCH_SIZE = 4, 4, 8


@dataclass(frozen=True)
class TrainerConfig:
    """What the trainer runs. Field names are the flag names with `-` replaced by `_` (`sglang_url` is a tuple)."""

    # parallelism (Megatron)
    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    world_size: int = 1
    # batches (slime / Megatron)
    rollout_batch_size: int | None = None  # default: DEFAULT_ROLLOUT_BATCH_SIZE rounded up to a multiple of DP
    n_samples_per_prompt: int = 8
    num_steps_per_rollout: int | None = None  # default: see `_derive_batch_defaults`
    global_batch_size: int | None = None
    micro_batch_size: int | None = None  # default: gcd(DEFAULT_MICRO_BATCH_SIZE, samples per DP rank and step)
    num_rollout: int = 16
    # packed micro-batches (slime's dynamic batch size)
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = None
    # rollout
    rollout_max_response_len: int = 12
    rollout_temperature: float = 1.0
    # top-p / top-k sampling (slime's flags; the trainer takes its log-probs under the same truncation)
    rollout_top_p: float = 1.0
    rollout_top_k: int = -1
    async_rollout: bool = False
    max_staleness: int | None = None  # optimizer steps; default with --async-rollout: 2·num_steps_per_rollout − 1
    staleness_policy: str | None = None  # default: "drop"
    partial_rollout: bool = False  # slime's: weight updates reach the engines mid-request (pause -> update -> continue)
    mask_offpolicy_in_partial_rollout: bool = False  # slime's: tokens before a sample's last update leave the loss
    sglang_url: tuple[str, ...] = ()
    rollout_engine: str = "sglang"
    sglang_python: str | None = None
    sglang_server_args: tuple[str, ...] = ()  # slime's --sglang-X pass-through, as SGLang's own --X
    rollout_num_engines: int = 1
    rollout_router: str = "auto"
    rollout_weight_sync: str = "disk"
    update_weight_buffer_size: int = 512 * 1024**2
    engine_dtype: str = "bfloat16"
    # failures and bounded waits
    max_failed_sample_fraction: float = 0.5
    rollout_request_timeout: float = 60.0
    rollout_health_check_interval: float = 30.0
    rollout_health_check_timeout: float = 30.0
    distributed_timeout_minutes: float = 10.0
    # decoupled mode's π_old (AReaL's names): the forward-only recompute, or the log-linear approximation
    prox_logp_method: str = "recompute"
    prox_logp_error_interval: int = 10  # loglinear: recompute too every N rollouts and log the error (0: never)
    # optimization
    lr: float = 1e-2
    clip_grad: float = 1.0
    seed: int = 1234
    grpo_std_normalization: bool = True
    params_dtype: str = "float32"
    # checkpoints
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    ckpt_step: int | None = None
    work_dir: str | None = None
    # the model: the tiny GPT of `model`, or a pretrained one (`--model` / `--hf-checkpoint`)
    model: TinyGPTArgs = field(default_factory=lambda: TinyGPTArgs(vocab_size=256))
    model_source: ModelSource = field(default_factory=ModelSource)
    task: str = "lowercase"
    # Mixture of Experts (slime's --use-rollout-routing-replay; --log-routing-mismatch is slime_corr's)
    use_rollout_routing_replay: bool = False
    log_routing_mismatch: bool = False

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
        """The rollout's top-p / top-k (sent to the engines, honoured by the trainer's log-probs)."""
        return Truncation(top_p=self.rollout_top_p, top_k=self.rollout_top_k)

    @property
    def asks_routes(self) -> bool:
        """The rollout asks the engines for the routed experts (replay, or the routing-mismatch metrics)."""
        return self.use_rollout_routing_replay or self.log_routing_mismatch

    def routed_experts_spec(self):  # -> slime_corr.rollout.routing.RoutedExpertsSpec | None
        """The MoE shape the engines' routes are checked against (None when no routes are asked for)."""
        from slime_corr.rollout.routing import RoutedExpertsSpec

        if not self.asks_routes:
            return None
        spec = self.model_source.spec()
        assert spec is not None and spec.is_moe
        return RoutedExpertsSpec(spec.num_layers, spec.num_experts_per_tok, spec.num_experts)

    @property
    def torch_params_dtype(self) -> torch.dtype:
        return getattr(torch, self.params_dtype)

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        def fail(msg: str) -> None:
            raise ConfigError(msg)

        positive = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
                    "rollout_batch_size", "n_samples_per_prompt", "num_steps_per_rollout", "micro_batch_size",
                    "num_rollout", "rollout_max_response_len", "rollout_num_engines", "update_weight_buffer_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                fail(f"--{_flag(name)} {value} must be an integer >= 1.")
        if not (math.isfinite(self.rollout_temperature) and self.rollout_temperature > 0):
            fail(f"--rollout-temperature {self.rollout_temperature} must be > 0: temperature 0 is greedy decoding, "
                 "not a policy to train (the log-probs are log_softmax(logits / T)); e.g. 1.0.")
        try:  # top-p / top-k: the one owner of their checks is the truncation the hook takes
            object.__setattr__(self, "rollout_top_k", self.truncation.top_k)
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
                fail(f"--{_flag(name)} {getattr(self, name)!r} is not one of {', '.join(choices)}.")
        if not (isinstance(self.max_failed_sample_fraction, int | float)
                and 0.0 <= self.max_failed_sample_fraction <= 1.0):
            fail(f"--max-failed-sample-fraction {self.max_failed_sample_fraction} must be in [0, 1]: the share of a "
                 "rollout's samples that may fail before the run stops (0: any failure stops it; 1: never stops).")
        for name in ("rollout_request_timeout", "rollout_health_check_interval", "rollout_health_check_timeout",
                     "distributed_timeout_minutes"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                fail(f"--{_flag(name)} {value} must be a finite number > 0.")
        for name in ("save", "work_dir"):
            if getattr(self, name):
                check_writable_dir(f"--{_flag(name)}", getattr(self, name))
        if self.sglang_url and self.rollout_num_engines != 1:
            fail("--rollout-num-engines starts engines; with --sglang-url the engines are yours: drop one.")
        self._check_engine()
        if self.task not in TASKS:
            fail(f"--task {self.task!r} is not one of {', '.join(TASKS)}.")
        if self.model_source.is_pretrained:
            self._check_pretrained()
        else:
            self._check_tiny_model()
        self._check_pipeline_and_packing()
        self._check_routing()
        if self.save_interval is not None:
            if self.save_interval < 1:
                fail(f"--save-interval {self.save_interval} must be >= 1 (rollouts between checkpoints).")
            if not self.save:
                fail("--save-interval needs --save DIR (where the checkpoints go).")
        self._check_staleness()
        if self.prox_logp_method not in PROX_LOGP_METHODS:
            fail(f"--prox-logp-method {self.prox_logp_method!r} is not one of {', '.join(PROX_LOGP_METHODS)}.")
        if not isinstance(self.prox_logp_error_interval, int) or self.prox_logp_error_interval < 0:
            fail(f"--prox-logp-error-interval {self.prox_logp_error_interval} must be an integer >= 0 (rollouts; 0: "
                 "never).")
        if self.ckpt_step is not None and not self.load:
            fail("--ckpt-step selects a checkpoint of --load DIR: add --load.")
        if self.load:
            self._check_load()

    def _check_staleness(self) -> None:
        k, steps = self.max_staleness, self.num_steps_per_rollout
        if self.partial_rollout and not self.async_rollout:
            raise ConfigError("--partial-rollout: updates the weights while rollouts are in flight, but a synchronous "
                              "run has none in flight at a sync: add --async-rollout.")
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise ConfigError("--mask-offpolicy-in-partial-rollout masks the tokens a sample generated before a "
                              "weight update reached it mid-request, which only --partial-rollout makes: add it.")
        if not self.async_rollout:
            for name in ("max_staleness", "staleness_policy"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"--{_flag(name)} {getattr(self, name)}: bounds the asynchronous rollout "
                                      "producer, but the run is synchronous (every sample is at most "
                                      "--num-steps-per-rollout − 1 steps old): add --async-rollout or drop it.")
        if self.staleness_policy is not None and self.staleness_policy not in STALENESS_POLICIES:
            raise ConfigError(f"--staleness-policy {self.staleness_policy!r} is not one of "
                              f"{', '.join(STALENESS_POLICIES)}.")
        if k is None:
            return
        if not isinstance(k, int) or k < 0:
            raise ConfigError(f"--max-staleness {k} must be an integer >= 0 (optimizer steps).")
        if k < 2 * steps - 1:
            raise ConfigError(f"--max-staleness {k}: with --num-steps-per-rollout {steps}, a rollout generated one "
                              f"rollout ahead is trained up to {2 * steps - 1} optimizer steps after the weights that "
                              f"sampled it (A rollouts ahead: (A + 1) × {steps} − 1); use --max-staleness >= "
                              f"{2 * steps - 1}, fewer steps per rollout, or drop --async-rollout.")

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

    def _check_engine(self) -> None:
        if self.rollout_engine not in ENGINE_KINDS:
            raise ConfigError(f"--rollout-engine {self.rollout_engine!r} is not one of {', '.join(ENGINE_KINDS)}.")
        launched = not self.sglang_url and self.rollout_engine == "sglang"
        passthrough = " ".join(self.sglang_server_args)
        if self.sglang_url and (self.sglang_server_args or self.sglang_python):
            what = passthrough or f"--sglang-python {self.sglang_python}"
            raise ConfigError(f"{what}: these configure the SGLang servers the trainer launches; with --sglang-url "
                              "the servers are yours (give them their flags when you start them): drop one.")
        if not self.sglang_url and self.rollout_engine == "embedded" and (self.sglang_server_args
                                                                           or self.sglang_python):
            what = passthrough or f"--sglang-python {self.sglang_python}"
            raise ConfigError(f"{what}: SGLang server flags, but --rollout-engine embedded starts no SGLang server; "
                              "use --rollout-engine sglang, or drop them.")
        if launched and self.engine_dtype not in SGLANG_DTYPES:
            raise ConfigError(f"--engine-dtype {self.engine_dtype}: the SGLang server serves "
                              f"{' or '.join(SGLANG_DTYPES)}; use --rollout-engine embedded for {self.engine_dtype}.")

    def _check_tiny_model(self) -> None:
        m = self.model
        for name in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"):
            value = getattr(m, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{_flag(name)} {value} must be an integer >= 1.")
        if m.hidden_size % m.num_attention_heads:
            raise ConfigError(f"--hidden-size {m.hidden_size} must be a multiple of --num-attention-heads "
                              f"{m.num_attention_heads}.")
        if m.vocab_size < 256:
            raise ConfigError(f"--vocab-size {m.vocab_size} must be >= 256: prompts, responses and rewards are byte "
                              "tokens.")
        if m.vocab_size % self.tensor_model_parallel_size or m.num_attention_heads % self.tensor_model_parallel_size:
            raise ConfigError(f"--tensor-model-parallel-size {self.tensor_model_parallel_size} must divide "
                              f"--vocab-size {m.vocab_size} and --num-attention-heads {m.num_attention_heads}.")
        longest = TASKS[self.task].max_prompt_chars + self.rollout_max_response_len + 2 * self.context_parallel_size
        if longest > m.max_position_embeddings:
            raise ConfigError(f"--rollout-max-response-len {self.rollout_max_response_len}: prompt + response (+ CP "
                              f"padding) reach {longest} tokens, more than --max-position-embeddings "
                              f"{m.max_position_embeddings}.")

    def _check_pretrained(self) -> None:
        """The checkpoint's heads, KV groups, FFN and vocabulary divide over TP; prompts (with a chat template's
        allowance) and responses fit its positions; the task reads text. Resolves the model (a shipped one is
        dequantized into the cache on first use)."""
        task = TASKS[self.task]
        if task.byte_tokens_only and not self.model_source.byte_tokens:
            raise ConfigError(f"--task {self.task} scores byte tokens (the tiny model's task); a pretrained model "
                              f"has its own tokenizer: choose one of "
                              f"{', '.join(n for n, t in TASKS.items() if not t.byte_tokens_only)}.")
        spec = self.model_source.spec()
        assert spec is not None
        try:
            check_tensor_parallel(spec, self.tensor_model_parallel_size)
        except CheckpointError as e:
            raise ConfigError(str(e)) from None
        if spec.is_moe and self.tensor_model_parallel_size > 1:
            raise ConfigError(f"--tensor-model-parallel-size {self.tensor_model_parallel_size}: training a Mixture-of-"
                              f"Experts model ({spec.path}) with TP > 1 needs Megatron's sequence parallelism, whose "
                              "norms need TransformerEngine or apex (absent on CPU); use TP=1 with CP or DP.")
        longest = CHAT_TEMPLATE_ALLOWANCE + task.max_prompt_chars + self.rollout_max_response_len
        if longest > spec.max_position_embeddings:
            raise ConfigError(f"--rollout-max-response-len {self.rollout_max_response_len}: prompt (with up to "
                              f"{CHAT_TEMPLATE_ALLOWANCE} tokens of chat template) + response reach {longest} tokens, "
                              f"more than the model's max_position_embeddings {spec.max_position_embeddings}.")

    def _check_pipeline_and_packing(self) -> None:
        from slime_corr.rollout.batching import packed_length

        pp, layers = self.pipeline_model_parallel_size, self.model.num_layers
        if self.model_source.is_pretrained and (pp > 1 or self.use_dynamic_batch_size):
            flag = f"--pipeline-model-parallel-size {pp}" if pp > 1 else "--use-dynamic-batch-size"
            raise ConfigError(f"{flag}: not supported yet with a pretrained model (--model / --hf-checkpoint): its "
                              "Megatron model is built unsplit and its RoPE needs Megatron's THD attention for packed "
                              "rows; use tensor, context or data parallelism with padded micro-batches.")
        if layers % pp:
            raise ConfigError(f"--pipeline-model-parallel-size {pp} must divide --num-layers {layers}: every "
                              "pipeline stage holds the same number of layers.")
        budget = self.max_tokens_per_gpu
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise ConfigError(f"--max-tokens-per-gpu {budget} must be an integer >= 1.")
        if self.use_dynamic_batch_size and budget is None:
            raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu N: the tokens a packed "
                              "micro-batch may hold per GPU.")
        if budget is not None and not self.use_dynamic_batch_size:
            raise ConfigError(f"--max-tokens-per-gpu {budget} only applies to packed micro-batches: add "
                              "--use-dynamic-batch-size, or drop --max-tokens-per-gpu.")
        if budget is not None:
            cp = self.context_parallel_size
            prompt = TASKS[self.task].max_prompt_chars  # byte tokens (the tiny model; a pretrained one is refused above)
            group = self.n_samples_per_prompt * packed_length(prompt + self.rollout_max_response_len, cp)
            if budget * cp < group:
                raise ConfigError(
                    f"--max-tokens-per-gpu {budget}: a GRPO group (--n-samples-per-prompt {self.n_samples_per_prompt}"
                    f" samples of up to {prompt} prompt + --rollout-max-response-len "
                    f"{self.rollout_max_response_len} tokens) can take {group} tokens, {-(-group // cp)} per GPU "
                    f"under --context-parallel-size {cp}, and a group is never split across micro-batches: use "
                    f"--max-tokens-per-gpu >= {-(-group // cp)}.")

    def _check_routing(self) -> None:
        """Routes need an MoE model and an engine that returns them (the real SGLang server); replay is done on the
        whole model (no PP: refused for bridge models anyway) and packed rows are refused for bridge models."""
        if not self.asks_routes:
            return
        flag = "--use-rollout-routing-replay" if self.use_rollout_routing_replay else "--log-routing-mismatch"
        spec = self.model_source.spec() if self.model_source.is_pretrained else None
        if spec is None or not spec.is_moe:
            what = f"{spec.model_type} at {spec.path}" if spec is not None else "the built-in tiny GPT"
            raise ConfigError(f"{flag}: the model is dense ({what}): routing replay and routing mismatch need a "
                              "Mixture-of-Experts model, e.g. --model tiny-moe or --hf-checkpoint of a qwen3_moe "
                              "checkpoint; drop the flag for a dense model.")
        if not self.sglang_url and self.rollout_engine == "embedded":
            raise ConfigError(f"{flag}: --rollout-engine embedded does not return the routed experts; use "
                              "--rollout-engine sglang (the trainer launches SGLang with "
                              "--enable-return-routed-experts) or --sglang-url of servers started with it.")

    def _check_load(self) -> None:
        from slime_corr.mcore.checkpoint import TRACKER_FILE, iteration_dir, latest_iteration
        from slime_corr.mcore.checkpoint import CheckpointError as CheckpointLoadError

        root = Path(self.load)  # type: ignore[arg-type]
        if not root.is_dir():
            raise ConfigError(f"--load {root}: no such directory; pass the --save directory of an earlier run.")
        try:
            step = self.ckpt_step if self.ckpt_step is not None else latest_iteration(root)
        except CheckpointLoadError as e:
            raise ConfigError(f"--load {root}: {e}") from None
        if step is None:
            raise ConfigError(f"--load {root}: no {TRACKER_FILE} (no complete checkpoint was saved there).")
        if not (iteration_dir(root, step) / "metadata.json").is_file():
            saved = sorted(p.name for p in root.glob("iter_*"))
            raise ConfigError(f"--ckpt-step {step}: {iteration_dir(root, step)} is not a complete checkpoint "
                              f"(saved: {', '.join(saved) or 'none'}).")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_args(cls, args: argparse.Namespace, *, world_size: int | None = None) -> TrainerConfig:
        """From parsed flags (`add_trainer_args`, `add_tiny_model_args`, `models.add_model_args`); `world_size`
        defaults to WORLD_SIZE. `--task` and `--lr` default to the model's: lowercase and 1e-2 for the tiny one,
        arithmetic and PRETRAINED_LR for a pretrained one."""
        names = [f for f in cls.__dataclass_fields__ if f not in ("world_size", "model", "sglang_url", "model_source",
                                                                  "task", "lr", "sglang_server_args",
                                                                  *MOE_FLAGS)]
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
        lr = args.lr if args.lr is not None else PRETRAINED_LR if text_model else \
            TINY_MOE_LR if source.byte_tokens else cls.lr
        return cls(**values, world_size=world, sglang_url=tuple(args.sglang_url or ()), model=model,
                   model_source=source, task=task, lr=lr,
                   sglang_server_args=tuple(getattr(args, "sglang_server_args", None) or ()))


def _flag(name: str) -> str:
    return name.replace("_", "-")


def check_writable_dir(flag: str, path: str | os.PathLike[str]) -> None:
    """ConfigError unless `path` is a directory this process can write in, or can be created (its nearest existing
    ancestor is a writable directory). Probes with a temporary file: permission bits lie to root and on read-only
    mounts."""
    import tempfile

    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{flag} {target}: is a file, not a directory; pass a directory (it is created if missing).")
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {target}: {existing} is a file, so the directory cannot be created there; pass "
                          "another path.")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        where = "" if existing == target else f" (it would be created in {existing})"
        raise ConfigError(f"{flag} {target}: cannot write there{where}: {e.strerror or e}; pass a directory you can "
                          "write to.") from None


def add_trainer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The trainer's flags (see the module doc); the model's come from `mcore.model.add_tiny_model_args`."""
    d = TrainerConfig()
    g = parser.add_argument_group(title="parallelism, optimization and checkpoints (Megatron's flags)")
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
                        "group (gloo on CPU).")
    e.add_argument("--update-weight-buffer-size", type=int, default=d.update_weight_buffer_size,
                   help="Bytes per bucket of the distributed weight sync.")
    e.add_argument("--engine-dtype", choices=ENGINE_DTYPES, default=d.engine_dtype,
                   help="Dtype the engines serve in (SGLang's --dtype; bfloat16 gives a real mismatch with the fp32 "
                        "trainer, float32 about 1e-5).")
    m = parser.add_argument_group(title="Mixture of Experts (slime's routing replay)")
    m.add_argument("--use-rollout-routing-replay", action="store_true",
                   help="R3 (slime's flag): the engines return the experts they routed every token to, and every "
                        "trainer forward that computes log-probs to train on (lp_old, the reference's, each "
                        "training pass) routes with them (Megatron's RouterReplay). MoE models and SGLang engines "
                        "only; logs the routing-mismatch metrics too.")
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


__all__ = ["TrainerConfig", "add_trainer_args", "check_writable_dir", "split_sglang_passthrough"]
