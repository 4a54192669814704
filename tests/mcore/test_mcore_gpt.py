"""A tiny real GPTModel (local spec, CPU) trained one step through `RolloutCorrectionLoss.train_step` (real
`get_forward_backward_func`, forward-only recompute of lp_old, Megatron DDP, `finalize_model_grads`) under
DP, emulated CP, TP and pipeline parallelism (PP=2 alone, with DP=2, with TP=2 and with CP=2): loss and parameter
gradients equal a single-rank full-batch reference at 1e-6 (fp64), for decoupled and bypass presets, with the step's
--tis-batch-normalize pre-pass in both modes, and with a KL term to a reference policy (another model, run by the
forward-only pass) and an entropy bonus. Under PP the schedule is Megatron's 1F1B pipeline over gloo p2p, and
the forward-only passes (lp_old, the reference log-probs, the bypass normalization log-probs) go through its
forward-only pipelined schedule; every stage is built with the unsplit model's weights for its layers (checked), and
the step metrics exist on the last stage.

Emulated CP (CP attention needs TransformerEngine): every CP rank runs the full sequence and zig-zag-slices
the logits before the loss; the loss, its CP reductions and Megatron's DP×CP gradient reduction are the real ones.
"""

from __future__ import annotations

import dataclasses
import re
from functools import partial

import pytest
import torch
import torch.distributed as dist

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.loss_terms import LossTermsConfig
from slime_corr.mcore.context_parallel import ParallelGroups, slice_batch_for_cp
from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
from slime_corr.mcore.model import TinyGPTArgs, build_tiny_gpt, emulated_cp_forward
from tests.mcore.mcore_helpers import TEMPERATURE, S, V, checking, init_layout, local_rows, spawn, step_data

pytestmark = pytest.mark.cost(70)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

ARGS = TinyGPTArgs(vocab_size=V, max_position_embeddings=S, hidden_size=32, num_attention_heads=4,
                   params_dtype=torch.float64)
CASES = (
    RolloutCorrectionConfig.preset("decoupled_seq_is_rs", loss_agg_mode="seq-mean-token-mean"),
    RolloutCorrectionConfig.preset("decoupled_token_is", tis_batch_normalize=True),
    RolloutCorrectionConfig.preset("pg_is"),
    RolloutCorrectionConfig.preset("pg_is", tis_batch_normalize=True, loss_agg_mode="seq-mean-token-mean"),
    RolloutCorrectionConfig.preset("ppo_is_bypass", loss_agg_mode="seq-mean-token-sum"),
)
# the first case also has a KL term to a reference policy (another seed) and an entropy bonus
TERMS = LossTermsConfig(kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coef=0.01)
REF_ARGS = dataclasses.replace(ARGS, seed=99)
# (TP, CP, DP, PP) per world size
LAYOUTS = {2: ((1, 1, 1, 2),), 4: ((1, 1, 4, 1), (1, 2, 2, 1), (1, 4, 1, 1), (2, 2, 1, 1), (1, 1, 2, 2), (2, 1, 1, 2),
                                   (1, 2, 1, 2))}


def _case_name(cfg: RolloutCorrectionConfig) -> str:
    return f"{cfg.rollout_correction_preset}{'+normalize' if cfg.tis_batch_normalize else ''}"


def _terms(cfg: RolloutCorrectionConfig) -> LossTermsConfig | None:
    return TERMS if cfg is CASES[0] else None


def _name(n: str) -> str:
    return n.removeprefix("module.")


def reference(cfg: RolloutCorrectionConfig, data: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """Single rank, no process groups, torch.log_softmax on full logits, the whole step as ONE batch (its rows are
    the sequences of every micro-batch, so the step's --tis-batch-normalize mean is that batch's): (loss, grads)."""
    from slime_corr.losses import compute_policy_loss

    terms = _terms(cfg)
    ref_model = build_tiny_gpt(REF_ARGS, ddp=False) if terms else None
    model = build_tiny_gpt(ARGS, ddp=False)

    def logp_of(m, b):
        logits = m(input_ids=b["tokens"], position_ids=b["position_ids"], attention_mask=None)
        return torch.log_softmax(logits / TEMPERATURE, -1)

    def lp_of(m, b):
        return logp_of(m, b).gather(-1, b["labels"].unsqueeze(-1))[..., 0]

    old = ref = entropy = None
    with torch.no_grad():
        if not cfg.use_rollout_logprobs:
            old = torch.cat([lp_of(model, b) for b in data])
        if terms:
            ref = torch.cat([lp_of(ref_model, b) for b in data])
    lp = torch.cat([lp_of(model, b) for b in data])
    if terms:
        logp = torch.cat([logp_of(model, b) for b in data])
        entropy = -(logp.exp() * logp).sum(-1)
    step = {k: torch.cat([b[k] for b in data]) for k in ("rollout_log_probs", "advantages", "loss_mask")}
    loss = compute_policy_loss(lp, old, step["rollout_log_probs"], step["advantages"], step["loss_mask"], cfg,
                               loss_terms=terms, ref_log_probs=ref, entropy=entropy).loss
    loss.backward()
    assert all(p.grad.abs().sum() > 0 for p in model.parameters() if p.dim() > 1), cfg  # a non-trivial test
    return loss.item(), {_name(n): p.grad.detach().double().clone() for n, p in model.named_parameters()}


def _reference_name(name: str, pp_rank: int) -> str:
    """A stage's parameter as the single-stage reference names it: its layers are numbered from 0 on every stage
    (the embedding and the output layer are not tied in the tiny GPT)."""
    name = _name(name)
    layer = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    return f"decoder.layers.{int(layer[1]) + pp_rank * ARGS.num_layers // PP}.{layer[2]}" if layer else name


def _check_stage_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], pp_rank: int, tp_rank: int,
                         tp: int) -> None:
    """A PP stage is built with the unsplit model's weights for its layers (its TP shard of each)."""
    for name, p in model.named_parameters():
        full = weights[_reference_name(name, pp_rank)]
        if getattr(p, "tensor_model_parallel", False):
            full = full.chunk(tp, dim=p.partition_dim)[tp_rank]
        assert torch.equal(p.detach(), full), name


