"""Single-process tests of the Megatron glue: log-probs vs torch, zig-zag layout, CPU compatibility."""

from __future__ import annotations

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.layout.context_parallel import seq_length_for_norm, zigzag_indices, zigzag_unslice
from slime_corr.mcore import cpu_compat
from slime_corr.mcore.context_parallel import ParallelGroups, slice_batch_for_cp
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


def _packed_and_padded(seed: int = 4):
    """The same samples as one packed micro-batch and as a padded one (batching's layouts), with logits."""
    from slime_corr.layout.micro_batch import build_micro_batch
    from slime_corr.samples import Sample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, (p, r) in enumerate(((3, 5), (2, 1), (4, 0), (1, 7))):  # a length-1 and an empty response
        lps = (-torch.rand(r, generator=g)).tolist()
        samples.append(Sample(prompt_tokens=[1] * p, response_tokens=list(range(2, 2 + r)), rollout_log_probs=lps,
                              index=i))
    adv = [0.5, -1.0, 2.0, 1.5]
    packed = build_micro_batch(samples, adv, packed=True, pad_to_multiple=2)
    padded = build_micro_batch(samples, adv)
    logits = torch.randn(*padded["labels"].shape, 10, generator=g, dtype=torch.float64)
    starts = packed["cu_seqlens_padded"].tolist()
    lengths = packed["cu_seqlens"].diff().tolist()
    packed_logits = torch.zeros(1, starts[-1], 10, dtype=torch.float64)
    for i, (a, n) in enumerate(zip(starts, lengths, strict=False)):
        packed_logits[0, a:a + n] = logits[i, :n]
    return packed, packed_logits, padded, logits


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_func_on_a_packed_micro_batch_equals_padded(agg):
    cfg = RolloutCorrectionConfig.preset("pg_is", loss_agg_mode=agg)
    packed, packed_logits, padded, logits = _packed_and_padded()
    s = padded["labels"].shape[-1]
    out = []
    for batch, lg in ((padded, logits), (packed, packed_logits)):
        leaf = lg.clone().requires_grad_()
        hook = RolloutCorrectionLoss(cfg, groups=ParallelGroups(), seq_length_for_norm=s)
        loss_sum, count, report = hook.loss_func({k: v.double() if v.is_floating_point() else v
                                                  for k, v in batch.items()}, leaf)
        loss_sum.backward()
        out.append((loss_sum, count, report, leaf.grad))
    (ls_pad, n_pad, rep_pad, g_pad), (ls_pack, n_pack, rep_pack, g_pack) = out
    torch.testing.assert_close(ls_pack, ls_pad, rtol=1e-12, atol=1e-14)
    assert int(n_pack) == int(n_pad) == 3  # sequences with a response token
    assert set(rep_pack) == set(rep_pad)
    for key, value in rep_pad.items():
        torch.testing.assert_close(rep_pack[key], value, rtol=1e-10, atol=1e-12, msg=key)
    starts, lengths = packed["cu_seqlens_padded"].tolist(), packed["cu_seqlens"].diff().tolist()
    for i, (a, n) in enumerate(zip(starts, lengths, strict=False)):
        torch.testing.assert_close(g_pack[0, a:a + n], g_pad[i, :n], rtol=1e-12, atol=1e-14)
    if agg == "seq-mean-token-sum-norm":  # a packed row has no padded length to normalize by
        with pytest.raises(ValueError, match="pass seq_length_for_norm"):
            RolloutCorrectionLoss(cfg, groups=ParallelGroups()).loss_func(
                {k: v.double() if v.is_floating_point() else v for k, v in packed.items()}, packed_logits)


