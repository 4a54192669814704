"""MoE routes on the rollout side: decoding SGLang's `meta_info.routed_experts` (recorded real responses and
hand-made ones), cumulative and incremental streams, and samples carrying them through abort/resume (a scripted
engine whose route of a token is a function of the token and the request, so every row can be traced)."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from slime_corr.rollout.client import GenerateResult
from slime_corr.rollout.protocol import (
    ResponseError,
    StreamAccumulator,
    build_generate_request,
    parse_generate_response,
)
from slime_corr.rollout.rollout import generate_sample
from slime_corr.routed_experts import (
    RoutedExpertsError,
    RoutedExpertsSpec,
    decode_routed_experts,
    encode_routed_experts,
    extend_routes,
)
from slime_corr.samples import Sample, SampleStatus, SampleValidationError

RECORDED = json.loads((Path(__file__).parent / "data" / "sglang_moe_routed_experts.json").read_text())
SPEC = RoutedExpertsSpec(num_layers=2, top_k=2, num_experts=8)  # the recorded tiny Qwen3-MoE


def _events(sse: str) -> list[str]:
    return [line[5:].strip() for line in sse.splitlines() if line.startswith("data:")]


def test_spec_dtype_and_bytes():
    assert SPEC.dtype == torch.uint8 and SPEC.bytes_per_token == 4
    big = RoutedExpertsSpec(num_layers=48, top_k=8, num_experts=257)
    assert big.dtype == torch.int16 and big.bytes_per_token == 48 * 8 * 2
    with pytest.raises(ValueError, match="top_k <= num_experts"):
        RoutedExpertsSpec(num_layers=1, top_k=9, num_experts=8)
    with pytest.raises(ValueError, match="int16"):
        RoutedExpertsSpec(num_layers=1, top_k=1, num_experts=40000)


def test_request_asks_for_routes_only_when_told():
    assert build_generate_request([1, 2], {}, "r", return_routed_experts=True)["return_routed_experts"] is True
    assert "return_routed_experts" not in build_generate_request([1, 2], {}, "r")


def test_recorded_plain_response():
    raw = np.frombuffer(base64.b64decode(RECORDED["plain"]["meta_info"]["routed_experts"]), dtype="<i4")
    out = parse_generate_response(RECORDED["plain"], routed_experts=SPEC)
    assert out.prompt_tokens == 4 and len(out.output_ids) == 4
    r = out.routed_experts
    assert r.dtype == torch.uint8 and r.shape == (4 + 4 - 1, 2, 2)  # the last output token is never an input
    assert r.flatten().tolist() == raw.tolist()  # the server's order kept (layer-major per token, top-k order)
    assert parse_generate_response(RECORDED["plain"]).routed_experts is None  # not asked for: not decoded
    with pytest.raises(ResponseError, match="--enable-return-routed-experts"):
        parse_generate_response(RECORDED["no_routes"], routed_experts=SPEC)
    with pytest.raises(ResponseError, match="does the server's model match"):
        parse_generate_response(RECORDED["plain"], routed_experts=RoutedExpertsSpec(3, 2, 8))


def test_recorded_cumulative_stream_and_its_incremental_form():
    events = _events(RECORDED["stream"])
    acc = StreamAccumulator(routed_experts=SPEC)
    for e in events:
        acc.feed_line(e)
    cumulative = acc.result()
    assert cumulative.routed_experts.shape == (7, 2, 2)
    # the prompt is the same as the plain request's: its rows (the prompt tokens) are the same routes
    plain = parse_generate_response(RECORDED["plain"], routed_experts=SPEC).routed_experts
    assert torch.equal(cumulative.routed_experts[:3], plain[:3])
    # the same events as deltas (SGLang's --incremental-streaming-output): routes still with the last event only
    acc2, seen = StreamAccumulator(routed_experts=SPEC), 0
    for e in events[:-1]:
        obj = json.loads(e)
        n = len(obj["output_ids"])
        obj["output_ids"] = obj["output_ids"][seen:]
        obj["meta_info"]["output_token_logprobs"] = obj["meta_info"]["output_token_logprobs"][seen:]
        seen = n
        acc2.feed(obj)
    acc2.feed_line("[DONE]")
    assert torch.equal(acc2.result().routed_experts, cumulative.routed_experts)
    assert acc2.mode == "incremental" and acc.mode == "cumulative"


def test_decode_rejects_bad_payloads():
    ok = encode_routed_experts(torch.tensor([[[0, 7]], [[3, 1]]]))
    spec = RoutedExpertsSpec(1, 2, 8)
    assert decode_routed_experts(ok, 2, spec).tolist() == [[[0, 7]], [[3, 1]]]
    for data, match in [(ok, "16 bytes, expected 1 tokens"), ("not base64!", "not base64"), (17, "base64 string"),
                        (encode_routed_experts(torch.tensor([0, 8, 1, 2])), r"outside \[0, 8\)"),
                        (encode_routed_experts(torch.tensor([0, -1, 1, 2])), "outside")]:
        with pytest.raises(RoutedExpertsError, match=match):
            decode_routed_experts(data, 1 if data == ok else 2, spec)
    big = RoutedExpertsSpec(1, 1, 300)
    r = decode_routed_experts(encode_routed_experts(torch.tensor([299, 0])), 2, big)
    assert r.dtype == torch.int16 and r.flatten().tolist() == [299, 0]
    assert decode_routed_experts("", 0, spec).shape == (0, 1, 2)  # an empty sequence


def test_extend_routes_keeps_earlier_rows():
    a = torch.zeros(3, 2, 2, dtype=torch.uint8)
    b = torch.ones(5, 2, 2, dtype=torch.uint8)
    e = extend_routes(a, b)
    assert e.shape == (5, 2, 2) and e[:3].eq(0).all() and e[3:].eq(1).all()
    assert extend_routes(None, b) is b
    with pytest.raises(RoutedExpertsError, match="do not extend"):
        extend_routes(b, a)


def test_sample_validates_routes():
    s = Sample(prompt_tokens=[1, 2, 3], response_tokens=[4], rollout_log_probs=[-1.0])
    s.routed_experts = torch.zeros(3, 2, 2, dtype=torch.uint8)
    s.validate()
    s.routed_experts = torch.zeros(4, 2, 2, dtype=torch.uint8)
    with pytest.raises(SampleValidationError, match="routed_experts: 4 rows for 4 tokens"):
        s.validate()
    s.routed_experts = torch.zeros(3, 2, 2, dtype=torch.int64)
    with pytest.raises(SampleValidationError, match="uint8/int16"):
        s.validate()


def route_of(token: int, spec: RoutedExpertsSpec) -> list[list[int]]:
    """The scripted engine's routes of a token: layer l picks ((t + l) % E, (t + l + 1) % E)."""
    return [[(token + layer + j) % spec.num_experts for j in range(spec.top_k)] for layer in range(spec.num_layers)]


