"""The policy the trainer trains, built by ONE function (`build_policy`) from the config: the model on this rank,
the frozen reference policy (KL term), how to run it on a micro-batch, its tokenizer, and how the rollout engines
serve it (the module, the weights they receive and the files they load them from).

- The tiny Megatron GPTModel (`slime_corr.mcore.model`), byte tokens: the embedded engines serve the same
  architecture (`EngineGPT`), weights under the trainer's names in one `model.pt`; SGLang serves it as the HF OPT
  checkpoint it equals (`models.tiny_opt`: OPT names on disk and over the distributed sync).
- A pretrained model (`--model smollm2-135m`, `--hf-checkpoint PATH`, the generated `--model tiny-moe`, which
  reads byte tokens; `slime_corr.models`): mbridge builds the
  Megatron GPTModel from the HF checkpoint and exports its weights under HF names (TP shards gathered); the engines
  serve the HF model itself (`models.load_engine_module`) with the checkpoint's tokenizer and chat template, and
  load HF checkpoints (`models.write_hf_checkpoint`: safetensors + the source's config and tokenizer files).

The engines run the model unsharded beside the TP-sharded trainer, in the driver's process: the engine's GPTModel
gets process groups of its own (`single_rank_groups`), so its layers never enter the trainer's collectives (the HF
model uses none).
"""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from slime_corr.device import current
from slime_corr.engines.embedded.model import (
    ENGINE_MODULE_FILE,
    ByteTokenizer,
    Tokenizer,
    write_engine_module_file,
)
from slime_corr.mcore.cpu_compat import apply_cpu_compat
from slime_corr.mcore.loss_hook import default_model_forward
from slime_corr.mcore.model import TinyGPTArgs, build_tiny_gpt, emulated_cp_forward, single_rank_groups
from slime_corr.mcore.params import full_named_tensors
from slime_corr.mcore.precision import (
    build_mixed_precision_gpt,
    float16_module,
    unwrap_model,
    wrap_for_training,
)
from slime_corr.mcore.routing import old_routes_forward, routed_forward
from slime_corr.models import ChatTokenizer, build_gpt_from_hf, load_engine_module, write_hf_checkpoint
from slime_corr.models.tiny_opt import opt_weights, write_opt_checkpoint
from slime_corr.ports import init_world_of_one
from slime_corr.trainer.config import TrainerConfig

WEIGHTS_FILE = "model.pt"
ModelForward = Callable[[nn.Module, dict[str, Tensor]], Tensor]


class EngineGPT:
    """The trainer's GPTModel architecture served by the embedded engine (`TorchEngineModel`'s module): built
    unsharded with its own single-rank process groups, weights from `WEIGHTS_FILE` (the trainer's names), on the
    device `slime_corr.device` chose (position ids follow the token ids)."""

    def __init__(self, model_args: Any, checkpoint_dir: str) -> None:
        self.module = build_tiny_gpt(model_args, ddp=False, pg_collection=single_rank_groups())
        state = torch.load(Path(checkpoint_dir) / WEIGHTS_FILE, map_location=current().device, weights_only=True)
        result = self.module.load_state_dict(state, strict=False)  # the file holds tensors, not _extra_state
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise ValueError(f"{checkpoint_dir}: weights do not fit the model (missing {missing[:3]}, unexpected "
                             f"{result.unexpected_keys[:3]})")
        self.cfg = types.SimpleNamespace(vocab_size=model_args.vocab_size, eos_token_id=None,
                                         max_seq_len=model_args.max_position_embeddings)

    def to(self, *args: Any, **kwargs: Any) -> EngineGPT:
        """`nn.Module.to` of the module (a dtype, a device)."""
        self.module = self.module.to(*args, **kwargs)
        return self

    def eval(self) -> EngineGPT:
        self.module.eval()
        return self

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def __call__(self, input_ids: Tensor) -> Tensor:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        return self.module(input_ids=input_ids, position_ids=position_ids, attention_mask=None)