def test_packed_batch_segments_are_the_thd_local_offsets():
    """The core's segments of a CP rank's packed slice: sample i at [cu_seqlens_padded[i] / CP, ...); the slice
    itself is compared with Megatron's own CP slicing in test_mcore_parallel.py (it needs a real CP group)."""
    from slime_corr.layout.micro_batch import build_micro_batch, cp_pad_multiple
    from slime_corr.mcore.context_parallel import batch_segments
    from slime_corr.samples import Sample

    samples = [Sample(prompt_tokens=list(range(1, 1 + n)), index=i) for i, n in enumerate((5, 1, 12, 6))]
    for cp in (1, 2, 3):
        packed = build_micro_batch(samples, packed=True, pad_to_multiple=cp_pad_multiple(cp))
        starts = packed["cu_seqlens_padded"].tolist()
        for r in range(cp):
            groups = ParallelGroups(cp_size=cp, cp_rank=r)
            mine = slice_batch_for_cp({**packed, "old_log_probs": packed["loss_mask"]}, groups)
            assert mine["tokens"].shape == mine["old_log_probs"].shape == (1, starts[-1] // cp)
            seg = batch_segments(mine, groups)
            assert seg.offsets.tolist() == [a // cp for a in starts] and seg.num == len(samples)
            # every sample's local tokens are its own: a prefix-free split of its span
            for i, (a, b) in enumerate(zip(seg.offsets.tolist(), seg.offsets.tolist()[1:], strict=False)):
                got = [t for t in mine["tokens"][0, a:b].tolist() if t]
                assert set(got) <= set(samples[i].prompt_tokens)
    assert batch_segments({"labels": torch.zeros(2, 4)}, ParallelGroups()) is None


def test_packed_seq_params_and_the_default_forward():
    from slime_corr.mcore.context_parallel import packed_seq_params
    from slime_corr.mcore.loss_hook import default_model_forward

    packed, _, padded, _ = _packed_and_padded()
    params = packed_seq_params(packed)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 8, 11, 15, 23]
    assert params.cu_seqlens_q_padded.tolist() == [0, 8, 12, 16, 24] and params.max_seqlen_q == 8
    assert params.cu_seqlens_q.dtype == torch.int32

    class Recorder(torch.nn.Module):  # records what the forward passes to the model
        def forward(self, **kwargs):
            self.kwargs = kwargs
            return kwargs["input_ids"]

    model = Recorder()
    default_model_forward(model, packed)
    assert model.kwargs["packed_seq_params"].cu_seqlens_q_padded.tolist() == [0, 8, 12, 16, 24]
    default_model_forward(model, padded)
    assert "packed_seq_params" not in model.kwargs


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
    assert ratios["pg_nonfinite_advantage_fraction"] == 0.0


@pytest.mark.parametrize("preset", ["pg_is", "disabled"])
def test_nonfinite_advantages_stop_the_step_in_both_megatron_paths(preset):
    """The trainer's `reduce_step_metrics` (the count over DP×CP) and the Megatron-LM drop-in's
    `pop_step_metrics` (this rank's count; Megatron logs pg_nonfinite_advantage_fraction) both raise."""
    from slime_corr.correction.checks import InputValueError

    cfg = RolloutCorrectionConfig.preset(preset, use_rollout_logprobs=True)  # bypass: lp_old = lp_rollout
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, 10, generator=g, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]).float()
    advantages = torch.randn(2, 6, generator=g, dtype=torch.float64)
    advantages[0, 0] = float("nan")  # outside the mask: ignored
    advantages[1, 2] = float("inf")
    batch = dict(labels=torch.randint(0, 10, (2, 6), generator=g), loss_mask=mask, advantages=advantages,
                 rollout_log_probs=-torch.rand(2, 6, generator=g, dtype=torch.float64))
    for path in ("trainer", "drop-in"):
        hook = RolloutCorrectionLoss(cfg, groups=ParallelGroups())
        with torch.enable_grad():
            _, _, report = hook.loss_func(batch, logits.clone().requires_grad_())
        assert report["pg_nonfinite_advantage_fraction"].tolist() == [1.0, 8.0]
        with pytest.raises(InputValueError, match=r"1 NaN/inf advantage\(s\)"):
            hook.reduce_step_metrics([report]) if path == "trainer" else hook.pop_step_metrics()


