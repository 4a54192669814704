"""Rollout routing replay in the trainer (`--use-rollout-routing-replay`) on the tiny Qwen3-MoE, float64:

- parse-time checks (a dense model refused, PP must divide the layers, sequence parallelism at TP > 1);
- the trainer's path (samples -> `trainer.data` micro-batches -> the loss hook's lp_old / reference pass and a
  training step through Megatron's schedule, the policy's `routed_forward`) against a plain reference: each
  sample alone (batch of one, no padding) through the Megatron model under `replay_routes`, its log-probs and the
  routing mismatch counted by hand (layer 0 by Python sets: the first router's input does not depend on replay);
- the same step (loss, KL, log-prob mismatch, routing mismatch, the gradient's norm) whatever the layout: padded
  micro-batches of 4 and of 1 sequence and packed THD rows (one or two groups per row) in one process; CP=2
  (padded and packed), DP=2, PP=2 (padded and packed: the stages' routes merged after the schedule) and TP=2
  (sequence parallel, padded and packed) in one 2-process launch.

The engine's routes are the model's own for half the tokens and random top-2 sets for the others, so replay
changes the log-probs (checked) and the routing mismatch is far from 0 and 1.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch

from slime_corr.config import ConfigError, RolloutCorrectionConfig
from slime_corr.models.selection import TINY_MOE, ModelSource
from slime_corr.samples import Sample, SampleStatus
from slime_corr.trainer.config import TrainerConfig

pytestmark = pytest.mark.cost(60)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

GROUP, GROUPS = 4, 2
TEMPERATURE = 0.8


class Layout(NamedTuple):
    """Parallel sizes and micro-batches: padded micro-batches of `mbs` samples, or packed THD rows of whole groups
    up to `max_tokens` per GPU (the test's groups take 45 and 43 tokens: one group per row, or both)."""

    cp: int = 1
    dp: int = 1
    pp: int = 1
    tp: int = 1
    mbs: int = 4
    max_tokens: int | None = None


LAYOUTS_ONE_PROCESS = [Layout(), Layout(mbs=1), Layout(max_tokens=50), Layout(max_tokens=100)]
LAYOUTS_SPAWNED = [Layout(cp=2), Layout(dp=2, mbs=2), Layout(cp=2, max_tokens=30), Layout(pp=2, mbs=2),
                   Layout(pp=2, max_tokens=50), Layout(tp=2), Layout(tp=2, max_tokens=100)]
KEYS = ("grad_norm", "train_rollout_logprob_abs_diff", "mismatch_k3_kl", "loss", "kl_loss", "routing_mismatch_frac",
        "routing_mismatch_token_frac", "routing_mismatch_layer_0", "routing_mismatch_layer_1",
        "logprob_abs_diff_routing_diff", "logprob_abs_diff_routing_same")
# Megatron's router takes its softmax in float32: the gradient's sums over tokens (in another order in another
# layout) round at float32's precision; everything else is float64
REL = {key: 1e-6 if key == "grad_norm" else 1e-9 for key in KEYS}


def _config(tiny_moe_cache: str, **kw) -> TrainerConfig:
    base = dict(model_source=ModelSource(model=TINY_MOE, cache_dir=tiny_moe_cache), use_rollout_routing_replay=True,
                params_dtype="float64", n_samples_per_prompt=GROUP, rollout_batch_size=GROUPS,
                num_steps_per_rollout=1, micro_batch_size=4, rollout_temperature=TEMPERATURE)
    return TrainerConfig(**{**base, **kw})


def test_parse_time_checks(tiny_moe_cache):
    with pytest.raises(ConfigError, match="--use-rollout-routing-replay: the model is dense"):
        TrainerConfig(use_rollout_routing_replay=True)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 4 must divide the model's 2 layers"):
        _config(tiny_moe_cache, pipeline_model_parallel_size=4, world_size=4)
    # MoE at TP > 1 runs with sequence parallelism (Megatron's requirement): rows padded to a multiple of TP
    assert _config(tiny_moe_cache, tensor_model_parallel_size=2, world_size=2).sequence_parallel_size == 2
    assert _config(tiny_moe_cache, context_parallel_size=2, world_size=2).sequence_parallel_size == 1
    ok = _config(tiny_moe_cache, sglang_url=("http://127.0.0.1:1",), rollout_engine="embedded")  # routes from that server
    assert ok.routed_experts_spec().bytes_per_token == 4


def test_route_filler_and_metric_keys():
    """Samples without routes get filler routes (experts 0..k-1) unless they are trained; the routing keys of the
    loss's report are logged under diag/."""
    from slime_corr.monitoring.keys import loss_step_metrics
    from slime_corr.routed_experts import RoutedExpertsSpec
    from slime_corr.trainer.data import _with_routes

    spec = RoutedExpertsSpec(2, 2, 8)
    failed = Sample(prompt_tokens=[1, 2], response_tokens=[3], rollout_log_probs=[-1.0], status=SampleStatus.FAILED,
                    failure_reason="test")
    (filled,) = _with_routes([failed], spec)
    assert filled.routed_experts.tolist() == [[[0, 1], [0, 1]], [[0, 1], [0, 1]]] and failed.routed_experts is None
    assert filled.routed_experts.dtype == torch.uint8
    trained = Sample(prompt_tokens=[1, 2], response_tokens=[3], status=SampleStatus.COMPLETED, loss_mask=[1],
                     rollout_log_probs=[-1.0])
    with pytest.raises(ValueError, match="trained sample .* has no routes"):
        _with_routes([trained], spec)
    assert _with_routes([trained], None) == [trained]
    keys = loss_step_metrics({"routing_mismatch_frac": 0.1, "routing_mismatch_layer_1": 0.2, "loss": 1.0,
                              "logprob_abs_diff_routing_diff": 0.3, "mismatch_k3_kl": 0.0})
    assert sorted(keys) == ["diag/logprob_abs_diff_routing_diff", "diag/routing_mismatch_frac",
                            "diag/routing_mismatch_layer_1", "rollout_corr/mismatch_k3_kl", "train/loss"]


def _samples() -> list[Sample]:
    """Uneven prompts and responses (1..9 tokens), a failed sample without routes, rollout log-probs around -2."""
    rng = random.Random(0)
    out = []
    for i in range(GROUP * GROUPS):
        prompt = [rng.randrange(1, 255) for _ in range(rng.randint(2, 7))]
        response = [rng.randrange(1, 255) for _ in range(rng.choice([1, 4, 9, 6]))]
        s = Sample(prompt_tokens=prompt, response_tokens=response, group_id=i // GROUP, index=i,
                   rollout_log_probs=[-2.0 + 0.5 * rng.random() for _ in response], loss_mask=[1] * len(response),
                   reward=float(rng.random() < 0.5), status=SampleStatus.COMPLETED)
        out.append(s)
    out[5].status, out[5].failure_reason = SampleStatus.FAILED, "test"  # masked out; no routes from the engine
    return out


def _reference(rank: int, world: int, tiny_moe_cache: str, samples: list[Sample], out: dict) -> None:
    """Engine routes for the samples (own routes, half of the tokens replaced by random sets), and the plain
    per-sample reference: replayed log-probs, unreplayed ones, the own routes under replay and at layer 0."""
    from slime_corr.mcore.routing import capture_routes, replay_routes
    from slime_corr.trainer.policy import build_policy
    from tests.mcore.mcore_helpers import init_layout

    init_layout(1, 1)
    policy = build_policy(_config(tiny_moe_cache), with_reference=False)
    model = policy.module.eval()
    g = torch.Generator().manual_seed(1)
    for s in samples:
        ids = torch.tensor([s.prompt_tokens + s.response_tokens])
        pos = torch.arange(ids.shape[1])[None]
        with torch.no_grad(), capture_routes(model, 1) as own:
            plain = model(input_ids=ids, position_ids=pos, attention_mask=None)
        routes = own[0][0, :-1].clone()  # [tokens - 1, L, k]: every token but the last
        flip = torch.rand(routes.shape[:2], generator=g) < 0.5
        rand = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(flip.numel())]).view(*flip.shape, 2)
        routes = torch.where(flip[..., None], rand, routes).to(torch.uint8)
        if s.status != SampleStatus.FAILED:
            s.routed_experts = routes
        full = torch.cat([routes, torch.tensor([0, 1], dtype=torch.uint8).expand(1, 2, 2)])[None]
        with torch.no_grad(), replay_routes(model, full) as handle:
            logits = model(input_ids=ids, position_ids=pos, attention_mask=None)
        p = len(s.prompt_tokens)

        def lp(x, p=p, ids=ids):
            return torch.log_softmax(x[0, p - 1:-1] / TEMPERATURE, -1).gather(-1, ids[0, p:, None])[:, 0]

        out.setdefault("lp", []).append(lp(logits))
        out.setdefault("lp_plain", []).append(lp(plain))
        out.setdefault("own", []).append(handle.own_routes(1)[0, p - 1:-1])  # at the trained positions
        out.setdefault("own0", []).append(own[0][0, p - 1:-1, 0])
        out.setdefault("engine", []).append(routes[p - 1:].long())


