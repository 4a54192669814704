"""A tiny Megatron `GPTModel` (local layer spec, learned absolute positions) for tests and the CPU demo job.

`build_tiny_gpt` wires what the rollout-correction loss needs: `calculate_per_token_loss=True`,
`finalize_model_grads` as the grad-finalize hook and Megatron DDP (gradient all-reduce over DP×CP). The model is
made on the CPU (`use_cpu_initialization`: the same weights at any TP) and moved to the device `slime_corr.device`
chose before DDP wraps it. On CPU call `slime_corr.mcore.cpu_compat.apply_cpu_compat()` first.

`single_rank_groups()` + `build_tiny_gpt(..., pg_collection=...)` build the same architecture unsharded beside a
TP-sharded trainer in the same process (the embedded rollout engine): its layers then never touch the trainer's
process groups. `emulated_cp_forward` is context parallelism on CPU (CP attention needs TransformerEngine): every CP
rank runs the full sequence and zig-zag-slices the logits before the loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slime_corr.device import place_module
from slime_corr.fields import flag
from slime_corr.layout.context_parallel import is_packed
from slime_corr.mcore.context_parallel import ParallelGroups, packed_seq_params, slice_tensor_for_cp
from slime_corr.mcore.local_spec import local_layer_spec
from slime_corr.mcore.params import unsplit_name


@dataclass(frozen=True)
class TinyGPTArgs:
    """The tiny GPT's shape and seed; the fields that are flags carry their help (`slime_corr.flags.model`)."""

    num_layers: int = flag(2, help="Transformer layers of the tiny GPT.")
    hidden_size: int = flag(64, help="Hidden size of the tiny GPT.")
    num_attention_heads: int = flag(4, help="Attention heads of the tiny GPT (must divide --hidden-size).")
    vocab_size: int = flag(128, help="Vocabulary size of the tiny GPT (the main job: 256, byte tokens).")  # divisible by TP
    max_position_embeddings: int = flag(256, help="Positions of the tiny GPT (prompt + response must fit).")
    seed: int = flag(1234, help="Random seed: the model's initialization (in the main job also the prompts and the "
                    "sampling).")
    params_dtype: torch.dtype = torch.float32  # tests use float64 to compare gradients at 1e-6


def build_tiny_gpt(args: TinyGPTArgs | argparse.Namespace | None = None, *, ddp: bool = True,
                   pg_collection: Any = None) -> torch.nn.Module:
    """A tiny GPTModel (fp32 unless `params_dtype`) on the current parallel_state (TP from it; CP attention is
    not used: build with context_parallel_size=1 and zig-zag-slice the logits to emulate CP on CPU). Same weights on every
    DP/CP rank for a given seed; TP shards come from `use_cpu_initialization` of the full weights. Under pipeline
    parallelism this rank's stage: its share of the layers, the embedding on the first stage, the output layer on
    the last (the stages exchange activations in `params_dtype`), with the weights the unsplit model has for the
    seed (a stage's own initialization would draw other random numbers): a seed gives one model at any TP and PP,
    on any device (made on the CPU, then moved to `slime_corr.device`'s).

    `pg_collection` (e.g. `single_rank_groups()`): the model's own process groups instead of parallel_state's; the
    weights are then left uninitialized (to be loaded) and the global RNG is not touched."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
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

    def gpt(config: TransformerConfig, pre_process: bool, post_process: bool) -> torch.nn.Module:
        return GPTModel(
            config=config,
            transformer_layer_spec=local_layer_spec(),
            vocab_size=a.vocab_size,
            max_sequence_length=a.max_position_embeddings,
            position_embedding_type="learned_absolute",
            parallel_output=True,
            pre_process=pre_process,
            post_process=post_process,
            **({"pg_collection": pg_collection} if pg_collection is not None else {}),
        ).to(dtype)  # the local spec's torch LayerNorm ignores params_dtype

    model = gpt(config, pp_rank == 0, pp_rank == pp_size - 1)
    if pp_size > 1 and pg_collection is None:  # the stage takes its part of the unsplit model's initial weights
        torch.manual_seed(a.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(a.seed)
        unsplit = gpt(dataclasses.replace(config, pipeline_model_parallel_size=1), True, True).state_dict()
        rename = unsplit_name(model)
        model.load_state_dict({name: unsplit[rename(name)] for name in model.state_dict()})
    model = place_module(model)
    if ddp:
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=dtype != torch.float64), module=model
        )
    config.finalize_model_grads_func = finalize_model_grads
    # pipeline stages exchange each micro-batch's activation shape (packed / padded micro-batches vary in length)
    config.variable_seq_lengths = pp_size > 1
    return model


# default process group -> this rank's collection; weak: an entry must not keep a destroyed world's group alive
_SINGLE_RANK_GROUPS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


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
    """The local layer spec's forward with context parallelism emulated, exactly: the full sequence
    (`full_tokens` / `full_position_ids`) through the model, then this CP rank's slice of the logits (the loss
    sees the layout of real CP attention). A packed (THD) row passes Megatron's `PackedSeqParams` of the full row
    (`mcore.local_spec` runs them on CPU). Without CP it is `default_model_forward`. Under pipeline parallelism
    only the last stage's output (the logits) is sliced; the others pass hidden states on."""
    groups = ParallelGroups.current()
    if groups.cp_size > 1 and "full_tokens" not in batch:
        raise KeyError("emulated CP runs the full row: the micro-batch needs 'full_tokens' and 'full_position_ids' "
                       "(the tokens and position ids before CP slicing).")
    tokens = batch.get("full_tokens", batch["tokens"])
    positions = batch.get("full_position_ids", batch["position_ids"])
    packed = {"packed_seq_params": packed_seq_params(batch)} if is_packed(batch) else {}
    out = model(input_ids=tokens, position_ids=positions, attention_mask=batch.get("attention_mask"), **packed)
    return slice_tensor_for_cp(out, batch, groups) if groups.pp_last and groups.cp_size > 1 else out


__all__ = ["TinyGPTArgs", "build_tiny_gpt", "emulated_cp_forward", "single_rank_groups"]