def test_cpu_compat_is_a_noop_when_the_process_computes_on_cuda():
    from slime_corr import device

    with device.use("cuda"):  # slime_corr.device's decision (it sets no CUDA device): no CPU adaptation
        assert not cpu_compat.cpu_compat_needed()
        assert cpu_compat.apply_cpu_compat() is False
    with device.use("cpu"):
        assert cpu_compat.cpu_compat_needed()


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


# ---------------------------------------------------------------- the per-token-loss requirement
def _bypass_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 6, 10, generator=g, dtype=torch.float64, requires_grad=True)
    batch = dict(labels=torch.randint(0, 10, (2, 6), generator=g),
                 loss_mask=torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]).float(),
                 rollout_log_probs=-torch.rand(2, 6, generator=g, dtype=torch.float64),
                 advantages=torch.randn(2, 6, generator=g, dtype=torch.float64))
    return logits, batch


def test_a_loss_divided_in_place_fails_at_backward_before_any_gradient():
    """What Megatron's schedule does with calculate_per_token_loss=False (forward_step_calc_loss): the loss is
    divided in place by the count and the number of micro-batches. Without a config to check, the first backward
    fails with the fix, and no gradient reaches the logits."""
    from slime_corr.mcore.per_token_loss import PerTokenLossError

    hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("pg_is"), groups=ParallelGroups())
    logits, batch = _bypass_batch()
    loss, count, _ = hook.loss_func(batch, logits)
    loss /= torch.clamp(count, min=1)
    loss /= 2
    with pytest.raises(PerTokenLossError, match="--calculate-per-token-loss"):
        loss.backward()
    assert logits.grad is None
    loss, count, report = hook.loss_func(batch, logits)  # untouched (calculate_per_token_loss=True): fine
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    # the reported loss is a copy: dividing the returned loss does not change it
    before = report["pg_loss"].clone()
    with torch.no_grad():
        loss /= 7
    assert torch.equal(report["pg_loss"], before)


def test_a_model_config_without_per_token_loss_is_refused_at_the_first_loss_func_call():
    from megatron.core.transformer import TransformerConfig

    from slime_corr.mcore.per_token_loss import PerTokenLossError

    class Model(torch.nn.Module):
        def __init__(self, per_token: bool):
            super().__init__()
            self.config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                            calculate_per_token_loss=per_token)

    hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("pg_is"), groups=ParallelGroups())
    logits, batch = _bypass_batch()
    with pytest.raises(PerTokenLossError, match=r"calculate_per_token_loss=False.*--calculate-per-token-loss"):
        hook.loss_func(batch, logits, model=Model(False))
    with pytest.raises(PerTokenLossError, match="calculate_per_token_loss=False"):
        hook.forward_step(iter([batch]), Model(False))
    hook.loss_func(batch, logits, model=Model(True))


# ---------------------------------------------------------------- RolloutStepIterator + next_micro_batch
class _CountingModel:
    """Stands in for a model: the logits of a micro-batch are stored in it; counts forward passes."""

    def __init__(self):
        self.forwards = 0


def _logits_forward(model, batch):
    model.forwards += 1
    return batch["logits"] * model.scale


def _rollout(seed: int, n: int):
    out = []
    for k in range(n):
        logits, batch = _bypass_batch(seed * 10 + k)
        batch["logits"] = logits.detach()
        out.append(batch)
    return out


