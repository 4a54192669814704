"""Unit tests of response / stream validation and of the Sample type."""

from __future__ import annotations

import math

import pytest
import torch

from slime_corr.rollout.protocol import (
    ResponseError,
    StreamAccumulator,
    StreamErrorEvent,
    build_generate_request,
    parse_generate_response,
)
from slime_corr.samples import Sample, SampleStatus, SampleValidationError


def _ev(ids, lps, total=None, finish=None):
    return {"text": "", "output_ids": ids, "meta_info": {
        "id": "r", "completion_tokens": len(ids) if total is None else total, "finish_reason": finish,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]}}


STOP = {"type": "stop", "matched": 3}


def test_cumulative_and_incremental_streams_fold_to_the_same_output():
    cum, inc = StreamAccumulator(), StreamAccumulator()
    ids, lps = [5, 6, 7, 3], [-0.5, -0.25, -1.0, -2.0]
    for k in range(1, 5):
        cum.feed(_ev(ids[:k], lps[:k], finish=STOP if k == 4 else None))
        inc.feed(_ev(ids[k - 1 : k], lps[k - 1 : k], total=k, finish=STOP if k == 4 else None))
    for acc in (cum, inc):
        acc.feed_line("[DONE]")
        out = acc.result()
        assert out.output_ids == ids and out.log_probs == lps and out.finish_type == "stop"
    assert cum.mode == "cumulative" and inc.mode == "incremental"


@pytest.mark.parametrize("bad", ["len", "nan", "inf", "positive", "token", "total"])
def test_bad_responses_are_rejected(bad):
    ids, lps = [5, 6], [-0.5, -0.25]
    ev = _ev(ids, lps, finish=STOP)
    e = ev["meta_info"]["output_token_logprobs"]
    if bad == "len":
        e.pop()
    elif bad in ("nan", "inf", "positive"):
        e[1][0] = {"nan": math.nan, "inf": -math.inf, "positive": 0.5}[bad]
    elif bad == "token":
        e[1][1] = 9
    else:
        ev["meta_info"]["completion_tokens"] = 7
    with pytest.raises(ResponseError):
        parse_generate_response(ev)


def test_stream_faults():
    acc = StreamAccumulator()
    acc.feed(_ev([1, 2], [-1.0, -1.0]))
    with pytest.raises(ResponseError, match="inconsistent"):
        acc.feed(_ev([1], [-1.0], total=5))
    acc = StreamAccumulator()
    acc.feed(_ev([1], [-1.0], finish=STOP))
    with pytest.raises(ResponseError, match="without \\[DONE\\]"):
        acc.result()
    with pytest.raises(ResponseError, match="malformed JSON"):
        StreamAccumulator().feed_line('{"output_ids": [')
    with pytest.raises(StreamErrorEvent) as ei:
        StreamAccumulator().feed_line('{"error": {"message": "x", "code": 503}}')
    assert ei.value.retryable
    acc = StreamAccumulator()
    acc.feed(_ev([1, 2], [-1.0, -1.0]))
    with pytest.raises(ResponseError, match="rewrote"):
        acc.feed(_ev([1, 2, 3], [-1.0, -0.5, -1.0]))


def test_build_request_rejects_what_sglang_rejects():
    body = build_generate_request([1, 2], {"max_new_tokens": 3}, "abc-000000000001", stream=True)
    assert body["rid"] == "abc-000000000001" and body["return_logprob"] is True
    with pytest.raises(ValueError, match="unknown keys"):
        build_generate_request([1], {"max_tokens": 3}, "r")
    with pytest.raises(ValueError, match="n must be 1"):
        build_generate_request([1], {"n": 4}, "r")


def test_sample_validation_names_the_field():
    s = Sample(prompt_tokens=[1, 2], response_tokens=[3, 4], rollout_log_probs=[-0.1, -0.2])
    assert s.rollout_log_probs.dtype == torch.float32 and s.loss_mask == [1, 1]
    cases = [
        (dict(rollout_log_probs=[-0.1]), "rollout_log_probs"),
        (dict(rollout_log_probs=torch.tensor([-0.1, -0.2], dtype=torch.float64)), "rollout_log_probs"),
        (dict(rollout_log_probs=[-0.1, math.nan]), "rollout_log_probs"),
        (dict(rollout_log_probs=[-0.1, -0.2], loss_mask=[1]), "loss_mask"),
        (dict(rollout_log_probs=[-0.1, -0.2], loss_mask=[1, 2]), "loss_mask"),
        (dict(rollout_log_probs=[-0.1, -0.2], reward=math.inf), "reward"),
        (dict(rollout_log_probs=[-0.1, -0.2], status=SampleStatus.FAILED), "failure_reason"),
    ]
    for kw, field in cases:
        with pytest.raises(SampleValidationError, match=f"^{field}"):
            Sample(prompt_tokens=[1, 2], response_tokens=[3, 4], **kw)
    with pytest.raises(SampleValidationError, match="^prompt_tokens"):
        Sample(prompt_tokens=[])


def test_multi_turn_tool_tokens_are_masked():
    s = Sample(prompt_tokens=[1])
    s.append_segment([5, 6], [-0.1, -0.2], "v0")
    s.append_segment([7, 8, 9], [0.0, 0.0, 0.0], None, trained=False)  # tool output
    s.append_segment([10], [-0.3], "v1")
    assert s.loss_mask == [1, 1, 0, 0, 0, 1]
    assert s.weight_versions == [("v0", 0, 2), ("v1", 5, 6)] and s.weight_version == "v1"
    assert s.rollout_log_probs.shape == (6,)