class ScriptedClient:
    """A client whose engine emits tokens 10 + position and routes token t in its r-th request (1-based) by
    `route_of(t + r)` (so rows show which response they came from); the first `aborts` requests come back
    aborted after 2 tokens (a pause), with or without their routes."""

    def __init__(self, aborts: int, abort_routes: bool) -> None:
        self.aborts, self.abort_routes, self.requests = aborts, abort_routes, []

    async def generate(self, input_ids, params, *, stream=False, routed_experts=None):
        self.requests.append(list(input_ids))
        aborted = len(self.requests) <= self.aborts
        n = 2 if aborted else params["max_new_tokens"]
        out = [10 + len(input_ids) + i for i in range(n)]
        seq = list(input_ids) + out
        meta = {"id": "r", "prompt_tokens": len(input_ids), "completion_tokens": n, "weight_version": "v0",
                "finish_reason": {"type": "abort", "message": "Aborted"} if aborted else {"type": "length"},
                "output_token_logprobs": [[-0.5, t, None] for t in out]}
        if routed_experts is not None and (self.abort_routes or not aborted):
            r = len(self.requests)
            meta["routed_experts"] = encode_routed_experts(torch.tensor([route_of(t + r, SPEC) for t in seq[:-1]]))
        parsed = parse_generate_response({"output_ids": out, "meta_info": meta}, routed_experts=routed_experts)
        return GenerateResult(**vars(parsed), server="scripted")