@pytest.mark.parametrize("preset", ["decoupled_token_is", "pg_is"])
def test_rollout_steps_prepare_each_step_before_its_first_micro_batch(preset):
    from slime_corr.mcore.rollout_steps import STEP_KEY, RolloutStepIterator

    cfg = RolloutCorrectionConfig.preset(preset, tis_batch_normalize=True)
    finalized: list[dict] = []
    hook = RolloutCorrectionLoss(cfg, groups=ParallelGroups(), model_forward=_logits_forward,
                                 on_step_metrics=finalized.append)
    rollouts = [_rollout(0, 4), _rollout(1, 2)]  # 2 steps, then 1 step, of 2 micro-batches
    data = RolloutStepIterator(rollouts, num_microbatches=2)
    model = _CountingModel()
    forwards, means = [], []
    for step in range(3):
        model.scale = 1.0 + step  # the weights change after every step
        for k in range(2):
            batch = hook.next_micro_batch(data, model)
            assert STEP_KEY not in batch
            forwards.append(model.forwards)
            if k == 0:
                means.append(hook.step_batch_norm_mean)
            hook.loss_func(batch, batch["logits"] * model.scale)
    with pytest.raises(StopIteration):
        next(data)
    if hook.needs_old_log_probs:  # lp_old once per rollout, with the weights of the rollout's first step
        assert forwards == [4, 4, 4, 4, 6, 6]
        for r, scale in ((0, 1.0), (1, 3.0)):
            for b in rollouts[r]:
                want = torch.log_softmax(b["logits"] * scale, -1).gather(-1, b["labels"].unsqueeze(-1))[..., 0]
                torch.testing.assert_close(b["old_log_probs"], want)
    else:  # bypass: one forward-only pass per step, for the step's normalization mean
        assert forwards == [2, 2, 4, 4, 6, 6]
    assert all(m is not None and torch.isfinite(m) for m in means)
    assert len(finalized) == 2 and all("mis_ratio_mean_after_mis" in m for m in finalized)
    assert hook.last_step_metrics is finalized[-1]
    assert hook.pop_step_metrics()["mis_valid_token_count"] == 16  # the last step: 2 micro-batches of 8 tokens


@pytest.mark.parametrize("cfg", [
    RolloutCorrectionConfig(use_tis=True, tis_ess_target=0.9, rs_metric="k2", rs_agg="token", rs_divergence_budget=0.5),
    RolloutCorrectionConfig.preset("pg_is", tis_level="token", tis_upper_bound=None, tis_ess_target=0.8,
                                   rs_metric="k3", rs_agg="mean", rs_divergence_budget=1.0),
], ids=["decoupled", "bypass"])
def test_rollout_steps_bound_each_step_from_all_its_micro_batches(cfg):
    """--rs-divergence-budget / --tis-ess-target inside pretrain(): each step's micro-batches use the bounds of the
    step's concatenated tensors (decoupled: from lp_old; bypass: a forward-only pre-pass per step), logged per step."""
    from slime_corr.correction import compute_rollout_correction, metrics_to_host
    from slime_corr.mcore.rollout_steps import RolloutStepIterator

    finalized: list[dict] = []
    hook = RolloutCorrectionLoss(cfg, groups=ParallelGroups(), model_forward=_logits_forward, keep_outputs=True,
                                 on_step_metrics=finalized.append)
    assert hook.budgeted and not hook.can_stream(2) and hook.can_stream(1) == (not hook.needs_old_log_probs)
    data = RolloutStepIterator([_rollout(5, 4)], num_microbatches=2)  # 2 steps of 2 micro-batches
    model = _CountingModel()
    refs = []
    for step in range(2):
        model.scale = 1.0 + step  # the weights change after every step
        batches = [hook.next_micro_batch(data, model) for _ in range(2)]
        for b in batches:
            hook.loss_func(b, b["logits"] * model.scale)
        lp = [b["old_log_probs"] if hook.needs_old_log_probs else
              torch.log_softmax(b["logits"] * model.scale, -1).gather(-1, b["labels"].unsqueeze(-1))[..., 0]
              for b in batches]
        refs.append(compute_rollout_correction(torch.cat(lp), torch.cat([b["rollout_log_probs"] for b in batches]),
                                               torch.cat([b["loss_mask"] for b in batches]), cfg))
    assert model.forwards == 4  # decoupled: lp_old of the rollout's 4 once; bypass: a pre-pass of each step's 2
    finalized.append(hook.pop_step_metrics())
    for step, ref in enumerate(refs):
        outs = [o.correction for o in hook.outputs[2 * step:2 * step + 2]]
        assert torch.equal(torch.cat([o.loss_mask for o in outs]), ref.loss_mask), step
        torch.testing.assert_close(torch.cat([o.weights for o in outs]), ref.weights, rtol=1e-12, atol=0)
        want = metrics_to_host(ref.metrics)
        for key in ("mis_rs_divergence_bound", "mis_tis_ess_bound"):
            assert finalized[step][key] == want[key], (step, key)
        assert 0 < want["mis_div_rejected_token_fraction"] < 1 and want["mis_truncate_fraction"] > 0, want