def _trainer_step(rank: int, world: int, tiny_moe_cache: str, samples: list[Sample], layouts: list, out: dict) -> None:
    """The trainer's path in each `Layout`: micro-batches, lp_old + reference pass, one training step; the rank
    that holds the step metrics (the last pipeline stage's first rank) records them and the trained tokens' lp_old
    / reference log-probs."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from slime_corr.loss_terms import LossTermsConfig
    from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
    from slime_corr.trainer.data import build_micro_batches, rollout_shards
    from slime_corr.trainer.policy import build_policy
    from tests.mcore.mcore_helpers import init_layout

    for layout in layouts:
        cp, dp, pp, tp, mbs, max_tokens = layout
        init_layout(tp, cp, pp)
        # the flags' budget bounds the longest possible group; the test's samples are shorter and pack tighter
        packing = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=128) if max_tokens else {}
        cfg = _config(tiny_moe_cache, context_parallel_size=cp, pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                      world_size=cp * dp * pp * tp, micro_batch_size=mbs, **packing)
        policy = build_policy(cfg, with_reference=True)
        assert policy.module.config.sequence_parallel == (tp > 1)  # Megatron's requirement for MoE with TP
        hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("decoupled_token_is"), temperature=TEMPERATURE,
                                     model_forward=policy.forward, seq_length_for_norm=cfg.rollout_max_response_len,
                                     loss_terms=LossTermsConfig(kl_loss_coef=0.1), ref_model=policy.reference)
        shards = rollout_shards(samples, GROUP, 1, dp, micro_batch_size=mbs, max_tokens=max_tokens, cp_size=cp,
                                sp_size=cfg.sequence_parallel_size)
        shard = shards[ps.get_data_parallel_rank()]
        (batches,) = build_micro_batches(shard, 0, cp_rank=ps.get_context_parallel_rank(), cp_size=cp,
                                         routes=cfg.routed_experts_spec(), packed=max_tokens is not None,
                                         sp_size=cfg.sequence_parallel_size)
        assert all(("cu_seqlens" in b) == (max_tokens is not None) for b in batches)
        hook.prepare_rollout(policy.model, batches)
        metrics = {**hook.train_step(policy.model, batches, recompute_old_log_probs=False),
                   "grad_norm": _grad_norm(policy.model)}
        reporting = ps.is_pipeline_last_stage() and rank == ps.get_pipeline_model_parallel_last_rank() and \
            ps.get_data_parallel_rank(with_context_parallel=True) == 0 and ps.get_tensor_model_parallel_rank() == 0
        if reporting:
            lps = [(b["old_log_probs"][b["loss_mask"] > 0], b["ref_log_probs"][b["loss_mask"] > 0]) for b in batches]
            out[layout] = {"metrics": metrics, "lps": lps}
        if dist.get_world_size() > 1:
            dist.barrier()


def _grad_norm(model: torch.nn.Module) -> float:
    """The norm of the whole model's gradient (Megatron DDP's main_grad after finalize_model_grads), each
    parameter counted once: TP shards summed over TP, stages over PP, replicated weights (norms, routers) once."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if param_is_not_tensor_parallel_duplicate(p):
            total += p.main_grad.double().square().sum()
    if dist.get_world_size() > 1:
        dist.all_reduce(total, group=ps.get_model_parallel_group())
    return float(total.sqrt())


