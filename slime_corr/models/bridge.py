"""HF Llama-family and Qwen3-MoE checkpoints <-> Megatron-Core `GPTModel` (local layer spec), through mbridge.

mbridge (what slime and verl use) owns the name mapping, the q/k/v and gate/up fusion and the TP split/merge.
Its own model builder does not run here (CPU, megatron-core 0.16.1, transformers 5), for these reasons, each
worked around in `_local_spec_bridge` while its weight loading and export run unchanged:
- `Bridge.get_model` builds with TransformerEngine's layer spec (`NameError: name 'TENorm' is not defined` without
  TE) and then calls `.cuda()`: we build `GPTModel` from mbridge's provider with the local spec instead;
- the local spec names the norms `input_layernorm` / `pre_mlp_layernorm` (TE fuses them into the linear layers as
  `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`): mapped here;
- `LLaMABridge` reads `hf_config.rope_theta`, which transformers 5 moved into `rope_parameters`;
- `Qwen2Bridge` rewrites its class-level name mapping for tied embeddings (leaking into later untied models):
  a tied model's output layer exists only on the last of several pipeline stages, mapped here to the embedding;
- MoE: mbridge names experts as TE's grouped GEMM does (`mlp.experts.linear_fc1.weight{e}`); the local spec's
  SequentialMLP has `mlp.experts.local_experts.{e}.linear_fc1.weight`: mapped here (`_CPU_MOE_CONFIG` says why).

All TP ranks call `load_weights` / `export_weights` together (scatter / all-gather over the TP group).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slime_corr.device import current, place_module
from slime_corr.mcore.local_spec import allow_sequence_parallel_norms, local_layer_spec
from slime_corr.mcore.model import single_rank_groups
from slime_corr.models.gguf_checkpoint import MARKER
from slime_corr.models.hf_checkpoint import (
    MODEL_EXTRA_HINT,
    CheckpointError,
    HFModelSpec,
    check_tensor_parallel,
    read_hf_checkpoint,
)

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TIED_SOURCE = "model.embed_tokens.weight"  # what a tied LM head reads
# Megatron local-spec norm -> HF norm, per decoder layer
_LOCAL_SPEC_NORMS = {"input_layernorm.weight": "input_layernorm.weight",
                     "pre_mlp_layernorm.weight": "post_attention_layernorm.weight"}
# Megatron local-spec expert weight (SequentialMLP, no grouped GEMM), per decoder layer
# MoE layers with the local spec: experts one by one (SequentialMLP; grouped GEMM needs TE or CUTLASS), the
# all-gather token dispatcher (the all-to-all one creates a CUDA stream; Megatron refuses all-gather with
# variable_seq_lengths at config time, so under PP `build_model` sets that flag afterwards: the all-gather runs over
# the TP/EP ranks of one micro-batch, whose lengths agree), no TE/apex fusions.
_CPU_MOE_CONFIG = dict(moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", variable_seq_lengths=False,
                       persist_layer_norm=False, bias_activation_fusion=False, bias_dropout_fusion=False)
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(?P<e>\d+)\.(?P<fc>linear_fc[12])\.weight")


def _mbridge_class(model_type: str) -> type:
    try:
        from mbridge.models import LLaMABridge, Qwen2Bridge, Qwen3MoEBridge
    except ImportError as e:
        raise ImportError(f"converting HF checkpoints to Megatron needs mbridge: {MODEL_EXTRA_HINT}") from e
    return {"llama": LLaMABridge, "qwen2": Qwen2Bridge, "qwen3_moe": Qwen3MoEBridge}[model_type]


def _local_spec_bridge(spec: HFModelSpec, hf_config: Any, dtype: torch.dtype) -> Any:
    """An instance of mbridge's bridge for `spec.model_type`, adapted to the local (non-TE) layer spec."""
    base = _mbridge_class(spec.model_type)

    class LocalSpecBridge(base):  # type: ignore[misc, valid-type]
        def _adjust_mapping_for_shared_weights(self) -> None:
            pass

        def _get_transformer_layer_spec(self, vp_stage: int | None = None) -> Any:
            self.has_vp_stage = False
            return local_layer_spec(normalization="RMSNorm", qk_layernorm=self.config.qk_layernorm,
                                    num_experts=self.config.num_moe_experts, moe_grouped_gemm=False)

        def _get_gptmodel_args(self) -> dict[str, Any]:
            return dict(vocab_size=spec.vocab_size, max_sequence_length=spec.max_position_embeddings,
                        position_embedding_type="rope", rotary_base=spec.rope_theta)

        def _weight_name_mapping_mcore_to_hf(self, name: str) -> list[str]:
            if name == "output_layer.weight" and getattr(hf_config, "tie_word_embeddings", False):
                return ["model.embed_tokens.weight"]  # the last stage's copy of the tied embedding
            layer, _, suffix = name.removeprefix("decoder.layers.").partition(".")
            if name.startswith("decoder.layers.") and suffix in _LOCAL_SPEC_NORMS:
                return [f"model.layers.{layer}.{_LOCAL_SPEC_NORMS[suffix]}"]
            expert = _LOCAL_EXPERT.fullmatch(suffix)
            if name.startswith("decoder.layers.") and expert:  # SequentialMLP -> mbridge's grouped-GEMM names
                fc, e = expert.group("fc"), expert.group("e")
                return super()._weight_name_mapping_mcore_to_hf(f"decoder.layers.{layer}.mlp.experts.{fc}.weight{e}")
            return super()._weight_name_mapping_mcore_to_hf(name)

    LocalSpecBridge.__name__ = f"LocalSpec{base.__name__}"
    return LocalSpecBridge(hf_config, dtype=dtype)