def test_step_bounds_before_the_update_reject_as_the_step_will():
    """The decoupled baselines (`kept_sequences`) use the step's budgeted bounds (`set_step_bounds`)."""
    from slime_corr.correction import compute_rollout_correction

    cfg = RolloutCorrectionConfig(rs_metric="k2", rs_agg="mean", rs_divergence_budget=2.0)
    hook = RolloutCorrectionLoss(cfg, groups=ParallelGroups(), model_forward=_logits_forward)
    model = _CountingModel()
    model.scale = 1.0
    batches = _rollout(6, 3)
    hook.compute_old_log_probs(model, batches)
    with pytest.raises(ValueError, match=r"hook.set_step_bounds\(step_micro_batches\) first"):
        hook.kept_sequences(batches[0])
    hook.set_step_bounds(batches)
    kept = torch.cat([hook.kept_sequences(b) for b in batches])
    ref = compute_rollout_correction(torch.cat([b["old_log_probs"] for b in batches]),
                                     torch.cat([b["rollout_log_probs"] for b in batches]),
                                     torch.cat([b["loss_mask"] for b in batches]), cfg)
    assert torch.equal(kept, ref.loss_mask.sum(-1) > 0) and 0 < kept.sum() < kept.numel()


def test_a_replayed_step_is_not_prepared_again_and_keeps_its_lp_old():
    """Megatron's rerun state machine (fault tolerance) replays a step from shallow copies of the micro-batches
    taken as they were first read: before the hook computed lp_old into them."""
    import copy

    from slime_corr.mcore.rollout_steps import RolloutStepIterator

    hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("decoupled_token_is"), groups=ParallelGroups(),
                                 model_forward=_logits_forward)
    data = RolloutStepIterator([_rollout(0, 1)], num_microbatches=1)
    model = _CountingModel()
    model.scale = 1.0
    saved = []

    class Rerun:  # what megatron.core.rerun_state_machine.RerunDataIterator does when rerun mode is on
        def __next__(self):
            n = next(data)
            saved.append(copy.copy(n))
            return n

    batch = hook.next_micro_batch(Rerun(), model)
    hook.loss_func(batch, batch["logits"])
    assert model.forwards == 1 and hook.step_stats.micro_batches == 1
    replayed = hook.next_micro_batch(iter(saved), model)
    assert model.forwards == 1 and hook.step_stats.micro_batches == 0  # not prepared again; stats void
    assert replayed["old_log_probs"] is batch["old_log_probs"]


def test_rollout_step_iterator_rejects_partial_steps_and_bad_sizes():
    from slime_corr.mcore.rollout_steps import RolloutStepIterator

    with pytest.raises(ValueError, match="num_microbatches=0"):
        RolloutStepIterator([], num_microbatches=0)
    with pytest.raises(ValueError, match=r"rollout 0: 3 micro-batches is not a positive multiple of the 2"):
        next(RolloutStepIterator([_rollout(0, 3)], num_microbatches=2))
    with pytest.raises(ValueError, match="pass num_microbatches"):
        next(RolloutStepIterator([_rollout(0, 2)]))


def test_decoupled_batches_read_with_plain_next_get_the_fix_in_the_error():
    from slime_corr.mcore.rollout_steps import RolloutStepIterator

    hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("decoupled_token_is"), groups=ParallelGroups())
    batch = next(RolloutStepIterator([_rollout(0, 1)], num_microbatches=1))
    with pytest.raises(KeyError, match=r"hook.next_micro_batch\(data_iterator, model\)"):
        hook.loss_func(batch, batch["logits"])