@dataclass
class Policy:
    """The trained policy on this rank (see the module doc)."""

    model: nn.Module  # Megatron DDP around this rank's GPTModel shard (and Float16Module under --bf16 / --fp16)
    reference: nn.Module | None  # the frozen initial policy (KL term), or None
    forward: ModelForward  # logits [B, S_local, V/TP] of this rank's (CP-sliced) micro-batch
    engine_module: Callable[[str], Any]  # checkpoint dir -> the module an embedded engine serves
    export_weights: Callable[[], Iterable[tuple[str, Tensor]]]  # (engine name, full tensor): COLLECTIVE over TP
    save_engine_checkpoint: Callable[[dict[str, Tensor], Path], str]  # weights -> a dir an engine loads; returns it
    tokenizer: Any = field(default_factory=ByteTokenizer)  # prompts, rewards and logs (`encode`/`decode`)
    engine_tokenizer: Tokenizer | None = None  # what the engines tokenize `text` with (None: byte-level)
    pad_token_id: int = 0
    name: str = "slime-corr-tiny"  # the engines' served model name

    @property
    def module(self) -> nn.Module:
        """The GPTModel inside the DDP (and Float16Module) wrappers."""
        return unwrap_model(self.model)

    def full_weights(self) -> dict[str, Tensor]:
        """Every weight as its full tensor under the engines' names, copied (an optimizer step does not change
        them): COLLECTIVE over the TP group."""
        return {name: t.clone() for name, t in self.export_weights()}


def save_engine_gpt_checkpoint(weights: dict[str, Tensor], directory: Path, model_args: Any = None) -> str:
    """Write `weights` where an `EngineGPT` loads them from (`/update_weights_from_disk`); returns the directory.
    With `model_args` the directory also says how to build the module (`ENGINE_MODULE_FILE`), so an engine that
    did not start from this model (a standalone one at `--sglang-url`) serves it too."""
    directory.mkdir(parents=True, exist_ok=True)
    if model_args is not None:
        fields = {f.name: getattr(model_args, f.name) for f in dataclasses.fields(model_args)}
        fields["params_dtype"] = str(fields["params_dtype"]).removeprefix("torch.")
        write_engine_module_file(directory, f"{__name__}:{engine_gpt_from_checkpoint.__name__}", model_args=fields)
    tmp = directory / (WEIGHTS_FILE + ".tmp")
    torch.save(weights, tmp)
    tmp.replace(directory / WEIGHTS_FILE)  # atomic: an engine never reads half a file
    return str(directory)


def engine_gpt_from_checkpoint(checkpoint_dir: str) -> EngineGPT:
    """The `EngineGPT` of a directory `save_engine_gpt_checkpoint` wrote with its model args. In a process without
    a default process group (a standalone engine) it first makes a one-rank world for the module's groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    apply_cpu_compat()  # Megatron on CPU (no-op where it computes on CUDA)
    if not dist.is_initialized():
        init_world_of_one(current().backend)
    if not parallel_state.model_parallel_is_initialized():  # its buffers and RNG states serve the module's layers
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(0)  # registers the RNG states (the weights are loaded)

    with open(Path(checkpoint_dir) / ENGINE_MODULE_FILE) as f:
        fields = json.load(f)["model_args"]
    fields["params_dtype"] = getattr(torch, fields["params_dtype"])
    return EngineGPT(TinyGPTArgs(**fields), checkpoint_dir)


def _save_hf_for_embedded(weights: dict[str, Tensor], source_dir: str, directory: Path) -> str:
    """An HF checkpoint an embedded engine serves (`models.load_engine_module` named in it)."""

    out = str(write_hf_checkpoint(weights, source_dir, directory))
    write_engine_module_file(out, "slime_corr.models.hf_checkpoint:load_engine_module")
    return out


def build_policy(config: TrainerConfig, *, with_reference: bool) -> Policy:
    """The policy of `config` on the current parallel_state (call `apply_cpu_compat()` first on CPU). Collective:
    every rank builds its shard (same seed: same full weights) and the engines' single-rank process groups."""

    emulated = config.context_parallel_size > 1 or config.use_dynamic_batch_size  # CP / THD attention on CPU
    forward = emulated_cp_forward if emulated else default_model_forward
    if config.asks_routes:  # MoE: the engine's routes replayed (or compared with the trainer's own)
        forward = routed_forward(forward, replay=config.use_rollout_routing_replay)
    elif config.use_routing_replay:  # MoE: the lp_old pass's routes replayed
        forward = old_routes_forward(forward)
    if config.model_source.is_pretrained:
        return _pretrained_policy(config, forward, with_reference)

    args, precision = config.model, config.precision
    model = build_mixed_precision_gpt(args, precision) if precision.mixed else build_tiny_gpt(args, ddp=True)
    gpt = unwrap_model(model)
    reference = None
    if with_reference:  # the initial policy: the same seed builds the same weights (in the trainer's precision)
        reference_args = dataclasses.replace(args, params_dtype=precision.params_dtype) if precision.mixed else args
        reference = float16_module(build_tiny_gpt(reference_args, ddp=False), precision).eval()
        reference.requires_grad_(False)
    single_rank_groups()
    # the engines get the weights the trainer computes with (bf16 / fp16 under --bf16 / --fp16, not the fp32 main
    # weights); the engine casts them to --engine-dtype
    engine_args = dataclasses.replace(args, params_dtype=torch.float32)
    if config.rollout_engine == "sglang":  # SGLang serves it as an HF OPT checkpoint (models.tiny_opt)
        return Policy(model=model, reference=reference, forward=forward,
                      engine_module=lambda directory: EngineGPT(engine_args, directory),
                      export_weights=lambda: opt_weights(full_named_tensors(gpt), args.num_attention_heads),
                      save_engine_checkpoint=lambda weights, directory: write_opt_checkpoint(weights, args,
                                                                                             directory))
    return Policy(model=model, reference=reference, forward=forward,
                  engine_module=lambda directory: EngineGPT(engine_args, directory),
                  export_weights=lambda: full_named_tensors(gpt),
                  save_engine_checkpoint=lambda weights, directory: save_engine_gpt_checkpoint(weights, directory,
                                                                                               engine_args))


