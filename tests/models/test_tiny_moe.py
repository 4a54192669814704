"""The tiny Qwen3-MoE on the trainer's side: HF -> Megatron-Core GPTModel (local spec, SequentialMLP) through
mbridge, logits equal to HF's (fp32 and fp64), the same experts chosen by both routers, the weights bitwise after
the round trip; Megatron's RouterReplay forces given experts."""

from __future__ import annotations

import pytest
import torch

from slime_corr import device
from slime_corr.engines.embedded.model import TorchEngineModel
from slime_corr.mcore.routing import capture_routes, moe_routers, replay_routes, routing_map_to_ids
from slime_corr.models import build_gpt_from_hf, load_engine_module, load_hf_causal_lm
from slime_corr.models.check import max_logit_diff, megatron_logits, round_trip_mismatches
from slime_corr.models.hf_checkpoint import CheckpointError, read_hf_checkpoint, spec_from_config
from slime_corr.models.tiny_moe import TinyMoEArgs, hf_router_logits, make_tiny_moe_checkpoint, topk_routes
from tests.mcore.mcore_helpers import checking, spawn

ARGS = TinyMoEArgs()
IDS = torch.randint(0, ARGS.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_moe_checkpoint(tmp_path_factory.mktemp("tiny_moe"), ARGS)


def test_checkpoint_spec(moe_dir):
    spec = read_hf_checkpoint(moe_dir)
    assert spec.model_type == "qwen3_moe" and spec.is_moe
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (8, 2, 32)
    assert not spec.qkv_bias and not spec.tie_word_embeddings
    import json

    cfg = json.loads((moe_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    with pytest.raises(CheckpointError, match="norm_topk_prob"):
        spec_from_config({**cfg, "norm_topk_prob": False})
    with pytest.raises(CheckpointError, match="mlp_only_layers"):
        spec_from_config({**cfg, "mlp_only_layers": [0]})


def test_routing_map_to_ids():
    m = torch.tensor([[0, 1, 0, 1], [1, 1, 0, 0]], dtype=torch.bool)
    assert routing_map_to_ids(m, 2).tolist() == [[1, 3], [0, 1]]
    with pytest.raises(ValueError, match="top_k=3"):
        routing_map_to_ids(m, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_megatron_equals_hf_logits_and_routes(single_rank, moe_dir, dtype):
    model, bridge = build_gpt_from_hf(moe_dir, dtype=dtype)
    hf = load_hf_causal_lm(moe_dir, dtype=dtype)
    diff = max_logit_diff(model, hf, IDS)
    # HF's router takes the softmax in float32 even in a float64 model: fp32 rounding of the expert weights
    print(f"tiny MoE {dtype}: max |logits megatron - hf eager| = {diff:.3e}")
    assert diff <= 1e-5, diff
    with capture_routes(model, IDS.size(0)) as captured:
        megatron_logits(model, IDS)
    (routes,) = captured
    hf_routes = topk_routes(hf_router_logits(hf, IDS), ARGS.num_experts_per_tok)
    assert routes.shape == (3, 24, ARGS.num_hidden_layers, ARGS.num_experts_per_tok)
    assert torch.equal(routes, hf_routes)
    assert len(torch.unique(routes)) == ARGS.num_experts  # the weights spread tokens over every expert
    if dtype == torch.float32:  # the checkpoint's dtype: export gives it back bitwise (expert names included)
        assert round_trip_mismatches(bridge, model) == []
    unloaded = bridge.build_model(load_weights=False)
    assert max_logit_diff(unloaded, hf, IDS) > 0.1  # the comparison sees the weights


def test_replay_forces_the_given_routes(single_rank, moe_dir):
    """Megatron's RouterReplay through `replay_routes`: its own routes replayed give the same logits; other routes
    (random sets) are what the routers then report, change the logits, and gradients flow through the routers'
    weights of the replayed experts."""
    model, _ = build_gpt_from_hf(moe_dir, config_overrides={"moe_enable_routing_replay": True})
    with capture_routes(model, IDS.size(0)) as captured:
        ref = megatron_logits(model, IDS)
    own = captured[0]
    with replay_routes(model, own.to(torch.uint8)), capture_routes(model, IDS.size(0)) as again:
        assert torch.equal(megatron_logits(model, IDS), ref)
    assert torch.equal(again[0], own)

    g = torch.Generator().manual_seed(3)
    forced = torch.rand(*own.shape[:-1], ARGS.num_experts, generator=g).argsort(-1)[..., : ARGS.num_experts_per_tok]
    assert (forced.sort(-1).values != own).any()
    with replay_routes(model, forced), capture_routes(model, IDS.size(0)) as replayed:
        logits = model(input_ids=IDS, position_ids=torch.arange(IDS.size(1)).expand_as(IDS), attention_mask=None)
        logits.float().logsumexp(-1).mean().backward()
    assert torch.equal(replayed[0], forced.sort(-1).values)
    assert (logits.detach() - ref).abs().max() > 1e-3
    router_grads = [r.weight.grad for r in moe_routers(model)]
    assert all(gr is not None and gr.abs().sum() > 0 for gr in router_grads)
    with capture_routes(model, IDS.size(0)) as after:  # the replay ended with the block
        megatron_logits(model, IDS)
    assert torch.equal(after[0], own)
    with pytest.raises(ValueError, match="moe_enable_routing_replay=True"):
        with replay_routes(build_gpt_from_hf(moe_dir)[0], own):
            pass


def _tp2_worker(rank: int, world: int, d: str) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model, bridge = build_gpt_from_hf(d, ddp=True)
    assert bridge.transformer_config.sequence_parallel  # Megatron's requirement for MoE with TP > 1
    hf = load_hf_causal_lm(d)
    for train in (False, True):  # forward-only (lp_old / reference) and training mode
        checking(f"train={train}")
        model.train(train)
        diff = max_logit_diff(model, hf, IDS)
        assert diff <= 1e-5, (rank, train, diff)
    assert round_trip_mismatches(bridge, model) == [], rank  # expert shards gathered back bitwise


def test_tp2_sequence_parallel(moe_dir):
    """TP=2 (2 gloo processes): experts and attention split by mbridge, sequence parallelism on (the local spec's
    torch norms allowed it by `mcore.local_spec`), logits equal HF's in eval and training mode."""
    spawn(_tp2_worker, 2, str(moe_dir))


def _two_micro_batches(model, first: torch.Tensor, second: torch.Tensor, switch: bool) -> dict[str, torch.Tensor]:
    """Forward micro-batch 1 (routes `first`), then 2 (`second`), then both backwards (a pipeline schedule's
    order); gradients summed."""
    model.zero_grad()
    pos = torch.arange(IDS.size(1)).expand_as(IDS)
    with replay_routes(model, first) as replay:
        loss1 = model(input_ids=IDS, position_ids=pos, attention_mask=None).double().logsumexp(-1).mean()
        replay.next_forward(second)
        loss2 = model(input_ids=IDS, position_ids=pos, attention_mask=None).double().logsumexp(-1).mean()
        if switch:
            replay.backward_phase()
        loss1.backward()
        loss2.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_replay_with_activation_recompute(single_rank, moe_dir):
    """Full activation recompute re-runs the routers in backward. Two micro-batches forwarded before their
    backwards: with `backward_phase()` each recompute takes its own micro-batch's routes and the gradients equal
    those of a model without recompute; without it micro-batch 1's recompute takes micro-batch 2's routes."""
    g = torch.Generator().manual_seed(4)
    first, second = (torch.rand(*IDS.shape, ARGS.num_hidden_layers, ARGS.num_experts, generator=g).argsort(-1)[..., :2]
                     for _ in range(2))
    plain, _ = build_gpt_from_hf(moe_dir, dtype=torch.float64, config_overrides={"moe_enable_routing_replay": True})
    recompute, _ = build_gpt_from_hf(moe_dir, dtype=torch.float64, config_overrides=dict(
        moe_enable_routing_replay=True, recompute_granularity="full", recompute_method="uniform",
        recompute_num_layers=1))
    ref = _two_micro_batches(plain, first, second, switch=False)  # no recompute: nothing to replay in backward
    got = _two_micro_batches(recompute, first, second, switch=True)
    assert ref.keys() == got.keys() and len(ref) > 0
    worst = max((ref[n] - got[n]).abs().max().item() for n in ref)
    assert worst <= 1e-12, worst
    stale = _two_micro_batches(recompute, first, second, switch=False)
    assert max((ref[n] - stale[n]).abs().max().item() for n in ref) > 1e-6


def test_the_moe_model_and_its_engine_module_are_built_on_the_chosen_device(single_rank, moe_dir):
    """Pointed at `meta` (`slime_corr.device`): the trained MoE GPTModel (experts, routers, DDP buffers), its
    reference and the engine's HF Qwen3-MoE are built there (their forwards route by value: not runnable on meta)."""
    meta = torch.device("meta")
    with device.use("meta"):
        model, bridge = build_gpt_from_hf(moe_dir, ddp=True)
        reference = bridge.build_model()
        engine = TorchEngineModel(str(moe_dir), factory=load_engine_module)
    assert {p.device for p in model.parameters()} == {p.main_grad.device for p in model.parameters()} == {meta}
    assert {p.device for p in reference.parameters()} == {p.device for p in engine.module.parameters()} == {meta}
    assert engine.device == meta and engine.routers is not None
