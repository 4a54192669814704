"""The engine's nucleus on the wire and in the samples: `top_logprobs_num` in the request, `output_top_logprobs`
parsed strictly (malformed entries named; a sampled token outside the engine's own kept set refused), plain and
streamed (cumulative and incremental) alike; the log-mass kept per response token in `Sample` across resumed
segments and a checkpoint's pickle, laid out in the micro-batch (padded, packed, CP-sliced); the embedded engine
serving SGLang's format from the log_softmax it samples from; and a rollout through the client end to end."""

from __future__ import annotations

import asyncio
import copy
import math
import pickle

import aiohttp
import pytest
import torch

from slime_corr.engines.embedded.engine import start_local_engine
from slime_corr.engines.embedded.model import load_tiny_lm
from slime_corr.layout.context_parallel import slice_micro_batch_for_cp
from slime_corr.layout.micro_batch import NUCLEUS_KNOWN_KEY, NUCLEUS_MASS_KEY, build_micro_batch
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.nucleus import NucleusRequest
from slime_corr.rollout.protocol import (
    ResponseError,
    StreamAccumulator,
    build_generate_request,
    parse_generate_response,
)
from slime_corr.rollout.rollout import generate_sample
from slime_corr.samples import Sample, SampleValidationError

STOP = {"type": "stop", "matched": 3}
# three positions of a 6-token vocabulary: (sampled token, the distribution)
PROBS = [[0.5, 0.3, 0.1, 0.05, 0.03, 0.02], [0.7, 0.1, 0.1, 0.05, 0.03, 0.02], [0.25, 0.25, 0.2, 0.15, 0.1, 0.05]]
SAMPLED = [1, 0, 1]


def _response(n: int, probs=PROBS, sampled=SAMPLED, start: int = 0, end: int | None = None, total: int | None = None,
              finish=STOP) -> dict:
    """An SGLang-shaped response (or stream event) over positions [start, end): per position the sampled token, its
    log-prob, and the n largest [logprob, token_id, null] (token id = rank here)."""
    end = len(probs) if end is None else end
    ids, lps, tops = [], [], []
    for p, y in zip(probs[start:end], sampled[start:end], strict=True):
        lp = [math.log(x) for x in p]
        ids.append(y)
        lps.append([lp[y], y, None])
        tops.append([[lp[j], j, None] for j in range(n)])
    meta = {"id": "r", "completion_tokens": end if total is None else total, "finish_reason": finish,
            "output_token_logprobs": lps, "output_top_logprobs": tops}
    return {"text": "", "output_ids": ids, "meta_info": meta}


def test_the_request_asks_for_top_logprobs():
    body = build_generate_request([1, 2], {"top_p": 0.9}, "r", top_logprobs_num=20)
    assert body["top_logprobs_num"] == 20 and body["return_logprob"] is True
    assert "top_logprobs_num" not in build_generate_request([1, 2], {"top_p": 0.9}, "r")
    for bad in ({"top_logprobs_num": -1}, {"top_logprobs_num": True}, {"top_logprobs_num": 3, "return_logprob": False}):
        with pytest.raises(ValueError, match="top_logprobs_num"):
            build_generate_request([1], {}, "r", **bad)


def test_the_engine_mass_per_token():
    """top_p 0.85, N = 4: positions 0 and 1 keep 3 tokens (0.5 + 0.3 and 0.7 + 0.1 = 0.8 ≤ 0.85 before rank 2,
    0.9 > 0.85 before rank 3): M = 0.9; position 2's four hold 0.85, not more than top_p: does not fit. top_k 2:
    the first two."""
    out = parse_generate_response(_response(4), nucleus=NucleusRequest(0.85, -1, 4))
    masses = out.nucleus_log_mass
    assert masses[0] == pytest.approx(math.log(0.9)) and masses[1] == pytest.approx(math.log(0.9))
    assert math.isnan(masses[2]) and len(out.top_ids) == 3 and out.top_ids[0] == [0, 1, 2, 3]
    k2 = parse_generate_response(_response(4), nucleus=NucleusRequest(1.0, 2, 4)).nucleus_log_mass
    assert k2 == pytest.approx([math.log(0.8), math.log(0.8), math.log(0.5)])
    assert parse_generate_response(_response(4)).nucleus_log_mass is None  # not asked: not read


