"""The engine's own nucleus against the REAL SGLang 0.5.23 server on CPU (one fp32 server, cumulative streaming),
serving the trainer's tiny model as its OPT checkpoint: with top_k = k and top_logprobs_num = k the sampled token
is among the engine's k returned tokens, the engine's mass is the sum of exp of those k log-probs, and it equals the
trainer's own top-k mass (fp32 Megatron GPTModel, teacher-forced) within fp32 tolerance; under top_p (with the
whole vocabulary returned) the engine's nucleus mass equals the trainer's by SGLang's rule wherever it is decided."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.nucleus import NucleusRequest
from slime_corr.rollout.rollout import generate_sample
from slime_corr.samples import Sample, SampleStatus
from tests.real_sglang.sglang_helpers import ServerSpec, teacher_forced

pytestmark = pytest.mark.cost(20)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

PROMPTS = [list(b"spell 42: "), list(b"hello"), list(b"x")]
T = 0.8
MASS_TOL = 1e-4  # fp32 server vs fp32 trainer (log-probs agree to 1-2e-5: SGLANG_ON_CPU.md)


@pytest.fixture(scope="module")
def server(shared_servers, tiny_opt):
    (s,) = shared_servers(ServerSpec(tiny_opt["v0"], name="fp32"))  # test_sglang_endpoints' cumulative server
    return s.url


def megatron_log_softmax(version_dir: str, sequences: list[tuple[list[int], list[int]]], temperature: float
                         ) -> list[torch.Tensor]:
    """log_softmax(logits / T) [response, V] at each response position, from the trainer's model (Megatron
    GPTModel, fp32, teacher-forced) in a one-rank gloo group in this process."""
    return teacher_forced(version_dir, sequences,
                          lambda logits, response: torch.log_softmax(logits.double() / temperature, -1))


def test_top_k_the_engine_mass_is_its_own_top_k_sum_and_the_trainers(server, tiny_opt):
    k = 5
    params = {"max_new_tokens": 12, "temperature": T, "top_k": k}

    async def go():
        async with SGLangClient(server) as c:
            return await asyncio.gather(*(c.generate(p, params, stream=stream, nucleus=NucleusRequest(1.0, k, k))
                                          for p in PROMPTS for stream in (False, True)))

    results = asyncio.run(go())
    ref = megatron_log_softmax(tiny_opt["v0"], [(p, r.output_ids) for p, r in zip(
        [p for p in PROMPTS for _ in (0, 1)], results, strict=True)], T)
    worst = 0.0
    for res, full in zip(results, ref, strict=True):
        assert len(res.output_ids) > 0 and len(res.top_ids) == len(res.output_ids)
        for i, (tok, ids, values, mass) in enumerate(zip(res.output_ids, res.top_ids, res.top_log_probs,
                                                         res.nucleus_log_mass, strict=True)):
            assert len(ids) == k and tok in ids, (i, tok, ids)  # the sampled token is in the engine's kept set
            own = math.log(sum(math.exp(v) for v in values))
            assert mass == pytest.approx(own, abs=1e-9)  # the engine's mass: its own k log-probs' sum
            trainer = float(full[i].topk(k).values.logsumexp(-1))
            worst = max(worst, abs(mass - trainer))
    assert worst <= MASS_TOL, worst
    print(f"top_k={k}: max |log M_engine - log M_trainer| = {worst:.2e}")


def test_top_p_the_engine_nucleus_mass_is_the_trainers(server, tiny_opt):
    """top_p 0.9 with all 256 log-probs returned (the tiny model's distributions are flat): every position's
    boundary is inside them; the mass equals the trainer's by SGLang's rule (sorted, mass before the rank ≤ top_p)
    except where the boundary lies within rounding of 0.9 (left to the trainer's mass: NaN)."""
    params = {"max_new_tokens": 12, "temperature": T, "top_p": 0.9}

    async def go():
        async with SGLangClient(server) as c:
            return await asyncio.gather(*(generate_sample(c, Sample(prompt_tokens=list(p)), params, stream=True,
                                                          nucleus_logprobs=256) for p in PROMPTS))

    samples = asyncio.run(go())
    ref = megatron_log_softmax(tiny_opt["v0"], [(s.prompt_tokens, s.response_tokens) for s in samples], T)
    known = worst = 0
    for s, full in zip(samples, ref, strict=True):
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED), s.failure_reason
        probs = full.exp().sort(-1, descending=True).values
        want = (probs * ((probs.cumsum(-1) - probs) <= 0.9)).sum(-1).log()
        got = s.rollout_nucleus_log_mass.double()
        fits = ~got.isnan()
        known += int(fits.sum())
        worst = max(worst, float((got[fits] - want[fits]).abs().max()) if fits.any() else 0.0)
    assert known >= 0.8 * sum(s.response_length for s in samples) and worst <= MASS_TOL, (known, worst)
