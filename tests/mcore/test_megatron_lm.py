"""Megatron-LM's own training loop (`megatron.training`, shipped in the megatron-core 0.19.x wheel) with the hook,
wired as a pretrain_gpt.py user wires it, at DP=2 and at CP=2 (2 gloo processes, one launch for everything).

Real Megatron-LM code on the path: `parse_and_validate_args(extra_args_provider=add_rollout_correction_args)`
(parse_args → validate_args → set_global_variables), `core_transformer_config_from_args` (the model config, so
calculate_per_token_loss comes from the flag), `get_megatron_ddp_config`, Megatron DDP, `RerunDataIterator`,
`train_step` (its get_forward_backward_func schedule, finalize_model_grads and its reduction of the loss dicts),
`training_log` (its printed log line), `get_batch_on_this_cp_rank` (the CP slicing of the batches, through
slime_corr.mcore.compat). The user side: a pretrain_gpt.py-style `forward_step` reading a `RolloutStepIterator`
with `hook.next_micro_batch` and returning `partial(hook.loss_func, batch, model=model)`.

Stubbed or replaced, because it cannot run on CPU:
- `initialize_megatron` (asserts CUDA, sets the CUDA device, NCCL, compiles the dataset helpers): the test
  initializes torch.distributed with gloo and `parallel_state.initialize_model_parallel` with the parsed sizes;
- Megatron's optimizer and LR scheduler (hard-coded CUDA): `SGDStub` (records each step's main_grad, then
  p -= lr · main_grad, returns (True, grad norm, None)) and `SchedulerStub` (step(increment));
- CP attention (needs TransformerEngine): emulated as in the other Megatron tests: the model runs on the full
  sequence and its logits are zig-zag sliced (by Megatron's get_batch_on_this_cp_rank) before the loss;
- the model's parameters are float64 (params_dtype), so gradients compare to the reference at 1e-6;
- `slime_corr.mcore.cpu_compat.apply_cpu_compat_megatron_training`: CPU versions of CUDA-only calls
  (device="cuda" tensor factories in training.py, torch.cuda.synchronize, the CUDA RNG tracker).

Checked: loss, gradients and lp_old of every step equal a one-rank full-batch reference over 2 rollouts (3 steps,
the weights changing in between); the correction metrics are in Megatron's reduced loss dict, finite and equal to
the reference; the non-ratio ones come exact from `hook.last_step_metrics`; training_log prints them; without
--calculate-per-token-loss train_step fails with the clear error and no gradient; Megatron-LM's own IS flags
with --use-tis fail at parse time naming both flags. At PP=2 (--pipeline-model-parallel-size 2, bypass mode: a
decoupled step's lp_old pre-pass cannot start inside pretrain()'s running pipeline, see the loss hook): Megatron's
1F1B schedule, the stages holding the reference's weights; loss, metrics and the log line on the last stage,
an empty loss dict on the first; every stage's gradients equal the reference's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import re
import sys
from functools import partial

import pytest
import torch

from slime_corr.mcore.compat import has_megatron_training
from slime_corr.mcore.parallel_groups import destroy_model_parallel_groups
from tests.mcore.mcore_helpers import B_GLOBAL, TEMPERATURE, S, V, checking, local_rows, spawn, step_data

pytestmark = [
    pytest.mark.skipif(not has_megatron_training(),
                       reason="needs Megatron-LM's megatron.training (megatron-core >= 0.19); scripts/test.sh runs it "
                              "in its megatron-core 0.19 environment"),
    pytest.mark.cost(60),  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)
]

LR = 0.05
N_MB = 2  # micro-batches per optimizer step
ROLLOUTS = (2, 1)  # optimizer steps per rollout: lp_old is recomputed at each rollout's first step only
BASE_ARGV = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(S),
    "--max-position-embeddings", str(S), "--global-batch-size", str(B_GLOBAL * N_MB),
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(V), "--make-vocab-size-divisible-by", str(V),
    "--train-iters", "3", "--lr", str(LR), "--log-interval", "1", "--use-cpu-initialization",
    "--position-embedding-type", "learned_absolute", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--distributed-backend", "gloo", "--seed", "1234", "--no-persist-layer-norm", "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
]
PP_CASES = {"pg_is": ["--rollout-correction-preset", "pg_is"]}  # bypass: no pre-pass inside pretrain()
CASES = {  # name -> slime_corr flags (decoupled mode: lp_old through RolloutStepIterator)
    "decoupled_token_is+normalize": ["--rollout-correction-preset", "decoupled_token_is", "--tis-batch-normalize"],
    "decoupled_seq_is_rs": ["--rollout-correction-preset", "decoupled_seq_is_rs",
                            "--loss-agg-mode", "seq-mean-token-mean"],
}
NON_RATIO_CHECKED = ("mis_weight_max", "mis_weight_min", "mis_ess", "mis_valid_token_count", "rollout_probs_diff_max")


class SGDStub:
    """Stands in for Megatron's optimizer (CUDA-only): records main_grad, p -= lr · main_grad."""

    def __init__(self, model_chunks):
        self.params = [p for m in model_chunks for p in m.parameters()]
        self.grads: list[dict[int, torch.Tensor]] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # Megatron DDP's zero_grad_buffer (train_step calls it) zeroes main_grad

    def step(self):
        self.grads.append({i: p.main_grad.detach().clone() for i, p in enumerate(self.params)})
        with torch.no_grad():
            for p in self.params:
                p -= LR * p.main_grad
        return True, torch.cat([p.main_grad.reshape(-1) for p in self.params]).norm().item(), None

    def get_loss_scale(self):
        return torch.tensor(1.0)