@pytest.mark.parametrize("abort_routes", [True, False])
def test_sample_routes_through_abort_and_resume(abort_routes):
    client = ScriptedClient(aborts=2, abort_routes=abort_routes)
    sample = asyncio.run(generate_sample(client, Sample(prompt_tokens=[1, 2, 3]), {"max_new_tokens": 6},
                                         routed_experts=SPEC))
    assert sample.status == SampleStatus.TRUNCATED and sample.response_length == 6
    assert len(client.requests) == 3 and client.requests[2] == [1, 2, 3] + sample.response_tokens[:4]
    seq = sample.prompt_tokens + sample.response_tokens
    # each row from the first response that covered it: requests 1, 2, 3 covered 3+2-1, 5+2-1, 7+2-1 rows
    first = [1] * 4 + [2] * 2 + [3] * 2 if abort_routes else [3] * 8
    expected = torch.tensor([route_of(t + r, SPEC) for t, r in zip(seq[:-1], first, strict=True)],
                            dtype=torch.uint8)
    assert sample.routed_experts.dtype == torch.uint8 and torch.equal(sample.routed_experts, expected)
    # without asking: no routes, and the engine was not asked for them
    plain = asyncio.run(generate_sample(ScriptedClient(0, True), Sample(prompt_tokens=[1, 2, 3]),
                                        {"max_new_tokens": 3}))
    assert plain.routed_experts is None and plain.response_length == 3


def _routed_sample(prompt: list[int], response: list[int], index: int = 0) -> Sample:
    s = Sample(prompt_tokens=prompt, response_tokens=response, rollout_log_probs=[-0.5] * len(response), index=index)
    seq = prompt + response
    s.routed_experts = torch.tensor([route_of(t, SPEC) for t in seq[:-1]], dtype=torch.uint8)
    s.validate()
    return s


def _check_layout(tokens: torch.Tensor, routes: torch.Tensor, real: torch.Tensor) -> int:
    """Every position holding a routed token (`real`) has that token's routes, every other one experts 0..k-1."""
    filler = torch.tensor([[0, 1]] * SPEC.num_layers, dtype=torch.uint8)
    checked = 0
    for t, r, is_real in zip(tokens.reshape(-1).tolist(), routes.reshape(-1, SPEC.num_layers, SPEC.top_k),
                             real.reshape(-1).tolist(), strict=True):
        want = torch.tensor(route_of(t, SPEC), dtype=torch.uint8) if is_real else filler
        assert torch.equal(r, want), (t, r, is_real)
        checked += is_real
    return checked


@pytest.mark.parametrize("packed", [False, True])
def test_routes_in_micro_batches_and_cp_slices(packed):
    from slime_corr.layout.context_parallel import slice_micro_batch_for_cp
    from slime_corr.layout.micro_batch import ROUTE_KEY, TOKEN_KEYS, build_micro_batch

    samples = [_routed_sample([101, 102, 103], [104, 105]), _routed_sample([111], [112, 113, 114, 115, 116], 1),
               _routed_sample([121, 122], [], 2)]
    batch = build_micro_batch(samples, pad_to_multiple=4, pad_token_id=0, packed=packed)
    routes = batch[ROUTE_KEY]
    assert routes.dtype == torch.uint8 and routes.shape == (*batch["tokens"].shape, SPEC.num_layers, SPEC.top_k)
    # routed: every token of a sample but its last (positions with a next token: where labels are the sample's)
    real = torch.zeros_like(batch["tokens"], dtype=torch.bool)
    starts = batch["cu_seqlens_padded"].tolist() if packed else None
    for i, s in enumerate(samples):
        row, begin = (0, starts[i]) if packed else (i, 0)
        real[row, begin : begin + s.total_length - 1] = True
    assert _check_layout(batch["tokens"], routes, real) == sum(s.total_length - 1 for s in samples)
    for cp_rank in range(2):
        local = slice_micro_batch_for_cp(batch, cp_rank, 2, keys=(*TOKEN_KEYS, ROUTE_KEY))
        local_real = slice_micro_batch_for_cp({**batch, "real": real}, cp_rank, 2, keys=("real",))["real"]
        assert local[ROUTE_KEY].shape[:2] == local["tokens"].shape
        _check_layout(local["tokens"], local[ROUTE_KEY], local_real)
        assert torch.equal(slice_micro_batch_for_cp(batch, cp_rank, 2)[ROUTE_KEY], routes)  # not sliced by default


def test_micro_batch_refuses_missing_or_partial_routes():
    from slime_corr.layout.micro_batch import build_micro_batch

    a = _routed_sample([1, 2], [3])
    b = Sample(prompt_tokens=[4, 5], response_tokens=[6], rollout_log_probs=[-1.0], index=7)
    with pytest.raises(ValueError, match=r"routed_experts: samples \[7\] carry no routes"):
        build_micro_batch([a, b])
    a.routed_experts = a.routed_experts[:1]  # a tool segment not routed yet
    with pytest.raises(ValueError, match="routes for 1 of its 2 input tokens"):
        build_micro_batch([a])
    assert "routed_experts" not in build_micro_batch([b])
