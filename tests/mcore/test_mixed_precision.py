"""Megatron's mixed-precision training (`slime_corr.mcore.precision`) with real Megatron code on CPU (gloo): the tiny
GPT in bf16 / fp16 under `Float16Module` + DDP, Megatron's `Float16OptimizerWithFloat16Params` (fp32 main params and
gradients), its loss scalers through the real schedule's `grad_scale_func`.

References: Adam (torch.optim.Adam, clipped like Megatron's --clip-grad) on an fp32 copy of the initial weights fed
the step's unscaled fp32 main gradients; the gradients of an fp32 model with the same weights (what the scaled fp16
gradients must be S times); a one-process run on the whole batch (what DP=2 must equal: rank r's rows are the
reference's micro-batch r, so the sums are the same two terms).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from slime_corr.errors import ConfigError
from slime_corr.mcore.compat import get_forward_backward_func
from slime_corr.mcore.model import TinyGPTArgs
from slime_corr.mcore.precision import (
    PrecisionConfig,
    StepOutcome,
    build_mixed_precision_gpt,
    build_optimizer,
    main_params,
    step_optimizer,
    unwrap_model,
)
from tests.mcore.mcore_helpers import checking, init_layout, run_in_process, spawn

pytestmark = pytest.mark.cost(40)  # CI seconds, roughly (tests/conftest.py runs the costliest modules first)

S, V, ROWS = 16, 32, 4  # sequence length, vocabulary, rows of the whole batch
ARGS = TinyGPTArgs(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V, max_position_embeddings=S,
                   seed=7)
LR, BETAS, EPS, CLIP = 1e-2, (0.9, 0.999), 1e-8, 1.0
BF16 = PrecisionConfig(bf16=True)
FP16 = PrecisionConfig(fp16=True, initial_loss_scale=2.0**10, loss_scale_window=3, hysteresis=2)


def whole_batch() -> dict[str, torch.Tensor]:
    """[ROWS, S] tokens with loss masks of different lengths (ranks hold different token counts)."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, V, (ROWS, S), generator=g)
    lengths = torch.tensor([16, 5, 12, 9])
    mask = (torch.arange(S)[None] < lengths[:, None]).float()
    return dict(tokens=tokens, labels=torch.roll(tokens, -1, dims=1),
                position_ids=torch.arange(S).expand(ROWS, S).clone(), loss_mask=mask)


def micro_batches(dp_rank: int, dp: int) -> list[dict[str, torch.Tensor]]:
    """The reference (dp=1) runs the whole batch as 2 micro-batches of 2 rows; DP rank r runs micro-batch r."""
    batch = whole_batch()
    halves = [{k: v[2 * i:2 * i + 2] for k, v in batch.items()} for i in range(2)]
    return halves if dp == 1 else [halves[dp_rank]]


def _loss(batch: dict[str, torch.Tensor], logits: torch.Tensor) -> tuple:
    """Megatron's per-token triple: (Σ masked CE, token count, report)."""
    logp = torch.log_softmax(logits.float(), -1).gather(-1, batch["labels"].unsqueeze(-1))[..., 0]
    loss_sum = -(logp * batch["loss_mask"]).sum()
    return loss_sum, batch["loss_mask"].sum().to(torch.int), {"loss": loss_sum.detach()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None)
    return logits, partial(_loss, batch)


def forward_backward(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> None:
    """Megatron's schedule (it scales each loss by `config.grad_scale_func`, then `finalize_model_grads`)."""
    get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(batches), model=model,
                                num_microbatches=len(batches), seq_length=S, micro_batch_size=2,
                                forward_only=False)


def overflow_before_reduction(model: torch.nn.Module) -> Callable[[], None]:
    """Make the next `finalize_model_grads` see an inf in one gradient before its DP all-reduce; returns undo."""
    config = model.config
    finalize = config.finalize_model_grads_func

    def poisoned(*args, **kwargs):
        next(model.parameters()).main_grad.view(-1)[0] = float("inf")
        return finalize(*args, **kwargs)

    config.finalize_model_grads_func = poisoned
    return lambda: setattr(config, "finalize_model_grads_func", finalize)


