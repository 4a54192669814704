"""Tiny random Llama-family HF checkpoints (GQA, tied or untied embeddings, Qwen2 biases) for the conversion matrix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

V = 128  # vocabulary, divisible by TP=2
TINY = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
# name -> (model_type, config overrides); every case has GQA (4 query heads share 2 KV heads)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_tied": ("llama", dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "llama_untied_theta": ("llama", dict(tie_word_embeddings=False, rope_theta=500000.0, num_key_value_heads=4)),
    "qwen2_bias_untied": ("qwen2", dict(tie_word_embeddings=False, rope_theta=1000000.0)),
}


def tiny_tokenizer_files(out: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary ('t0' .. 't127', '</s>' = eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(V - 1)} | {"</s>": V - 1}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="t0").save_pretrained(out)


def make_tiny_checkpoint(out: Path, model_type: str, seed: int = 0, **overrides: Any) -> Path:
    """Random-init HF model (TINY sizes + `overrides`), weights scaled up (std 0.02 init gives near-uniform
    logits), saved with a tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**TINY, "eos_token_id": V - 1, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # non-trivial RMSNorm weights
            else:
                p.normal_(0.0, 0.2 if p.dim() > 1 else 0.5)
    model.save_pretrained(out)
    tiny_tokenizer_files(out)
    return out
