"""MoE rollout routing replay (R3) through Megatron-LM's own training loop (`megatron.training`, megatron-core
0.19.x), at DP=2 (2 gloo processes, one launch for everything).

Megatron-LM's side is real, as in test_megatron_lm.py (whose stubs this reuses: CPU initialization, the optimizer
and LR scheduler): `parse_and_validate_args` with Megatron-LM's MoE flags (`--num-experts 4 --moe-router-topk 2
--moe-enable-routing-replay`, the all-gather dispatcher and no grouped GEMM, as on CPU), the local layer spec with
experts, `core_transformer_config_from_args`, Megatron DDP, `train_step` and `training_log`. The user side is the
wiring of `slime_corr.mcore.megatron_lm`: `add_megatron_lm_args` as extra_args_provider, `--use-rollout-routing-replay`,
the hook's `model_forward` from `routed_model_forward(args)`, and a pretrain_gpt.py-style forward_step that runs
`hook.model_forward`. Every micro-batch carries random valid routes (`routed_experts`, uint8, mostly not what the
routers would choose).

Checked, over 2 rollouts (3 steps, the weights changing in between):
(a) in every forward (the lp_old pre-pass and each training pass) each router's routing map is the given routes,
    token for token (a forward hook on Megatron's TopKRouter);
(b) the loss, the gradients and lp_old equal a one-process float64 full-batch reference whose routers take the
    given experts through an object of the test's own in RouterReplay's place (not slime_corr's replay_routes);
    the reference without replay has different gradients, so (b) sees a missing replay;
(c) `routing_mismatch_frac` (the trainer's own top-k vs the given routes) is in Megatron's reduced loss dict, > 0
    and equal to the reference's; training_log prints it;
(d) `--use-rollout-routing-replay` without `--moe-enable-routing-replay` is a ConfigError naming both flags, from
    `config_from_args` and `routed_model_forward`; so are replay with an activation recompute that re-runs the
    routers in backward (tried: gradient errors of ~0.2, the recompute routes by itself) and a routing flag on a
    dense model.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from slime_corr.layout.micro_batch import ROUTE_KEY
from slime_corr.mcore.compat import has_megatron_training
from tests.mcore.mcore_helpers import B_GLOBAL, TEMPERATURE, S, local_rows, spawn
from tests.mcore.test_megatron_lm import (
    BASE_ARGV,
    LR,
    ROLLOUTS,
    _init_parallel,
    _parse,
    rollout_data,
    train_iterations,
)

pytestmark = [
    pytest.mark.skipif(not has_megatron_training(),
                       reason="needs Megatron-LM's megatron.training (megatron-core >= 0.19); scripts/test.sh runs it "
                              "in its megatron-core 0.19 environment"),
    pytest.mark.cost(30),  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)
]

N_MB = 2  # micro-batches per optimizer step
E, K, LAYERS = 4, 2, 2
# Megatron-LM's MoE flags as they work on CPU: the all-gather dispatcher (the all-to-all one makes a CUDA stream),
# experts one by one (no --moe-grouped-gemm: TE / CUTLASS), no linear biases (an expert's biased fc2 output is
# modified in place, which autograd refuses at TP=1 on this path; MoE models have none anyway)
MOE_ARGV = ["--num-experts", str(E), "--moe-router-topk", str(K), "--moe-token-dispatcher-type", "allgather",
            "--disable-bias-linear"]
REPLAY_ARGV = [*MOE_ARGV, "--moe-enable-routing-replay", "--use-rollout-routing-replay"]
CASE_ARGV = ["--micro-batch-size", str(B_GLOBAL // 2), "--calculate-per-token-loss",
             "--rollout-correction-preset", "decoupled_token_is"]


def _parse_moe(argv: list[str]):
    from slime_corr.mcore.megatron_lm import add_megatron_lm_args

    return _parse(BASE_ARGV + argv, add_megatron_lm_args)


def _model_config(args):
    """Megatron-LM's model config from the flags, float64 (gradients compare at 1e-6)."""
    from megatron.training.arguments import core_transformer_config_from_args

    return dataclasses.replace(core_transformer_config_from_args(args), params_dtype=torch.float64)


def _gpt(args) -> torch.nn.Module:
    """The MoE GPTModel as pretrain_gpt.py's model provider builds it with the local spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(args.seed)
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm)
    return GPTModel(config=_model_config(args), transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, position_embedding_type="learned_absolute",
                    parallel_output=True).to(torch.float64)


def _routers(model) -> list[torch.nn.Module]:
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert len(routers) == LAYERS
    return routers


def _seq_first(routes: torch.Tensor, layer: int) -> torch.Tensor:
    """`[B, S, L, k]` -> layer's `[S*B, k]` int64: Megatron's hidden states are `[S, B, H]`, flattened s-major."""
    return routes[:, :, layer].transpose(0, 1).reshape(-1, routes.shape[-1]).long()


class _Forced:
    """The reference's replay, in a router's `router_replay` slot: top-k = the given experts, probabilities from
    the router's scores there (RouterReplay's REPLAY_FORWARD), and the router's own top-k kept in `own`."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self.own: torch.Tensor | None = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        self.own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
        return scores.gather(1, self.ids), self.ids


