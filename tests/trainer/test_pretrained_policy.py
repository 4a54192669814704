"""The pretrained policy (`--model smollm2-135m`) through the trainer's own pieces, in this process: `build_policy`
(Megatron GPTModel from the HF checkpoint through mbridge), the rollout driver starting the default engine on it in
fp32 (the real SGLang server with the checkpoint's tokenizer and chat template, on loopback), the task's prompts and
reward, the data path (`rollout_shards`, `build_micro_batches`) and the loss hook's forward-only pass (lp_old and
the reference log-probs of the KL term). Teacher-forced log-probs of the tokens the engine sampled equal the
engine's to 5e-5, before and after a weight update reaches the engine, over both weight-sync paths (HF-named
weights: a checkpoint on disk, a broadcast over a gloo group). The engine also takes text in and gives text out.

The bound is fp32 rounding through 30 layers of two implementations: SGLang's CPU path (torch-native attention,
its own norm and rotary code) gives up to 2.8e-5; the embedded engine (HF transformers 5.24) 1.1e-5, and 5.7e-6 to
7.2e-6 with the transformers 5.x releases before it. A weight update that did not reach the engine moves log-probs
by > 1e-3. The bound holds with micro-batches of one sequence: the engine runs one sequence per forward (a seeded
request is computed alone), and CPU fp32 matrix products give bitwise the same rows for the same sequence only while
the number of rows stays small; a padded micro-batch of 4 sequences (~160 rows) rounds differently (SmolLM2's
logits of one sequence differ by ~7e-5 between 40 and 80 rows, in Megatron and in HF alike), so its log-probs are
held to 1e-4.

CI cost: one SmolLM2 policy and one real SGLang server for the module, 3 short fp32 rollouts (4 samples of <= 4
tokens) and one greedy request, ~90 s here.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.loss_terms import LossTermsConfig
from slime_corr.models import ModelSource, cached_hf_checkpoint
from slime_corr.ports import init_world_of_one
from slime_corr.trainer.config import TrainerConfig
from slime_corr.trainer.task import TASKS, Response

# CI seconds, roughly: the costliest modules run first (tests/conftest.py). Not first: its SGLang server waits for
# .venv-sglang's install, which scripts/test.sh runs beside the first modules (readme's and trainer_launch's run meanwhile)
pytestmark = pytest.mark.cost(205)

FLAGS = dict(rollout_batch_size=2, n_samples_per_prompt=2, num_steps_per_rollout=1, micro_batch_size=4,
             rollout_max_response_len=4, rollout_temperature=0.7, engine_dtype="float32", task="arithmetic", seed=3)


@pytest.fixture(scope="module")
def smollm2_policy() -> Iterator[tuple[TrainerConfig, object]]:
    """A world of one gloo process with Megatron's parallel state, and the SmolLM2 policy with its reference."""
    from megatron.core import parallel_state as ps

    from slime_corr.mcore.cpu_compat import apply_cpu_compat
    from slime_corr.mcore.parallel_groups import destroy_model_parallel_groups
    from slime_corr.trainer.policy import build_policy

    cached_hf_checkpoint("smollm2-135m")
    config = TrainerConfig(model_source=ModelSource(model="smollm2-135m"), **FLAGS)
    init_world_of_one("gloo")  # an in-process store: no port
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
        apply_cpu_compat()
        yield config, build_policy(config, with_reference=True)
    finally:
        destroy_model_parallel_groups(world=True)


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_policy, tmp_path_factory):
    """The rollout driver with one real SGLang server on the policy's initial weights, shared by this module's tests
    (a SmolLM2 fp32 server is the costliest part of each); `--rollout-weight-sync distributed`. Yields (driver, its
    directory)."""
    import dataclasses

    from slime_corr.trainer.driver import RolloutDriver

    base, policy = smollm2_policy
    config = dataclasses.replace(base, rollout_weight_sync="distributed")
    work = tmp_path_factory.mktemp("engine")
    with RolloutDriver(config, policy.engine_module, work, "none", tokenizer=policy.tokenizer,
                       engine_tokenizer=policy.engine_tokenizer, served_model_name=policy.name) as driver:
        driver.start(policy.full_weights(), 0, policy.save_engine_checkpoint)
        yield driver, work


def _teacher_forced(policy, config, samples, step: int, micro_batch_size: int = 1):
    """The trainer's path from samples to log-probs: micro-batches, then the hook's forward-only pass. Returns
    (rollout log-probs, lp of the current weights, lp of the reference = initial weights) at trained tokens."""
    from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
    from slime_corr.trainer.data import build_micro_batches, rollout_shards

    hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("decoupled_seq_is_rs"),
                                 temperature=config.rollout_temperature, model_forward=policy.forward,
                                 loss_terms=LossTermsConfig(kl_loss_coef=0.1), ref_model=policy.reference)
    shard = rollout_shards(samples, config.n_samples_per_prompt, 1, 1, micro_batch_size=micro_batch_size)[0]
    batches = [b for per_step in build_micro_batches(shard, step, pad_token_id=policy.pad_token_id) for b in per_step]
    hook.prepare_rollout(policy.model, batches)
    pick = [(b["loss_mask"] > 0) for b in batches]
    return [torch.cat([b[k][m] for b, m in zip(batches, pick, strict=True)]).double()
            for k in ("rollout_log_probs", "old_log_probs", "ref_log_probs")]


