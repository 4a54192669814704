"""Local Hugging Face Llama-family checkpoints: what we read from `config.json`, what we accept, and the plain HF
model (the reference the converted Megatron model is checked against, and the module the local engine serves).

Accepted: `model_type` llama or qwen2 with RMSNorm, SwiGLU (`hidden_act` silu), plain RoPE (`rope_type` default),
grouped-query attention, tied or untied embeddings, Qwen2's q/k/v biases; weights as `*.safetensors`. And qwen3_moe
(Mixture of Experts, q/k RMSNorm): every layer sparse, top-k probabilities renormalized (`norm_topk_prob`).
`config.json` is read as JSON (no transformers import), in the layouts of transformers 4 (`rope_theta`,
`rope_scaling`) and 5 (`rope_parameters`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slime_corr.extras import install_hint

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3_moe")
MOE_MODEL_TYPES = ("qwen3_moe",)
MODEL_EXTRA_HINT = install_hint("model")


class CheckpointError(ValueError):
    """A checkpoint (or a parallel layout for it) that slime_corr cannot use; the message says why and the fix."""


@dataclass(frozen=True)
class HFModelSpec:
    """The architecture fields of a Llama-family `config.json` that the Megatron conversion depends on."""

    path: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_id: int | list[int] | None
    num_experts: int = 0  # 0: a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _rope(cfg: dict[str, Any]) -> tuple[float, str]:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), str(kind)


def spec_from_config(cfg: dict[str, Any], path: str = "", flag: str = "--hf-checkpoint") -> HFModelSpec:
    """Validate a `config.json` dict and return its :class:`HFModelSpec` (errors name `flag` and `path`)."""
    where = f"{flag} {path}" if path else flag
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
            "(Llama-family: RMSNorm, SwiGLU, RoPE, grouped-query attention)"
        )
    theta, rope_type = _rope(cfg)
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg.get('hidden_act')!r} (only 'silu', i.e. SwiGLU)")
    if rope_type != "default":
        problems.append(f"rope_type={rope_type!r} (only plain RoPE, 'default')")
    if cfg.get("use_sliding_window"):
        problems.append("use_sliding_window=true (full causal attention only)")
    if model_type == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        problems.append("attention_bias/mlp_bias=true (Llama linear layers without biases only)")
    if model_type in MOE_MODEL_TYPES:
        if cfg.get("attention_bias"):
            problems.append("attention_bias=true (no q/k/v biases)")
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
            problems.append(f"mlp_only_layers={cfg.get('mlp_only_layers')!r}, decoder_sparse_step="
                            f"{cfg.get('decoder_sparse_step')!r} (every layer sparse only: [] and 1)")
        if not cfg.get("norm_topk_prob", False):
            problems.append("norm_topk_prob=false (only renormalized top-k, Megatron's softmax router after top-k)")
    if problems:
        raise CheckpointError(f"{where}: unsupported {model_type} variant: {'; '.join(problems)}")
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return HFModelSpec(
            path=path,
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            eos_token_id=cfg.get("eos_token_id"),
            **({} if model_type not in MOE_MODEL_TYPES else dict(
                num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]))),
        )
    except KeyError as e:
        raise CheckpointError(f"{where}: config.json lacks the field {e.args[0]!r}") from None


def read_hf_checkpoint(path: str | os.PathLike[str], flag: str = "--hf-checkpoint") -> HFModelSpec:
    """Check that `path` is a usable local checkpoint (config.json, *.safetensors, a tokenizer) and read its spec."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(
            f"{flag} {path}: not a directory; give a local Hugging Face checkpoint directory "
            "(config.json, *.safetensors, tokenizer files): nothing is downloaded at run time"
        )
    if not (p / "config.json").is_file():
        raise CheckpointError(f"{flag} {path}: no config.json in it; is this a Hugging Face checkpoint directory?")
    try:
        cfg = json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{flag} {path}: config.json is not valid JSON ({e})") from None
    spec = spec_from_config(cfg, str(path), flag)
    if not any(p.glob("*.safetensors")):
        hint = " (it has PyTorch .bin weights: save them as safetensors)" if any(p.glob("*.bin")) else ""
        raise CheckpointError(f"{flag} {path}: no *.safetensors weights{hint}")
    for weights in sorted(p.glob("*.safetensors")):
        why = safetensors_problem(weights)
        if why is not None:
            raise CheckpointError(f"{flag} {path}: {weights.name} {why}: copy or save the checkpoint again")
    if not ((p / "tokenizer.json").is_file() or (p / "tokenizer.model").is_file()):
        raise CheckpointError(f"{flag} {path}: no tokenizer (tokenizer.json or tokenizer.model) next to the weights")
    return spec


