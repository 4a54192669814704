"""The trainer's pieces on their own (no process launch): every bad run flag is refused at parse time with the
flag's name, GRPO advantages with and without std normalization and with rejected samples left out of their group,
the DP plan (whole groups, token-balanced) and its micro-batches (padded, or packed by a token budget with equal
counts on every DP rank), weight lags, and the KL / entropy loss terms against hand formulas."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys

import pytest
import torch

from slime_corr.config import ConfigError
from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.layout.groups import group_advantages, grpo_advantages
from slime_corr.loss_terms import LossTermsConfig
from slime_corr.losses import KL_ESTIMATORS, compute_policy_loss
from slime_corr.main import main
from slime_corr.samples import Sample, SampleStatus
from slime_corr.trainer.config import TrainerConfig
from slime_corr.trainer.data import (
    RankShard,
    build_micro_batches,
    plan_micro_batches,
    plan_rollout,
    rollout_shards,
    token_lags,
    version_step,
)
from tests.job_runner import job_env, run_main_job


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


BAD_FLAGS = [
    (["--rollout-max-response-len", "0"], "--rollout-max-response-len 0 must be an integer >= 1"),
    (["--num-rollout", "0"], "--num-rollout 0 must be an integer >= 1"),
    (["--rollout-temperature", "0"], "--rollout-temperature 0.0 must be > 0"),
    (["--rollout-nucleus-logprobs", "-1"], "--rollout-nucleus-logprobs -1 must be an integer >= 0"),
    (["--lr", "-0.001"], "--lr -0.001 must be a finite number > 0"),
    (["--lr", "nan"], "--lr nan must be a finite number > 0"),
    (["--n-samples-per-prompt", "1"], "--n-samples-per-prompt 1: GRPO"),
    (["--pipeline-model-parallel-size", "2"], "× --pipeline-model-parallel-size 2: launch TP × CP × PP × DP"),
    (["--use-dynamic-batch-size"], "--use-dynamic-batch-size needs --max-tokens-per-gpu N"),
    (["--max-tokens-per-gpu", "512"], "--max-tokens-per-gpu 512 only applies to packed micro-batches: add "
                                      "--use-dynamic-batch-size"),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "0"], "--max-tokens-per-gpu 0 must be an integer >= 1"),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "200"], "--max-tokens-per-gpu 200: a GRPO group "
                                                                  "(--n-samples-per-prompt 8 samples"),
    (["--tensor-model-parallel-size", "2"], "1 processes (WORLD_SIZE) are not a multiple of --tensor-model"),
    (["--global-batch-size", "5"], "--global-batch-size 5 must divide the rollout's 32 samples"),
    (["--global-batch-size", "8", "--num-steps-per-rollout", "2"], "--global-batch-size 8 × --num-steps-per-rollout 2 "
                                                                   "must equal"),
    (["--max-failed-sample-fraction", "1.5"], "--max-failed-sample-fraction 1.5 must be in [0, 1]"),
    (["--rollout-request-timeout", "0"], "--rollout-request-timeout 0.0 must be a finite number > 0"),
    (["--distributed-timeout-minutes", "-1"], "--distributed-timeout-minutes -1.0 must be a finite number > 0"),
    (["--num-steps-per-rollout", "8", "--rollout-batch-size", "4"], "--global-batch-size 4 must be a multiple of "
                                                                    "--n-samples-per-prompt 8"),
    (["--micro-batch-size", "3"], "--micro-batch-size 3 must divide the 8 samples"),
    (["--rollout-max-response-len", "300"], "--rollout-max-response-len 300: prompt + response"),
    (["--save-interval", "2"], "--save-interval needs --save DIR"),
    (["--load", "/nonexistent/ckpt"], "--load /nonexistent/ckpt: no such directory"),
    (["--ckpt-step", "2"], "--ckpt-step selects a checkpoint of --load DIR"),
    (["--kl-loss-coef", "-1"], "--kl-loss-coef -1.0 must be a finite number >= 0"),
    (["--kl-loss-type", "k9"], "argument --kl-loss-type: invalid choice"),
    (["--entropy-coef", "inf"], "--entropy-coef inf must be a finite number"),
    (["--rollout-num-engines", "0"], "--rollout-num-engines 0 must be an integer >= 1"),
    (["--clip-grad", "-1"], "--clip-grad -1.0 must be >= 0"),
    (["--vocab-size", "128"], "--vocab-size 128 must be >= 256"),
    (["--hidden-size", "0"], "--hidden-size 0 must be an integer >= 1"),
    (["--hidden-size", "30"], "--hidden-size 30 must be a multiple of --num-attention-heads 4"),
    (["--max-staleness", "3"], "--max-staleness 3: bounds the asynchronous rollout producer, but the run is "
                               "synchronous"),
    (["--staleness-policy", "regenerate"], "--staleness-policy regenerate: bounds the asynchronous"),
    (["--async-rollout", "--max-staleness", "-1"], "--max-staleness -1 must be an integer >= 0"),
    (["--async-rollout", "--max-staleness", "6"], "--max-staleness 6: with --num-steps-per-rollout 4, a rollout "
                                                  "generated one rollout ahead is trained up to 7"),
    (["--async-rollout", "--staleness-policy", "keep"], "argument --staleness-policy: invalid choice"),
    (["--prox-logp-method", "loglinear", "--rollout-correction-preset", "ppo_is_bypass"],
     "--prox-logp-method loglinear approximates decoupled mode's recomputed lp_old; bypass mode"),
    (["--prox-logp-method", "loglinear", "--rollout-top-k", "20"], "--prox-logp-method loglinear with --rollout-top-p"),
    (["--partial-rollout"], "--partial-rollout: updates the weights while rollouts are in flight, but a synchronous "
                            "run has none"),
    (["--async-rollout", "--mask-offpolicy-in-partial-rollout"], "--mask-offpolicy-in-partial-rollout masks the "
                                                                 "tokens"),
    (["--prox-logp-error-interval", "-1"], "--prox-logp-error-interval -1 must be an integer >= 0"),
    # --bf16 / --fp16 (Megatron's mixed precision, slime_corr.mcore.precision)
    (["--bf16", "--fp16"], "--bf16 and --fp16 are exclusive"),
    (["--fp16", "--loss-scale", "0"], "--loss-scale 0.0: must be > 0"),
    (["--loss-scale", "8"], "--loss-scale 8.0: loss scaling applies to --fp16 or --bf16 training only"),
    (["--bf16", "--params-dtype", "float64"], "--bf16 and --params-dtype float64 are exclusive"),
    (["--fp16", "--params-dtype", "float64"], "--fp16 and --params-dtype float64 are exclusive"),
    (["--fp16", "--initial-loss-scale", "4", "--min-loss-scale", "8"], "--min-loss-scale 8.0 > --initial-loss-scale"),
    (["--fp16", "--hysteresis", "0"], "--hysteresis 0: must be an integer >= 1"),
]


@pytest.mark.parametrize("argv, message", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_each_bad_run_flag_is_refused_at_parse_time_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--self-check"])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()  # the short usage line and the message, not the whole help
    assert len(lines) == 2 and lines[0].startswith("usage: python -m slime_corr.main [FLAGS]"), lines
    assert message in lines[1]


def test_an_unreachable_sglang_url_is_refused_at_start_up(capsys, tmp_path):
    """Refused with a hint, and the hint followed: the same command without --sglang-url and with the engine it
    names runs (the real SGLang server, the default, is followed in tests/real_sglang)."""
    url = f"http://127.0.0.1:{_closed_port()}"
    command = ["--rollout-engine", "embedded", "--num-rollout", "1", "--rollout-batch-size", "2",
               "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--rollout-progress", "none"]
    with pytest.raises(SystemExit) as e:
        main(["--sglang-url", url, *command])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--sglang-url {url} is not reachable" in err and "refused" in err.lower()
    assert "drop --sglang-url: the job then starts its own engines" in err and "--rollout-engine embedded" in err
    followed = run_main_job([*command, "--run-dir", str(tmp_path / "run")], env=job_env(), timeout=300,
                            output_dir=tmp_path)
    assert followed.returncode == 0 and "step 1:" in followed.stdout, followed.stderr[-2000:]
    with pytest.raises(SystemExit):
        main(["--sglang-url", "localhost:30000", "--self-check"])
    assert "not an http(s) URL" in capsys.readouterr().err


def test_an_empty_load_directory_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--load", str(tmp_path), "--self-check"])
    assert "no latest_checkpointed_iteration.txt" in capsys.readouterr().err


def test_the_default_run_parses_and_derives_slimes_batch_arithmetic():
    assert main(["--self-check"]) == 0
    cfg = TrainerConfig(world_size=4, tensor_model_parallel_size=2, rollout_batch_size=4, n_samples_per_prompt=4,
                        num_steps_per_rollout=2, micro_batch_size=2)
    assert (cfg.data_parallel_size, cfg.global_batch_size, cfg.samples_per_rank_step, cfg.num_microbatches) == \
        (2, 8, 4, 2)
    with pytest.raises(ConfigError, match="--kl-loss-type"):
        LossTermsConfig(kl_loss_type="kl")


def test_pipeline_and_packing_flags_are_checked_against_the_model_and_the_batch():
    from slime_corr.mcore.model import TinyGPTArgs

    pp = TrainerConfig(world_size=2, pipeline_model_parallel_size=2, micro_batch_size=2,
                       model=TinyGPTArgs(num_layers=4, vocab_size=256))
    assert (pp.data_parallel_size, pp.num_microbatches) == (1, 4)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 2 must divide --num-layers 3"):
        TrainerConfig(world_size=2, pipeline_model_parallel_size=2, model=TinyGPTArgs(num_layers=3, vocab_size=256))
    # packed: --micro-batch-size is not used; the budget must hold a group: 8 samples of 16 + 12 tokens, padded
    # to 2·CP = 4 under CP=2 -> 224 tokens, 112 per GPU
    packed = TrainerConfig(world_size=2, context_parallel_size=2, micro_batch_size=3, use_dynamic_batch_size=True,
                           max_tokens_per_gpu=112)
    assert packed.micro_batching == "packed, up to 112 tokens per GPU"
    with pytest.raises(ConfigError, match="can take 224 tokens, 112 per GPU under --context-parallel-size 2"):
        TrainerConfig(world_size=2, context_parallel_size=2, use_dynamic_batch_size=True, max_tokens_per_gpu=111)


# ------------------------------------------------------------------------------------------------ advantages
def _reference_advantages(rewards, groups, keep, normalize_std, eps=1e-6):
    """A plain loop: per group, over the kept samples only."""
    out = []
    for i, r in enumerate(rewards):
        if not keep[i]:
            out.append(0.0)
            continue
        peers = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i] and keep[j]]
        mean = sum(peers) / len(peers)
        a = r - mean
        if normalize_std:
            std = math.sqrt(sum((p - mean) ** 2 for p in peers) / (len(peers) - 1)) if len(peers) > 1 else 0.0
            a /= std + eps
        out.append(a)
    return out


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_leave_rejected_samples_out_of_the_baseline(normalize_std):
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(12, generator=g, dtype=torch.float64)
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3, 5, 5, 9, 9])
    keep = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1, 0, 1, 1], dtype=torch.bool)  # an all-rejected group, a lone one
    got = group_advantages(rewards, groups, keep, normalize_std)
    want = _reference_advantages(rewards.tolist(), groups.tolist(), keep.tolist(), normalize_std)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert got[8] == 0.0 and (got[4:8] == 0).all()
    # the rejected sample's reward does not move its group: changing it changes nothing
    rewards2 = rewards.clone()
    rewards2[1] = 100.0
    assert torch.equal(group_advantages(rewards2, groups, keep, normalize_std), got)


def test_grpo_advantages_of_samples_match_the_tensor_version():
    samples = [Sample(prompt_tokens=[1], reward=r, group_id=g) for r, g in
               [(1.0, 0), (0.0, 0), (0.5, 0), (0.2, 1), (0.2, 1)]]
    assert grpo_advantages(samples) == pytest.approx(
        _reference_advantages([s.reward for s in samples], [s.group_id for s in samples], [True] * 5, True))
    assert grpo_advantages(samples, normalize_std=False)[:3] == pytest.approx([0.5, -0.5, 0.0])


# ------------------------------------------------------------------------------------------------ data plan
def _samples(n_groups: int, group_size: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for gid in range(n_groups):
        for j in range(group_size):
            n = int(torch.randint(1, 9, (1,), generator=g))
            out.append(Sample(prompt_tokens=[65, 66], response_tokens=[97] * n,
                              rollout_log_probs=torch.full((n,), -1.0), reward=float(j % 2), group_id=gid,
                              index=gid * group_size + j, weight_version="step-3",
                              status=SampleStatus.TRUNCATED))
    return out


def test_the_plan_keeps_groups_whole_and_balances_tokens_across_dp():
    samples = _samples(8, 4)
    plan = plan_rollout(samples, group_size=4, num_steps=2, dp_size=2)
    seen = sorted(i for step in plan for part in step for i in part)
    assert seen == list(range(32))
    for k, step in enumerate(plan):
        for part in step:
            assert len(part) == 8 and {samples[i].group_id for i in part} <= set(range(4 * k, 4 * k + 4))
            for gid in {samples[i].group_id for i in part}:  # whole groups only
                assert sum(samples[i].group_id == gid for i in part) == 4
        loads = [sum(samples[i].total_length for i in part) for part in step]
        group_tokens = sorted(sum(samples[i].total_length for i in range(g * 4, g * 4 + 4)) for g in
                              range(4 * k, 4 * k + 4))
        assert abs(loads[0] - loads[1]) <= group_tokens[-1]  # greedy longest-first: within the largest group


def _group_samples(response_lengths: list[list[int]]) -> list[Sample]:
    """Groups of samples with a 2-token prompt and the given response lengths, trainable, rewards 0, 1, 0, ..."""
    out = []
    for gid, lengths in enumerate(response_lengths):
        for j, n in enumerate(lengths):
            out.append(Sample(prompt_tokens=[65, 66], response_tokens=[97] * n, rollout_log_probs=torch.full((n,), -1.0),
                              reward=float(j % 2), group_id=gid, index=len(out), status=SampleStatus.COMPLETED))
    return out


def test_packed_micro_batches_hold_whole_groups_within_the_budget_and_equal_counts_across_dp():
    # group tokens 10, 10, 10, 12 (2 samples of 5 or 6): DP rank 0 gets groups 2 and 3 (22 tokens), rank 1 groups
    # 0 and 1 (20): with 20 tokens per micro-batch rank 1 needs one micro-batch, rank 0 two
    samples = _group_samples([[3, 3], [3, 3], [3, 3], [4, 4]])
    (parts,) = plan_rollout(samples, group_size=2, num_steps=1, dp_size=2)
    assert [sorted({samples[i].group_id for i in p}) for p in parts] == [[2, 3], [0, 1]]
    plan = plan_micro_batches(samples, parts, group_size=2, micro_batch_size=2, max_tokens=20)
    assert plan == [[[4, 5], [6, 7]], [[0, 1, 2, 3], []]]  # rank 1 filled up with an empty micro-batch
    # padded: micro_batch_size samples each, equal counts by construction
    assert plan_micro_batches(samples, parts, 2, micro_batch_size=2) == [[[4, 5], [6, 7]], [[0, 1], [2, 3]]]
    # under CP=2 every sample is padded to 4 (6 -> 8): 24 per group of 12, 20 for the others; 12 per GPU = 24
    plan = plan_micro_batches(samples, parts, 2, micro_batch_size=2, max_tokens=12, cp_size=2)
    assert plan == [[[4, 5], [6, 7]], [[0, 1], [2, 3]]]
    # a larger rollout: every sample once, groups whole, budgets kept, counts equal, empties last
    samples = _samples(8, 4, seed=3)
    for parts in plan_rollout(samples, group_size=4, num_steps=2, dp_size=2):
        plan = plan_micro_batches(samples, parts, 4, micro_batch_size=4, max_tokens=60)
        assert len({len(mbs) for mbs in plan}) == 1
        assert sorted(i for mbs in plan for mb in mbs for i in mb) == sorted(i for p in parts for i in p)
        for mbs in plan:
            sizes = [len(mb) for mb in mbs]
            assert sizes == sorted(sizes, key=lambda n: n == 0)  # the empty ones at the end
            for mb in filter(None, mbs):
                groups = {samples[i].group_id for i in mb}
                assert len(mb) == 4 * len(groups)  # whole groups
                assert len(groups) == 1 or sum(samples[i].total_length for i in mb) <= 60


def test_an_empty_micro_batch_trains_nothing_and_counts_no_sequence():
    shard = RankShard(steps=[[[], []]])
    (mbs,) = build_micro_batches(shard, first_step=0, packed=True, cp_size=2)
    for b in mbs:
        assert b["loss_mask"].sum() == 0 and b["trained"].tolist() == [False] and b["sample_ids"].tolist() == [-1]
        assert b["group_ids"].tolist() == [-1] and b["cu_seqlens_padded"].tolist() == [0, 4]


def test_micro_batches_carry_lag_ids_rewards_and_cp_slices():
    samples = _samples(2, 4)
    samples[2].weight_versions = [("step-1", 0, 1), ("step-3", 1, samples[2].response_length)]
    samples[5].status, samples[5].failure_reason = SampleStatus.FAILED, "test"
    (shard,) = rollout_shards(samples, group_size=4, num_steps=1, dp_size=1, micro_batch_size=4)
    (mbs,) = build_micro_batches(shard, first_step=5)
    assert [b["sample_ids"].tolist() for b in mbs] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    b = mbs[0]
    p = len(samples[2].prompt_tokens)
    assert b["weight_lag"][2, p - 1].item() == 4 and b["weight_lag"][2, p].item() == 2  # resumed across versions
    assert b["rewards"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert mbs[1]["loss_mask"][1].sum() == 0  # the failed sample stays, untrained
    assert mbs[1]["trained"].tolist() == [True, False, True, True]
    (cp,) = build_micro_batches(shard, first_step=5, cp_rank=1, cp_size=2)
    assert cp[0]["tokens"].shape[1] * 2 == cp[0]["full_tokens"].shape[1] and "full_position_ids" in cp[0]
    assert cp[0]["weight_lag"].shape == cp[0]["loss_mask"].shape
    assert token_lags(samples[0], 3) == [0] * samples[0].response_length
    assert version_step("step-12") == 12 and version_step("default") is None


# ------------------------------------------------------------------------------------------------ KL, entropy
def test_kl_estimators_are_schulmans():
    x = torch.tensor([-30.0, -2.0, -0.1, 0.0, 0.3, 25.0], dtype=torch.float64)  # x = lp − lp_ref
    assert torch.equal(KL_ESTIMATORS.get("k1", flag="f")(x), x)
    torch.testing.assert_close(KL_ESTIMATORS.get("k2", flag="f")(x), x**2 / 2)
    xc = x.clamp(-20, 20)
    k3 = torch.exp(-xc) - 1 + xc
    torch.testing.assert_close(KL_ESTIMATORS.get("k3", flag="f")(x), k3)
    torch.testing.assert_close(KL_ESTIMATORS.get("low_var_kl", flag="f")(x), k3.clamp(-10, 10))
    assert torch.isfinite(KL_ESTIMATORS.get("k3", flag="f")(x)).all() and (k3 >= 0).all()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_loss_terms_add_coef_times_kl_minus_entropy_per_token(agg, kl_type):
    g = torch.Generator().manual_seed(1)
    B, S = 4, 7
    lp = (-torch.rand(B, S, generator=g, dtype=torch.float64) * 2).requires_grad_()
    old = lp.detach() + 0.05 * torch.randn(B, S, generator=g, dtype=torch.float64)
    ref = lp.detach() + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)
    ent = (torch.rand(B, S, generator=g, dtype=torch.float64) * 3).requires_grad_()
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, S)
    mask = torch.rand(B, S, generator=g) > 0.3
    mask[1] = False
    ref[0, 0] = float("nan")  # a non-finite reference contributes nothing, never a NaN
    cfg = C(loss_agg_mode=agg)
    terms = LossTermsConfig(kl_loss_coef=0.1, kl_loss_type=kl_type, entropy_coef=0.01)
    out = compute_policy_loss(lp, old, None, adv, mask, cfg, loss_terms=terms, ref_log_probs=ref, entropy=ent)
    base = compute_policy_loss(lp, old, None, adv, mask, cfg)
    x = lp - torch.nan_to_num(ref)
    kl = x if kl_type == "k1" else torch.exp(-x) - 1 + x
    ok = mask & torch.isfinite(ref)
    term = torch.where(ok, 0.1 * kl, 0.0) - torch.where(mask, 0.01 * ent, 0.0)
    if agg == "token-mean":
        extra = term.sum() / mask.sum()
    else:
        n = mask.sum(-1)
        rows = n > 0
        extra = (term.sum(-1)[rows] / n[rows]).sum() / rows.sum()
    torch.testing.assert_close(out.loss, base.loss + extra, rtol=1e-12, atol=1e-12)
    want_grad = torch.autograd.grad(base.loss + extra, (lp, ent))
    got_grad = torch.autograd.grad(out.loss, (lp, ent))
    for a, b in zip(got_grad, want_grad, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    kl_mean = torch.where(ok, kl, 0.0).sum() / mask.sum()
    assert out.metrics["kl_loss"].item() == pytest.approx(kl_mean.item(), rel=1e-12)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
def test_the_unbiased_kl_weights_each_token_by_the_ratio_to_lp_old_gradient_included(kl_type):
    """--use-unbiased-kl (slime's, DeepSeek-V3.2): kl_t = ρ_t · k_t, ρ_t = exp(lp_t − lp_old,t) with its gradient;
    low_var_kl clamps the product to [−10, 10] (a far reference token reaches the clamp)."""
    g = torch.Generator().manual_seed(2)
    B, S = 3, 6
    lp = (-torch.rand(B, S, generator=g, dtype=torch.float64) * 2).requires_grad_()
    old = lp.detach() + 0.2 * torch.randn(B, S, generator=g, dtype=torch.float64)
    ref = lp.detach() + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)
    ref[0, 1] = lp[0, 1].item() + 15.0  # k3 = exp(15) - 16: the clamp of low_var_kl
    adv = torch.randn(B, S, generator=g, dtype=torch.float64)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[2, 3:] = False
    cfg = C()
    terms = LossTermsConfig(kl_loss_coef=0.1, kl_loss_type=kl_type, use_unbiased_kl=True)
    out = compute_policy_loss(lp, old, None, adv, mask, cfg, loss_terms=terms, ref_log_probs=ref)
    base = compute_policy_loss(lp, old, None, adv, mask, cfg)
    x = lp - ref
    k = {"k1": x, "k2": x**2 / 2, "k3": torch.exp(-x) - 1 + x, "low_var_kl": torch.exp(-x) - 1 + x}[kl_type]
    kl = torch.exp(lp - old) * k
    if kl_type == "low_var_kl":
        kl = kl.clamp(-10, 10)
    extra = 0.1 * torch.where(mask, kl, 0.0).sum() / mask.sum()
    torch.testing.assert_close(out.loss, base.loss + extra, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(out.loss, lp)[0], torch.autograd.grad(base.loss + extra, lp)[0],
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ConfigError, match="--use-unbiased-kl weights the KL loss's tokens, and there is no KL loss"):
        LossTermsConfig(use_unbiased_kl=True)


def test_loss_terms_need_their_inputs():
    lp = torch.zeros(1, 3, requires_grad=True)
    with pytest.raises(ValueError, match="ref_log_probs"):
        compute_policy_loss(lp, lp.detach(), None, torch.ones(1, 3), torch.ones(1, 3), C(),
                            loss_terms=LossTermsConfig(use_kl_loss=True))
    with pytest.raises(ValueError, match="entropy"):
        compute_policy_loss(lp, lp.detach(), None, torch.ones(1, 3), torch.ones(1, 3), C(),
                            loss_terms=LossTermsConfig(entropy_coef=0.1))


# ------------------------------------------------------------------------------------------------ rebaseline
def _per_sequence(batch: dict, key: str) -> list[torch.Tensor]:
    """A micro-batch entry per sequence: the rows of a padded batch, the spans of a packed one."""
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens_padded"].tolist()
        return [batch[key][0, a:e] for a, e in zip(cu, cu[1:], strict=False)]
    return list(batch[key])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_rejected_sequences_leave_their_groups_baseline_before_the_update(packed):
    from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
    from slime_corr.trainer.update import rebaseline_rejected

    samples = _samples(2, 4)
    for s, r in zip(samples, [1.0, 0.0, 0.9, 0.2, 0.3, 0.3, 0.8, 0.1], strict=True):
        s.reward = r
    (shard,) = rollout_shards(samples, group_size=4, num_steps=1, dp_size=1, micro_batch_size=4)
    (mbs,) = build_micro_batches(shard, first_step=0, packed=packed)
    for b in mbs:  # lp_old = lp_rollout (no mismatch) except one catastrophic token in sample 0
        b["old_log_probs"] = b["rollout_log_probs"].clone().double()
    p = len(samples[0].prompt_tokens)
    mbs[0]["old_log_probs"][0, p] -= 12.0  # ratio e^-12 < 1e-4: vetoed by decoupled_geo_rs
    before = [b["advantages"].clone() for b in mbs]
    hook = RolloutCorrectionLoss(C.preset("decoupled_geo_rs"))
    assert hook.kept_sequences(mbs[0]).tolist() == [False, True, True, True]
    assert rebaseline_rejected(hook, mbs, normalize_std=True) == 1
    want = _reference_advantages([s.reward for s in samples], [s.group_id for s in samples],
                                 [i != 0 for i in range(8)], True)
    for b, rows in zip(mbs, (want[:4], want[4:]), strict=True):
        got = [float(a[m > 0][0]) for a, m in zip(_per_sequence(b, "advantages"), _per_sequence(b, "loss_mask"),
                                                   strict=True)]
        assert got == pytest.approx(rows, rel=1e-6)
        assert (b["advantages"][b["loss_mask"] == 0] == 0).all()
    assert torch.equal(mbs[1]["advantages"], before[1])  # the other group is untouched
    assert not torch.equal(mbs[0]["advantages"], before[0])
    with pytest.raises(ValueError, match="bypass"):
        RolloutCorrectionLoss(C.preset("pg_rs")).kept_sequences(mbs[0])


@pytest.mark.parametrize(("world", "tp", "expected"), [
    (1, 1, (4, 4, 8, 8)), (2, 1, (4, 2, 16, 8)), (4, 2, (4, 2, 16, 8)), (3, 1, (6, 2, 24, 8)), (8, 1, (8, 1, 64, 8))])
def test_batch_defaults_are_valid_at_any_dp_size(world, tp, expected):
    """(--rollout-batch-size, --num-steps-per-rollout, --global-batch-size, --micro-batch-size) when none is given:
    every DP rank trains 8 samples (one GRPO group) per step, as one process does by default."""
    cfg = TrainerConfig(world_size=world, tensor_model_parallel_size=tp)
    got = (cfg.rollout_batch_size, cfg.num_steps_per_rollout, cfg.global_batch_size, cfg.micro_batch_size)
    assert got == expected
    assert cfg.samples_per_rank_step == 8
    explicit = TrainerConfig(world_size=world, tensor_model_parallel_size=tp, global_batch_size=expected[2] * 2,
                             rollout_batch_size=expected[0] * 2)
    assert explicit.num_steps_per_rollout == expected[1] and explicit.micro_batch_size == 8


_ONE_PROCESS_GROUP = """
import os, socket, subprocess, sys
import torch.distributed as dist
from slime_corr import device, ports

def no_port(*args):
    raise AssertionError("a world of one picked a port")

ports.free_port = no_port  # a picked port could be taken before its bind: a world of one needs none
assert device.init_distributed(0.5) and dist.get_world_size() == 1 and dist.get_rank() == 0
assert not device.init_distributed()  # a second call joins the existing group
leaked = sorted(k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k in os.environ)
child = subprocess.run([sys.executable, "-c", "import os; print('RANK' in os.environ)"], capture_output=True, text=True)
print("leaked", leaked, "child_sees_rank", child.stdout.strip())
dist.destroy_process_group()
"""


def test_a_one_process_group_leaves_no_torchrun_variables_for_child_processes_and_binds_no_port():
    """A RANK/MASTER_PORT left in os.environ made the next job a test started look like a torchrun rank bound to the
    first job's port (EADDRINUSE). A world of one binds no port (an in-process store): there is no race to lose,
    and a port picked anyway fails the test."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", _ONE_PROCESS_GROUP], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "leaked [] child_sees_rank False" in out.stdout, out.stdout