# ---------------------------------------------------------------- Megatron-LM's RL flags, compat
def test_megatron_lm_is_flags_with_ours_are_a_config_error_naming_both():
    import argparse

    from slime_corr.config import ConfigError
    from slime_corr.mcore.megatron_lm import check_megatron_lm_rl_flags

    def ns(**kw):  # Megatron-LM's defaults for its two flags
        return argparse.Namespace(**{"rl_inference_logprobs_is_correction": False,
                                     "rl_importance_sampling_truncation_coef": None, **kw})

    rs = RolloutCorrectionConfig(use_rs=True, rs_upper_bound=2.0, rs_veto_threshold=1e-4)
    with pytest.raises(ConfigError, match=r"--rl-inference-logprobs-is-correction .* with --use-rs / "
                                          r"--rs-veto-threshold \(slime_corr\)"):
        check_megatron_lm_rl_flags(ns(rl_inference_logprobs_is_correction=True), rs)
    tis = RolloutCorrectionConfig(use_tis=True)
    with pytest.raises(ConfigError, match=r"--rl-importance-sampling-truncation-coef 2.0 .* --use-tis"):
        check_megatron_lm_rl_flags(ns(rl_importance_sampling_truncation_coef=2.0), tis)
    check_megatron_lm_rl_flags(ns(), tis)  # Megatron-LM's defaults
    check_megatron_lm_rl_flags(argparse.Namespace(), tis)  # not a Megatron-LM namespace
    metrics_only = RolloutCorrectionConfig(get_mismatch_metrics=True)  # does not change the loss
    check_megatron_lm_rl_flags(ns(rl_inference_logprobs_is_correction=True), metrics_only)


def test_missing_triton_is_a_clear_import_error(monkeypatch):
    from slime_corr.mcore import compat

    def import_module(name):  # the fault megatron-core 0.19 raises without triton
        raise ModuleNotFoundError("No module named 'triton'", name="triton")

    monkeypatch.setattr(compat.importlib, "import_module", import_module)
    with pytest.raises(ImportError, match="pip install triton"):
        compat.import_schedules()


@pytest.mark.parametrize("preset", ["decoupled_token_is", "decoupled_seq_is_rs"])
def test_decoupled_normalization_prepass_is_reused_by_the_training_pass(preset, monkeypatch):
    # lp_train = lp_old in decoupled mode: the training pass applies the step divisor to the pre-pass's
    # corrections instead of computing them again, and gives the loss, weights and metrics of a recompute.
    import slime_corr.losses as losses
    import slime_corr.mcore.loss_hook as loss_hook

    cfg = RolloutCorrectionConfig.preset(preset, tis_batch_normalize=True)
    model = _CountingModel()
    model.scale = 1.0
    hook = RolloutCorrectionLoss(cfg, groups=ParallelGroups(), model_forward=_logits_forward, keep_outputs=True)
    batches = _rollout(3, 3)
    hook.compute_old_log_probs(model, batches)
    for b in batches:  # lp_old differs from the training log-probs: the loss must use the pre-pass's lp_old
        b["old_log_probs"] = b["old_log_probs"] + 0.05 * torch.randn_like(b["old_log_probs"]) * b["loss_mask"]
    calls = []
    real = losses.compute_rollout_correction
    monkeypatch.setattr(losses, "compute_rollout_correction", lambda *a, **k: calls.append(1) or real(*a, **k))
    hook.prepare_step(model, batches, recompute_old_log_probs=False)
    assert all(loss_hook.PRECOMPUTED_CORRECTION in b for b in batches)
    got = [hook.loss_func(b, b["logits"])[0] for b in batches]
    assert calls == []  # the training pass computed no correction
    mean = hook.step_batch_norm_mean
    for b, loss, out in zip(batches, got, hook.outputs, strict=True):
        want = losses.compute_policy_loss(hook.log_probs(b["logits"], b["labels"])[0], b["old_log_probs"],
                                          b["rollout_log_probs"], b["advantages"], b["loss_mask"], cfg,
                                          batch_norm_mean=mean)
        torch.testing.assert_close(loss, want.loss_sum, rtol=0, atol=0)
        torch.testing.assert_close(out.correction.weights, want.correction.weights, rtol=0, atol=0)
        assert torch.equal(out.correction.loss_mask, want.correction.loss_mask)
    hook.prepare_step(model, batches, recompute_old_log_probs=False)  # a new step replaces the stored results
    assert len(calls) == len(batches)