def _broken(kind: str) -> dict:
    r = _response(4)
    tops = r["meta_info"]["output_top_logprobs"]
    if kind == "missing":
        del r["meta_info"]["output_top_logprobs"]
    elif kind == "rows":
        tops.pop()
    elif kind == "null row":
        tops[1] = None
    elif kind == "count":
        tops[1].pop()
    elif kind == "string log-prob":
        tops[1][2][0] = "-1.0"
    elif kind == "float id":
        tops[1][2][1] = 2.0
    elif kind == "bool id":
        tops[1][2][1] = True
    elif kind == "negative id":
        tops[1][2][1] = -2
    elif kind == "short entry":
        tops[1][2] = [-1.0]
    elif kind == "nan":
        tops[1][3][0] = math.nan
    elif kind == "positive":
        tops[1][0][0] = 0.5
    elif kind == "unsorted":
        tops[1][0], tops[1][1] = tops[1][1], tops[1][0]
    elif kind == "repeated id":
        tops[1][3][1] = 0
    elif kind == "sampled differs":
        tops[1][0][0] -= 0.01
    elif kind == "outside":  # position 0's sampled token moved to rank 3, outside its 3 kept
        r["output_ids"][0] = 3
        r["meta_info"]["output_token_logprobs"][0] = [tops[0][3][0], 3, None]
    return r


@pytest.mark.parametrize("kind, message", [
    ("missing", r"output_top_logprobs: missing \(was top_logprobs_num honoured"),
    ("rows", "output_top_logprobs: 2 entries for 3 output tokens"),
    ("null row", r"output_top_logprobs\[1\]: expected top_logprobs_num=4 .* got None"),
    ("count", r"output_top_logprobs\[1\]: expected top_logprobs_num=4 .* got 3 entries"),
    ("string log-prob", r"output_top_logprobs\[1\]: expected \[logprob, token_id, text\] entries with a number"),
    ("float id", r"output_top_logprobs\[1\]: expected \[logprob, token_id, text\] entries"),
    ("bool id", r"output_top_logprobs\[1\]: expected \[logprob, token_id, text\] entries"),
    ("short entry", r"output_top_logprobs\[1\]: expected \[logprob, token_id, text\] entries"),
    ("negative id", r"output_top_logprobs\[1\]: a token id is negative"),
    ("nan", r"output_top_logprobs\[1\]: a log-prob is not a finite number <= 0"),
    ("positive", r"output_top_logprobs\[1\]: a log-prob is not a finite number <= 0"),
    ("unsorted", r"output_top_logprobs\[1\]: log-probs not sorted"),
    ("repeated id", r"output_top_logprobs\[1\]: a token id appears twice"),
    ("sampled differs", r"output_top_logprobs\[1\]: the sampled token 0 has log-prob"),
    ("outside", r"output_top_logprobs\[0\]: the sampled token 3 .* lies outside the engine's own top_p=0.85"),
])
def test_malformed_top_logprobs_are_refused_naming_the_field(kind, message):
    with pytest.raises(ResponseError, match=message):
        parse_generate_response(_broken(kind), nucleus=NucleusRequest(0.85, -1, 4))


@pytest.mark.parametrize("interval", [1, 2])
def test_streams_cumulative_and_incremental_read_the_same_nucleus(interval):
    request = NucleusRequest(0.85, -1, 4)
    want = parse_generate_response(_response(4), nucleus=request)
    cumulative, incremental = StreamAccumulator(nucleus=request), StreamAccumulator(nucleus=request)
    ends = list(range(interval, 3, interval)) + [3]
    start = 0
    for end in ends:
        finish = STOP if end == 3 else None
        cumulative.feed(_response(4, end=end, finish=finish))
        incremental.feed(_response(4, start=start, end=end, total=end, finish=finish))
        start = end
    for acc in (cumulative, incremental):
        acc.feed_line("[DONE]")
        got = acc.result()
        assert got.top_ids == want.top_ids and got.top_log_probs == want.top_log_probs
        assert str(got.nucleus_log_mass) == str(want.nucleus_log_mass)  # NaN included
    assert cumulative.mode == "cumulative" and incremental.mode == "incremental"
    bad = StreamAccumulator(nucleus=request)
    bad.feed(_response(4, end=1, finish=None))
    event = _response(4, end=2, finish=None)
    event["meta_info"]["output_top_logprobs"][1] = None  # a new entry of a cumulative event is checked
    with pytest.raises(ResponseError, match=r"output_top_logprobs\[1\]"):
        bad.feed(event)