def train_step(model: torch.nn.Module, optimizer, batches: list[dict], overflow: bool = False
               ) -> tuple[StepOutcome, dict[str, torch.Tensor]]:
    """zero grads, forward/backward (an inf in a gradient when `overflow`), step; returns the outcome and the
    main_grads the step saw (clones, before the optimizer unscaled / clipped them in place)."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    undo = overflow_before_reduction(model) if overflow else (lambda: None)
    try:
        forward_backward(model, batches)
    finally:
        undo()
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    return step_optimizer(optimizer), grads


def named_main_params(model: torch.nn.Module, optimizer) -> dict[str, torch.Tensor]:
    mains = main_params(optimizer)
    return {n: mains[id(p)].detach().clone() for n, p in model.named_parameters()}


class ReferenceAdam:
    """torch.optim.Adam on an fp32 copy of the model's initial weights, clipped like Megatron (coefficient
    CLIP / (norm + 1e-6) when below 1)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {n: p.detach().float().clone().requires_grad_() for n, p in model.named_parameters()}
        self.adam = torch.optim.Adam(list(self.params.values()), lr=LR, betas=BETAS, eps=EPS)

    def step(self, grads: dict[str, torch.Tensor]) -> float:
        """One step with these (unscaled) gradients; returns their global norm."""
        norm = torch.stack([g.double().square().sum() for g in grads.values()]).sum().sqrt().item()
        coeff = min(1.0, CLIP / (norm + 1e-6))
        for n, p in self.params.items():
            p.grad = grads[n].float() * coeff
        self.adam.step()
        return norm


def assert_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float, tag: str) -> None:
    assert got.keys() == want.keys(), tag
    for n in want:
        err = (got[n].double() - want[n].double()).abs().max().item()
        assert err <= atol, f"{tag} {n}: max |diff| {err:.3e} > {atol:.0e}"


# --- bf16 ---------------------------------------------------------------------------------------------------------


def _bf16_matches_reference_adam(rank: int, world: int) -> None:
    init_layout(1, 1)
    model = build_mixed_precision_gpt(ARGS, BF16)
    optimizer = build_optimizer([model], BF16, lr=LR, clip_grad=CLIP, adam_betas=BETAS, adam_eps=EPS)
    assert type(optimizer.chained_optimizers[0]).__name__ == "Float16OptimizerWithFloat16Params"
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.config.bf16 and not model.config.fp16 and model.config.grad_scale_func == optimizer.scale_loss
    softmaxes = [m for m in model.modules() if type(m).__name__ == "FusedScaleMaskSoftmax"]
    assert softmaxes and all(m.input_in_bf16 and m.input_in_float16 for m in softmaxes)  # softmax in fp32
    mains = named_main_params(model, optimizer)
    assert all(m.dtype == torch.float32 for m in mains.values())
    assert_params_close(mains, {n: p.float() for n, p in model.named_parameters()}, 0.0, "initial main params")
    reference = ReferenceAdam(model)
    batches = micro_batches(0, 1)
    for step in range(3):
        outcome, grads = train_step(model, optimizer, batches)
        norm = reference.step(grads)
        assert outcome.applied and outcome.loss_scale == 1.0, outcome
        assert abs(outcome.grad_norm - norm) <= 1e-5 * norm, (step, outcome.grad_norm, norm)
        assert norm > CLIP, "a non-trivial test: the reference clips"
        mains = named_main_params(model, optimizer)
        assert_params_close(mains, {n: p.detach() for n, p in reference.params.items()}, 1e-6, f"step {step}")
        for n, p in model.named_parameters():  # the model holds the main params rounded to bf16
            assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), mains[n].to(torch.bfloat16)), n
    # the fp32 main params carry what bf16 cannot: an optimizer stepping the bf16 weights would lose it
    assert any((m - m.to(torch.bfloat16).float()).abs().max() > 0 for m in mains.values())
    initial = ReferenceAdam(build_mixed_precision_gpt(ARGS, BF16)).params
    assert any((mains[n] - initial[n]).abs().max() > 1e-3 for n in mains), "the weights moved"


def test_bf16_fp32_main_params_follow_adam_on_the_bf16_gradients():
    run_in_process(_bf16_matches_reference_adam)


# --- fp16 loss scaling ---------------------------------------------------------------------------------------------


