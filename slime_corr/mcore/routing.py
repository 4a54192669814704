"""The experts Megatron-Core's MoE routers pick: a capture of each layer's `TopKRouter` output during a forward,
and routing replay (Megatron's `RouterReplay`, `moe_enable_routing_replay=True`): force given experts.

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


def _check_routes(routers: list[nn.Module], routes: torch.Tensor) -> None:
    if routes.dim() != 4 or routes.shape[2] != len(routers):
        raise ValueError(f"replay_routes: routes {tuple(routes.shape)} must be [batch, seq, {len(routers)} layers, "
                         "top_k]")
    k = routers[0].config.moe_router_topk
    if routes.shape[-1] != k:
        raise ValueError(f"replay_routes: routes have top_k={routes.shape[-1]}, the model's routers {k}")


def _router_order(routes: torch.Tensor, layer: int) -> torch.Tensor:
    """`[B, S, L, k]` -> layer `layer`'s `[S*B, k]` int64 in the router's (sequence-first) token order."""
    return routes[:, :, layer].transpose(0, 1).reshape(-1, routes.shape[-1]).long()


class ReplayHandle:
    """What `replay_routes` yields. `next_forward(routes)` replays other routes in the next forward (the next
    micro-batch). With activation recompute (`recompute_granularity`) the backward pass runs the routers again;
    while a forward's routes are still the current ones the recompute replays them, but once later micro-batches
    were forwarded (pipeline schedules) call `backward_phase()` before the backwards: each recompute then takes its
    own forward's routes, in forward order (`RouterReplay`'s REPLAY_BACKWARD). Megatron-Core does not switch it."""

    def __init__(self, routers: list[nn.Module]) -> None:
        self.routers = routers

    def next_forward(self, routes: torch.Tensor) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        _check_routes(self.routers, routes)
        for i, r in enumerate(self.routers):
            r.router_replay.set_target_indices(_router_order(routes, i))  # also queued for the backward
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def backward_phase(self) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for r in self.routers:
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)


@contextmanager
def replay_routes(model: nn.Module, routes: torch.Tensor) -> Iterator[ReplayHandle]:
    """Inside the block, every forward of `model` routes its tokens to `routes` (`[B, S, L, k]` expert ids of the
    batch it is given, batch-first; any integer dtype) instead of its routers' own top-k; the routers' weights
    still come from their own scores at those experts (`RouterReplay.get_replay_topk`: the gathered scores).
    Set per router of this model (not through `RouterReplay`'s process-wide instance list, which every model
    built in the process appends to). The model must be built with `moe_enable_routing_replay=True`. Yields a
    :class:`ReplayHandle` (activation recompute in backward)."""
    routers = moe_routers(model)
    missing = [i for i, r in enumerate(routers) if r.router_replay is None]
    if not routers or missing:
        raise ValueError("replay_routes: build the model with moe_enable_routing_replay=True "
                         f"(config_overrides); routers without replay: {missing or 'no MoE router'}")
    for r in routers:
        r.router_replay.clear_indices()
    handle = ReplayHandle(routers)
    handle.next_forward(routes)
    try:
        yield handle
    finally:
        for r in routers:
            r.router_replay.clear_indices()
            r.router_replay.clear_router_replay_action()


__all__ = ["moe_routers", "routing_map_to_ids", "capture_routes", "replay_routes", "ReplayHandle"]
