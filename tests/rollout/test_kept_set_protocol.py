"""The engine's kept sets on the wire (SGLang 0.5.23's `return_sampling_mask`): the request fields and the top_k rule;
`output_token_sampling_mask` / `output_token_sampling_logprobs` parsed strictly (every malformed shape named; a
sampled token outside its set refused) in plain responses and in cumulative and incremental streams alike, the
engine's exact mass log M_μ = lp − lp_trunc; the embedded engine serving SGLang's format and rules from the
distribution it samples from (checked against SGLang's own schema and a sort-based reference); and rollouts through
the client keeping each token's set through pauses (resume, resample)."""

from __future__ import annotations

import asyncio
import copy
import math

import aiohttp
import pytest
import torch

from slime_corr.engines.embedded.engine import start_local_engine
from slime_corr.engines.embedded.model import load_tiny_lm
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.protocol import (
    SAMPLING_MASK_MAX_TOKENS,
    ResponseError,
    StreamAccumulator,
    build_generate_request,
    parse_generate_response,
    sampling_mask_params,
)
from slime_corr.rollout.rollout import PausePolicy, generate_sample
from slime_corr.samples import Sample, SampleStatus

from .engine_helpers import wait_tokens

# three positions of a 6-token vocabulary: the kept set (ids, largest first), its renormalized log-probs, the sampled
PROBS = [[0.5, 0.3, 0.1, 0.05, 0.03, 0.02], [0.7, 0.1, 0.1, 0.05, 0.03, 0.02], [0.25, 0.25, 0.2, 0.15, 0.1, 0.05]]
KEPT = [[0, 1, 2], [0], [0, 1, 2, 3]]
SAMPLED = [1, 0, 3]


def _response(start: int = 0, end: int = 3, total: int | None = None, finish=None) -> dict:
    """An SGLang-shaped response (or stream event) over positions [start, end)."""
    ids, lps, masks, support = [], [], [], []
    for p, kept, y in zip(PROBS[start:end], KEPT[start:end], SAMPLED[start:end], strict=True):
        mass = sum(p[i] for i in kept)
        ids.append(y)
        lps.append([math.log(p[y]), y, None])
        masks.append(list(kept))
        support.append([math.log(p[i] / mass) for i in kept])
    meta = {"id": "r", "completion_tokens": end if total is None else total,
            "finish_reason": finish if finish is not None else ({"type": "length"} if end == 3 else None),
            "output_token_logprobs": lps, "output_token_sampling_mask": masks,
            "output_token_sampling_logprobs": support, "output_token_sampling_mask_length": end}
    return {"text": "", "output_ids": ids, "meta_info": meta}


def test_the_request_asks_for_the_mask_with_a_finite_top_k():
    body = build_generate_request([1, 2], {"top_p": 0.9, "top_k": 50}, "r", return_sampling_mask=True)
    assert body["return_sampling_mask"] is True and body["sampling_logprobs_mode"] == "support"
    assert "return_sampling_mask" not in build_generate_request([1, 2], {"top_p": 0.9}, "r")
    with pytest.raises(ValueError, match=r"sampling_params.top_k None: .* finite top_k in \[1, 4096\]"):
        build_generate_request([1, 2], {"top_p": 0.9}, "r", return_sampling_mask=True)
    assert sampling_mask_params({"top_p": 0.9})["top_k"] == SAMPLING_MASK_MAX_TOKENS
    assert sampling_mask_params({"top_p": 0.9, "top_k": -1})["top_k"] == SAMPLING_MASK_MAX_TOKENS
    assert sampling_mask_params({"top_k": 20})["top_k"] == 20


def test_the_kept_sets_and_the_engine_mass_per_token():
    out = parse_generate_response(_response(), sampling_mask=True)
    assert out.kept_ids == KEPT and out.output_ids == SAMPLED
    for p, kept, lps, mass in zip(PROBS, KEPT, out.kept_log_probs, out.nucleus_log_mass, strict=True):
        m = sum(p[i] for i in kept)
        assert mass == pytest.approx(math.log(m), abs=1e-12)  # lp − lp_trunc = log M_μ
        assert sum(math.exp(v) for v in lps) == pytest.approx(1.0)
    assert out.nucleus_log_mass[1] == pytest.approx(math.log(0.7))  # a singleton: its mass is its probability


