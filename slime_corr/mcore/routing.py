"""The experts Megatron-Core's MoE routers pick: a capture of each layer's `TopKRouter` output during a forward,
and routing replay (Megatron's `RouterReplay`, `moe_enable_routing_replay=True`): force given experts.

Megatron's hidden states are sequence-first (`[S, B, H]`), so a router sees tokens in (s, b) order and returns
`routing_map` `[S*B, num_experts]` (bool, k entries set per token). Routes here are batch-first expert ids
`[B, S, layers, top_k]`, each row sorted ascending (a top-k *set*), the layout `models.tiny_moe.topk_routes` and
the rollout's routed experts use. Under pipeline parallelism a stage holds some of the layers: its routers replay
their own layers of the routes (`TopKRouter.layer_number`), and the routes it captures have -1 at the other
stages' layers until `stage_routing_reports` fills them in (MAX over the pipeline group, after the schedule).
Under sequence parallelism (MoE with TP > 1) a router sees its TP rank's contiguous share of the sequence-first
tokens: it replays that share, and captured routes are gathered over TP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from slime_corr.correction.reporting import ratio_pair
from slime_corr.correction.routing import routing_mismatch_pairs
from slime_corr.layout.micro_batch import ROUTE_KEY
from slime_corr.mcore.context_parallel import slice_tensor_for_cp

# The trainer's own routes `[B, S, L, k]` of a training forward (what its routers chose, before any replay),
# stored in the micro-batch by `routed_forward` for the loss function's routing-mismatch report.
TRAINER_ROUTES_KEY = "trainer_routed_experts"
# Under pipeline parallelism: the last stage's log-probs of a micro-batch, kept for `stage_routing_reports`
ROUTING_LOG_PROBS_KEY = "routing_log_probs"


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


def _sequence_parallel(router: nn.Module) -> bool:
    return bool(router.config.sequence_parallel) and router.tp_group.size() > 1


def _local_share(router: nn.Module, ids: Tensor) -> Tensor:
    """Sequence-first `[S*B, k]` ids -> the rows this router sees (its TP rank's sequence share under SP)."""
    if not _sequence_parallel(router):
        return ids
    return ids.chunk(router.tp_group.size(), dim=0)[router.tp_group.rank()]


def _gather_shares(router: nn.Module, ids: Tensor) -> Tensor:
    """The inverse of `_local_share`: every TP rank's rows, in order (a collective over TP under SP)."""
    if not _sequence_parallel(router):
        return ids
    import torch.distributed as dist

    parts = [torch.empty_like(ids) for _ in range(router.tp_group.size())]
    dist.all_gather(parts, ids.contiguous(), group=router.tp_group)
    return torch.cat(parts)


def router_layers(routers: list[nn.Module]) -> list[int]:
    """The 0-based index, in the whole model, of each router's layer (pipeline stages hold some of them)."""
    return [int(r.layer_number) - 1 for r in routers]


def _stage_routes(per_layer: list[Tensor], layers: list[int], num_layers: int, batch_size: int) -> Tensor:
    """Each local router's `[S*B, k]` ids (sequence-first) -> `[B, S, num_layers, k]` (int64, rows ascending),
    -1 at the layers of other pipeline stages."""
    k = per_layer[0].shape[-1]
    local = torch.stack([ids.view(-1, batch_size, k).transpose(0, 1) for ids in per_layer], dim=2)
    out = local.new_full((*local.shape[:2], num_layers, k), -1)
    out[:, :, layers] = local.sort(dim=-1).values
    return out


@contextmanager
def capture_routes(model: nn.Module, batch_size: int) -> Iterator[list[torch.Tensor]]:
    """Inside the block, each forward of `model` on `batch_size` sequences appends its routes `[B, S, L, k]`
    (int64; L the model's layers, -1 at another pipeline stage's) to the yielded list."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError("capture_routes: the model has no MoE router (num_moe_experts unset?)")
    layers, num_layers = router_layers(routers), routers[0].config.num_layers
    per_layer: list[torch.Tensor] = []
    out: list[torch.Tensor] = []

    def hook(router: nn.Module, _inp, result) -> None:
        _probs, routing_map = result
        per_layer.append(_gather_shares(router, routing_map_to_ids(routing_map, router.config.moe_router_topk)))
        if len(per_layer) == len(routers):
            out.append(_stage_routes(per_layer, layers, num_layers, batch_size))
            per_layer.clear()

    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def _check_routes(routers: list[nn.Module], routes: torch.Tensor) -> None:
    layers = routers[0].config.num_layers
    if routes.dim() != 4 or routes.shape[2] != layers:
        raise ValueError(f"replay_routes: routes {tuple(routes.shape)} must be [batch, seq, {layers} layers, "
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
        self._own: list[Tensor | None] = [None] * len(routers)

    def own_routes(self, batch_size: int) -> Tensor:
        """`[B, S, L, k]` (int64, rows ascending; -1 at another pipeline stage's layers): the experts each router
        would have chosen itself in the last replayed forward (its own top-k of the scores it computed, before the
        replay replaced them)."""
        if any(ids is None for ids in self._own):
            raise RuntimeError("own_routes: no replayed forward ran inside replay_routes")
        own = [_gather_shares(r, ids) for r, ids in zip(self.routers, self._own, strict=True)]  # type: ignore[arg-type]
        return _stage_routes(own, router_layers(self.routers), self.routers[0].config.num_layers, batch_size)

    def _record_own(self) -> None:
        """Wrap each router's `RouterReplay.get_replay_topk` (on the instance) so that a replayed forward also
        computes the router's own top-k from the same scores (`default_compute_topk`), kept for `own_routes`."""
        for i, r in enumerate(self.routers):
            replay = r.router_replay
            original = type(replay).get_replay_topk.__get__(replay)

            def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None,
                                _i=i, _original=original):
                self._own[_i] = default_compute_topk(scores, topk, num_groups=num_groups,
                                                     group_topk=group_topk)[1].detach()
                return _original(scores, topk, num_groups, group_topk, default_compute_topk)

            replay.get_replay_topk = get_replay_topk

    def _stop_recording(self) -> None:
        for r in self.routers:
            r.router_replay.__dict__.pop("get_replay_topk", None)

    def next_forward(self, routes: torch.Tensor) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        _check_routes(self.routers, routes)
        for r, layer in zip(self.routers, router_layers(self.routers), strict=True):
            r.router_replay.set_target_indices(_local_share(r, _router_order(routes, layer)))  # queued for backward too
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
    handle._record_own()
    try:
        yield handle
    finally:
        handle._stop_recording()
        for r in routers:
            r.router_replay.clear_indices()
            r.router_replay.clear_router_replay_action()


def model_tokens(batch: dict[str, Any]) -> Tensor:
    """The tokens the model runs on: the full rows under emulated CP (`full_tokens`), else `tokens`."""
    return batch.get("full_tokens", batch["tokens"])


def routed_forward(inner: Callable[[nn.Module, dict[str, Tensor]], Tensor], *, replay: bool
                   ) -> Callable[[nn.Module, dict[str, Tensor]], Tensor]:
    """A `model_forward(model, batch)` for MoE models whose micro-batches carry the engine's routes
    (`batch[ROUTE_KEY]` `[B, S, L, k]`, laid out like the tokens the model runs on: the full rows under emulated
    CP). `replay`: every forward (training, lp_old, reference) routes with the engine's experts
    (`replay_routes`); else the model routes itself. A forward with gradients (the training pass) also stores the
    trainer's own routes in `batch[TRAINER_ROUTES_KEY]` (under replay: what its routers would have chosen), which
    the loss function compares with the engine's (`routing_report`). A batch without routes runs `inner` as is."""
    def forward(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        routes = batch.get(ROUTE_KEY)
        if routes is None:
            return inner(model, batch)
        tokens = model_tokens(batch)
        if tuple(routes.shape[:2]) != tuple(tokens.shape):
            raise ValueError(f"{ROUTE_KEY} {tuple(routes.shape)} does not cover the tokens the model runs on "
                             f"{tuple(tokens.shape)} (under emulated CP the routes stay unsliced)")
        record = torch.is_grad_enabled()
        batch_size = tokens.shape[0]
        if replay:
            with replay_routes(model, routes) as handle:
                out = inner(model, batch)
            if record:
                batch[TRAINER_ROUTES_KEY] = handle.own_routes(batch_size)
            return out
        with capture_routes(model, batch_size) if record else nullcontext([]) as captured:
            out = inner(model, batch)
        if record:
            batch[TRAINER_ROUTES_KEY] = captured[-1]
        return out

    return forward


def old_routes_forward(inner: Callable[[nn.Module, dict[str, Tensor]], Tensor]
                       ) -> Callable[[nn.Module, dict[str, Tensor]], Tensor]:
    """slime's R2 (`--use-routing-replay`) as a `model_forward(model, batch)`: the first forward of a micro-batch,
    the policy's lp_old pass (forward-only, before the rollout's first update), records the experts its routers
    choose in `batch[ROUTE_KEY]` (`[B, S, L, k]` int16 of the tokens the model runs on; under PP each stage its own
    layers, -1 at the others', which it never replays); every later forward of that micro-batch (the reference's,
    each training pass) routes with them, so the update's routes stay those of π_old whatever the weights became."""
    def forward(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        routes = batch.get(ROUTE_KEY)
        if routes is None:
            if torch.is_grad_enabled():
                raise RuntimeError("--use-routing-replay: a training forward ran before the lp_old pass recorded the "
                                   "micro-batch's routes (decoupled mode computes lp_old first)")
            with capture_routes(model, model_tokens(batch).shape[0]) as captured:
                out = inner(model, batch)
            batch[ROUTE_KEY] = captured[-1].to(torch.int16)  # kept to the last pass: compact (-1 needs a sign)
            return out
        with replay_routes(model, routes):
            return inner(model, batch)

    return forward


def routing_report(batch: dict[str, Any], log_probs: Tensor, groups: Any) -> dict[str, Tensor]:
    """The loss function's routing-mismatch entries of one micro-batch (Megatron `[numerator, denominator]`
    pairs, this rank's sums; {} without `batch[TRAINER_ROUTES_KEY]`): the trainer's own routes vs the engine's at
    the trained positions (`loss_mask`: position t's logits, which token t's experts compute, predict the trained
    token t+1), and |log π_θ − log π_rollout| split by a routing difference there (`correction.routing`).
    Under emulated CP the full-row routes are cut to this rank's slice first. Under pipeline parallelism the
    other stages' routes are not known yet: the log-probs are kept in the batch and `stage_routing_reports` adds
    the entries after the schedule ({} here)."""
    if TRAINER_ROUTES_KEY not in batch:
        return {}
    if groups.pp_size > 1:
        batch[ROUTING_LOG_PROBS_KEY] = log_probs.detach()
        return {}
    return _routing_entries(batch, log_probs, groups)


def _routing_entries(batch: dict[str, Any], log_probs: Tensor, groups: Any) -> dict[str, Tensor]:
    own, engine = batch[TRAINER_ROUTES_KEY], batch[ROUTE_KEY]
    mask = batch["loss_mask"]
    if own.shape[1] != mask.shape[-1]:  # full rows (emulated CP): this rank's slice
        own, engine = slice_tensor_for_cp(own, batch, groups), slice_tensor_for_cp(engine, batch, groups)
    pairs = routing_mismatch_pairs(engine.to(own.device), own, mask, log_probs.detach(),
                                   batch["rollout_log_probs"].to(log_probs.dtype))
    return {key: ratio_pair(num, den) for key, (num, den) in pairs.items()}


def stage_routing_reports(batches: list[dict[str, Any]], reports: list[dict[str, Any]], groups: Any) -> None:
    """After a pipelined training step: each micro-batch's own routes, recorded stage by stage (-1 at the other
    stages' layers), merged by a MAX over the pipeline group (one all-reduce per micro-batch, every stage); then
    the last stage adds each micro-batch's routing entries to its report (`reports`, in schedule order)."""
    import torch.distributed as dist

    for batch in batches:
        dist.all_reduce(batch[TRAINER_ROUTES_KEY], op=dist.ReduceOp.MAX, group=groups.pp)
    if not groups.pp_last:
        return
    if len(reports) != len(batches):
        raise RuntimeError(f"stage_routing_reports: {len(reports)} micro-batch reports for {len(batches)} routed "
                           "micro-batches")
    for report, batch in zip(reports, batches, strict=True):
        report.update(_routing_entries(batch, batch.pop(ROUTING_LOG_PROBS_KEY), groups))


__all__ = ["TRAINER_ROUTES_KEY", "ROUTING_LOG_PROBS_KEY", "moe_routers", "router_layers", "routing_map_to_ids",
           "capture_routes", "replay_routes", "ReplayHandle", "model_tokens", "old_routes_forward", "routed_forward",
           "routing_report", "stage_routing_reports"]