# ---------------------------------------------------------------- pipeline parallelism: what fails, and how
@pytest.mark.parametrize("preset,normalize", [("decoupled_token_is", False), ("pg_is", True)])
def test_rollout_steps_under_pp_refuse_a_prepass_from_inside_the_schedule(preset, normalize):
    """Inside pretrain() a step's pre-pass (lp_old, or the normalization mean over several micro-batches) would
    be a second pipelined schedule started from within the running one: a clear error instead of a deadlock.
    Bypass without normalization needs no pre-pass and runs."""
    from slime_corr.mcore.rollout_steps import RolloutStepIterator

    cfg = RolloutCorrectionConfig.preset(preset, tis_batch_normalize=normalize)
    hook = RolloutCorrectionLoss(cfg, groups=ParallelGroups(pp_size=2), model_forward=_logits_forward)
    model = _CountingModel()
    model.scale = 1.0
    with pytest.raises(NotImplementedError, match=r"under pipeline parallelism.*hook\.train_step"):
        hook.next_micro_batch(RolloutStepIterator([_rollout(0, 2)], num_microbatches=2), model)
    bypass = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("pg_is"), groups=ParallelGroups(pp_size=2),
                                   model_forward=_logits_forward)
    batch = bypass.next_micro_batch(RolloutStepIterator([_rollout(0, 2)], num_microbatches=2), model)
    assert model.forwards == 0 and "labels" in batch


def test_pipeline_shapes_need_variable_seq_lengths_when_they_differ():
    from megatron.core.transformer import TransformerConfig

    from slime_corr.mcore.pipeline import check_pipeline_shapes

    class Model(torch.nn.Module):
        def __init__(self, variable: bool):
            super().__init__()
            self.config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
            self.config.variable_seq_lengths = variable

    same = [{"labels": torch.zeros(2, 8)}, {"labels": torch.zeros(2, 8)}]
    different = [{"labels": torch.zeros(1, 12)}, {"labels": torch.zeros(1, 20)}]
    check_pipeline_shapes(Model(False), same)
    check_pipeline_shapes(Model(True), different)
    check_pipeline_shapes([Model(True)], iter(different))
    with pytest.raises(ValueError, match=r"micro-batches of shapes \[\(1, 12\), \(1, 20\)\].*variable_seq_lengths"):
        check_pipeline_shapes(Model(False), different)
    with pytest.raises(ValueError, match="a stream of micro-batches.*config.variable_seq_lengths = True"):
        check_pipeline_shapes([Model(False)], iter(same))


def test_rollout_steps_move_their_micro_batches_to_the_device_once():
    """The Megatron-LM drop-in's data: every micro-batch of a rollout on `slime_corr.device`'s device before any
    pass reads it (`meta` here: what a GPU run gets as cuda), non-tensor entries kept."""
    from slime_corr import device
    from slime_corr.mcore.rollout_steps import RolloutStepIterator, pop_step

    rollout = [{"tokens": torch.ones(2, 3, dtype=torch.long), "note": "kept"} for _ in range(2)]
    with device.use("meta"):
        data = RolloutStepIterator([rollout], num_microbatches=2)
        first, second = next(data), next(data)
    assert pop_step(first) is not None and pop_step(second) is None
    assert first["tokens"].device.type == second["tokens"].device.type == "meta" and first["note"] == "kept"
    assert first is rollout[0]  # in place: the step's pre-pass and the training pass see the same dicts