def test_the_sample_keeps_the_mass_aligned_across_segments_and_pickles():
    s = Sample(prompt_tokens=[1])
    s.append_segment([4, 5], [-0.1, -0.2], "v0")  # a segment without it (e.g. before the flag)
    assert s.rollout_nucleus_log_mass is None
    s.append_segment([6], [-0.3], "v0", nucleus_log_mass=[-0.05])
    s.append_segment([7, 8], [-0.0, -0.0], None, trained=False)  # tool tokens
    s.append_segment([9], [-0.4], "v1", nucleus_log_mass=[float("nan")])
    mass = s.rollout_nucleus_log_mass
    assert mass is not None and mass.dtype == torch.float32 and mass.numel() == s.response_length == 6
    assert mass.isnan().tolist() == [True, True, False, True, True, True] and mass[2].item() == pytest.approx(-0.05)
    for bad, message in ((torch.zeros(5), r"expected float32 \[6\]"),
                         (torch.zeros(6, dtype=torch.float64), "expected float32 .* got torch.float64"),
                         (torch.full((6,), -math.inf), "values must be NaN .unknown. or finite <= 0"),
                         (torch.full((6,), 0.5), "values must be NaN .unknown. or finite <= 0")):
        with pytest.raises(SampleValidationError, match="rollout_nucleus_log_mass: " + message):
            Sample(prompt_tokens=[1], response_tokens=[4] * 6, rollout_log_probs=torch.zeros(6),
                   rollout_nucleus_log_mass=bad)
    back = pickle.loads(pickle.dumps(s))  # a checkpoint's pending samples
    assert torch.equal(back.rollout_nucleus_log_mass.nan_to_num(1.0), mass.nan_to_num(1.0))
    old = copy.copy(s)
    del old.__dict__["rollout_nucleus_log_mass"]  # pickled before the field existed
    assert pickle.loads(pickle.dumps(old)).rollout_nucleus_log_mass is None


def _with_mass(prompt: list[int], masses: list[float] | None, mask: list[int] | None = None) -> Sample:
    r = len(masses) if masses is not None else 2
    return Sample(prompt_tokens=prompt, response_tokens=list(range(10, 10 + r)),
                  rollout_log_probs=torch.full((r,), -0.5),
                  loss_mask=mask, rollout_nucleus_log_mass=None if masses is None else torch.tensor(masses))


@pytest.mark.parametrize("packed", [False, True])
def test_the_micro_batch_lays_the_mass_out_like_the_log_probs(packed):
    nan = float("nan")
    samples = [_with_mass([1, 2], [-0.1, nan, -0.3], mask=[1, 1, 0]), _with_mass([3], None)]
    b = build_micro_batch(samples, pad_to_multiple=4, packed=packed)
    known, mass = b[NUCLEUS_KNOWN_KEY], b[NUCLEUS_MASS_KEY]
    assert known.dtype == torch.bool and mass.dtype == torch.float32 and known.shape == b["loss_mask"].shape
    first = (0, slice(0, 8)) if packed else (0, slice(None))
    row = known[first].tolist()
    assert row[:5] == [False, True, False, False, False] and not any(row[5:])  # NaN and loss mask 0: unknown
    assert mass[first].tolist()[:5] == pytest.approx([0.0, -0.1, 0.0, 0.0, 0.0])
    assert not known[(0, slice(8, None)) if packed else (1, slice(None))].any()  # the sample without it
    assert not (known & ~(b["loss_mask"] > 0)).any()
    local = slice_micro_batch_for_cp(b, 1, 2)
    assert local[NUCLEUS_KNOWN_KEY].shape == local["loss_mask"].shape
    assert NUCLEUS_KNOWN_KEY not in build_micro_batch([_with_mass([1], None)])  # none carries it: no keys


@pytest.fixture(scope="module")
def fp32_engine(tiny_ckpt):
    with start_local_engine(tiny_ckpt, dtype=torch.float32) as h:
        yield h


def _post(url: str, body: dict) -> dict:
    async def go():
        async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    return asyncio.run(go())


