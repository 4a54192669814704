"""The trainer's Megatron paths follow `slime_corr.device`, checked without a GPU: pointed at `meta`, the tiny GPT
(its Megatron DDP buffers and the reference's and the engine's copies), the embedded engine serving it, one
training step (the micro-batches moved once, Megatron's schedule, the loss, the backward) and the weight sync to
the engine all run there, and `DeviceCheck` names any op of ours that touches the CPU. This is the check the GPU
machine's first run needed: the engine's GPTModel stayed on the CPU while Megatron's buffers were on CUDA
(GPU_MEASURED.md, section 1). One gloo rank in this process (`run_in_process`)."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import torch

from slime_corr import device
from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.device_check import DeviceCheck
from slime_corr.engines.embedded.engine import LocalEngine
from slime_corr.engines.embedded.model import TorchEngineModel
from slime_corr.mcore.loss_hook import RolloutCorrectionLoss, default_model_forward
from slime_corr.mcore.model import TinyGPTArgs, build_tiny_gpt, single_rank_groups
from slime_corr.mcore.params import full_named_tensors
from slime_corr.rollout.weight_group import WeightUpdateGroup, make_buckets
from slime_corr.samples import Sample, SampleStatus
from slime_corr.trainer import update
from slime_corr.trainer.data import build_micro_batches, rollout_shards
from slime_corr.trainer.policy import WEIGHTS_FILE, EngineGPT
from tests.mcore.mcore_helpers import init_layout, run_in_process

META = torch.device("meta")
ARGS = TinyGPTArgs(vocab_size=256)


def _on_meta(tensors) -> bool:  # noqa: ANN001
    return {t.device for t in tensors} == {META}


def _building(rank: int, world: int) -> None:
    init_layout(1, 1)
    with device.use("meta"):
        model = build_tiny_gpt(ARGS, ddp=True)
        reference = build_tiny_gpt(ARGS, ddp=False)
        engine_copy = build_tiny_gpt(ARGS, ddp=False, pg_collection=single_rank_groups())
    params = list(model.parameters())
    assert _on_meta(params) and _on_meta(p.main_grad for p in params)  # DDP's grad buffers too
    assert _on_meta(reference.parameters()) and _on_meta(engine_copy.parameters())


def test_the_tiny_gpt_its_ddp_buffers_and_its_copies_are_built_on_the_chosen_device() -> None:
    run_in_process(_building)


def _engine(rank: int, world: int, checkpoint: str) -> None:
    init_layout(1, 1)
    single_rank_groups()
    torch.save(dict(full_named_tensors(build_tiny_gpt(ARGS, ddp=False))), Path(checkpoint) / WEIGHTS_FILE)
    with device.use("meta"):
        model = TorchEngineModel(checkpoint, factory=lambda d: EngineGPT(ARGS, d), dtype=torch.bfloat16)
        engine = LocalEngine(model)
        with DeviceCheck("meta") as check:
            last, _ = engine._forward([[104, 105, 33], [111, 107]], with_routes=False)
        check.assert_clean()  # token ids, position ids, the causal mask and Megatron's buffers: all there
        weights = [(n, torch.zeros_like(t, dtype=torch.float32)) for n, t in model.named_weights()]
        with DeviceCheck("meta") as check:
            model.load_weights(weights)  # what /update_weights_from_distributed loads
        check.assert_clean()
    assert model.device == META and _on_meta(model.module.module.parameters()) and last.device == META


def test_the_engine_serving_the_trainers_gpt_runs_on_the_chosen_device(tmp_path: Path) -> None:
    run_in_process(_engine, str(tmp_path))


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for gid in range(2):
        for j in range(4):
            n = int(torch.randint(1, 9, (1,), generator=g))
            out.append(Sample(prompt_tokens=[65, 66], response_tokens=[97] * n,
                              rollout_log_probs=torch.full((n,), -1.0), reward=float(j % 2), group_id=gid,
                              index=gid * 4 + j, weight_version="step-0", status=SampleStatus.TRUNCATED))
    return out


def _step(rank: int, world: int) -> None:
    init_layout(1, 1)
    (shard,) = rollout_shards(_samples(), group_size=4, num_steps=1, dp_size=1, micro_batch_size=4)
    steps = build_micro_batches(shard, first_step=0)
    on_cpu = sum(isinstance(t, torch.Tensor) for b in steps[0] for t in b.values())
    with device.use("meta"):
        model = build_tiny_gpt(ARGS, ddp=True)
        hook = RolloutCorrectionLoss(C.preset("ppo_is_bypass"), model_forward=default_model_forward)
        updater = update.Updater(model, torch.optim.Adam(model.parameters()), hook, clip_grad=1.0,
                                 rebaseline=False, normalize_std=True)
        # host reads (the metrics' one transfer, the grad norm's value) and the DP grad all-reduce of a real gloo
        # group cannot run on meta: each has its own device test (tests/mcore/test_mcore_device.py)
        with mock.patch.object(model.module.config, "finalize_model_grads_func", lambda *a, **k: None), \
                mock.patch.object(hook, "reduce_step_metrics", lambda losses: {}), \
                mock.patch.object(update, "optimizer_step", lambda *a: 0.0), DeviceCheck("meta") as check:
            updater.train_rollout(steps)
    # Megatron's schedule makes its default token count with torch.tensor(0) (through cpu_compat's torch):
    # replaced by the loss's count on the last stage, not ours
    ours = [p for p in check.problems if "cpu_compat.py" not in p]
    moves = [p for p in ours if p.startswith("aten._to_copy") and " at device.py:" in p]  # device.to_device
    assert len(moves) == len(ours) == on_cpu, "\n".join(dict.fromkeys(ours))  # each tensor moved once
    assert _on_meta(t for b in steps[0] for t in b.values() if isinstance(t, torch.Tensor))
    assert _on_meta(p.main_grad for p in model.parameters())


def test_one_training_step_moves_its_micro_batches_once_and_runs_on_the_chosen_device() -> None:
    run_in_process(_step)


class _RecordingGroup:
    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def broadcast(self, tensors: list[torch.Tensor], opts: object) -> _RecordingGroup:
        self.tensors += tensors
        return self

    def wait(self) -> None:
        pass


def _sync(rank: int, world: int) -> None:
    init_layout(1, 1)
    sent = _RecordingGroup()
    with device.use("meta", backend="nccl"), mock.patch.object(WeightUpdateGroup, "_join", lambda self, *a: sent):
        model = build_tiny_gpt(ARGS, ddp=True)
        group = WeightUpdateGroup("127.0.0.1", 0, 0, 2, backend="nccl")
        with DeviceCheck("meta") as check:
            weights = {name: t.clone() for name, t in full_named_tensors(model.module)}  # Policy.full_weights
            for bucket in make_buckets(list(weights.items()), bucket_bytes=64 * 1024):
                group.send_bucket(bucket.tensors, flattened=True)
        check.assert_clean()
    assert sent.tensors and _on_meta(sent.tensors)


def test_the_weights_leave_for_the_engines_from_the_chosen_device() -> None:
    run_in_process(_sync)