def fp32_gradients(model: torch.nn.Module, batches: list[dict]) -> dict[str, torch.Tensor]:
    """The gradients of an fp32 model holding `model`'s current (16-bit) weights: the true gradients."""
    fp32 = build_mixed_precision_gpt(ARGS, PrecisionConfig())
    weights = unwrap_model(model).state_dict()  # also non-tensor entries (_extra_state)
    unwrap_model(fp32).load_state_dict({k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                                        for k, v in weights.items()})
    fp32.zero_grad_buffer()
    forward_backward(fp32, batches)
    return {f"module.{n}": p.main_grad.clone() for n, p in fp32.named_parameters()}  # Float16Module's prefix


def assert_scaled(grads: dict[str, torch.Tensor], true: dict[str, torch.Tensor], scale: float, tag: str) -> None:
    """grads = scale × true gradients, to fp16 precision (relative error per parameter and overall)."""
    assert grads.keys() == true.keys(), tag
    total = 0.0
    for n, g in grads.items():
        err = ((g / scale - true[n]).norm() / true[n].norm()).item()
        assert err < 1e-2, f"{tag} {n}: relative error {err:.2e} of main_grad / {scale} against the fp32 gradient"
        total += (g / scale - true[n]).square().sum().item()
    overall = total ** 0.5 / sum(t.square().sum().item() for t in true.values()) ** 0.5
    assert overall < 2e-3, f"{tag}: overall relative error {overall:.2e}"


def _fp16_dynamic_scaler(rank: int, world: int) -> None:
    init_layout(1, 1)
    model = build_mixed_precision_gpt(ARGS, FP16)
    optimizer = build_optimizer([model], FP16, lr=LR, clip_grad=CLIP, adam_betas=BETAS, adam_eps=EPS)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert type(optimizer.chained_optimizers[0].grad_scaler).__name__ == "DynamicGradScaler"
    reference, batches, scale = ReferenceAdam(model), micro_batches(0, 1), FP16.initial_loss_scale
    # (overflow?, the scale after the step): hysteresis 2 halves at the 2nd overflow, window 3 doubles at the 3rd
    # good step in a row
    plan = [(False, scale), (True, scale), (True, scale / 2), (False, scale / 2), (False, scale / 2),
            (False, scale)]
    for step, (overflow, scale_after) in enumerate(plan):
        scale_before = float(optimizer.get_loss_scale())
        true = None if overflow else fp32_gradients(model, batches)
        before = named_main_params(model, optimizer), {n: p.detach().clone() for n, p in model.named_parameters()}
        outcome, grads = train_step(model, optimizer, batches, overflow=overflow)
        assert outcome.loss_scale == scale_after, (step, outcome)
        if overflow:  # skipped: neither the main params nor the fp16 weights moved
            assert not outcome.applied, (step, outcome)
            assert_params_close(named_main_params(model, optimizer), before[0], 0.0, f"step {step} main params")
            assert all(torch.equal(p.detach(), before[1][n]) for n, p in model.named_parameters()), step
            continue
        assert_scaled(grads, true, scale_before, f"step {step}")
        norm = reference.step({n: g / scale_before for n, g in grads.items()})
        assert outcome.applied and abs(outcome.grad_norm - norm) <= 1e-5 * norm, (step, outcome, norm)
        mains = named_main_params(model, optimizer)
        assert_params_close(mains, {n: p.detach() for n, p in reference.params.items()}, 1e-6, f"step {step}")
        assert all(torch.equal(p.detach(), mains[n].half()) for n, p in model.named_parameters()), step


def test_fp16_dynamic_loss_scale_scales_skips_backs_off_and_grows():
    run_in_process(_fp16_dynamic_scaler)


def _fp16_default_scale_overflows(rank: int, world: int) -> None:
    """Megatron's default initial scale 2**32 overflows a real fp16 backward (no injected inf): the first steps are
    skipped until the scale has come down (hysteresis 2: the 2nd overflow halves it)."""
    init_layout(1, 1)
    precision = PrecisionConfig(fp16=True)
    model = build_mixed_precision_gpt(ARGS, precision)
    optimizer = build_optimizer([model], precision, lr=LR, clip_grad=CLIP)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    first, grads = train_step(model, optimizer, micro_batches(0, 1))
    assert not all(torch.isfinite(g).all() for g in grads.values()), "the scaled fp16 backward overflows"
    second, _ = train_step(model, optimizer, micro_batches(0, 1))
    assert (first.applied, first.loss_scale, second.applied, second.loss_scale) == (False, 2.0**32, False, 2.0**31)
    assert all(torch.equal(p.detach(), weights[n]) for n, p in model.named_parameters())


