"""Tensor-parallel-aware parameter operations of a Megatron model trained with a plain `torch.optim` optimizer.

- `full_named_tensors`: every weight as its full (un-sharded) tensor, gathering TP shards along each parameter's
  `partition_dim` (Megatron's layout: the TP=1 tensor is the concatenation of the shards), e.g. to export the
  policy to a rollout engine that runs the model unsharded. Collective over the TP group. Under pipeline
  parallelism a stage's layers are named by their number in the whole model (`pipeline.gather_stages` merges the
  stages).
- `optimizer_step`: Megatron DDP accumulates (and, through `finalize_model_grads`, reduces over DP×CP) gradients
  into `main_grad`; this computes the global L2 gradient norm (each TP shard once, parameters replicated across TP
  once, summed over the pipeline stages), clips (Megatron's `--clip-grad`: coefficient max_norm / (norm + 1e-6)
  when below 1), hands the gradients to the optimizer and steps. Megatron's own optimizer and clipping hard-code
  CUDA (`torch.cuda` calls; see `slime_corr/mcore/cpu_compat.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor


def _is_sharded(param: Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def unsplit_name(module: torch.nn.Module) -> Callable[[str], str]:
    """Parameter name -> its name in the unsplit model: a pipeline stage numbers its decoder layers from 0, their
    `layer_number` (1-based) is their number in the whole model. The identity without pipeline parallelism."""
    layers = getattr(getattr(module, "decoder", None), "layers", ())
    renames = {f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}." for i, layer in enumerate(layers)}

    def rename(name: str) -> str:
        prefix = next((p for p in renames if name.startswith(p)), None)
        return name if prefix is None else renames[prefix] + name[len(prefix):]

    return rename


def full_named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor) for every tensor of `module.state_dict()` (not DDP-wrapped). Every rank of the TP group
    must iterate it to the end together (one all_gather per sharded parameter)."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    size = ps.get_tensor_model_parallel_world_size()
    params = dict(module.named_parameters())
    rename = unsplit_name(module)
    for name, tensor in module.state_dict().items():
        if not isinstance(tensor, Tensor):
            continue
        param = params.get(name)
        if size > 1 and param is not None and _is_sharded(param):
            parts = [torch.empty_like(tensor) for _ in range(size)]
            dist.all_gather(parts, tensor.detach().contiguous(), group=group)
            tensor = torch.cat(parts, dim=param.partition_dim)
        yield rename(name), tensor.detach()


def _zero_like_params(model: torch.nn.Module) -> Tensor:
    """A float64 zero on the model's device (the CPU for a model without parameters)."""
    p = next(model.parameters(), None)
    return torch.zeros((), dtype=torch.float64, device=None if p is None else p.device)


def grad_norm(model: torch.nn.Module) -> Tensor:
    """Global L2 norm (float64) of the `main_grad`s of a Megatron DDP model: TP-sharded parameters summed over the
    TP group, replicated ones counted once, pipeline stages summed (one all-reduce over the model-parallel group,
    TP×PP); DP×CP replicas hold the same reduced gradients."""
    from megatron.core import parallel_state as ps

    first = ps.get_tensor_model_parallel_rank() == 0
    squares = [p.main_grad.double().square().sum() for p in model.parameters() if first or _is_sharded(p)]
    total = torch.stack(squares).sum() if squares else _zero_like_params(model)
    if ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=ps.get_model_parallel_group())
    return total.sqrt()


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, clip_grad: float | None = None
                   ) -> float:
    """Clip by the global norm (when `clip_grad` > 0), copy `main_grad` into `.grad`, step. Returns the norm
    before clipping."""
    norm = grad_norm(model)
    scale = 1.0
    if clip_grad and float(norm) > 0:
        scale = min(1.0, clip_grad / (float(norm) + 1e-6))
    for p in model.parameters():
        p.grad = (p.main_grad * scale).to(p.dtype) if scale != 1.0 else p.main_grad.to(p.dtype)
    optimizer.step()
    return float(norm)


__all__ = ["full_named_tensors", "grad_norm", "optimizer_step", "unsplit_name"]