def _broken(kind: str) -> dict:
    r = copy.deepcopy(_response())
    meta = r["meta_info"]
    if kind == "missing":
        del meta["output_token_sampling_mask"]
    elif kind == "missing_logprobs":
        del meta["output_token_sampling_logprobs"]
    elif kind == "short":
        meta["output_token_sampling_mask"].pop()
    elif kind == "outside":
        meta["output_token_sampling_mask"][2] = [0, 1, 2, 4]
    elif kind == "twice":
        meta["output_token_sampling_mask"][0] = [1, 1, 2]
    elif kind == "empty":
        meta["output_token_sampling_mask"][1], meta["output_token_sampling_logprobs"][1] = [], []
    elif kind == "not_ints":
        meta["output_token_sampling_mask"][0] = [0, "1", 2]
    elif kind == "count":
        meta["output_token_sampling_logprobs"][0] = meta["output_token_sampling_logprobs"][0][:2]
    elif kind == "selected":  # one log-prob per token (sampling_logprobs_mode "selected")
        meta["output_token_sampling_logprobs"] = [[x[0]] for x in meta["output_token_sampling_logprobs"]]
    elif kind == "not_normalized":
        meta["output_token_sampling_logprobs"][2] = [math.log(PROBS[2][i]) for i in KEPT[2]]
    elif kind == "positive":
        meta["output_token_sampling_logprobs"][0][0] = 0.5
    return r


@pytest.mark.parametrize(("kind", "message"), [
    ("missing", r"meta_info.output_token_sampling_mask: missing"),
    ("missing_logprobs", r"meta_info.output_token_sampling_logprobs: missing"),
    ("short", r"meta_info.output_token_sampling_mask: 2 entries for 3 output tokens"),
    ("outside", r"output_token_sampling_mask\[2\]: the sampled token 3 is not in its kept set"),
    ("twice", r"output_token_sampling_mask\[0\]: kept ids must be distinct"),
    ("empty", r"output_token_sampling_mask\[1\]: an empty kept set"),
    ("not_ints", r"output_token_sampling_mask\[0\]: expected a list of token ids"),
    ("count", r"output_token_sampling_logprobs\[0\]: 2 log-probs for the 3 kept ids"),
    ("selected", r"output_token_sampling_logprobs\[0\]: 1 log-probs for the 3 kept ids"),
    ("not_normalized", r"output_token_sampling_logprobs\[2\]: the kept set's probabilities sum to 0.85"),
    ("positive", r"output_token_sampling_logprobs\[0\]: a log-prob is not a finite number <= 0"),
])
def test_malformed_kept_sets_are_refused_naming_the_field(kind, message):
    with pytest.raises(ResponseError, match=message):
        parse_generate_response(_broken(kind), sampling_mask=True)


def test_an_abort_without_tokens_may_come_without_the_mask():
    r = {"text": "", "output_ids": [], "meta_info": {"id": "r", "completion_tokens": 0, "output_token_logprobs": [],
                                                     "finish_reason": {"type": "abort", "message": "paused"}}}
    out = parse_generate_response(r, sampling_mask=True)
    assert out.kept_ids == [] and out.nucleus_log_mass == []
    partial = _response(end=2, finish={"type": "abort", "message": "paused"})
    del partial["meta_info"]["output_token_sampling_mask"]
    with pytest.raises(ResponseError, match="output_token_sampling_mask: missing"):  # its tokens need their sets
        parse_generate_response(partial, sampling_mask=True)


@pytest.mark.parametrize("mode", ["cumulative", "incremental"])
def test_streams_read_the_same_kept_sets(mode):
    acc = StreamAccumulator(sampling_mask=True)
    if mode == "cumulative":
        events = [_response(0, 1), _response(0, 2), _response(0, 2), _response(0, 3)]
    else:
        events = [_response(0, 1), _response(1, 2, total=2), _response(2, 3, total=3)]
    for e in events:
        acc.feed(e)
    acc.feed_line("[DONE]")
    out = acc.result()
    whole = parse_generate_response(_response(), sampling_mask=True)
    assert (out.kept_ids, out.kept_log_probs, out.nucleus_log_mass) == (whole.kept_ids, whole.kept_log_probs,
                                                                          whole.nucleus_log_mass)
    bad = StreamAccumulator(sampling_mask=True)
    bad.feed(_response(0, 1))
    with pytest.raises(ResponseError, match="output_token_sampling_mask: 1 entries for 2 output tokens"):
        event = _response(0, 2)
        event["meta_info"]["output_token_sampling_mask"].pop()
        bad.feed(event)


def _post(url: str, body: dict) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as resp:
            return resp.status, await resp.json(content_type=None)

    return asyncio.run(go())