def _run_whole_sequences(model: nn.Module) -> None:
    """Emulated CP: the model sees whole rows, so its rotary embeddings (the table, and per sample in packed rows,
    `cu_seqlens`) must not be split over parallel_state's CP group: they get a one-rank CP group."""
    import copy

    from megatron.core.transformer.attention import Attention

    one = single_rank_groups().cp
    model.rotary_pos_emb.cp_group = one
    for module in model.modules():
        if isinstance(module, Attention):
            module.pg_collection = copy.copy(module.pg_collection)
            module.pg_collection.cp = one


def unwrap(model: nn.Module) -> nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


class MegatronHFBridge:
    """One HF checkpoint's Megatron side on the current `parallel_state`: TP and PP from it (this rank's stage of
    the layers; with PP the stages exchange each micro-batch's shape, `variable_seq_lengths`).

    `config_overrides` go to Megatron's `TransformerConfig` (e.g. `recompute_granularity`); the defaults are those
    the rollout-correction loss needs: no dropout, `calculate_per_token_loss=True`. `emulated_context_parallel`:
    the models run whole sequences although parallel_state has CP > 1 (CP emulated on CPU,
    `mcore.model.emulated_cp_forward`): CP size 1 in the config, and RoPE does not slice its table over CP.
    """

    def __init__(self, hf_dir: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32,
                 config_overrides: dict[str, Any] | None = None, emulated_context_parallel: bool = False) -> None:
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        self.hf_dir = Path(hf_dir)
        self.spec = read_hf_checkpoint(hf_dir)
        pp = ps.get_pipeline_model_parallel_world_size()
        if self.spec.num_layers % pp:
            raise CheckpointError(f"--pipeline-model-parallel-size {pp} must divide the model's {self.spec.num_layers} "
                                  "layers: every pipeline stage holds the same number of layers")
        self.first_stage = ps.is_pipeline_first_stage(ignore_virtual=True)
        self.last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.pipeline_parallel = pp > 1
        check_tensor_parallel(self.spec, ps.get_tensor_model_parallel_world_size())
        self.dtype = dtype
        self.emulated_context_parallel = emulated_context_parallel
        if emulated_context_parallel:
            config_overrides = {"context_parallel_size": 1, **(config_overrides or {})}
        # Megatron requires sequence parallelism for MoE with TP > 1 (local-spec norms: mcore.local_spec)
        self.sequence_parallel = self.spec.is_moe and ps.get_tensor_model_parallel_world_size() > 1
        if self.sequence_parallel:
            allow_sequence_parallel_norms()
        self._mb = _local_spec_bridge(self.spec, AutoConfig.from_pretrained(hf_dir, local_files_only=True), dtype)
        self._mb.set_extra_args(
            **(_CPU_MOE_CONFIG if self.spec.is_moe else {}),
            use_cpu_initialization=current().cpu_initialization,
            sequence_parallel=self.sequence_parallel,
            masked_softmax_fusion=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            calculate_per_token_loss=True,
            **(config_overrides or {}),
        )

    @property
    def transformer_config(self) -> Any:
        return self._mb.config

    def build_model(self, load_weights: bool = True) -> nn.Module:
        """A GPTModel (vocab-parallel logits) with the checkpoint's weights unless `load_weights=False`, on the
        device `slime_corr.device` chose."""
        model = self._mb._model_provider([])(pre_process=self.first_stage, post_process=self.last_stage)
        # the local spec's torch RMSNorm ignores params_dtype and Megatron's device: both set here
        model = place_module(model.to(self.dtype))
        if self.emulated_context_parallel:  # RoPE reads parallel_state's CP group, not the config's size
            _run_whole_sequences(model)
        if self.pipeline_parallel:  # stages exchange each micro-batch's activation shape (lengths vary)
            model.config.variable_seq_lengths = True
        if load_weights:
            self.load_weights(model)
        return model

    def load_weights(self, model: nn.Module, hf_dir: str | os.PathLike[str] | None = None) -> None:
        """Copy HF weights (this checkpoint's, or another one of the same architecture) into `model`."""
        with torch.no_grad():
            self._mb.load_weights([unwrap(model)], str(hf_dir or self.hf_dir))

    def export_weights(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every weight, on every TP rank; a tied LM head is not repeated. At TP=1 the
        tensors alias the parameters: copy them before the next optimizer step if they must outlive it."""
        with torch.no_grad():
            for name, tensor in self._mb.export_weights([unwrap(model)]):
                yield name, tensor.detach()

    def save_hf_checkpoint(self, model: nn.Module, out_dir: str | os.PathLike[str]) -> Path:
        """Write `model` as an HF checkpoint (what the engine's `/update_weights_from_disk` reads), see
        `write_hf_checkpoint`. Every rank calls it; rank 0 of the world writes, and all return once the checkpoint
        is complete."""
        import torch.distributed as dist

        weights = dict(self.export_weights(model))
        if not dist.is_initialized() or dist.get_rank() == 0:
            write_hf_checkpoint(weights, self.hf_dir, out_dir)
        if dist.is_initialized():
            dist.barrier()
        return Path(out_dir)


def write_hf_checkpoint(weights: dict[str, torch.Tensor], source_dir: str | os.PathLike[str],
                        out_dir: str | os.PathLike[str]) -> Path:
    """`weights` (HF names) as one safetensors file in `out_dir`, beside every other file of the source checkpoint
    (config, tokenizer, chat template; not its weights). The weights file is written under a temporary name and
    renamed: a reader never sees half of it. A tied model (`tie_word_embeddings`) gets an explicit `lm_head.weight`
    (the embedding's copy): Hugging Face leaves it out, and SGLang 0.5.23's Qwen3-MoE, which never ties, would serve
    a zero LM head (every log-prob -log(vocab)); models that tie ignore it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(source_dir).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (WEIGHTS_INDEX, MARKER):
            shutil.copy2(f, out / f.name)
    _name_architecture(out / "config.json")
    if json.loads((out / "config.json").read_text()).get("tie_word_embeddings") and "lm_head.weight" not in weights \
            and TIED_SOURCE in weights:
        weights = {**weights, "lm_head.weight": weights[TIED_SOURCE].clone()}  # safetensors stores no shared memory
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file({name: t.contiguous() for name, t in weights.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_FILE)
    return out


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}  # the model types we accept


def _name_architecture(config_path: Path) -> None:
    """Add `architectures` to a config.json that lacks it: SGLang chooses its model class by it (a config without
    it fails to load there)."""
    cfg = json.loads(config_path.read_text())
    if not cfg.get("architectures") and cfg.get("model_type") in ARCHITECTURES:
        cfg["architectures"] = [ARCHITECTURES[cfg["model_type"]]]
        config_path.write_text(json.dumps(cfg, indent=2))


def build_gpt_from_hf(hf_dir: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32, ddp: bool = False,
                      config_overrides: dict[str, Any] | None = None, emulated_context_parallel: bool = False
                      ) -> tuple[nn.Module, MegatronHFBridge]:
    """(GPTModel with the checkpoint's weights, its bridge) on the current parallel_state, like
    `mcore.model.build_tiny_gpt`: Megatron DDP around it when `ddp`, `finalize_model_grads` as the grad hook.
    On CPU call `slime_corr.mcore.cpu_compat.apply_cpu_compat()` first."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    bridge = MegatronHFBridge(hf_dir, dtype=dtype, config_overrides=config_overrides,
                              emulated_context_parallel=emulated_context_parallel)
    model = bridge.build_model()
    config = bridge.transformer_config
    if ddp:
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=dtype != torch.float64), module=model
        )
    config.finalize_model_grads_func = finalize_model_grads
    return model, bridge


__all__ = ["MegatronHFBridge", "build_gpt_from_hf", "unwrap", "write_hf_checkpoint", "WEIGHTS_FILE"]