def test_fp16_default_initial_loss_scale_overflows_for_real_and_is_skipped():
    run_in_process(_fp16_default_scale_overflows)


def _fp16_constant_scaler(rank: int, world: int) -> None:
    init_layout(1, 1)
    precision = PrecisionConfig(fp16=True, loss_scale=128.0)
    model = build_mixed_precision_gpt(ARGS, precision)
    optimizer = build_optimizer([model], precision, lr=LR, clip_grad=CLIP, adam_betas=BETAS, adam_eps=EPS)
    assert type(optimizer.chained_optimizers[0].grad_scaler).__name__ == "ConstantGradScaler"
    reference, batches = ReferenceAdam(model), micro_batches(0, 1)
    for step, overflow in enumerate((False, True, True, False)):
        true = fp32_gradients(model, batches)
        before = named_main_params(model, optimizer)
        outcome, grads = train_step(model, optimizer, batches, overflow=overflow)
        assert (outcome.applied, outcome.loss_scale) == (not overflow, 128.0), (step, outcome)
        if overflow:
            assert_params_close(named_main_params(model, optimizer), before, 0.0, f"step {step}")
            continue
        assert_scaled(grads, true, 128.0, f"step {step}")
        reference.step({n: g / 128.0 for n, g in grads.items()})
        assert_params_close(named_main_params(model, optimizer),
                            {n: p.detach() for n, p in reference.params.items()}, 1e-6, f"step {step}")


def test_fp16_constant_loss_scale():
    run_in_process(_fp16_constant_scaler)


# --- checkpoint of the optimizer state -----------------------------------------------------------------------------


def _after_a_good_and_a_skipped_step() -> tuple:
    """(model, optimizer, batches) of one process after one applied and one skipped (overflowing) fp16 step."""
    init_layout(1, 1)
    batches = micro_batches(0, 1)
    model = build_mixed_precision_gpt(ARGS, FP16)
    optimizer = build_optimizer([model], FP16, lr=LR, clip_grad=CLIP)
    train_step(model, optimizer, batches)
    train_step(model, optimizer, batches, overflow=True)
    return model, optimizer, batches


def _optimizer_state_round_trip(rank: int, world: int) -> None:
    """state_dict() after a good and a skipped step, loaded into a fresh model + optimizer (the model's own
    weights loaded beside it): the next step is the same as the uninterrupted run's, scaler state included."""
    model, optimizer, batches = _after_a_good_and_a_skipped_step()
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    saved_model = copy.deepcopy(unwrap_model(model).state_dict())

    resumed = build_mixed_precision_gpt(ARGS, FP16)
    resumed_optimizer = build_optimizer([resumed], FP16, lr=LR, clip_grad=CLIP)
    train_step(resumed, resumed_optimizer, batches)  # a different state, overwritten by the load
    unwrap_model(resumed).load_state_dict(saved_model)
    resumed_optimizer.load_state_dict(saved_optimizer)
    assert_params_close(named_main_params(resumed, resumed_optimizer), named_main_params(model, optimizer), 0.0,
                        "loaded main params")
    scalers = [o.chained_optimizers[0].grad_scaler for o in (optimizer, resumed_optimizer)]
    assert [(float(s.scale), s._growth_tracker, s._hysteresis_tracker) for s in scalers] == \
        [(FP16.initial_loss_scale, 0, 1)] * 2
    for overflow in (True, False):  # the 2nd overflow in a row halves the scale only if the tracker was restored
        want, _ = train_step(model, optimizer, batches, overflow=overflow)
        got, _ = train_step(resumed, resumed_optimizer, batches, overflow=overflow)
        assert (got.applied, got.loss_scale) == (want.applied, want.loss_scale), (got, want)
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=0, nan_ok=True), (got, want)
    assert want.loss_scale == FP16.initial_loss_scale / 2
    assert_params_close(named_main_params(resumed, resumed_optimizer), named_main_params(model, optimizer), 0.0,
                        "after the resumed steps")