def _force(model, routes: torch.Tensor | None) -> list[_Forced]:
    """Route `model`'s next forwards with `routes` (None: its own top-k)."""
    forced = []
    for layer, router in enumerate(_routers(model)):
        router.router_replay = None if routes is None else _Forced(_seq_first(routes, layer))
        forced.append(router.router_replay)
    return forced


def _lp(model, b, replay: bool = True):
    _force(model, b[ROUTE_KEY] if replay else None)
    logits = model(input_ids=b["tokens"], position_ids=b["position_ids"], attention_mask=None)
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, b["labels"].unsqueeze(-1))[..., 0]


def _random_routes(b: dict, g: torch.Generator) -> None:
    """Each token and layer: K distinct experts of E, rows ascending (uint8, as the engine's)."""
    b[ROUTE_KEY] = torch.rand(B_GLOBAL, S, LAYERS, E, generator=g).argsort(-1)[..., :K].sort(-1).values.to(torch.uint8)


def _rollout_data(args) -> list[list[dict]]:
    """test_megatron_lm's data with random routes; lp_rollout from the initial model replaying them."""
    return rollout_data(partial(_lp, _gpt(args)), torch.Generator().manual_seed(5), _random_routes)


def _grads(model, loss: torch.Tensor) -> dict[int, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {j: p.grad.detach().clone() for j, p in enumerate(model.parameters())}


def reference(cfg, args, rollouts):
    """One rank, full batch, replayed routes: per step (loss, grads, lp_old, routing_mismatch_frac), and the
    gradients of the first step without replay."""
    from slime_corr.losses import compute_policy_loss

    model = _gpt(args)
    out, unreplayed = [], None
    for batches in rollouts:
        with torch.no_grad():
            old = [_lp(model, b) for b in batches]
        for i in range(0, len(batches), N_MB):
            step = {k: torch.cat([b[k] for b in batches[i:i + N_MB]]) for k in batches[0]}
            lp_old = torch.cat(old[i:i + N_MB])

            def loss(replay: bool, step=step, lp_old=lp_old):
                return compute_policy_loss(_lp(model, step, replay), lp_old, step["rollout_log_probs"],
                                           step["advantages"], step["loss_mask"], cfg).loss

            if unreplayed is None:
                unreplayed = _grads(model, loss(False))
            value = loss(True)
            forced = [r.router_replay for r in _routers(model)]
            own = torch.stack([f.own.view(S, -1, K).transpose(0, 1) for f in forced], dim=2)  # [B, S, L, k]
            differ = (own.sort(-1).values != step[ROUTE_KEY].long()).any(-1).double()  # [B, S, L]
            m = step["loss_mask"].double()
            frac = ((differ * m[..., None]).sum() / (LAYERS * m.sum())).item()
            grads = _grads(model, value)
            assert all(g.abs().sum() > 0 for g in grads.values() if g.dim() > 1), "a trivial reference"
            out.append((value.item(), grads, old[i:i + N_MB], frac))
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * p.grad
    return out, unreplayed


def _run(args, rollouts):
    """pretrain()'s loop around Megatron-LM's train_step and training_log; the user's forward_step runs the hook's
    routed model_forward. Returns the loss dicts, the optimizer's grads, the local micro-batches, the log lines and
    each forward's (given routes, each router's routing map)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.training import get_timers
    from megatron.training.training import get_megatron_ddp_config

    from slime_corr.arguments import config_from_args
    from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
    from slime_corr.mcore.megatron_lm import routed_model_forward
    from slime_corr.mcore.rollout_steps import RolloutStepIterator

    config = config_from_args(args)
    gpt = _gpt(args)
    model = [DistributedDataParallel(gpt.config, get_megatron_ddp_config(args), module=gpt)]
    model_config = gpt.config
    model_config.finalize_model_grads_func = finalize_model_grads  # as pretrain() sets them
    model_config.timers = get_timers()

    maps: list[torch.Tensor] = []  # the test's probe: each router's routing map, in forward order
    for router in _routers(model[0]):
        router.register_forward_hook(lambda _m, _inp, result: maps.append(result[1].detach().clone()))
    forwards: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    user_forward = routed_model_forward(args)  # the wiring under test

    def probed_forward(model, batch):
        out = user_forward(model, batch)
        forwards.append((batch[ROUTE_KEY], maps[-LAYERS:]))
        return out

    hook = RolloutCorrectionLoss(config, temperature=TEMPERATURE, model_forward=probed_forward)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    local_rollouts = [[{k: local_rows(v, dp_rank, dp) for k, v in b.items()} for b in batches]
                      for batches in rollouts]
    data = RerunDataIterator(RolloutStepIterator(local_rollouts))

    def forward_step(data_iterator, model):  # as in pretrain_gpt.py
        batch = hook.next_micro_batch(data_iterator, model)
        return hook.model_forward(model, batch), partial(hook.loss_func, batch, model=model)

    results, logs, optimizer = train_iterations(forward_step, data, model, model_config)
    return results, optimizer.grads, local_rollouts, logs, forwards


def _check_replay() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from slime_corr.arguments import config_from_args

    args = _parse_moe(REPLAY_ARGV + CASE_ARGV)
    _init_parallel(args)
    rollouts = _rollout_data(args)
    refs, unreplayed = reference(config_from_args(args), args, rollouts)
    results, grads, local_rollouts, logs, forwards = _run(args, rollouts)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    # (a) every forward: the lp_old pre-pass (one per micro-batch of a rollout) and the training passes
    assert len(forwards) == 2 * sum(ROLLOUTS) * N_MB, len(forwards)
    for n, (routes, layer_maps) in enumerate(forwards):
        for layer, got in enumerate(layer_maps):
            want = torch.zeros(got.shape, dtype=torch.bool).scatter_(1, _seq_first(routes, layer), True)
            bad = (got != want).any(-1).sum().item()
            assert bad == 0, f"forward {n} layer {layer}: {bad} of {got.shape[0]} tokens not routed as given"

    steps = [(r, i) for r, n in enumerate(ROLLOUTS) for i in range(n)]
    assert len(results) == len(refs) == len(grads) == len(steps)
    for j, ((ref_loss, ref_grads, ref_old, ref_frac), got, got_grads) in enumerate(
            zip(refs, results, grads, strict=True)):
        t = f"step {j}"
        # (b) gradients, loss, lp_old against the full-batch replayed reference
        for i, want in ref_grads.items():
            err = (got_grads[i] - want).norm() / want.norm().clamp_min(1e-30)
            assert err <= 1e-6, f"{t} parameter {i}: relative gradient error {err:.2e}"
        assert got["pg_loss"] == pytest.approx(ref_loss, rel=1e-6, abs=1e-9), t
        r, i = steps[j]
        for k, want in enumerate(ref_old):
            b = local_rollouts[r][i * N_MB + k]
            err = (b["old_log_probs"] - local_rows(want, dp_rank, dp)).abs().max().item()
            assert err <= 1e-6, f"{t}: lp_old off by {err:.2e} (micro-batch {k})"
        # (c) the routing mismatch of the trainer's own routers vs the given routes, in Megatron's loss dict
        assert {"routing_mismatch_frac", "routing_mismatch_token_frac", "logprob_abs_diff_routing_diff"} <= set(got), t
        assert got["routing_mismatch_frac"] > 0.3, (t, got["routing_mismatch_frac"])
        assert got["routing_mismatch_frac"] == pytest.approx(ref_frac, abs=1e-9), t
        assert "mismatch_kl" in got, t  # the correction metrics beside it
        if dist.get_rank() == dist.get_world_size() - 1:  # training_log prints on the last rank
            assert "routing_mismatch_frac:" in logs[j], logs[j]
    # the replay matters: the reference without it has other gradients (so (b) fails without replay)
    worst = max(((unreplayed[i] - g).norm() / g.norm()).item() for i, g in refs[0][1].items())
    assert worst > 1e-3, worst


def _check_flags() -> None:
    """(d) the parse-time errors, from config_from_args and from routed_model_forward."""
    from slime_corr.arguments import config_from_args
    from slime_corr.config import ConfigError
    from slime_corr.mcore.megatron_lm import routed_model_forward

    argv = [*CASE_ARGV, "--use-rollout-routing-replay"]
    args = _parse_moe(MOE_ARGV + argv)
    assert args.moe_enable_routing_replay is False
    both = r"--use-rollout-routing-replay .*needs --moe-enable-routing-replay.* Add --moe-enable-routing-replay"
    with pytest.raises(ConfigError, match=both):
        config_from_args(args)
    with pytest.raises(ConfigError, match=both):
        routed_model_forward(args)
    recomputes = {"--recompute-granularity full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                                   "--recompute-num-layers", "1"],
                  "--recompute-modules moe": ["--recompute-granularity", "selective", "--recompute-modules", "moe"]}
    for named, flags in recomputes.items():  # the backward's recompute would route by itself (wrong gradients)
        with pytest.raises(ConfigError, match=f"--use-rollout-routing-replay with {named}: the backward"):
            config_from_args(_parse_moe(REPLAY_ARGV + CASE_ARGV + flags))
    with pytest.raises(ConfigError, match=r"--log-routing-mismatch: the model is dense \(no --num-experts\)"):
        config_from_args(_parse_moe([*CASE_ARGV, "--log-routing-mismatch"]))
    config_from_args(_parse_moe(REPLAY_ARGV + CASE_ARGV))  # the right flags
    config_from_args(_parse_moe(MOE_ARGV + [*CASE_ARGV, "--log-routing-mismatch"]))  # no replay: no RouterReplay


def _worker(rank: int, world: int) -> None:
    import os

    from slime_corr.mcore.cpu_compat import apply_cpu_compat_megatron_training

    # as torchrun and a Megatron-LM launch script set them
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), CUDA_DEVICE_MAX_CONNECTIONS="1")
    apply_cpu_compat_megatron_training()
    _check_flags()
    _check_replay()


def test_megatron_lm_train_step_replays_the_rollout_routes_at_dp2():
    spawn(_worker, 2)