def _perturb(policy, seed: int) -> None:
    """A weight update of the trainer: every weight moves (the tied embedding / LM head too)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 2e-3)


def test_engine_serves_text_in_and_out_with_the_chat_template(smollm2_policy, smollm2_engine):
    """SGLang's /generate with `text`: the engine tokenizes with the checkpoint's tokenizer (the prompt ids the
    trainer's chat template gives) and returns the decoded `text` of its `output_ids`. Runs first in this module:
    greedy decoding of the checkpoint's own weights."""
    _, policy = smollm2_policy
    driver, work = smollm2_engine
    messages = [{"role": "user", "content": "What is 2+2? Answer with a number."}]
    prompt = policy.tokenizer.chat_prompt(messages)
    url = driver.client.urls[0]
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}, "return_logprob": True}
    req = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    with urllib.request.urlopen(f"{url}/model_info", timeout=30) as resp:
        info = json.loads(resp.read())
    meta = out["meta_info"]
    ids = [t[1] for t in meta["output_token_logprobs"]]
    print(f"engine: {prompt!r} -> {out['text']!r}")
    assert meta["prompt_tokens"] == len(policy.tokenizer.chat_prompt_ids(messages))
    assert out["text"] == policy.tokenizer.decode(ids, skip_special_tokens=True) and "4" in out["text"]
    assert Path(info["model_path"]).parent == work and info["served_model_name"] == "smollm2-135m"


def test_fp32_engine_logprobs_equal_the_trainers_through_both_weight_syncs(smollm2_policy, smollm2_engine, tmp_path):
    import asyncio

    from slime_corr.rollout.weight_sync import sync_weights_from_disk
    from slime_corr.trainer.data import weight_version

    _, policy = smollm2_policy
    driver, _ = smollm2_engine
    config = driver.config
    initial = {n: t.clone() for n, t in policy.module.state_dict().items() if isinstance(t, torch.Tensor)}
    task = TASKS["arithmetic"]
    samples = driver.submit(0).result()
    assert all(s.status in ("completed", "truncated") and s.response_length for s in samples), samples
    rollout, current, reference = _teacher_forced(policy, config, samples, 0)
    gap = (current - rollout).abs().max().item()
    batched = (_teacher_forced(policy, config, samples, 0, micro_batch_size=4)[1] - rollout).abs().max().item()
    texts = [policy.tokenizer.decode(s.response_tokens, skip_special_tokens=True) for s in samples]
    print(f"step 0: responses {texts}, rewards {[s.reward for s in samples]}: max |lp trainer - lp engine "
          f"(fp32)| = {gap:.2e} over {rollout.numel()} tokens (micro-batches of 1), {batched:.2e} (one padded "
          "micro-batch of 4)")
    assert gap <= 5e-5 and torch.equal(current, reference)
    assert batched <= 1e-4  # CPU fp32 GEMMs round differently above ~64 rows: see the module doc
    labels = [p.label for p in task.prompts(config.seed, 0, config.rollout_batch_size)]
    assert [s.reward for s in samples] == [task.reward(Response(t, s.response_tokens, labels[s.group_id]))
                                           for s, t in zip(samples, texts, strict=True)]

    for step, path in ((1, "distributed"), (2, "disk")):
        _perturb(policy, step)
        if path == "distributed":  # the driver's own path for --rollout-weight-sync distributed
            report = driver.sync_weights(policy.full_weights(), step, policy.save_engine_checkpoint)
        else:  # the function the driver runs for --rollout-weight-sync disk
            ckpt = policy.save_engine_checkpoint(policy.full_weights(), tmp_path / weight_version(step))
            report = asyncio.run_coroutine_threadsafe(
                sync_weights_from_disk(driver.client, ckpt, weight_version(step)), driver.loop).result()
        samples = driver.submit(step).result()
        assert {s.weight_version for s in samples} == {weight_version(step)}
        rollout, current, reference = _teacher_forced(policy, config, samples, step)
        gap, moved = (current - rollout).abs().max().item(), (reference - rollout).abs().max().item()
        print(f"after update {step} ({path} sync, {report.seconds:.2f} s): max |lp trainer - lp engine| = "
              f"{gap:.2e}, max |lp initial weights - lp engine| = {moved:.2e}")
        assert gap <= 5e-5 and moved > 1e-3  # the engine serves the updated weights, not the initial ones
    with torch.no_grad():  # the policy leaves this test with the checkpoint's weights
        policy.module.load_state_dict(initial, strict=False)