class SchedulerStub:
    def step(self, increment: int) -> None:
        pass


def _parse(argv: list[str], extra_args_provider=None):
    from slime_corr.arguments import add_rollout_correction_args
    from slime_corr.mcore.compat import import_megatron_training

    import_megatron_training()
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.training import destroy_global_state

    destroy_global_state()  # one process runs several launches
    sys.argv = ["pretrain_rollout_correction.py", *argv]
    return parse_and_validate_args(extra_args_provider=extra_args_provider or add_rollout_correction_args)


def _init_parallel(args, pipeline: bool = True) -> None:
    """The CPU substitute of initialize_megatron's distributed part: model parallel from the parsed sizes
    (`pipeline=False`: one stage, for the full reference model)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    destroy_model_parallel_groups()
    ps.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size if pipeline else 1,
                                 context_parallel_size=args.context_parallel_size)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)


def _gpt(config, args) -> torch.nn.Module:
    """The GPTModel (this rank's pipeline stage of it) as a model_provider builds it."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(args.seed)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    position_embedding_type="learned_absolute", parallel_output=True,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    ).to(torch.float64)


def _model_config(args, full: bool = False):
    """Megatron-LM's model config from the flags; CP emulated (attention on the full sequence), float64 (also
    the activations pipeline stages exchange); `full`: one pipeline stage (the reference model)."""
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    pp = 1 if full else config.pipeline_model_parallel_size
    return dataclasses.replace(config, context_parallel_size=1, params_dtype=torch.float64,
                               pipeline_dtype=torch.float64, pipeline_model_parallel_size=pp)


def _build_model(args):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.training.training import get_megatron_ddp_config

    config = _model_config(args)
    model = DistributedDataParallel(config, get_megatron_ddp_config(args), module=_gpt(config, args))
    return [model], config


def _cp_slice(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from slime_corr.mcore.compat import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(dict(tensors))


def emulated_cp_forward(model, batch):
    logits = model(input_ids=batch["full_tokens"], position_ids=batch["full_position_ids"], attention_mask=None)
    return _cp_slice({"logits": logits})["logits"]


def _lp(model, b):
    logits = model(input_ids=b["tokens"], position_ids=b["position_ids"], attention_mask=None)
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, b["labels"].unsqueeze(-1))[..., 0]


def rollout_data(lp, g: torch.Generator, prepare=None) -> list[list[dict]]:
    """Global micro-batches per rollout; lp_rollout = `lp(batch)` (the initial model's log-probs) + noise (some
    sequences are rejected by RS, IS weights are truncated) with uneven masks (CP ranks hold different token
    counts). `prepare(batch, g)` adds to each micro-batch first (the MoE test: its routes)."""
    rollouts = []
    for r, steps in enumerate(ROLLOUTS):
        batches = [b for k in range(steps) for b in step_data(seed=10 * r + k)]
        for b in batches:
            del b["old_log_probs"]
            if prepare is not None:
                prepare(b, g)
            with torch.no_grad():
                noise = torch.where(torch.rand(B_GLOBAL, 1, generator=g) < 0.5, 0.02, 0.5)
                b["rollout_log_probs"] = (lp(b) + noise * torch.randn(B_GLOBAL, S, generator=g)) * b["loss_mask"]
        rollouts.append(batches)
    return rollouts


def _rollout_data(args) -> list[list[dict]]:
    return rollout_data(partial(_lp, _gpt(_model_config(args, full=True), args)), torch.Generator().manual_seed(5))


def reference(cfg, args, rollouts):
    """One rank, full batch, torch.log_softmax: per step (loss, {param index: grad}, metrics, lp_old)."""
    from slime_corr.correction.rejection_outcomes import rejection_outcome_pairs
    from slime_corr.losses import compute_policy_loss

    model = _gpt(_model_config(args, full=True), args)
    out = []
    for batches in rollouts:
        with torch.no_grad():
            old = [_lp(model, b) for b in batches]
        for i in range(0, len(batches), N_MB):
            step = {k: torch.cat([b[k] for b in batches[i:i + N_MB]]) for k in batches[0]}
            lp_old = torch.cat(old[i:i + N_MB])
            model.zero_grad()
            res = compute_policy_loss(_lp(model, step), lp_old, step["rollout_log_probs"], step["advantages"],
                                      step["loss_mask"], cfg)
            res.loss.backward()
            grads = {j: p.grad.detach().clone() for j, p in enumerate(model.parameters())}
            assert all(g.abs().sum() > 0 for g in grads.values() if g.dim() > 1), "a trivial reference"
            metrics = {k: v.item() for k, v in res.metrics.items()}
            if res.correction is not None and cfg.rejects:  # the loss report's rejection outcomes (tests/correction)
                pairs = rejection_outcome_pairs(step["loss_mask"], res.correction.loss_mask, step["advantages"],
                                                step.get("rewards"))
                metrics.update({k: (v[0] / v[1]).item() for k, v in pairs.items()})
            out.append((res.loss.item(), grads, metrics, old[i:i + N_MB]))
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * p.grad
    return out


def _local(b: dict, dp_rank: int, dp: int) -> dict:
    """This rank's micro-batch as a Megatron-LM get_batch makes it: DP rows, CP slice (Megatron's function), plus
    the full sequence for the emulated-CP forward."""
    rows = {k: local_rows(v, dp_rank, dp) for k, v in b.items()}
    local = _cp_slice(rows)
    local["full_tokens"], local["full_position_ids"] = rows["tokens"], rows["position_ids"]
    return local


def _stage_param_names(model) -> list[str]:
    """The reference model's name of each of this stage's parameters (in `parameters()` order): a stage numbers
    its layers from 0."""
    from megatron.core import parallel_state as ps

    offset = ps.get_pipeline_model_parallel_rank() * (2 // ps.get_pipeline_model_parallel_world_size())
    out = []
    for name, _ in model.module.named_parameters():
        layer = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        out.append(f"decoder.layers.{int(layer[1]) + offset}.{layer[2]}" if layer else name)
    return out


def _run(args, rollouts, weights=None):
    """pretrain()'s loop around Megatron-LM's real train_step and training_log, one iteration per step.
    `weights`: the reference model's initial weights by name, loaded into this pipeline stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.training import get_timers

    from slime_corr.arguments import config_from_args
    from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
    from slime_corr.mcore.rollout_steps import RolloutStepIterator

    config = config_from_args(args)
    model, model_config = _build_model(args)
    if weights is not None:
        with torch.no_grad():
            for name, p in zip(_stage_param_names(model[0]), model[0].parameters(), strict=True):
                p.copy_(weights[name])
    model_config.finalize_model_grads_func = finalize_model_grads  # as pretrain() sets them
    model_config.timers = get_timers()
    step_metrics: list[dict[str, float]] = []  # each step's, finalized when the next step starts
    hook = RolloutCorrectionLoss(config, temperature=TEMPERATURE, model_forward=emulated_cp_forward,
                                 on_step_metrics=step_metrics.append)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    local_rollouts = [[_local(b, dp_rank, dp) for b in batches] for batches in rollouts]
    data = RerunDataIterator(RolloutStepIterator(local_rollouts))

    def forward_step(data_iterator, model):  # as in pretrain_gpt.py
        batch = hook.next_micro_batch(data_iterator, model)
        logits = emulated_cp_forward(model, batch)
        return logits, partial(hook.loss_func, batch, model=model)

    results, logs, optimizer = train_iterations(forward_step, data, model, model_config)
    step_metrics.append(hook.pop_step_metrics())  # the last step's
    return results, optimizer.grads, local_rollouts, step_metrics, logs, config, _stage_param_names(model[0])


def train_iterations(forward_step, data, model, model_config) -> tuple[list[dict], list[str], SGDStub]:
    """Megatron-LM's real `train_step` and `training_log` for each of the rollouts' steps (pretrain()'s loop, with
    `SGDStub` as the optimizer): the reduced loss dicts, the printed log lines, the optimizer."""
    from megatron.training import get_timers
    from megatron.training.training import train_step, training_log

    from slime_corr.mcore.compat import get_forward_backward_func

    optimizer = SGDStub(model)
    results, logs, total_loss_dict = [], [], {}
    get_timers()("interval-time", log_level=0).start(barrier=True)
    for iteration in range(sum(ROLLOUTS)):
        loss_dict, skipped, _, _, _, grad_norm, _, _ = train_step(
            forward_step, data, model, optimizer, SchedulerStub(), model_config, get_forward_backward_func(),
            iteration=iteration)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            training_log(loss_dict, total_loss_dict, LR, iteration + 1, 1.0, False, skipped, grad_norm, None,
                         None, 0)
        results.append({k: v.item() for k, v in loss_dict.items()})
        logs.append(buf.getvalue())
    return results, logs, optimizer


def _check_case(name, flags, tag_prefix):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from slime_corr.arguments import config_from_args

    args = _parse(BASE_ARGV + flags + ["--calculate-per-token-loss"])
    _init_parallel(args, pipeline=False)  # the data and the reference: the full model
    tag = f"{tag_prefix} {name}"
    rollouts = _rollout_data(args)
    refs = reference(config_from_args(args), args, rollouts)
    full = _gpt(_model_config(args, full=True), args)
    names = [n for n, _ in full.named_parameters()]
    weights = dict(full.named_parameters())
    _init_parallel(args)
    pipelined = ps.get_pipeline_model_parallel_world_size() > 1
    results, grads, local_rollouts, step_metrics, logs, cfg, stage_names = _run(args, rollouts,
                                                                                weights if pipelined else None)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    steps = [(r, i) for r, n in enumerate(ROLLOUTS) for i in range(n)]
    last = ps.is_pipeline_last_stage()
    assert len(results) == len(refs) == len(grads) == len(steps), tag
    assert len(step_metrics) == (len(steps) if last else 1), tag
    for j, ((ref_loss, ref_grads, ref_metrics, ref_old), got, got_grads) in enumerate(
            zip(refs, results, grads, strict=True)):
        t = f"{tag} step {j}"
        for i, want_name in enumerate(stage_names):  # every stage's parameters
            want = ref_grads[names.index(want_name)]
            err = (got_grads[i] - want).norm() / want.norm().clamp_min(1e-30)
            assert err <= 1e-6, f"{t} {want_name}: relative gradient error {err:.2e}"
        if not last:  # Megatron-LM: the loss dict and the metrics are on the last stage
            assert got == {} and step_metrics == [{}], t
            continue
        pop = step_metrics[j]
        assert got["pg_loss"] == pytest.approx(ref_loss, rel=1e-6, abs=1e-9), t
        corr = {k for k in got if k.startswith(("mismatch_", "mis_", "train_rollout", "rollout_"))}
        assert {"mismatch_kl", "mismatch_k3_kl", "mis_rejected_token_fraction"} <= corr, t
        for k in corr | ({"ppo_kl", "pg_clipfrac", "ois"} & set(ref_metrics)):  # REINFORCE has no PPO terms
            assert got[k] == pytest.approx(ref_metrics[k], rel=1e-6, abs=1e-9), f"{t} {k}"
        assert all(v == v and abs(v) != float("inf") for v in got.values()), t
        for k in NON_RATIO_CHECKED:
            if k in ref_metrics:
                assert pop[k] == pytest.approx(ref_metrics[k], rel=1e-6, abs=1e-9), f"{t} {k}"
        r, i = steps[j]
        for k, want in enumerate(ref_old if not cfg.use_rollout_logprobs else []):  # lp_old: at the rollout's start
            b = local_rollouts[r][i * N_MB + k]
            want = _cp_slice({"x": local_rows(want, dp_rank, dp)})["x"]
            err = (b["old_log_probs"] - want).abs().max().item()
            assert err <= 1e-6, f"{t}: lp_old off by {err:.2e} (micro-batch {k})"  # a stale lp_old: ~1e-3
        if dist.get_rank() == dist.get_world_size() - 1:  # training_log prints on the last rank
            assert "mismatch_k3_kl:" in logs[j] and "mis_rejected_seq_fraction:" in logs[j], logs[j]


def _check_per_token_loss_required(layout_flags):
    """Megatron-LM's default (no --calculate-per-token-loss): the first loss_func call fails clearly."""
    from slime_corr.mcore.per_token_loss import PerTokenLossError

    args = _parse(BASE_ARGV + layout_flags + CASES["decoupled_seq_is_rs"])
    assert args.calculate_per_token_loss is False
    _init_parallel(args)
    with pytest.raises(PerTokenLossError, match="--calculate-per-token-loss"):
        _run(args, _rollout_data(args))
    # a loss_func that is not given the model: Megatron-LM's parsed arguments are checked
    from slime_corr.arguments import config_from_args
    from slime_corr.mcore.loss_hook import RolloutCorrectionLoss

    hook = RolloutCorrectionLoss(config_from_args(args))
    batch = {k: v[:1] for k, v in step_data()[0].items()}
    with pytest.raises(PerTokenLossError, match="calculate_per_token_loss=False in Megatron-LM's arguments"):
        hook.loss_func(batch, torch.zeros(1, S, V, dtype=torch.float64, requires_grad=True))


def _check_rl_flags():
    from slime_corr.arguments import config_from_args
    from slime_corr.config import ConfigError

    argv = [*BASE_ARGV, "--micro-batch-size", "1"]
    args = _parse(argv + ["--calculate-per-token-loss", "--use-tis", "--rl-inference-logprobs-is-correction"])
    with pytest.raises(ConfigError, match="--rl-inference-logprobs-is-correction.*--use-tis"):
        config_from_args(args)
    args = _parse(argv + ["--use-tis", "--rl-importance-sampling-truncation-coef", "3"])
    with pytest.raises(ConfigError, match="--rl-importance-sampling-truncation-coef 3.0.*--use-tis"):
        config_from_args(args)
    assert not config_from_args(_parse(argv + ["--rl-inference-logprobs-is-correction"])).computes_metrics


def _load_example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "megatron_lm" / "pretrain_rollout_correction.py"
    spec = importlib.util.spec_from_file_location("pretrain_rollout_correction", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_example(tmp_dir: str) -> None:
    """examples/megatron_lm: its flags through Megatron-LM's parser, its rollout side against a real engine on
    loopback (the embedded local engine: its own tiny model, so the mismatch is real), its data iterator and
    forward_step through Megatron-LM's train_step at DP=2: lp_old computed, loss, gradients and metrics finite."""
    import torch.distributed as dist
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.training import get_timers
    from megatron.training.training import train_step

    from slime_corr.arguments import config_from_args
    from slime_corr.engines.embedded.engine import start_local_engine
    from slime_corr.engines.embedded.model import create_tiny_checkpoint
    from slime_corr.mcore.compat import get_forward_backward_func
    from slime_corr.mcore.loss_hook import RolloutCorrectionLoss

    example = _load_example()
    prompts = f"{tmp_dir}/prompts.txt"
    with contextlib.ExitStack() as stack:
        url = [None]
        if dist.get_rank() == 0:
            with open(prompts, "w") as f:
                f.write("1 2 3\n4 5\n6 7 8 9\n")
            ckpt = create_tiny_checkpoint(f"{tmp_dir}/engine", seed=3, vocab_size=V, max_seq_len=S)
            url = [stack.enter_context(start_local_engine(ckpt)).url]
        dist.broadcast_object_list(url, src=0)
        args = _parse(BASE_ARGV + ["--micro-batch-size", str(B_GLOBAL // 2), "--calculate-per-token-loss",
                                   "--dataloader-type", "external", "--sglang-url", url[0], "--prompt-file", prompts,
                                   "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8",
                                   "--rollout-correction-preset", "decoupled_token_is"], example.add_args)
        _init_parallel(args)
        example.HOOK = RolloutCorrectionLoss(config_from_args(args), temperature=args.rollout_temperature)
        data, _, _ = example.train_valid_test_datasets_provider([0, 0, 0])
        model, model_config = _build_model(args)
        model_config.finalize_model_grads_func = finalize_model_grads
        model_config.timers = get_timers()
        optimizer = SGDStub(model)
        for iteration in range(2):  # two rollouts
            loss_dict, *_ = train_step(example.forward_step, RerunDataIterator(data), model, optimizer,
                                       SchedulerStub(), model_config, get_forward_backward_func(),
                                       iteration=iteration)
            got = {k: v.item() for k, v in loss_dict.items()}
            assert {"pg_loss", "mismatch_kl", "mis_rejected_seq_fraction"} <= set(got), got
            assert all(math.isfinite(v) for v in got.values()), got
            assert got["mismatch_k3_kl"] > 1e-3, got  # two different models: a real mismatch
            assert sum(g.abs().sum() for g in optimizer.grads[-1].values()) > 0
        assert data.rollouts_started == 2


def _worker(rank: int, world: int) -> None:
    import os
    import tempfile

    import torch.distributed as dist

    from slime_corr.mcore.cpu_compat import apply_cpu_compat_megatron_training

    # as torchrun and a Megatron-LM launch script set them
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), CUDA_DEVICE_MAX_CONNECTIONS="1")

    apply_cpu_compat_megatron_training()
    _check_rl_flags()
    layouts = {"DP=2": ["--micro-batch-size", str(B_GLOBAL // 2)],
               "CP=2": ["--micro-batch-size", str(B_GLOBAL), "--context-parallel-size", "2"]}
    for layout, flags in layouts.items():
        for name, case_flags in CASES.items():
            checking(f"{layout} {name}")
            _check_case(name, flags + case_flags, layout)
        _check_per_token_loss_required(flags)
    for name, case_flags in PP_CASES.items():
        checking(f"PP=2 {name}")
        _check_case(name, ["--micro-batch-size", str(B_GLOBAL), "--pipeline-model-parallel-size", "2"] + case_flags,
                    "PP=2")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = [tmp]
        dist.broadcast_object_list(tmp_dir, src=0)  # rank 0 writes the prompt file, every rank reads it
        _check_example(tmp_dir[0])


def test_megatron_lm_train_step_with_the_hook_at_dp2_cp2_and_pp2():
    spawn(_worker, 2)
