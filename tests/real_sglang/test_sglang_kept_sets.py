"""The engine's kept sets against the REAL SGLang 0.5.23 server on CPU (one fp32 server, cumulative streaming, its
pytorch sampler), serving the trainer's tiny model as its OPT checkpoint: `return_sampling_mask` with
`sampling_logprobs_mode: "support"` through the client (top-p alone is sent with top_k 4096, SGLang's cap): every
token's kept set equals the trainer's own top-k / top-p set (fp32 Megatron GPTModel, teacher-forced) wherever the
fp32 margin is clear of the threshold, and the trainer's replayed log π_trunc of every kept id
(`kept_set.kept_token_log_softmax`) equals the engine's support log-probs to ~1e-6; a main job replaying the sets on
this server trains, with the kept-set metrics in its log."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from slime_corr.mcore.kept_set import kept_token_log_softmax
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.rollout import generate_sample
from slime_corr.samples import Sample, SampleStatus
from tests.job_runner import run_main_job
from tests.real_sglang.sglang_helpers import ServerSpec, teacher_forced

pytestmark = pytest.mark.cost(45)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

PROMPTS = [list(b"spell 42: "), list(b"hello"), list(b"x")]
T = 0.8
MARGIN = 1e-4  # a boundary this close to the threshold may fall either way between fp32 engine and trainer
SUPPORT_TOL = 2e-6  # fp32 server vs fp32 trainer: the renormalized log-probs of the kept ids
SETTINGS = [(0.9, -1), (1.0, 20), (0.7, 30)]  # (top_p, top_k)


@pytest.fixture(scope="module")
def server(shared_servers, tiny_opt):
    (s,) = shared_servers(ServerSpec(tiny_opt["v0"], name="fp32"))  # test_sglang_endpoints' cumulative server
    return s.url


@pytest.fixture(scope="module")
def sampled(server) -> dict[tuple[float, int], list[Sample]]:
    """Per setting, a streamed and a plain sample of each prompt, through the client with the sampling mask."""
    async def go():
        async with SGLangClient(server) as c:
            return await asyncio.gather(*(
                generate_sample(c, Sample(prompt_tokens=list(p)), {"max_new_tokens": 12, "temperature": T,
                                                                   "top_p": top_p, "top_k": top_k},
                                stream=stream, sampling_mask=True)
                for top_p, top_k in SETTINGS for p in PROMPTS for stream in (True, False)))

    samples = asyncio.run(go())
    per = len(PROMPTS) * 2
    return {s: samples[i * per:(i + 1) * per] for i, s in enumerate(SETTINGS)}


def _sets(s: Sample) -> list[list[int]]:
    o = s.rollout_top_p_token_offsets.tolist()
    return [s.rollout_top_p_token_ids[o[i]:o[i + 1]].tolist() for i in range(s.response_length)]


def test_the_kept_set_is_the_trainers_nucleus_where_the_margin_is_clear(sampled, tiny_opt):
    clear_total = 0
    for (top_p, top_k), samples in sampled.items():
        assert all(s.status != SampleStatus.FAILED and s.response_length for s in samples), \
            [s.failure_reason for s in samples]
        logits = teacher_forced(tiny_opt["v0"], [(s.prompt_tokens, s.response_tokens) for s in samples],
                                lambda x, response: x.float())
        for s, rows in zip(samples, logits, strict=True):
            for i, (kept, row) in enumerate(zip(_sets(s), rows, strict=True)):
                z = row.double() / T
                probs, order = torch.softmax(z, -1).sort(descending=True)
                before = probs.cumsum(0) - probs  # the mass ranked before each token
                ours = before <= top_p if top_p < 1 else torch.ones_like(probs, dtype=torch.bool)
                clear = top_p >= 1 or bool(((before - top_p).abs() > MARGIN).all())
                if top_k > 0:
                    ours[top_k:] = False
                    zs = z[order]
                    clear = clear and bool(zs[top_k - 1] - zs[top_k] > MARGIN)
                assert s.response_tokens[i] in kept
                if clear:
                    clear_total += 1
                    assert sorted(kept) == sorted(order[ours].tolist()), (top_p, top_k, i, len(kept), int(ours.sum()))
    assert clear_total >= 0.8 * sum(s.response_length for v in sampled.values() for s in v), clear_total


def test_the_replayed_log_probs_are_the_engines_support_log_probs(sampled, tiny_opt):
    worst = 0.0
    for samples in sampled.values():
        logits = teacher_forced(tiny_opt["v0"], [(s.prompt_tokens, s.response_tokens) for s in samples],
                                lambda x, response: x.float())
        for s, rows in zip(samples, logits, strict=True):
            out = kept_token_log_softmax(rows, torch.tensor(s.response_tokens), s.rollout_top_p_token_offsets.diff(),
                                         s.rollout_top_p_token_ids, temperature=T)
            assert out.has_kept_set.all()
            diff = (out.kept_log_probs.double() - s.rollout_top_p_log_probs.double()).abs()
            worst = max(worst, float(diff.max()))
            # the engine's mass from its own numbers, lp − lp_trunc, is the trainer's lse_N − lse_V
            full = torch.log_softmax(rows.double() / T, -1).gather(-1, torch.tensor(s.response_tokens)[:, None])[:, 0]
            torch.testing.assert_close(s.rollout_nucleus_log_mass.double(), full - out.log_probs.double(),
                                       rtol=0, atol=1e-4)
    print(f"max |log π_trunc,train − log π_trunc,engine| over every kept id: {worst:.2e}")
    assert worst <= SUPPORT_TOL, worst


def test_a_main_job_replays_the_kept_sets_on_the_server(server, tmp_path):
    run_dir = tmp_path / "run"
    out = run_main_job(["--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
                        "--num-steps-per-rollout", "2", "--micro-batch-size", "4", "--rollout-max-response-len", "8",
                        "--run-dir", str(run_dir), "--sglang-url", server, "--rollout-correction-preset",
                        "decoupled_seq_is_rs", "--rollout-weight-sync", "disk", "--rollout-top-p", "0.9",
                        "--rollout-top-k", "50", "--rollout-return-sampling-mask"], timeout=600,
                       output_dir=tmp_path / "output")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["rollout_corr/mismatch_nucleus_engine_share"] == 1.0
        assert r["rollout_corr/mismatch_kept_abs_log_prob_diff"] < 1e-5, r  # fp32 server, fp32 trainer
        assert r["rollout_corr/mismatch_kept_outside_trainer_nucleus"] < 0.05, r
        assert 1 <= r["rollout/kept_set_size_p50"] <= r["rollout/kept_set_size_p99"] <= 50
        assert all(math.isfinite(r[k]) for k in ("rollout_corr/mismatch_kept_trainer_log_mass",
                                                  "rollout/kept_set_size_mean", "rollout/kept_set_singleton_share"))
    print("step 1:", {k: v for k, v in rows[0].items() if "kept" in k})