def safetensors_problem(file: Path) -> str | None:
    """Why `file` is not a whole safetensors file, or None: its header (an 8-byte little-endian length, then JSON
    naming each tensor's byte range) must parse and its byte ranges must fit in the file (a cut-off copy does not).
    Reads the header only."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if size < 8 or n > size - 8:
                return f"is not a safetensors file ({size} bytes; its first 8 bytes announce a {n}-byte header)"
            header = json.loads(fh.read(n))
        ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]
    except (OSError, ValueError, TypeError, KeyError, IndexError) as e:
        return f"is not a safetensors file (its header does not parse: {e})"
    need = 8 + n + max(ends, default=0)
    return f"is truncated: {size} bytes, its header needs {need}" if size < need else None


def check_tensor_parallel(spec: HFModelSpec, tp: int, flag: str = "--tensor-model-parallel-size") -> None:
    """Megatron splits heads, KV groups, the FFN and the vocabulary evenly over TP ranks: check they divide."""
    sizes = {
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        ("moe_intermediate_size" if spec.is_moe else "intermediate_size"):
            spec.moe_intermediate_size if spec.is_moe else spec.intermediate_size,
        "vocab_size": spec.vocab_size,
    }
    bad = {k: v for k, v in sizes.items() if tp >= 1 and v % tp}
    if tp < 1 or bad:
        fits = [d for d in range(1, spec.num_key_value_heads + 1) if all(v % d == 0 for v in sizes.values())]
        detail = ", ".join(f"{k}={v}" for k, v in bad.items()) or f"{tp} < 1"
        raise CheckpointError(
            f"{flag}={tp} does not divide the model at {spec.path or 'this checkpoint'} ({detail}); "
            f"sizes that fit: {', '.join(map(str, fits))}"
        )


def load_hf_causal_lm(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"
) -> nn.Module:
    """The plain HF model from a local checkpoint. `eager` attention is the op order of Megatron's local
    (non-TransformerEngine) attention: the converted fp32 model then gives bitwise-equal logits. MoE models run
    their experts one by one (`experts_implementation="eager"`, as Megatron's SequentialMLP; also the only one
    with float64)."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise ImportError(f"loading a Hugging Face model needs transformers: {MODEL_EXTRA_HINT}") from e
    hf_logging.disable_progress_bar()  # a "Loading weights" bar at every engine weight update
    moe = json.loads((Path(path) / "config.json").read_text()).get("model_type") in MOE_MODEL_TYPES
    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation=attn_implementation, local_files_only=True,
        **({"experts_implementation": "eager"} if moe else {}),
    ).eval()


def load_engine_module(checkpoint_dir: str) -> nn.Module:
    """Factory for the local engine (`engines.embedded.model.TorchEngineModel(checkpoint_dir,
    factory=load_engine_module)`): the checkpoint's HF causal LM in fp32 (the engine casts it to its dtype), without
    KV cache (the engine recomputes each sequence), its config giving `vocab_size`, `eos_token_id` and
    `max_position_embeddings`; its weight names are the checkpoint's, as the trainer's export names them."""
    read_hf_checkpoint(checkpoint_dir, flag="checkpoint_dir")
    model = load_hf_causal_lm(checkpoint_dir)
    model.config.use_cache = False
    return model


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "MOE_MODEL_TYPES",
    "CheckpointError",
    "HFModelSpec",
    "spec_from_config",
    "read_hf_checkpoint",
    "check_tensor_parallel",
    "load_hf_causal_lm",
    "load_engine_module",
]