PP = 2


def _rollout_near_model(data: list[dict]) -> None:
    """lp_rollout = model's log-probs + small noise, so IS weights are non-trivial and RS keeps most sequences."""
    model = build_tiny_gpt(ARGS, ddp=False)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for b in data:
            logits = model(input_ids=b["tokens"], position_ids=b["position_ids"], attention_mask=None)
            lp = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, b["labels"].unsqueeze(-1))[..., 0]
            b["rollout_log_probs"] = (lp + 0.05 * torch.randn(lp.shape, generator=g)) * b["loss_mask"]


def _full_param(p: torch.Tensor, grad: torch.Tensor, tp_group) -> torch.Tensor:
    """Gather a TP-sharded gradient back to the full parameter shape."""
    if not getattr(p, "tensor_model_parallel", False) or dist.get_world_size(tp_group) == 1:
        return grad
    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, grad.contiguous(), group=tp_group)
    return torch.cat(parts, dim=p.partition_dim)


def _worker(rank: int, world: int) -> None:
    from megatron.core import parallel_state as ps

    data = [{k: v for k, v in b.items() if k not in ("old_log_probs", "ref_log_probs")} for b in step_data(seed=3)]
    init_layout(1, 1)
    _rollout_near_model(data)
    refs = {_case_name(c): reference(c, data) for c in CASES}
    weights = {_name(n): p.detach().clone() for n, p in build_tiny_gpt(ARGS, ddp=False).named_parameters()}
    for tp, cp, dp, pp in LAYOUTS[world]:
        init_layout(tp, cp, pp)
        groups = ParallelGroups.from_parallel_state()
        dp_rank, pp_rank = ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        for cfg in CASES:
            tag = f"TP={tp} CP={cp} DP={dp} PP={pp} {_case_name(cfg)}"
            checking(tag)
            model = build_tiny_gpt(ARGS)
            if pp > 1:
                _check_stage_weights(model.module, weights, pp_rank, ps.get_tensor_model_parallel_rank(), tp)
            batches = []
            for b in data:
                rows = {k: local_rows(v, dp_rank, dp) for k, v in b.items()}
                local = slice_batch_for_cp(rows, groups)
                local["full_tokens"], local["full_position_ids"] = rows["tokens"], rows["position_ids"]
                batches.append(local)
            terms = _terms(cfg)
            hook = RolloutCorrectionLoss(cfg, temperature=TEMPERATURE, model_forward=emulated_cp_forward,
                                         loss_terms=terms,
                                         ref_model=build_tiny_gpt(REF_ARGS, ddp=False) if terms else None)
            model.zero_grad_buffer()
            metrics = hook.train_step(model, batches)
            last = ps.is_pipeline_last_stage(ignore_virtual=True)
            # lp_old lives where the loss does: on the last stage
            assert all("old_log_probs" in b for b in batches) == (last and not cfg.use_rollout_logprobs), tag
            assert all("ref_log_probs" in b for b in batches) == (last and terms is not None), tag
            ref_loss, ref = refs[_case_name(cfg)]
            if last:
                assert abs(metrics["loss"] - ref_loss) <= 1e-6 * max(1.0, abs(ref_loss)), f"{tag}: {metrics['loss']}"
                assert cfg.use_rollout_logprobs or metrics["mis_valid_token_count"] > 0, tag
                assert terms is None or metrics["kl_loss"] > 1e-3, tag  # the reference policy is another model
            else:  # Megatron's convention: the loss and the metrics are on the last stage
                assert metrics == {}, tag
            for name, p in model.named_parameters():
                got = _full_param(p, p.main_grad.double(), groups.tp)
                want = ref[_reference_name(name, pp_rank)]
                err = (got - want).norm() / want.norm().clamp_min(1e-30)
                assert err <= 1e-6, f"{tag} {name}: relative gradient error {err:.2e}"
        if pp == 1:
            _check_per_token_loss_guard(batches, f"TP={tp} CP={cp} DP={dp}")


def _check_per_token_loss_guard(batches: list[dict], tag: str) -> None:
    """calculate_per_token_loss=False in the model config, and a forward_step whose loss_func cannot see the model
    (no Megatron-LM args either): Megatron's real schedule divides the loss in place, and the first backward fails
    with the fix before any gradient reaches a parameter."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from slime_corr.mcore.per_token_loss import PerTokenLossError

    model = build_tiny_gpt(ARGS)
    model.config.calculate_per_token_loss = False
    hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("pg_is"), temperature=TEMPERATURE)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        return emulated_cp_forward(model, batch), partial(hook.loss_func, batch)

    model.zero_grad_buffer()
    with pytest.raises(PerTokenLossError, match="divided the rollout-correction loss in place"):
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=model,
                                    num_microbatches=len(batches), seq_length=S, micro_batch_size=1,
                                    forward_only=False)
    assert all(p.main_grad.abs().sum() == 0 for p in model.parameters()), tag


@pytest.mark.parametrize("world", [2, 4])
def test_tiny_gpt_gradients_match_single_rank_under_dp_cp_tp_pp(world):
    spawn(_worker, world)