def _reference_kept(model, prompt: list[int], response: list[int], t: float, top_p: float, top_k: int):
    """Per response position: SGLang's kept set (sorted, largest first) and its renormalized log-probs, from the
    fp32 logits of the engine's model, sort-based."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response]))[0, len(prompt) - 1:-1].float()
    out = []
    for row in logits:
        probs, order = torch.softmax(row / t, -1).sort(descending=True)
        kept = (probs.cumsum(0) - probs) <= top_p
        kept[top_k:] = False
        w = probs[kept]
        out.append((order[kept].tolist(), torch.log(w / w.sum()).tolist()))
    return out


@pytest.fixture(scope="module")
def fp32_engine(tiny_ckpt):
    with start_local_engine(tiny_ckpt, dtype=torch.float32) as h:
        yield h


def test_the_embedded_engine_serves_sglangs_fields_and_rules(fp32_engine, tiny_ckpt, api_types):
    prompt, t = [72, 101, 108, 108, 111], 0.7
    params = {"max_new_tokens": 8, "temperature": t, "top_p": 0.8, "top_k": 30, "ignore_eos": True}
    status, r = _post(fp32_engine.url, {"input_ids": prompt, "return_logprob": True, "return_sampling_mask": True,
                                        "sampling_logprobs_mode": "support", "sampling_params": params})
    assert status == 200
    api_types.GenerateResponse.from_json_value(r)  # SGLang's own schema
    meta = r["meta_info"]
    assert meta["output_token_sampling_mask_length"] == len(r["output_ids"]) == 8
    want = _reference_kept(load_tiny_lm(tiny_ckpt), prompt, r["output_ids"], t, 0.8, 30)
    for (ids, lps), kept, support, tok in zip(want, meta["output_token_sampling_mask"],
                                              meta["output_token_sampling_logprobs"], r["output_ids"], strict=True):
        assert kept == ids and tok in kept
        torch.testing.assert_close(torch.tensor(support), torch.tensor(lps), rtol=0, atol=1e-5)
    parse_generate_response(r, sampling_mask=True)  # and our own checks
    # "selected": the sampled token's renormalized log-prob only, as SGLang
    _, sel = _post(fp32_engine.url, {"input_ids": prompt, "return_logprob": True, "return_sampling_mask": True,
                                     "sampling_params": {**params, "sampling_seed": 3}})
    assert all(len(x) == 1 for x in sel["meta_info"]["output_token_sampling_logprobs"])
    # greedy: singletons with log-prob 0
    _, greedy = _post(fp32_engine.url, {"input_ids": prompt, "return_sampling_mask": True,
                                        "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert greedy["meta_info"]["output_token_sampling_mask"] == [[t] for t in greedy["output_ids"]]
    # SGLang's refusals: no finite top_k; a logprobs mode without the mask
    status, text = _post(fp32_engine.url, {"input_ids": prompt, "return_sampling_mask": True,
                                           "sampling_params": {"max_new_tokens": 3, "top_p": 0.9}})
    assert status == 400 and "return_sampling_mask requires top_k=1 for greedy sampling" in str(text)
    status, text = _post(fp32_engine.url, {"input_ids": prompt, "sampling_logprobs_mode": "support",
                                           "sampling_params": {"max_new_tokens": 3}})
    assert status == 400 and "sampling_logprobs_mode can only be set when return_sampling_mask=true" in str(text)


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_a_rollout_keeps_every_tokens_kept_set_streamed(tiny_ckpt, incremental):
    """Through the client and `generate_sample`, streamed: top-p alone (the client sends top_k 4096), top-k alone
    and both; the kept sets equal the sort-based reference and the mass is the reference's."""
    model = load_tiny_lm(tiny_ckpt)
    prompt = [104, 105, 32]
    with start_local_engine(tiny_ckpt, dtype=torch.float32, incremental_streaming_output=incremental) as h:
        async def go(params: dict) -> Sample:
            async with SGLangClient(h.url) as c:
                return await generate_sample(c, Sample(prompt_tokens=list(prompt)), params, stream=True,
                                             sampling_mask=True)

        base = {"max_new_tokens": 10, "temperature": 0.8, "ignore_eos": True, "stream_interval": 3, "sampling_seed": 4}
        for top_p, top_k in ((0.9, -1), (1.0, 5), (0.7, 20)):
            s = asyncio.run(go({**base, "top_p": top_p, "top_k": top_k}))
            assert s.status == SampleStatus.TRUNCATED and s.response_length == 10, s.failure_reason
            want = _reference_kept(model, prompt, s.response_tokens, 0.8, top_p, top_k if top_k > 0 else 10**9)
            o = s.rollout_top_p_token_offsets.tolist()
            got = [s.rollout_top_p_token_ids[o[i]:o[i + 1]].tolist() for i in range(10)]
            assert got == [ids for ids, _ in want]
            mass = torch.tensor([math.log(sum(math.exp(v) for v in lps) or 1) for _, lps in want])  # (= 0)
            assert mass.abs().max() < 1e-5
            torch.testing.assert_close(s.rollout_top_p_log_probs, torch.tensor([v for _, lps in want for v in lps]),
                                       rtol=0, atol=1e-5)
            lp_trunc = torch.tensor([lps[ids.index(tok)] for (ids, lps), tok in zip(want, s.response_tokens,
                                                                                     strict=True)])
            torch.testing.assert_close(s.rollout_nucleus_log_mass, s.rollout_log_probs - lp_trunc, rtol=0, atol=2e-5)
        plain = asyncio.run(go({**base, "top_p": 1.0}))  # nothing truncated: nothing asked
        assert plain.rollout_top_p_token_ids is None