def test_optimizer_state_dict_round_trip_resumes_the_same_run():
    run_in_process(_optimizer_state_round_trip)


def _dist_checkpointing_round_trip(rank: int, world: int, directory: str) -> None:
    """What `mcore/checkpoint.py` saves for Megatron's optimizer: `optimizer.sharded_state_dict(model's sharded
    state dict)` through dist_checkpointing (torch_dist on CPU), loaded with `is_loading=True` +
    `load_state_dict`: main params, Adam moments and the scaler's trackers come back (the next steps match)."""
    from megatron.core import dist_checkpointing

    model, optimizer, batches = _after_a_good_and_a_skipped_step()
    state = unwrap_model(model).sharded_state_dict()
    dist_checkpointing.save({"model": state, "optimizer": optimizer.sharded_state_dict(state)}, directory)

    resumed = build_mixed_precision_gpt(ARGS, FP16)
    resumed_optimizer = build_optimizer([resumed], FP16, lr=LR, clip_grad=CLIP)
    state = unwrap_model(resumed).sharded_state_dict()
    loaded = dist_checkpointing.load(
        {"model": state, "optimizer": resumed_optimizer.sharded_state_dict(state, is_loading=True)}, directory)
    unwrap_model(resumed).load_state_dict(loaded["model"])
    resumed_optimizer.load_state_dict(loaded["optimizer"])
    for overflow in (True, False):  # the scale halves at this 2nd overflow in a row only if the tracker came back
        want, _ = train_step(model, optimizer, batches, overflow=overflow)
        got, _ = train_step(resumed, resumed_optimizer, batches, overflow=overflow)
        assert (got.applied, got.loss_scale) == (want.applied, want.loss_scale) == (not overflow, 512.0), (got, want)
    assert_params_close(named_main_params(resumed, resumed_optimizer), named_main_params(model, optimizer), 0.0,
                        "after the resumed steps")


def test_dist_checkpointing_round_trip_of_the_megatron_optimizer(tmp_path: Path):
    directory = tmp_path / "iter_0000002"
    directory.mkdir()  # dist_checkpointing.save writes into an existing directory
    run_in_process(_dist_checkpointing_round_trip, str(directory))


def _save_starts_no_process(rank: int, world: int, root: str) -> None:
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from slime_corr.mcore.checkpoint import load_checkpoint, save_checkpoint
    from slime_corr.mcore.model import build_tiny_gpt

    init_layout(1, 1)
    model = build_tiny_gpt(ARGS, ddp=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    model(input_ids=torch.tensor([[1, 2, 3]]), position_ids=torch.arange(3)[None], attention_mask=None).sum().backward()
    optimizer.step()
    children = set(multiprocessing.active_children())
    save_checkpoint(root, 1, model, optimizer, {"step": 1}, rank_state="r0", rank0_state={"pending": [1]})
    # megatron-core's own results queue, whose making spawns the manager, was never made (this process saved nothing
    # before), and the save left no process behind
    assert filesystem_async._results_queue is None
    assert set(multiprocessing.active_children()) == children, multiprocessing.active_children()
    resumed = build_tiny_gpt(dataclasses.replace(ARGS, seed=ARGS.seed + 1), ddp=False)  # other weights until loaded
    resumed_optimizer = torch.optim.Adam(resumed.parameters(), lr=LR)
    assert load_checkpoint(root, resumed, resumed_optimizer) == (1, {"step": 1}, "r0", {"pending": [1]})
    for (name, want), got in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want), name
    got, want = resumed_optimizer.state_dict()["state"], optimizer.state_dict()["state"]
    assert sorted(got) == sorted(want) and all(got[i]["step"] == 1 for i in got)
    for i in want:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[i][key], want[i][key]), (i, key)


def test_a_checkpoint_save_starts_no_process_and_loads_back(tmp_path: Path):
    """`save_checkpoint` hands megatron-core's writer an in-process results queue (mcore/checkpoint.py): the save
    starts no manager process (a fresh interpreter that imported the whole job again), and the checkpoint loads. In a
    process of its own: one that saved before (this module's round trip) holds megatron-core's queue already."""
    spawn(_save_starts_no_process, 1, str(tmp_path / "ckpt"))