def _metrics_spawned(rank: int, world: int, tiny_moe_cache: str, samples: list[Sample], path: str) -> None:
    out: dict = {}
    _trainer_step(rank, world, tiny_moe_cache, samples, LAYOUTS_SPAWNED, out)
    torch.save({k: v["metrics"] for k, v in out.items()}, f"{path}.{rank}")


@pytest.fixture(scope="module")
def reference(tiny_moe_cache):
    """The samples with their engine routes, and the step metrics of the plain per-sample reference."""
    from tests.mcore.mcore_helpers import run_in_process

    samples = _samples()
    ref: dict = {}
    run_in_process(_reference, tiny_moe_cache, samples, ref)
    trained = [i for i, s in enumerate(samples) if s.status != SampleStatus.FAILED]
    lp = torch.cat([ref["lp"][i] for i in trained])
    lp_plain = torch.cat([ref["lp_plain"][i] for i in trained])
    rollout = torch.cat([torch.tensor(samples[i].rollout_log_probs, dtype=torch.float64) for i in trained])
    engine = torch.cat([ref["engine"][i] for i in trained])
    own = torch.cat([ref["own"][i] for i in trained])
    own0 = torch.cat([ref["own0"][i] for i in trained])
    assert (lp - lp_plain).abs().max() > 1e-2  # replay changes the log-probs: the test can fail
    layer0 = sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(engine[:, 0], own0, strict=True)) / len(own0)
    assert 0.2 < layer0 < 0.8, layer0
    differ = (engine.sort(-1).values != own).any(-1).double()  # [tokens, L]
    any_layer = differ.amax(-1)
    want = {"train_rollout_logprob_abs_diff": float((lp - rollout).abs().mean()),
            "routing_mismatch_layer_0": layer0, "routing_mismatch_frac": float(differ.mean()),
            "routing_mismatch_token_frac": float(any_layer.mean()),
            "logprob_abs_diff_routing_diff": float(((lp - rollout).abs() * any_layer).sum() / any_layer.sum())}
    return samples, lp, want


