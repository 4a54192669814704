"""A tiny Megatron `GPTModel` (local layer spec, learned absolute positions) for tests and the CPU demo job.

`build_tiny_gpt` wires what the rollout-correction loss needs: `calculate_per_token_loss=True`,
`finalize_model_grads` as the grad-finalize hook and Megatron DDP (gradient all-reduce over DP×CP).
On CPU call `slime_corr.mcore.cpu_compat.apply_cpu_compat()` first.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TinyGPTArgs:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 128  # must be divisible by the TP size
    max_position_embeddings: int = 256
    seed: int = 1234
    params_dtype: torch.dtype = torch.float32  # tests use float64 to compare gradients at 1e-6


def add_tiny_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-like model flags (`--num-layers`, `--hidden-size`, ...) for the tiny model."""
    group = parser.add_argument_group("tiny GPT model (Megatron-Core)")
    d = TinyGPTArgs()
    group.add_argument("--num-layers", type=int, default=d.num_layers)
    group.add_argument("--hidden-size", type=int, default=d.hidden_size)
    group.add_argument("--num-attention-heads", type=int, default=d.num_attention_heads)
    group.add_argument("--vocab-size", type=int, default=d.vocab_size)
    group.add_argument("--max-position-embeddings", type=int, default=d.max_position_embeddings)
    group.add_argument("--seed", type=int, default=d.seed)
    return parser


def build_tiny_gpt(args: TinyGPTArgs | argparse.Namespace | None = None, *, ddp: bool = True) -> torch.nn.Module:
    """A tiny GPTModel (fp32 unless `params_dtype`) on the current parallel_state (TP from it; CP attention is
    not used: build with context_parallel_size=1 and zig-zag-slice the logits to emulate CP on CPU). Same weights on every
    DP/CP rank for a given seed; TP shards come from `use_cpu_initialization` of the full weights. Under pipeline
    parallelism this rank's stage: its share of the layers, the embedding on the first stage, the output layer on
    the last (the stages exchange activations in `params_dtype`)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    a = args or TinyGPTArgs()
    dtype = getattr(a, "params_dtype", torch.float32)
    torch.manual_seed(a.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(a.seed)
    config = TransformerConfig(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=True,
        params_dtype=dtype,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=dtype,
    )
    model: torch.nn.Module = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=a.vocab_size,
        max_sequence_length=a.max_position_embeddings,
        position_embedding_type="learned_absolute",
        parallel_output=True,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=True),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=True),
    ).to(dtype)  # the local spec's torch LayerNorm ignores params_dtype
    if ddp:
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=dtype != torch.float64), module=model
        )
    config.finalize_model_grads_func = finalize_model_grads
    # pipeline stages exchange each micro-batch's activation shape (packed / padded micro-batches vary in length)
    config.variable_seq_lengths = ps.get_pipeline_model_parallel_world_size() > 1
    return model


__all__ = ["TinyGPTArgs", "add_tiny_model_args", "build_tiny_gpt"]