def _pretrained_policy(config: TrainerConfig, forward: ModelForward, with_reference: bool) -> Policy:
    """The `--model` / `--hf-checkpoint` policy: Megatron GPTModel from the HF checkpoint in `--params-dtype` (under
    --bf16 / --fp16: in 16 bits inside Float16Module; every rank loads its TP shard), the reference a second copy of
    the checkpoint's weights. With
    `--use-rollout-routing-replay` / `--use-routing-replay` both are built with Megatron's `RouterReplay` and the
    reference replays the same routes too (its KL term then compares the two policies on the same expert path)."""
    from megatron.core import tensor_parallel

    hf_dir = config.model_source.resolve()
    assert hf_dir is not None
    torch.manual_seed(config.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
    overrides = {"moe_enable_routing_replay": True} if config.replays_routes else None
    precision = config.precision
    dtype = precision.params_dtype if precision.mixed else config.torch_params_dtype
    model, bridge = build_gpt_from_hf(hf_dir, dtype=dtype, ddp=not precision.mixed, config_overrides=overrides,
                                      emulated_context_parallel=config.context_parallel_size > 1)
    if precision.mixed:  # Float16Module + DDP with fp32 gradients, for Megatron's mixed-precision optimizer
        model = wrap_for_training(model, precision)
    reference = None
    if with_reference:
        reference = float16_module(bridge.build_model(), precision).eval()
        reference.requires_grad_(False)
    common = dict(model=model, reference=reference, forward=forward, engine_module=load_engine_module,
                  export_weights=lambda: bridge.export_weights(model),
                  save_engine_checkpoint=(
                      (lambda weights, directory: str(write_hf_checkpoint(weights, hf_dir, directory)))
                      if config.rollout_engine == "sglang" else
                      (lambda weights, directory: _save_hf_for_embedded(weights, hf_dir, directory))),
                  name=config.model_source.model or Path(hf_dir).name)
    if config.model_source.byte_tokens:  # --model tiny-moe: byte tokens, as the tiny GPT (engines get token ids)
        return Policy(**common)
    tokenizer = ChatTokenizer.from_pretrained(hf_dir)
    return Policy(**common, tokenizer=tokenizer, engine_tokenizer=tokenizer.hf, pad_token_id=tokenizer.pad_token_id)


__all__ = ["EngineGPT", "Policy", "WEIGHTS_FILE", "build_policy", "engine_gpt_from_checkpoint",
           "save_engine_gpt_checkpoint"]
