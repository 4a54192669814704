"""A tiny Megatron `GPTModel` (local layer spec, learned absolute positions) for tests and the CPU demo job.

`build_tiny_gpt` wires what the rollout-correction loss needs: `calculate_per_token_loss=True`,
`finalize_model_grads` as the grad-finalize hook and Megatron DDP (gradient all-reduce over DP×CP).
On CPU call `slime_corr.mcore.cpu_compat.apply_cpu_compat()` first.

`single_rank_groups()` + `build_tiny_gpt(..., pg_collection=...)` build the same architecture unsharded beside a
TP-sharded trainer in the same process (the embedded rollout engine): its layers then never touch the trainer's
process groups. `emulated_cp_forward` is context parallelism on CPU (CP attention needs TransformerEngine): every CP
rank runs the full sequence and zig-zag-slices the logits before the loss.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


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


def build_tiny_gpt(args: TinyGPTArgs | argparse.Namespace | None = None, *, ddp: bool = True,
                   pg_collection: Any = None) -> torch.nn.Module:
    """A tiny GPTModel (fp32 unless `params_dtype`) on the current parallel_state (TP from it; CP attention is
    not used: build with context_parallel_size=1 and zig-zag-slice the logits to emulate CP on CPU). Same weights on every
    DP/CP rank for a given seed; TP shards come from `use_cpu_initialization` of the full weights. Under pipeline
    parallelism this rank's stage: its share of the layers, the embedding on the first stage, the output layer on
    the last (the stages exchange activations in `params_dtype`).

    `pg_collection` (e.g. `single_rank_groups()`): the model's own process groups instead of parallel_state's; the
    weights are then left uninitialized (to be loaded) and the global RNG is not touched."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    a = args or TinyGPTArgs()
    dtype = getattr(a, "params_dtype", torch.float32)
    if pg_collection is None:
        torch.manual_seed(a.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(a.seed)
        tp_size = ps.get_tensor_model_parallel_world_size()
        pp_size, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    else:
        tp_size, pp_size, pp_rank = pg_collection.tp.size(), pg_collection.pp.size(), pg_collection.pp.rank()
    config = TransformerConfig(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        tensor_model_parallel_size=tp_size,
        use_cpu_initialization=True,
        perform_initialization=pg_collection is None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=True,
        params_dtype=dtype,
        pipeline_model_parallel_size=pp_size,
        pipeline_dtype=dtype,
    )
    model: torch.nn.Module = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=a.vocab_size,
        max_sequence_length=a.max_position_embeddings,
        position_embedding_type="learned_absolute",
        parallel_output=True,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        **({"pg_collection": pg_collection} if pg_collection is not None else {}),
    ).to(dtype)  # the local spec's torch LayerNorm ignores params_dtype
    if ddp:
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=dtype != torch.float64), module=model
        )
    config.finalize_model_grads_func = finalize_model_grads
    # pipeline stages exchange each micro-batch's activation shape (packed / padded micro-batches vary in length)
    config.variable_seq_lengths = pp_size > 1
    return model


_SINGLE_RANK_GROUPS: dict[Any, Any] = {}  # default process group -> this rank's collection


def single_rank_groups() -> Any:
    """A `ProcessGroupCollection` whose groups hold this rank only. The first call in a default process group is
    COLLECTIVE (every rank creates every rank's group, as `torch.distributed.new_group` requires); later calls
    reuse it."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    world = dist.group.WORLD
    if world not in _SINGLE_RANK_GROUPS:
        _SINGLE_RANK_GROUPS.clear()  # groups of an earlier (destroyed) default group
        rank, mine = dist.get_rank(), None
        for r in range(dist.get_world_size()):
            group = dist.new_group([r])
            if r == rank:
                mine = group
        pgs = ProcessGroupCollection()
        for name in ("tp", "pp", "mp", "cp", "tp_cp", "embd", "pos_embd", "ep", "expt_tp", "tp_ep", "tp_ep_pp",
                     "dp", "dp_cp", "expt_dp"):
            setattr(pgs, name, mine)
        _SINGLE_RANK_GROUPS[world] = pgs
    return _SINGLE_RANK_GROUPS[world]


def emulated_cp_forward(model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Context parallelism on CPU: the full sequence (`full_tokens`, `full_position_ids`) through the model, then
    this CP rank's zig-zag slice of the logits (the loss sees the same layout as with real CP attention)."""
    from slime_corr.mcore.context_parallel import ParallelGroups, zigzag_slice

    groups = ParallelGroups.current()
    logits = model(input_ids=batch["full_tokens"], position_ids=batch["full_position_ids"], attention_mask=None)
    return zigzag_slice(logits, groups.cp_rank, groups.cp_size, dim=1)


__all__ = ["TinyGPTArgs", "add_tiny_model_args", "build_tiny_gpt", "emulated_cp_forward", "single_rank_groups"]
