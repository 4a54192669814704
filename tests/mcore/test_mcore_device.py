"""The Megatron glue creates its tensors on its inputs' device: the loss hook's `loss_func` (vocab-parallel log-probs,
the correction, the loss, Megatron's report, the diagnostics), the grad norm, the step report and the CP index, run
on `meta` under `DeviceCheck` with fake TP / CP / DP groups of 2 whose collectives accept only `meta` tensors. On the
test device (`-m device`): TP = 2 log-probs over two processes, and the main job's path in one (the device from
`slime_corr.device`, the tiny GPT, the embedded engine serving it, one optimizer step)."""

from __future__ import annotations

import math
from pathlib import Path
from unittest import mock

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.device import setup as setup_device
from slime_corr.device_check import DeviceCheck, fake_process_groups
from slime_corr.layout.context_parallel import zigzag_indices
from slime_corr.losses import PolicyLossOutput
from slime_corr.mcore import params
from slime_corr.mcore.context_parallel import ParallelGroups, all_reduce_dp_cp
from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
from slime_corr.mcore.step_metrics import build_report
from tests.device_helpers import rank_placement

B, S, V = 4, 8, 16  # V: this TP rank's vocab shard


def _batch(decoupled: bool) -> dict[str, torch.Tensor]:
    m = dict(device="meta")
    batch = dict(labels=torch.zeros(B, S, dtype=torch.long, **m), loss_mask=torch.ones(B, S, **m),
                 rollout_log_probs=torch.randn(B, S, **m), advantages=torch.randn(B, **m),
                 position_ids=torch.arange(S, **m).expand(B, S), weight_lag=torch.zeros(B, S, dtype=torch.long, **m),
                 sample_ids=torch.arange(B, **m))
    if decoupled:
        batch["old_log_probs"] = torch.randn(B, S, **m)
    return batch


@pytest.mark.parametrize("preset", ["decoupled_seq_is_rs", "decoupled_token_is", "ppo_is_bypass", "disabled"])
def test_loss_func_on_the_inputs_device(preset: str) -> None:
    cfg = C.preset(preset)
    with fake_process_groups(2, expect="meta") as g, DeviceCheck("meta") as check:
        groups = ParallelGroups(tp=g.tp, cp=g.cp, dp=g.dp, dp_cp=None, cp_size=2, cp_rank=0)
        hook = RolloutCorrectionLoss(cfg, groups=groups, compute_entropy=True, diagnostics_top_k=2)
        logits = torch.randn(B, S, V, device="meta", requires_grad=True)
        with mock.patch("slime_corr.mcore.loss_hook.megatron_lm_args", lambda: None):
            loss, count, report = hook.loss_func(_batch(not cfg.use_rollout_logprobs), logits)
        loss.backward()
    check.assert_clean()
    assert logits.grad is not None and logits.grad.device.type == "meta"
    assert all(v.device.type == "meta" for v in report.values()) and count.device.type == "meta"
    assert "all_reduce" in g.collectives


def test_step_report_default_count_on_the_inputs_device() -> None:
    """A loss output without `pg_nonfinite_token_count` (a custom loss path): the default count is on the device."""
    m = dict(device="meta")
    out = PolicyLossOutput(loss=torch.zeros((), **m), loss_sum=torch.zeros((), **m), denominator=torch.ones((), **m),
                           metrics={"ppo_kl": torch.zeros((), **m)}, correction=None)
    with DeviceCheck("meta") as check:
        report = build_report(out, C(), ParallelGroups(), torch.ones(B, S, **m), torch.ones(B, S, **m))
    check.assert_clean()
    assert set(report) >= {"pg_loss", "ppo_kl", "pg_nonfinite_token_fraction", "entropy"}


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_grad_norm_on_the_model_device(tp_rank: int) -> None:
    """On TP rank 1 with no sharded parameter nothing is summed locally: the zero must be on the model's device."""
    model = torch.nn.Linear(3, 2, device="meta")
    for p in model.parameters():
        p.main_grad = torch.ones_like(p)
    ps = mock.Mock(get_tensor_model_parallel_rank=lambda: tp_rank, get_tensor_model_parallel_world_size=lambda: 2,
                   get_pipeline_model_parallel_world_size=lambda: 1, get_model_parallel_group=lambda: g.tp)
    import megatron.core

    with fake_process_groups(2, expect="meta") as g, mock.patch.object(megatron.core, "parallel_state", ps), \
            DeviceCheck("meta") as check:
        norm = params.grad_norm(model)
    check.assert_clean()
    assert norm.device.type == "meta" and g.collectives == ["all_reduce"]