@pytest.fixture(scope="module")
def one_process(tiny_moe_cache, reference) -> dict:
    from tests.mcore.mcore_helpers import run_in_process

    got: dict = {}
    run_in_process(_trainer_step, tiny_moe_cache, reference[0], LAYOUTS_ONE_PROCESS, got)
    return got


def test_replay_equals_the_plain_reference_padded_and_packed(reference, one_process):
    _, lp, want = reference
    for layout, result in one_process.items():
        m = result["metrics"]
        for key, value in want.items():
            assert m[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (key, layout)
        old = torch.cat([o for o, _ in result["lps"]])
        ref_lp = torch.cat([r for _, r in result["lps"]])
        assert torch.allclose(old, lp, rtol=0, atol=1e-12)  # lp_old under replay = the plain replayed forward
        assert torch.equal(old, ref_lp)  # the reference replays the engine's routes too (same initial weights)
    base = one_process[LAYOUTS_ONE_PROCESS[0]]["metrics"]
    for layout in LAYOUTS_ONE_PROCESS[1:]:  # padded micro-batches of 1 sequence, packed rows: the same step
        for key in KEYS:
            assert one_process[layout]["metrics"][key] == pytest.approx(base[key], rel=REL[key], abs=1e-12), \
                (key, layout)
    print({k: round(v, 6) for k, v in base.items() if k in KEYS})


def test_replay_step_under_cp_dp_pp_tp(tiny_moe_cache, reference, one_process, tmp_path):
    """Every 2-process layout logs the one-process step: loss, KL, log-prob and routing mismatch."""
    from tests.mcore.mcore_helpers import spawn

    samples, _, want = reference
    path = tmp_path / "spawned.pt"
    spawn(_metrics_spawned, 2, tiny_moe_cache, samples, str(path))
    got = {**torch.load(f"{path}.0", weights_only=False), **torch.load(f"{path}.1", weights_only=False)}
    assert set(got) == set(LAYOUTS_SPAWNED)
    base = one_process[LAYOUTS_ONE_PROCESS[0]]["metrics"]
    for layout, m in got.items():
        for key, value in want.items():
            assert m[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (key, layout)
        for key in KEYS:
            assert m[key] == pytest.approx(base[key], rel=REL[key], abs=1e-12), (key, layout)


def _old_routes_replay(rank: int, world: int, tiny_moe_cache: str, samples: list[Sample], out: dict) -> None:
    """R2 in one process: the lp_old pass records the policy's routes; after the router weights are flipped (its
    own choices then differ) the reference pass and the training step still route with the recorded ones."""
    from slime_corr.layout.micro_batch import ROUTE_KEY
    from slime_corr.loss_terms import LossTermsConfig
    from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
    from slime_corr.mcore.routing import capture_routes, moe_routers, routing_map_to_ids
    from slime_corr.trainer.data import build_micro_batches, rollout_shards
    from slime_corr.trainer.policy import build_policy
    from tests.mcore.mcore_helpers import init_layout

    init_layout(1, 1)
    cfg = _config(tiny_moe_cache, use_rollout_routing_replay=False, use_routing_replay=True)
    assert cfg.routed_experts_spec() is None  # nothing asked from the engines
    policy = build_policy(cfg, with_reference=True)
    hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("decoupled_token_is"), temperature=TEMPERATURE,
                                 model_forward=policy.forward, seq_length_for_norm=cfg.rollout_max_response_len,
                                 loss_terms=LossTermsConfig(kl_loss_coef=0.1), ref_model=policy.reference)
    (shard,) = rollout_shards(samples, GROUP, 1, 1, micro_batch_size=4)
    (batches,) = build_micro_batches(shard, 0)
    hook.prepare_rollout(policy.model, batches)
    model = policy.module
    with torch.no_grad():
        for b in batches:
            with capture_routes(model, b["tokens"].shape[0]) as own:
                model(input_ids=b["tokens"], position_ids=b["position_ids"], attention_mask=None)
            assert torch.equal(b[ROUTE_KEY], own[0])  # the lp_old pass's routes are the policy's own
        for r in moe_routers(model):
            r.weight.neg_()  # the routers now prefer the experts they ranked last
    routed: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, _i, o: routed.append(routing_map_to_ids(o[1], 2)))
             for r in moe_routers(model)]
    hook.train_step(policy.model, batches, recompute_old_log_probs=False)
    for h in hooks:
        h.remove()
    recorded = [b[ROUTE_KEY][:, :, layer].transpose(0, 1).reshape(-1, 2) for b in batches for layer in range(2)]
    out["same"] = all(torch.equal(a, b) for a, b in zip(routed, recorded, strict=True))
    with torch.no_grad(), capture_routes(model, batches[0]["tokens"].shape[0]) as flipped:
        model(input_ids=batches[0]["tokens"], position_ids=batches[0]["position_ids"], attention_mask=None)
    out["own_differ"] = float((flipped[0] != batches[0][ROUTE_KEY]).any(-1).double().mean())


def test_r2_replays_the_lp_old_pass_routes(tiny_moe_cache):
    from tests.mcore.mcore_helpers import run_in_process

    out: dict = {}
    run_in_process(_old_routes_replay, tiny_moe_cache, _samples(), out)
    assert out["own_differ"] > 0.5  # without replay the training pass would route otherwise
    assert out["same"]


def test_r2_flags_are_checked(tiny_moe_cache):
    with pytest.raises(ConfigError, match="--use-routing-replay .* with --use-rollout-routing-replay"):
        _config(tiny_moe_cache, use_routing_replay=True)
    with pytest.raises(ConfigError, match="--prox-logp-method loglinear skips"):
        _config(tiny_moe_cache, use_rollout_routing_replay=False, use_routing_replay=True, prox_logp_method="loglinear")
    with pytest.raises(ConfigError, match="--use-routing-replay: the model is dense"):
        TrainerConfig(use_routing_replay=True)