# --- DP=2 ----------------------------------------------------------------------------------------------------------

OVERFLOW_STEP = 1  # fp16: this step's gradients overflow (on DP rank 1 only, before the all-reduce)


def run_steps(precision: PrecisionConfig, dp_rank: int, dp: int) -> dict:
    """3 steps on this rank's micro-batches; fp16 overflows at OVERFLOW_STEP on the last DP rank."""
    model = build_mixed_precision_gpt(ARGS, precision)
    optimizer = build_optimizer([model], precision, lr=LR, clip_grad=CLIP)
    outcomes = []
    for step in range(3):
        overflow = precision.fp16 and step == OVERFLOW_STEP and dp_rank == dp - 1
        outcomes.append(train_step(model, optimizer, micro_batches(dp_rank, dp), overflow=overflow)[0])
    return {"outcomes": outcomes, "main": named_main_params(model, optimizer)}


def _dp2_worker(rank: int, world: int, reference_file: str) -> None:
    init_layout(1, 1)  # DP = 2
    reference = torch.load(reference_file, weights_only=False)
    for name, precision in (("bf16", BF16), ("fp16", FP16)):
        checking(f"DP=2 {name}")
        run = run_steps(precision, rank, world)
        want = reference[name]
        if precision.fp16:
            assert [o.applied for o in run["outcomes"]] == [True, False, True], run["outcomes"]
        for got, ref in zip(run["outcomes"], want["outcomes"], strict=True):
            assert got.applied == ref.applied and got.loss_scale == ref.loss_scale, (name, got, ref)
            assert got.grad_norm == pytest.approx(ref.grad_norm, rel=1e-6, nan_ok=True), (name, got, ref)
        assert_params_close(run["main"], want["main"], 1e-6, f"{name} DP=2 rank {rank} vs one process")
        for n, p in run["main"].items():  # and the same on both ranks
            other = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(other, p)
            assert all(torch.equal(o, p) for o in other), f"{name} {n}: ranks differ"


def _one_process_reference(rank: int, world: int, reference_file: str) -> None:
    init_layout(1, 1)
    torch.save({"bf16": run_steps(BF16, 0, 1), "fp16": run_steps(FP16, 0, 1)}, reference_file)


def test_dp2_main_params_equal_the_one_process_run(tmp_path: Path):
    reference_file = str(tmp_path / "one_process.pt")
    run_in_process(_one_process_reference, reference_file)
    spawn(_dp2_worker, 2, reference_file)


# --- configuration -------------------------------------------------------------------------------------------------


def test_precision_config_defaults_are_megatron_lm_s():
    config = PrecisionConfig()
    assert (config.loss_scale, config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window,
            config.hysteresis) == (None, 2.0**32, 1.0, 1000, 2)
    assert config.params_dtype == torch.float32 and not config.mixed
    assert PrecisionConfig(bf16=True).params_dtype == torch.bfloat16
    assert PrecisionConfig(fp16=True).params_dtype == torch.float16 and PrecisionConfig(fp16=True).dynamic_loss_scale
    assert not PrecisionConfig(fp16=True, loss_scale=8.0).dynamic_loss_scale


@pytest.mark.parametrize(("kwargs", "flags"), [
    (dict(bf16=True, fp16=True), ("--bf16", "--fp16")),
    (dict(fp16=True, initial_loss_scale=4.0, min_loss_scale=8.0), ("--min-loss-scale", "--initial-loss-scale")),
    (dict(fp16=True, loss_scale=0.0), ("--loss-scale",)),
    (dict(fp16=True, loss_scale=-2.0), ("--loss-scale",)),
    (dict(loss_scale=8.0), ("--loss-scale", "--fp16", "--bf16")),
    (dict(fp16=True, min_loss_scale=0.0), ("--min-loss-scale",)),
    (dict(fp16=True, loss_scale_window=0), ("--loss-scale-window",)),
    (dict(fp16=True, hysteresis=0), ("--hysteresis",)),
    (dict(bf16="yes"), ("--bf16",)),
])
def test_precision_config_rejects_with_the_flags_named(kwargs, flags):
    with pytest.raises(ConfigError) as error:
        PrecisionConfig(**kwargs)
    assert all(flag in str(error.value) for flag in flags), str(error.value)