def test_the_embedded_engine_serves_top_logprobs_of_its_own_log_softmax(fp32_engine, tiny_ckpt, api_types):
    prompt, t, n = [72, 101, 108, 108, 111], 0.7, 7
    r = _post(fp32_engine.url, {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": n,
                                "return_text_in_logprobs": True,
                                "sampling_params": {"max_new_tokens": 8, "temperature": t, "ignore_eos": True}})
    api_types.GenerateResponse.from_json_value(r)  # SGLang's own schema
    meta = r["meta_info"]
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(r["output_ids"]) == 8 and all(len(row) == n for row in tops)
    model = load_tiny_lm(tiny_ckpt)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + r["output_ids"]]))[0, len(prompt) - 1:-1]
    full = torch.log_softmax(logits.double() / t, -1)
    values, ids = full.topk(n, -1)
    assert [[e[1] for e in row] for row in tops] == ids.tolist()
    torch.testing.assert_close(torch.tensor([[e[0] for e in row] for row in tops], dtype=torch.float64), values,
                               rtol=0, atol=2e-5)
    assert all(isinstance(e[2], str) for row in tops for e in row)  # return_text_in_logprobs
    for (lp, tok, _), row in zip(meta["output_token_logprobs"], tops, strict=True):  # the same numbers
        assert all(v == lp for v, i, _ in row if i == tok)
    plain = _post(fp32_engine.url, {"input_ids": prompt, "return_logprob": True,
                                    "sampling_params": {"max_new_tokens": 2}})
    assert "output_top_logprobs" not in plain["meta_info"]
    for bad in (-1, 1.5, 257):
        async def refused(value=bad):
            async with aiohttp.ClientSession() as s, s.post(fp32_engine.url + "/generate", json={
                    "input_ids": prompt, "return_logprob": True, "top_logprobs_num": value}) as resp:
                return resp.status, await resp.text()

        status, text = asyncio.run(refused())
        assert status == 400 and "top_logprobs_num" in text


def _reference_mass(model, prompt: list[int], response: list[int], t: float, top_p: float, top_k: int
                    ) -> torch.Tensor:
    """log M_μ of every response position from the full fp32 distribution, SGLang's rule rank by rank."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response]))[0, len(prompt) - 1:-1]
    probs = torch.softmax(logits.double() / t, -1).sort(-1, descending=True).values
    kept = (probs.cumsum(-1) - probs) <= top_p
    if top_k > 0:
        kept[:, top_k:] = False
    return (probs * kept).sum(-1).log()


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_a_rollout_keeps_the_engines_nucleus_mass(tiny_ckpt, incremental):
    """Through the client and `generate_sample`, streamed: top-k 5 (asked for 5: always fits) and top-p 0.9 with a
    cap of 256 (the whole vocabulary: fits), the masses equal the full distribution's; with a cap of 2, top-p
    fits where the two largest probabilities hold more than 0.9 and falls back (NaN) elsewhere."""
    model = load_tiny_lm(tiny_ckpt)
    prompt = [104, 105, 32]
    with start_local_engine(tiny_ckpt, dtype=torch.float32, incremental_streaming_output=incremental) as h:
        async def go(params: dict, cap: int) -> Sample:
            async with SGLangClient(h.url) as c:
                return await generate_sample(c, Sample(prompt_tokens=list(prompt)), params, stream=True,
                                             nucleus_logprobs=cap)

        base = {"max_new_tokens": 10, "temperature": 0.8, "ignore_eos": True, "stream_interval": 3, "sampling_seed": 4}
        for top_p, top_k, cap in ((1.0, 5, 20), (0.9, -1, 256), (0.9, 4, 256)):
            s = asyncio.run(go({**base, "top_p": top_p, "top_k": top_k}, cap))
            assert s.response_length == 10 and s.rollout_nucleus_log_mass is not None, s.failure_reason
            want = _reference_mass(model, prompt, s.response_tokens, 0.8, top_p, top_k)
            got = s.rollout_nucleus_log_mass.double()
            known = ~got.isnan()  # a top-p boundary within rounding of 0.9 is left to the trainer (rare)
            assert known.sum() >= 8 and (known.all() or top_p < 1.0)
            torch.testing.assert_close(got[known], want[known], rtol=0, atol=1e-5)
        small = asyncio.run(go({**base, "top_p": 0.9}, 2))
        with torch.no_grad():
            logits = model(torch.tensor([prompt + small.response_tokens]))[0, len(prompt) - 1:-1]
        two = torch.softmax(logits.double() / 0.8, -1).topk(2, -1).values.sum(-1)  # fits iff the two hold > 0.9
        got = small.rollout_nucleus_log_mass
        assert torch.equal(got.isnan(), two <= 0.9) and 0 < int(got.isnan().sum()) < 10, (got, two)
        want = _reference_mass(model, prompt, small.response_tokens, 0.8, 0.9, -1)
        torch.testing.assert_close(got.double()[two > 0.9], want[two > 0.9], rtol=0, atol=1e-5)
        off = asyncio.run(go({**base, "top_p": 0.9}, 0))
        assert off.rollout_nucleus_log_mass is None