def test_a_long_rollout_says_what_it_waits_for(monkeypatch):
    """No silence over ~30 s: a rollout that is not back says, every WAIT_NOTICE_S, which engines it waits for, how
    long so far and what bounds the wait; the samples come back as they are, and a rollout's own TimeoutError is
    the rollout's, not taken for the wait's."""
    from concurrent.futures import Future
    from threading import Timer
    from types import SimpleNamespace

    from slime_corr.trainer import driver as driver_module

    monkeypatch.setattr(driver_module, "WAIT_NOTICE_S", 0.2)
    driver = driver_module.RolloutDriver.__new__(driver_module.RolloutDriver)
    driver.client = SimpleNamespace(urls=["http://127.0.0.1:1234"])
    driver.config = TrainerConfig(rollout_request_timeout=45.0)
    future: Future = Future()
    Timer(0.7, future.set_result, (["sample"],)).start()
    lines: list[str] = []
    assert driver.wait(future, 3, lines.append) == ["sample"]
    assert 2 <= len(lines) <= 4, lines
    assert lines[0].startswith("slime_corr.main: waiting for rollout 3 from http://127.0.0.1:1234: ")
    assert "after 45 s without a byte, --rollout-request-timeout" in lines[0]
    failed: Future = Future()
    failed.set_exception(TimeoutError("the rollout's own"))
    with pytest.raises(TimeoutError, match="the rollout's own"):
        driver.wait(failed, 4, lines.append)
