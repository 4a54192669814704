"""The embedded engine and the weight sync compute on the device `slime_corr.device` chose, checked without a GPU:
pointed at `meta`, the engine's model, its token ids and its forward, and the tensors the weight-update group
broadcasts and receives, are all there (`DeviceCheck` names any op that touches the CPU). Sampling stays on the
CPU by design: one transfer of the last-token logits per forward, outside the checked region."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from slime_corr import device
from slime_corr.device_check import DeviceCheck
from slime_corr.engines.embedded.engine import LocalEngine
from slime_corr.engines.embedded.model import TorchEngineModel, load_tiny_lm
from slime_corr.rollout.weight_group import WeightUpdateGroup, make_buckets

META = torch.device("meta")


def test_the_engines_model_and_forward_are_on_the_chosen_device(tiny_ckpt: str) -> None:
    with device.use("meta"):
        model = TorchEngineModel(tiny_ckpt, dtype=torch.float32)
        engine = LocalEngine(model)
        with DeviceCheck("meta") as check:
            last, routes = engine._forward([[72, 101, 108], [108, 111]], with_routes=False)
        check.assert_clean()
    assert model.device == META and {p.device for p in model.module.parameters()} == {META}
    assert last.shape == (2, 256) and last.device == META and routes is None


def test_the_engines_forward_on_the_cpu_is_unchanged(tiny_ckpt: str) -> None:
    """The same rows as the model's own forward of each sequence (padding does not leak: causal attention)."""
    with device.use("cpu"):
        engine = LocalEngine(TorchEngineModel(tiny_ckpt, dtype=torch.float32))
    seqs = [[72, 101, 108], [108, 111]]
    last, _ = engine._forward(seqs, with_routes=False)
    reference = load_tiny_lm(tiny_ckpt)
    for row, seq in zip(last, seqs, strict=True):
        with torch.no_grad():
            want = reference(torch.tensor([seq]))[0, -1]
        torch.testing.assert_close(row, want, rtol=1e-5, atol=1e-5)


class _RecordingGroup:
    """A process group's `broadcast` that records the tensors it was given (no peer: a device check)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        self.tensors += tensors
        return self

    def wait(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _group(monkeypatch: pytest.MonkeyPatch, backend: str) -> tuple[WeightUpdateGroup, _RecordingGroup]:
    fake = _RecordingGroup()
    monkeypatch.setattr(WeightUpdateGroup, "_join", lambda self, *args: fake)
    return WeightUpdateGroup("127.0.0.1", 0, 0, 2, backend=backend), fake


@pytest.mark.parametrize("flattened", [True, False], ids=["flattened", "per_tensor"])
def test_an_nccl_weight_sync_sends_and_receives_on_the_chosen_device(monkeypatch, flattened: bool) -> None:
    weights = [("w", torch.ones(4, 3, device="meta")), ("b", torch.zeros(3, dtype=torch.bfloat16, device="meta"))]
    with device.use("meta", backend="nccl"):
        group, sent = _group(monkeypatch, "nccl")
        (bucket,) = make_buckets(weights, bucket_bytes=1 << 20)
        with DeviceCheck("meta") as check:
            group.send_bucket(bucket.tensors, flattened)
            received = group.receive_bucket([t.dtype for t in bucket.tensors], bucket.shapes, flattened)
        check.assert_clean()
    assert group.device == META and sent.tensors and {t.device for t in sent.tensors + received} == {META}