def test_cp_index_and_dp_cp_reduction_on_the_inputs_device() -> None:
    with fake_process_groups(2, expect="meta") as g, DeviceCheck("meta") as check:
        idx = zigzag_indices(16, 1, 2, device="meta")
        all_reduce_dp_cp(torch.zeros(3, device="meta"), ParallelGroups(cp=g.cp, dp=g.dp, cp_size=2))
    check.assert_clean()
    assert idx.device.type == "meta" and g.collectives == ["all_reduce", "all_reduce"]
    assert zigzag_indices(8, 0, 2).tolist() == [0, 1, 6, 7]  # the CPU default is unchanged




def _tp_worker(rank: int, store: str, device_name: str) -> None:
    import torch.distributed as dist

    from slime_corr.mcore.logprobs import vocab_parallel_log_probs

    device, backend = rank_placement(rank, 2, device_name)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(B, S, 2 * V, generator=g, dtype=torch.float64)
        labels = torch.randint(0, 2 * V, (B, S), generator=g)
        full = torch.log_softmax(logits / 0.7, -1)
        want_lp = full.gather(-1, labels[..., None])[..., 0]
        want_h = -(full.exp() * full).sum(-1)
        shard = logits[..., rank * V:(rank + 1) * V].to(device).requires_grad_(True)
        lp, h = vocab_parallel_log_probs(shard, labels.to(device), tp_group=dist.group.WORLD, temperature=0.7,
                                         chunk_size=8, with_entropy=True)
        assert lp.device.type == device.type
        torch.testing.assert_close(lp.detach().cpu(), want_lp, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(h.detach().cpu(), want_h, rtol=1e-10, atol=1e-12)
        ref = logits.clone().requires_grad_(True)
        torch.log_softmax(ref / 0.7, -1).gather(-1, labels[..., None]).sum().backward()
        lp.sum().backward()
        torch.testing.assert_close(shard.grad.cpu(), ref.grad[..., rank * V:(rank + 1) * V], rtol=1e-10, atol=1e-12)
    finally:
        dist.destroy_process_group()


@pytest.mark.device
@pytest.mark.slow  # a spawn; the CPU suite covers TP over gloo in test_mcore_parallel.py
def test_tp2_log_probs_on_device(test_device: torch.device, tmp_path) -> None:
    """TP = 2 vocab-parallel log-probs, entropy and gradient on the test device equal the full softmax on the CPU:
    NCCL with one GPU per rank, else gloo on the device's tensors."""
    import torch.multiprocessing as mp

    mp.spawn(_tp_worker, args=(str(tmp_path / "store"), str(test_device)), nprocs=2, join=True)


def _job_worker(rank: int, store: str, device_name: str, checkpoint: str) -> None:
    """The main job's device path in one process: `slime_corr.device` decides, the tiny GPT is built there, the
    embedded engine serves its weights there and agrees with it, and one optimizer step trains there."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from slime_corr.device import to_device
    from slime_corr.engines.embedded.engine import LocalEngine
    from slime_corr.engines.embedded.model import TorchEngineModel
    from slime_corr.mcore.cpu_compat import apply_cpu_compat
    from slime_corr.mcore.loss_hook import default_model_forward
    from slime_corr.mcore.model import TinyGPTArgs, build_tiny_gpt, single_rank_groups
    from slime_corr.mcore.parallel_groups import destroy_model_parallel_groups
    from slime_corr.mcore.params import full_named_tensors
    from slime_corr.samples import Sample, SampleStatus
    from slime_corr.trainer.data import build_micro_batches, rollout_shards
    from slime_corr.trainer.policy import EngineGPT, save_engine_gpt_checkpoint
    from slime_corr.trainer.update import Updater

    placement = setup_device("cuda" if torch.device(device_name).type == "cuda" else "cpu")
    dist.init_process_group(placement.backend, init_method=f"file://{store}", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel()
        apply_cpu_compat()  # a no-op on CUDA
        args = TinyGPTArgs(vocab_size=256)
        model = build_tiny_gpt(args, ddp=True)
        assert {p.device for p in model.parameters()} == {placement.device}
        single_rank_groups()
        save_engine_gpt_checkpoint(dict(full_named_tensors(model.module)), Path(checkpoint))
        engine = LocalEngine(TorchEngineModel(checkpoint, factory=lambda d: EngineGPT(args, d), dtype=torch.float32))
        seqs = [[104, 105, 33, 10], [111, 107]]
        last, _ = engine._forward(seqs, with_routes=False)
        assert last.device == placement.device
        for row, seq in zip(last, seqs, strict=True):
            batch = to_device({"tokens": torch.tensor([seq]), "position_ids": torch.arange(len(seq))[None]})
            with torch.no_grad():
                want = default_model_forward(model, batch)[0, -1]
            torch.testing.assert_close(row, want, rtol=1e-4, atol=1e-4)
        samples = [Sample(prompt_tokens=[65, 66], response_tokens=[97] * (1 + i), rollout_log_probs=torch.full(
            (1 + i,), -5.0), reward=float(i % 2), group_id=i // 4, index=i, weight_version="step-0",
            status=SampleStatus.TRUNCATED) for i in range(8)]
        (shard,) = rollout_shards(samples, group_size=4, num_steps=1, dp_size=1, micro_batch_size=4)
        hook = RolloutCorrectionLoss(C.preset("decoupled_token_is"), model_forward=default_model_forward)
        updater = Updater(model, torch.optim.Adam(model.parameters(), lr=1e-3), hook, clip_grad=1.0,
                          rebaseline=True, normalize_std=True)
        (result,), _ = updater.train_rollout(build_micro_batches(shard, first_step=0))
        assert result.metrics["grad_norm"] > 0 and all(map(math.isfinite, result.metrics.values())), result.metrics
    finally:
        destroy_model_parallel_groups(world=True)


@pytest.mark.device
@pytest.mark.slow  # a spawn; the CPU suite runs the same path in tests/trainer (the main job)
def test_the_tiny_gpt_its_engine_and_a_step_run_on_device(test_device: torch.device, tmp_path) -> None:
    """What the main job does on a GPU, in one spawned process: the model built on the test device, the embedded
    engine's logits equal to the trainer's there, and one decoupled optimizer step (lp_old pass, token IS, GRPO
    re-baselining, Megatron's schedule, DDP, Adam) with finite metrics."""
    import torch.multiprocessing as mp

    mp.spawn(_job_worker, args=(str(tmp_path / "store"), str(test_device), str(tmp_path / "engine")), nprocs=1,
             join=True)


@pytest.mark.device
def test_a_checkpoints_rng_states_restore_the_devices_generator(test_device: torch.device) -> None:
    """What a resume restores (`trainer.checkpoint`): the CPU generator, Python's, Megatron's tracker and, on CUDA,
    the GPU's default generator: the same draws again after the states are set back."""
    import random

    from slime_corr import device
    from slime_corr.trainer.checkpoint import _rng_states, _set_rng_states

    with device.use(test_device):
        states = _rng_states()
        first = (torch.rand(4, device=test_device).cpu(), torch.rand(3), random.random())
        _set_rng_states(states)
        again = (torch.rand(4, device=test_device).cpu(), torch.rand(3), random.random())
    assert ("cuda" in states) == (test_device.type == "cuda")
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1]) and first[2] == again[2]
