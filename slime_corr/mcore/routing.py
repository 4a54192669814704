"""The experts Megatron-Core's MoE routers pick: a capture of each layer's `TopKRouter` output during a forward.

Megatron's hidden states are sequence-first (`[S, B, H]`), so a router sees tokens in (s, b) order and returns
`routing_map` `[S*B, num_experts]` (bool, k entries set per token). Routes here are batch-first expert ids
`[B, S, layers, top_k]`, each row sorted ascending (a top-k *set*), the layout `models.tiny_moe.topk_routes` and
the rollout's routed experts use.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The `TopKRouter` of every MoE layer of a GPTModel (wrappers allowed), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def routing_map_to_ids(routing_map: torch.Tensor, top_k: int) -> torch.Tensor:
    """`[tokens, E]` bool map with `top_k` experts set per token -> `[tokens, top_k]` ids, ascending."""
    counts = routing_map.sum(-1)
    if not bool((counts == top_k).all()):
        raise ValueError(f"routing_map has {counts.unique().tolist()} experts per token, expected top_k={top_k}")
    ids = torch.arange(routing_map.size(-1), device=routing_map.device).expand_as(routing_map)
    return ids[routing_map].view(-1, top_k)  # boolean indexing keeps row-major (ascending) order


@contextmanager
def capture_routes(model: nn.Module, batch_size: int) -> Iterator[list[torch.Tensor]]:
    """Inside the block, each forward of `model` on `batch_size` sequences appends its routes `[B, S, L, k]`
    (int64) to the yielded list."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError("capture_routes: the model has no MoE router (num_moe_experts unset?)")
    per_layer: list[torch.Tensor] = []
    out: list[torch.Tensor] = []

    def hook(router: nn.Module, _inp, result) -> None:
        _probs, routing_map = result
        k = router.config.moe_router_topk
        ids = routing_map_to_ids(routing_map, k)
        per_layer.append(ids.view(-1, batch_size, k).transpose(0, 1))  # [S*B, k] -> [B, S, k]
        if len(per_layer) == len(routers):
            out.append(torch.stack(per_layer, dim=2))
            per_layer.clear()

    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


__all__ = ["moe_routers", "routing_map_to_ids", "capture_routes"]
