"""Single-process tests of the Megatron glue: log-probs vs torch, zig-zag layout, CPU compatibility."""

from __future__ import annotations

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.mcore import cpu_compat
from slime_corr.mcore.context_parallel import (
    ParallelGroups,
    seq_length_for_norm,
    slice_batch_for_cp,
    zigzag_indices,
    zigzag_unslice,
)
from slime_corr.mcore.logprobs import vocab_parallel_log_probs
from slime_corr.mcore.loss_hook import RolloutCorrectionLoss


def _ref(logits: torch.Tensor, labels: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits / t, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk_size", [5, 4096])
def test_log_probs_and_entropy_match_torch_forward_and_backward(temperature, chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 11, 50, generator=g, dtype=torch.float64) * 4).requires_grad_()
    labels = torch.randint(0, 50, (3, 11), generator=g)
    coef = torch.randn(3, 11, 2, generator=g, dtype=torch.float64)
    lp, ent = vocab_parallel_log_probs(logits, labels, temperature=temperature, chunk_size=chunk_size,
                                       with_entropy=True)
    ref_logits = logits.detach().clone().requires_grad_()
    ref_lp, ref_ent = _ref(ref_logits, labels, temperature)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    (lp * coef[..., 0] + ent * coef[..., 1]).sum().backward()
    (ref_lp * coef[..., 0] + ref_ent * coef[..., 1]).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-10, atol=1e-12)


def test_log_probs_half_precision_is_upcast_and_extreme_logits_stay_finite():
    logits = torch.tensor([[[1000.0, -1000.0, 0.0], [0.0, 0.0, 0.0]]], dtype=torch.bfloat16)
    labels = torch.tensor([[1, 2]])
    lp = vocab_parallel_log_probs(logits, labels)
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all()
    torch.testing.assert_close(lp[0, 1], torch.tensor(-torch.log(torch.tensor(3.0)).item()))


def test_log_probs_reject_bad_inputs():
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_log_probs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))


def test_zigzag_layout_and_inverse():
    assert zigzag_indices(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert zigzag_indices(16, 3, 4).tolist() == [6, 7, 8, 9]
    x = torch.arange(2 * 24).reshape(2, 24)
    for cp in (1, 2, 3, 4):
        parts = [x[:, zigzag_indices(24, r, cp)] for r in range(cp)]
        assert torch.equal(zigzag_unslice(parts), x)
    assert seq_length_for_norm(6, 4) == 24


def test_slice_batch_for_cp_slices_every_sequence_tensor():
    b = {k: torch.arange(16).reshape(2, 8) for k in ("tokens", "labels", "position_ids", "loss_mask",
                                                     "rollout_log_probs", "advantages", "old_log_probs")}
    b["mb_index"] = 3
    out = slice_batch_for_cp(b, ParallelGroups(cp_size=2, cp_rank=1))
    for k, v in out.items():
        if k != "mb_index":
            assert v[0].tolist() == [2, 3, 4, 5], k
    assert out["mb_index"] == 3


def test_decoupled_loss_func_requires_old_log_probs():
    hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("decoupled_token_is"), groups=ParallelGroups())
    assert hook.needs_old_log_probs
    assert not RolloutCorrectionLoss(RolloutCorrectionConfig.preset("pg_rs")).needs_old_log_probs
    batch = dict(labels=torch.zeros(1, 4, dtype=torch.long), loss_mask=torch.ones(1, 4),
                 rollout_log_probs=torch.zeros(1, 4), advantages=torch.zeros(1, 4))
    with pytest.raises(KeyError, match="compute_old_log_probs"):
        hook.loss_func(batch, torch.zeros(1, 4, 8))


def test_loss_func_rejects_packed_micro_batches():
    hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("pg_is"), groups=ParallelGroups())
    batch = dict(labels=torch.zeros(1, 4, dtype=torch.long), loss_mask=torch.ones(1, 4),
                 rollout_log_probs=torch.zeros(1, 4), advantages=torch.zeros(1, 4),
                 cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="packed"):
        hook.loss_func(batch, torch.zeros(1, 4, 8))


def test_bypass_loss_func_single_rank_matches_core():
    from slime_corr.losses import compute_policy_loss

    cfg = RolloutCorrectionConfig.preset("pg_is")
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 10, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 10, (2, 6), generator=g)
    batch = dict(labels=labels, loss_mask=torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]).float(),
                 rollout_log_probs=-torch.rand(2, 6, generator=g, dtype=torch.float64),
                 advantages=torch.randn(2, 6, generator=g, dtype=torch.float64))
    loss_sum, count, report = RolloutCorrectionLoss(cfg, groups=ParallelGroups()).loss_func(batch, logits)
    lp = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1))[..., 0]
    ref = compute_policy_loss(lp, None, batch["rollout_log_probs"], batch["advantages"], batch["loss_mask"], cfg)
    torch.testing.assert_close(loss_sum, ref.loss_sum)
    assert count.dtype == torch.int32 and int(count) == int(ref.denominator) == 8
    # Megatron's reporting format: every value a [numerator, denominator] pair (or 1 element), finite; the
    # pairs of one micro-batch give the core's metrics of that micro-batch
    assert all(v.numel() in (1, 2) and torch.isfinite(v).all() for v in report.values()), report
    torch.testing.assert_close(report["pg_loss"], torch.stack([ref.loss_sum, ref.denominator]).double())
    ratios = {k: (v[0] / v[1]).item() for k, v in report.items()}
    for key in ("pg_loss", "ppo_kl", "pg_clipfrac", *ref.correction.metrics):
        if key in ratios:
            assert ratios[key] == pytest.approx(ref.metrics[key].item(), rel=1e-9, abs=1e-12), key
    assert {"mismatch_kl", "mis_mean_is_weight_before_clip", "mis_ratio_mean_after_mis"} <= set(report)
    assert ratios["pg_nonfinite_token_fraction"] == 0.0


def test_cpu_compat_is_a_noop_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not cpu_compat.cpu_compat_needed()
    assert cpu_compat.apply_cpu_compat() is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU adaptations are inactive with CUDA")
def test_cpu_compat_patches_megatron_on_cpu():
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils

    assert cpu_compat.apply_cpu_compat() is True and cpu_compat.is_cpu_compat_applied()
    assert cpu_compat.apply_cpu_compat() is True  # idempotent
    assert torch.cuda.current_device() == "cpu"
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert torch.equal(utils.get_default_causal_mask(3), torch.triu(torch.ones(3, 3, dtype=torch.bool), 1))
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("x", 7)
    before = torch.get_rng_state()
    with tracker.fork("x"):
        a = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    torch.manual_seed(7)
    assert torch.equal(a, torch.rand(2))


@pytest.mark.parametrize("cfg", [RolloutCorrectionConfig.preset("decoupled_token_is"),
                                 RolloutCorrectionConfig.preset("pg_is", tis_batch_normalize=True)])
def test_a_stream_is_refused_where_a_first_pass_is_needed(cfg):
    class Stream:
        def __len__(self):
            return 2

        def __next__(self):
            raise AssertionError("must not be read")

    hook = RolloutCorrectionLoss(cfg, groups=ParallelGroups())
    assert not hook.can_stream(2)
    with pytest.raises(ValueError, match="micro_batches: a stream is read once"):
        hook.train_step(None, Stream())
    assert RolloutCorrectionLoss(RolloutCorrectionConfig.preset("pg_is"), groups=ParallelGroups()).can_stream(2)
