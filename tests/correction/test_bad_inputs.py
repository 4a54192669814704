"""Bad inputs at the core's public entry points: each gets a named error (argument, what it got, what it expects),
never a raw traceback or a silently wrong loss; the checks read no tensor value (no device->host sync)."""

from __future__ import annotations

import argparse
import textwrap

import numpy as np
import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import compute_rollout_correction
from slime_corr.losses import compute_policy_loss

B, S = 3, 5
G = torch.Generator().manual_seed(0)
LP = -torch.rand(B, S, generator=G)
RO = LP + 0.1 * torch.randn(B, S, generator=G)
OLD = LP + 0.1 * torch.randn(B, S, generator=G)
ADV = torch.randn(B, S, generator=G)
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
TIS = C(use_tis=True)
NORM = C(use_tis=True, tis_batch_normalize=True)


def corr(lp=LP, ro=RO, mask=MASK, cfg=TIS, **kw):
    return compute_rollout_correction(lp, ro, mask, cfg, **kw)


def loss(lp=LP, old=OLD, ro=RO, adv=ADV, mask=MASK, cfg=TIS, **kw):
    return compute_policy_loss(lp, old, ro, adv, mask, cfg, **kw)


CASES = [
    # compute_rollout_correction
    ("[B, 1] loss mask with [B, S] log-probs (broadcast silently before)", lambda: corr(mask=MASK[:, :1]),
     ValueError, "compute_rollout_correction: loss_mask must have shape (3, 5) like log_probs, got a torch.bool tensor of shape (3, 1)"),
    ("mismatched [B, S] shapes", lambda: corr(ro=RO[:, :4]),
     ValueError, "rollout_log_probs must have shape (3, 5) like log_probs, got a torch.float32 tensor of shape (3, 4)"),
    ("mismatched batch", lambda: corr(ro=RO[:2]), ValueError, "rollout_log_probs must have shape (3, 5)"),
    ("numpy log-probs", lambda: corr(lp=LP.numpy()), TypeError,
     "log_probs must be a torch.Tensor [batch, seq], got numpy.ndarray of shape (3, 5); convert it with torch.as_tensor"),
    ("numpy mask", lambda: corr(mask=MASK.numpy()), TypeError, "loss_mask must be a torch.Tensor [batch, seq], got numpy.ndarray"),
    ("list log-probs", lambda: corr(lp=LP.tolist()), TypeError, "log_probs must be a torch.Tensor [batch, seq], got list; convert"),
    ("None rollout log-probs", lambda: corr(ro=None), TypeError, "rollout_log_probs must be a torch.Tensor [batch, seq], got NoneType"),
    ("dict as config", lambda: corr(cfg={"use_tis": True}), TypeError,
     "config must be a RolloutCorrectionConfig, got dict (build it with RolloutCorrectionConfig.from_dict(...))"),
    ("Namespace as config", lambda: corr(cfg=argparse.Namespace(use_tis=True)), TypeError,
     "config must be a RolloutCorrectionConfig, got argparse.Namespace"),
    ("1-D log-probs", lambda: corr(lp=LP[0], ro=RO[0], mask=MASK[0]), ValueError,
     "log_probs must be 2-D [batch, seq] (this rank's slice under context parallelism), got a torch.float32 tensor of shape (5,)"),
    ("3-D log-probs", lambda: corr(lp=LP[None]), ValueError, "log_probs must be 2-D [batch, seq]"),
    ("integer log-probs", lambda: corr(lp=LP.long()), TypeError, "log_probs must hold floating-point log-probs/values, got a torch.int64"),
    ("bool rollout log-probs", lambda: corr(ro=MASK), TypeError, "rollout_log_probs must hold floating-point"),
    ("complex mask", lambda: corr(mask=MASK.to(torch.complex64)), TypeError, "loss_mask must be a bool, integer or float mask"),
    ("another device", lambda: corr(ro=torch.empty(B, S, device="meta")), ValueError,
     "rollout_log_probs is on meta but log_probs is on cpu; put both on one device"),
    ("batch_norm_mean without the flag", lambda: corr(batch_norm_mean=torch.tensor(1.0)), ValueError,
     "batch_norm_mean is given but --tis-batch-normalize is off, so it would be ignored"),
    ("batch_norm_mean as a vector", lambda: corr(cfg=NORM, batch_norm_mean=torch.ones(3)), TypeError,
     "batch_norm_mean must be a one-element float tensor (e.g. weight_mean(...)), got a torch.float32 tensor of shape (3,)"),
    ("batch_norm_mean as a float", lambda: corr(cfg=NORM, batch_norm_mean=1.0), TypeError,
     "batch_norm_mean must be a one-element float tensor"),
    ("a string as group", lambda: corr(cp_group="cp"), TypeError, "cp_group must be a torch.distributed ProcessGroup or None, got str"),
    # compute_policy_loss
    ("decoupled without lp_old", lambda: loss(old=None), ValueError,
     "compute_policy_loss: old_log_probs (pi_old) is None; decoupled mode needs it"),
    ("bypass without rollout log-probs", lambda: loss(ro=None, cfg=C.preset("pg_rs", get_mismatch_metrics=False)), ValueError,
     "--use-rollout-logprobs (bypass) takes pi_old from rollout_log_probs, which is None"),
    ("metrics without rollout log-probs", lambda: loss(ro=None), ValueError,
     "rollout_log_probs is None, but rollout correction / mismatch metrics are on"),
    ("[B, 1] loss mask in the loss", lambda: loss(mask=MASK[:, :1]), ValueError, "loss_mask must have shape (3, 5) like log_probs"),
    ("lp_old of another shape", lambda: loss(old=OLD[:, :4]), ValueError, "old_log_probs must have shape (3, 5)"),
    ("advantages [B, S + 1]", lambda: loss(adv=torch.zeros(B, S + 1)), ValueError,
     "advantages must have shape (3, 5) per token, or (3,) / (3, 1) per sequence, got a torch.float32 tensor of shape (3, 6)"),
    ("advantages [B, 2]", lambda: loss(adv=torch.zeros(B, 2)), ValueError, "advantages must have shape (3, 5) per token"),
    ("advantages [B + 1]", lambda: loss(adv=torch.zeros(B + 1)), ValueError, "advantages must have shape (3, 5) per token"),
    ("numpy advantages", lambda: loss(adv=ADV.numpy()), TypeError, "advantages must be a torch.Tensor of shape (3, 5) per token"),
    ("integer advantages", lambda: loss(adv=ADV.long()), TypeError, "advantages must hold floating-point"),
    ("seq_length_for_norm 0", lambda: loss(seq_length_for_norm=0), ValueError,
     "seq_length_for_norm must be a positive int (the maximum response length), got 0"),
    ("seq_length_for_norm 2.5", lambda: loss(seq_length_for_norm=2.5), ValueError, "seq_length_for_norm must be a positive int"),
    ("seq_length_for_norm True", lambda: loss(seq_length_for_norm=True), ValueError, "seq_length_for_norm must be a positive int"),
    ("loss_fn 3", lambda: loss(loss_fn=3), TypeError, "loss_fn must be a registered name, an import path or a callable, got int"),
    ("dict config in the loss", lambda: loss(cfg={}), TypeError, "compute_policy_loss: config must be a RolloutCorrectionConfig, got dict"),
]


