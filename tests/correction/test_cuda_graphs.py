"""`--rollout-correction-cuda-graph` (slime_corr/correction/cuda_graphs.py).

On the CPU: the packing of a call's outputs into one buffer per dtype (and back, as views) on real correction
results, and the flag's error off CUDA. With `-m device --device cuda` (scripts/gpu_check.sh): the replayed call
equals the eager one on every config of tests/correction/test_device.py (the same kernels: bit-equal), a replay's
results survive the next replay, a new shape captures a new graph, a tensor option is a graph input, and the policy
loss gives the eager loss and gradient. Elsewhere those skip: a CUDA graph needs CUDA.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import compute_rollout_correction, cuda_graphs, metrics_to_host
from slime_corr.errors import ConfigError
from tests.correction.test_device import CONFIGS, _inputs, _loss


def _correction(cfg: C, x: dict[str, torch.Tensor], **kw):
    return compute_rollout_correction(x["old"], x["ro"], x["mask"], cfg, **kw)


def _tensors(result, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a CorrectionResult (and of the records it holds, its `stats`) by its path."""
    out = {}
    for f in dataclasses.fields(result):
        value, path = getattr(result, f.name), prefix + f.name
        if isinstance(value, torch.Tensor):
            out[path] = value
        elif dataclasses.is_dataclass(value):
            out.update(_tensors(value, f"{path}."))
        elif isinstance(value, dict):
            out.update({f"{path}.{k}": v for k, v in value.items() if isinstance(v, torch.Tensor)})
    return out


@pytest.mark.parametrize("name", ["token_is", "seq_is_rs", "clip_batch_norm", "off", "custom"])
def test_pack_then_unpack_gives_every_output_back_as_views_of_one_buffer_per_dtype(name: str) -> None:
    result = _correction(CONFIGS[name], _inputs("cpu", torch.float32))
    buffers, spec = cuda_graphs.pack(result)
    want = _tensors(result)
    assert {t.dtype for t in want.values()} == set(buffers)
    assert sum(b.numel() for b in buffers.values()) == sum(t.numel() for t in want.values())
    copies = {dtype: b.clone() for dtype, b in buffers.items()}
    got = _tensors(cuda_graphs.unpack(copies, spec))
    assert got.keys() == want.keys()
    for key, t in want.items():
        assert got[key].shape == t.shape and got[key].dtype == t.dtype, key
        assert torch.equal(got[key], t), key
        assert got[key].untyped_storage().data_ptr() == copies[t.dtype].untyped_storage().data_ptr(), key
    assert (result.weights is None) == (cuda_graphs.unpack(copies, spec).weights is None)


def test_the_flag_off_cuda_is_an_error_that_names_it() -> None:
    cfg = CONFIGS["token_is"].replace(rollout_correction_cuda_graph=True)
    with pytest.raises(ConfigError, match=r"--rollout-correction-cuda-graph .* on cpu\. Leave it off on a CPU"):
        _correction(cfg, _inputs("cpu"))


# ------------------------------------------------------------------------------------------ on CUDA
@pytest.fixture
def cuda(test_device: torch.device) -> torch.device:
    if test_device.type != "cuda":
        pytest.skip(f"a CUDA graph needs CUDA (the test device is {test_device}; --device cuda on a GPU machine)")
    cuda_graphs.clear()
    return test_device


def _assert_same(got, want, tag: str) -> None:
    g, w = _tensors(got), _tensors(want)
    assert g.keys() == w.keys(), tag
    for key, t in w.items():  # bit-equal, NaN where eager has NaN
        torch.testing.assert_close(g[key], t, rtol=0, atol=0, equal_nan=True, msg=f"{tag} {key}")


@pytest.mark.device
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_replayed_equals_eager_and_outlives_the_next_replay(name: str, dtype: torch.dtype, cuda) -> None:
    cfg = CONFIGS[name]
    graphed = cfg.replace(rollout_correction_cuda_graph=True)
    first, second = _inputs(cuda, dtype), _inputs(cuda, dtype)
    second["ro"] = second["ro"] + 0.05 * torch.randn_like(second["ro"])
    eager_first, eager_second = _correction(cfg, first), _correction(cfg, second)
    replay_first = _correction(graphed, first)  # captured here
    replay_second = _correction(graphed, second)  # replayed, same shape
    _assert_same(replay_first, eager_first, f"{name} first")
    _assert_same(replay_second, eager_second, f"{name} second")
    assert metrics_to_host(replay_second.metrics) == metrics_to_host(eager_second.metrics)
    bigger = _inputs(cuda, dtype, b=8, s=24)  # another shape: another graph
    _assert_same(_correction(graphed, bigger), _correction(cfg, bigger), f"{name} 8x24")
    _assert_same(replay_first, eager_first, f"{name} first, after two more replays")


@pytest.mark.device
def test_a_tensor_option_is_an_input_of_the_graph(cuda) -> None:
    cfg = CONFIGS["clip_batch_norm"]
    x = _inputs(cuda, torch.float32)
    for mean in (0.5, 2.0):  # the same graph, two step means
        m = torch.tensor(mean, dtype=torch.float64, device=cuda)
        got = _correction(cfg.replace(rollout_correction_cuda_graph=True), x, batch_norm_mean=m)
        _assert_same(got, _correction(cfg, x, batch_norm_mean=m), f"batch_norm_mean={mean}")


@pytest.mark.device
@pytest.mark.parametrize("name", ["token_is", "seq_is_rs", "pg_is"])
def test_the_policy_loss_with_a_replayed_correction_equals_eager(name: str, cuda) -> None:
    cfg = CONFIGS[name]
    x = _inputs(cuda, torch.float32)
    (out, grad), (ref, ref_grad) = (_loss(c, x) for c in (cfg.replace(rollout_correction_cuda_graph=True), cfg))
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)
    assert metrics_to_host(out.metrics) == metrics_to_host(ref.metrics)