@pytest.mark.parametrize("policy", [PausePolicy.RESUME, PausePolicy.RESAMPLE])
def test_kept_sets_survive_a_pause(tiny_ckpt, policy):
    """A request aborted by a pause mid-response: RESUME keeps the partial tokens with their sets and appends the
    resumed request's; RESAMPLE starts over (no set of the dropped tokens left). Every token's set holds it."""
    prompt = [10, 20, 30, 40]
    params = {"max_new_tokens": 30, "ignore_eos": True, "temperature": 1.0, "top_p": 0.9, "top_k": 50}
    with start_local_engine(tiny_ckpt, dtype=torch.float32, step_delay=0.01) as h:
        sample = Sample(prompt_tokens=list(prompt))

        async def go():
            async with SGLangClient(h.url) as c:
                task = asyncio.create_task(generate_sample(c, sample, params, stream=True, pause_policy=policy,
                                                           sampling_mask=True))
                await wait_tokens(h.engine, c, 5)
                await c.pause("abort")
                await asyncio.sleep(0.05)
                await c.continue_generation()
                return await task

        s = asyncio.run(go())
    assert s.status == SampleStatus.TRUNCATED and s.response_length == 30, s.failure_reason
    assert s.rollout_top_p_token_offsets.numel() == 31 and s.rollout_nucleus_log_mass.isfinite().all()
    s.validate()  # every token in its own set, once
    assert (s.rollout_top_p_token_offsets.diff() > 0).all()
    if policy == PausePolicy.RESUME:
        assert len(s.weight_versions) >= 1 and s.attempts >= 2


def test_the_buffer_and_data_iterator_carry_the_kept_sets(tiny_ckpt):
    """A streamed rollout with the sampling mask into the buffer, read by `BufferMicroBatchIterator` as CP rank 0
    of 2 (packed, a token budget that leaves an empty micro-batch): every micro-batch carries the key pair, the
    ids of its positions, and the empty one the (empty) keys too."""
    from slime_corr.layout.context_parallel import slice_micro_batch_for_cp
    from slime_corr.layout.kept_sets import KEPT_COUNTS_KEY, KEPT_IDS_KEY, KEPT_LOG_PROBS_KEY
    from slime_corr.layout.micro_batch import build_micro_batch, cp_pad_multiple, mask_not_trained
    from slime_corr.rollout.buffer import SampleBuffer
    from slime_corr.rollout.data_iterator import BufferMicroBatchIterator, background_event_loop
    from slime_corr.rollout.rollout import generate_group_samples

    params = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 0.8}
    prompts = [list(b"Count: "), list(b"x = ")]
    with start_local_engine(tiny_ckpt, dtype=torch.float32) as h, background_event_loop() as loop:
        buffer = SampleBuffer(maxsize=8)

        async def rollout():
            async with SGLangClient(h.url) as c:
                return await generate_group_samples(c, prompts, 2, params, stream=True, buffer=buffer,
                                                    sampling_mask=True, reward_fn=lambda s: float(s.index))

        done = asyncio.run_coroutine_threadsafe(rollout(), loop)
        it = BufferMicroBatchIterator(buffer, loop, 4, 4, group_size=2, cp_rank=0, cp_size=2, packed=True,
                                      max_tokens_per_micro_batch=1000, timeout=60, kept_sets=True)
        batches = list(it)
        samples = done.result(timeout=60)
    assert all(s.rollout_top_p_token_ids is not None for s in samples)
    assert len(batches) == 2 and it.batch_sizes == [4, 0]  # all four in the first, the second empty
    for batch in batches:
        assert {KEPT_COUNTS_KEY, KEPT_IDS_KEY} <= set(batch)
    assert batches[1][KEPT_IDS_KEY].numel() == 0
    whole = mask_not_trained(build_micro_batch(it.samples, packed=True, pad_to_multiple=cp_pad_multiple(2)),
                             it.samples)
    want = slice_micro_batch_for_cp(whole, 0, 2)
    for key in (KEPT_COUNTS_KEY, KEPT_IDS_KEY, KEPT_LOG_PROBS_KEY):
        assert torch.equal(batches[0][key], want[key]), key