@pytest.mark.parametrize("name, call, error, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_named_error(name, call, error, message):
    with pytest.raises(error) as e:
        call()
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("shape", [(B,), (B, 1)])
def test_per_sequence_advantages_broadcast_along_the_sequence(shape):
    adv = torch.randn(B, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    full = adv[:, None].expand(B, S)
    for cfg in (TIS, C.preset("pg_is")):
        xs = [LP.clone().requires_grad_() for _ in range(2)]
        got = compute_policy_loss(xs[0], OLD, RO, adv.reshape(shape), MASK, cfg)
        want = compute_policy_loss(xs[1], OLD, RO, full, MASK, cfg)
        got.loss.backward()
        want.loss.backward()
        assert torch.equal(got.loss, want.loss) and torch.equal(xs[0].grad, xs[1].grad)


CUSTOM = textwrap.dedent("""
    import torch
    from slime_corr.correction import WeightOutputs

    def returns_tensor(inputs, config):  # unannotated: caught at its first call
        return inputs.log_ratio.exp()

    def weights_wrong_shape(inputs, config):
        return WeightOutputs(weights=inputs.log_ratio[:, :2], loss_mask=inputs.loss_mask)

    def mask_wrong_shape(inputs, config):
        return WeightOutputs(weights=None, loss_mask=inputs.loss_mask[:, :1])

    def metrics_not_tensors(inputs, config):
        return WeightOutputs(weights=None, loss_mask=inputs.loss_mask, metrics={"m": 0.5})

    def per_sequence_weights(inputs, config):  # [B, 1]: one weight per sequence, allowed
        w = (inputs.seq_log_ratio_sum / inputs.seq_token_count.clamp(min=1)).exp()[:, None]
        return WeightOutputs(weights=w, loss_mask=inputs.loss_mask)
""")


@pytest.mark.parametrize("fn, message", [
    ("returns_tensor", "returned a torch.float32 tensor of shape (3, 5) on cpu; it must return slime_corr.correction.WeightOutputs("),
    ("weights_wrong_shape", "returned WeightOutputs.weights = a torch.float32 tensor of shape (3, 2) on cpu; expected a float tensor of shape (3, 5) (or (3, 1)), or None"),
    ("mask_wrong_shape", "returned WeightOutputs.loss_mask = a torch.bool tensor of shape (3, 1) on cpu; expected a bool or 0/1 tensor of shape (3, 5)"),
    ("metrics_not_tensors", "returned WeightOutputs.metrics = {'m': 0.5}; expected a dict of name -> one-element tensor"),
])
def test_custom_function_outputs_are_checked_at_the_first_call(tmp_path, fn, message):
    f = tmp_path / "custom.py"
    f.write_text(CUSTOM)
    cfg = C(use_tis=True, custom_tis_function_path=f"{f}:{fn}")
    with pytest.raises((TypeError, ValueError)) as e:
        corr(cfg=cfg)
    assert str(e.value).startswith(f"--custom-tis-function-path {f}:{fn} ") and message in str(e.value), str(e.value)


def test_custom_per_sequence_weights_are_broadcast(tmp_path):
    f = tmp_path / "custom.py"
    f.write_text(CUSTOM)
    res = corr(cfg=C(use_tis=True, custom_tis_function_path=f"{f}:per_sequence_weights"))
    geo = corr(cfg=C(use_tis=True, tis_level="geometric", tis_upper_bound=1e9))
    torch.testing.assert_close(res.weights, geo.weights)
    assert isinstance(res, type(geo))


@pytest.mark.parametrize("cfg", [TIS, C.preset("decoupled_seq_is_rs", rs_veto_threshold=1e-3, tis_batch_normalize=True),
                                 C.preset("pg_is"), C(use_tis=True, tis_mode="mask", use_rs=True, rs_upper_bound=1.5)])
def test_checks_and_hot_path_read_no_tensor_value(monkeypatch, cfg):
    """No .item(), .tolist(), bool() or float() of a tensor (each is a device->host sync on a GPU) anywhere in the
    correction or the loss: checks only read shapes, dtypes and devices."""
    def sync(*_):
        raise AssertionError("a tensor value was read on the host")

    for attr in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, attr, sync)
    x = LP.clone().requires_grad_()
    out = compute_policy_loss(x, OLD, RO, ADV[:, 0], MASK.float(), cfg)
    out.loss.backward()
    monkeypatch.undo()
    assert torch.isfinite(x.grad).all()


def test_numpy_scalar_types_in_config_are_fine():
    cfg = C(use_tis=np.bool_(True), tis_upper_bound=np.float64(1.5))
    assert corr(cfg=cfg).weights.max().item() <= 1.5
