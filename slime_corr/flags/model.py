"""The model's flags: the tiny GPT's shape (`add_tiny_model_args`, Megatron's names) and the pretrained model
(`add_model_args`: `--model`, `--hf-checkpoint`, `--model-cache-dir`). Help, defaults and choices are the fields' of
`TinyGPTArgs` and `ModelSource`."""

from __future__ import annotations

import argparse

from slime_corr.fields import add_flags
from slime_corr.mcore.model import TinyGPTArgs
from slime_corr.models.selection import ModelSource

TINY_MODEL = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings", "seed")
PRETRAINED = ("model", "hf_checkpoint", "cache_dir")


def add_tiny_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-like model flags (`--num-layers`, `--hidden-size`, ...) for the tiny model. Returns the parser."""
    add_flags(parser.add_argument_group("tiny GPT model (Megatron-Core)"), TinyGPTArgs, TINY_MODEL)
    return parser


def add_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--model`, `--hf-checkpoint`, `--model-cache-dir`. Returns the parser."""
    add_flags(parser.add_argument_group(title="pretrained model (slime_corr)"), ModelSource, PRETRAINED)
    return parser


__all__ = ["PRETRAINED", "TINY_MODEL", "add_model_args", "add_tiny_model_args"]
