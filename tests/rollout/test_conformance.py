"""Conformance with SGLang 0.5.23's own request/response schema (sglang/api/v1/api_types.py, via msgspec).

The schema file is downloaded from PyPI by the ``api_types`` fixture (conftest.py) and never committed.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from slime_corr.engines.embedded.engine import start_local_engine
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.protocol import SAMPLING_KEYS, build_generate_request

from .fault_server import CODE, run_fault_server

FULL_PARAMS = {"max_new_tokens": 6, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.01,
               "stop_token_ids": [0], "stop": ["zz"], "ignore_eos": False, "no_stop_trim": False,
               "sampling_seed": 3, "min_new_tokens": 1, "stream_interval": 2}


def test_sampling_keys_match_sglang_schema(api_types):
    assert set(api_types.SamplingParams.__struct_fields__) == SAMPLING_KEYS
    with pytest.raises(api_types.JsonContractError):
        api_types.SamplingParams.from_json_value({"max_tokens": 3})  # the schema is strict, so the check bites


def test_client_requests_conform(api_types):
    with run_fault_server() as (url, server):
        async def go():
            async with SGLangClient(url) as c:
                await c.generate([CODE["ok"], 0, 1], FULL_PARAMS)
                await c.generate([CODE["ok"], 0, 2], {"max_new_tokens": 4}, stream=True)
                await c.abort(rid=c.new_rid())

        asyncio.run(go())
    gen, abort = server.bodies[:2], server.bodies[2]
    for body in gen:
        req = api_types.GenerateRequest.from_json_value(body)
        assert req.return_logprob is True and isinstance(req.input_ids, list) and isinstance(req.rid, str)
        assert req.sampling_params.n == 1
    assert api_types.GenerateRequest.from_json_value(gen[0]).sampling_params.top_k == 20
    api_types.AbortRequest.from_json_value(abort)
    # and a request the schema rejects is one our client refuses to send
    bad = {"input_ids": [1], "sampling_params": {"max_tokens": 3}}
    with pytest.raises(api_types.JsonContractError):
        api_types.GenerateRequest.from_json_value(bad)
    with pytest.raises(ValueError):
        build_generate_request([1], {"max_tokens": 3}, "r")


def _collect(url: str, body: dict) -> list:
    """Raw response objects: one for a plain call, every SSE event for a stream."""
    async def go():
        async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
            assert r.status == 200
            raw = await r.read()
        if not body.get("stream"):
            return [json.loads(raw)]
        events = [e[len(b"data: "):] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        return [json.loads(e) for e in events[:-1]]

    return asyncio.run(go())


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_engine_responses_conform(api_types, tiny_ckpt, incremental):
    with start_local_engine(tiny_ckpt, incremental_streaming_output=incremental) as h:
        base = {"input_ids": [5, 6, 7], "return_logprob": True, "return_text_in_logprobs": True}
        plain = _collect(h.url, {**base, "sampling_params": FULL_PARAMS})
        stream = _collect(h.url, {**base, "stream": True, "sampling_params": {"max_new_tokens": 5,
                                                                             "ignore_eos": True}})
        batch = _collect(h.url, {"input_ids": [[1, 2], [3]], "return_logprob": True,
                                 "sampling_params": {"max_new_tokens": 2}})[0]

        async def info():
            async with SGLangClient(h.url) as c:
                return await c.control.model_info(), await c.control.server_info()

        mi, si = asyncio.run(info())
    for obj in plain + stream + batch:
        resp = api_types.GenerateResponse.from_json_value(obj)
        meta = resp.meta_info
        assert meta.completion_tokens >= len(resp.output_ids)
        assert len(meta.output_token_logprobs) == len(resp.output_ids)
        assert all(e.logprob <= 0 and isinstance(e.token_id, int) for e in meta.output_token_logprobs)
    last = api_types.GenerateResponse.from_json_value(stream[-1]).meta_info
    assert isinstance(last.finish_reason, api_types.FinishLength) and last.finish_reason.length == 5
    assert isinstance(api_types.GenerateResponse.from_json_value(plain[0]).meta_info.finish_reason,
                      api_types.FinishStop | api_types.FinishLength)
    assert api_types.GetModelInfoResponse.from_json_value(mi).is_generation is True
    assert api_types.GetServerInfoResponse.from_json_value(si).incremental_streaming_output is incremental


def test_engine_abort_and_errors_conform(api_types, tiny_ckpt):
    with start_local_engine(tiny_ckpt, step_delay=0.01) as h:
        async def go():
            async with SGLangClient(h.url) as c, aiohttp.ClientSession() as s:
                task = asyncio.create_task(c.generate([1, 2], {"max_new_tokens": 100, "ignore_eos": True}))
                while not any(r.output_ids for r in list(h.engine.active.values())):
                    await asyncio.sleep(0.005)
                async with s.post(h.url + "/abort_request", json={"rid": "", "abort_all": True}) as r:
                    abort_resp = r.status, await r.read()
                res = await task
                async with s.post(h.url + "/generate", json={"input_ids": [1], "sampling_params": {"x": 1}}) as r:
                    err = (r.status, await r.json())
                return abort_resp, res, err

        abort_resp, res, err = asyncio.run(go())
    assert abort_resp == (200, b"")  # http_server.py answers an abort with an empty 200
    fr = api_types.decode_FinishReason(res.finish_reason)
    assert isinstance(fr, api_types.FinishAbort) and fr.status_code is None
    assert err[0] == 400 and "x" in err[1]["error"]


def test_fault_server_faults_are_realistic(api_types):
    """The injected error event and abort have SGLang's own shapes (the faults are faithful, not invented)."""
    with run_fault_server() as (url, _):
        events = _collect(url, {"rid": "f-000000000001", "input_ids": [CODE["error_event"], 1, 77],
                                "stream": True, "return_logprob": True})
        abort = _collect(url, {"rid": "f-000000000002", "input_ids": [CODE["abort_503"], 1, 78],
                               "return_logprob": True})[0]
    err = api_types.GenerateStreamError.from_json_value(events[-1])
    assert err.error is not None and err.error.code == 500
    fr = api_types.GenerateResponse.from_json_value(abort).meta_info.finish_reason
    assert isinstance(fr, api_types.FinishAbort) and fr.status_code == 503


# LoadSnapshot's core keys in sglang 0.5.23 (sglang/srt/managers/load_snapshot.py): what /v1/loads reports per rank
LOAD_KEYS = {"timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
             "num_used_tokens", "num_total_tokens", "num_active_tokens", "num_prealloc_ready_tokens",
             "max_total_num_tokens", "max_running_requests", "token_usage", "gen_throughput", "cache_hit_rate",
             "utilization", "total_prefill_uncached_tokens", "total_prefill_busy_us"}


def _call(url: str, method: str, path: str, body: dict | None = None) -> tuple[int, str, object]:
    async def go():
        async with aiohttp.ClientSession() as s, s.request(method, url + path, json=body) as r:
            raw = await r.read()
        try:
            parsed = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            parsed = None
        return r.status, raw.decode(), parsed

    return asyncio.run(go())


def test_engine_control_bodies_are_sglangs(api_types, tiny_ckpt):
    """The bodies http_server.py of sglang 0.5.23 answers, and the endpoints sglang-router and trainers call."""
    with start_local_engine(tiny_ckpt, step_delay=0.01) as h:
        url = h.url
        assert _call(url, "GET", "/ready")[0] == 200
        models = _call(url, "GET", "/v1/models")[2]
        card = api_types.ModelCard.from_json_value(models["data"][0])
        assert models["object"] == "list" and card.id == "slime-corr-tiny" and card.max_model_len == 256
        api_types.GetModelInfoResponse.from_json_value(_call(url, "GET", "/model_info")[2])
        loads = _call(url, "GET", "/v1/loads")[2]
        assert set(loads) >= {"timestamp", "version", "loads"} and set(loads["loads"][0]) == LOAD_KEYS
        assert set(_call(url, "GET", "/get_load")[2][0]) == {"dp_rank", "num_reqs", "num_waiting_reqs",
                                                             "num_tokens"}
        put = _call(url, "PUT", "/generate", {"input_ids": [1, 2],
                                               "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
                                               "return_logprob": True})
        api_types.GenerateResponse.from_json_value(put[2])
        assert _call(url, "POST", "/pause_generation", {"mode": "in_place"})[2] == {
            "message": "Generation paused successfully.", "status": "ok"}
        assert _call(url, "POST", "/continue_generation", {})[2] == {
            "message": "Generation continued successfully.", "status": "ok"}
        flush = _call(url, "POST", "/flush_cache")
        assert flush[0] == 200 and flush[1].startswith("Cache flushed.")
        assert _call(url, "POST", "/update_weight_version", {"new_version": "w7"})[2] == {
            "success": True, "message": "Weight version updated to w7", "new_version": "w7"}
        # memory: refused while a request runs; released, a new request waits; resumed, it runs
        async def memory():
            async with SGLangClient(url) as c, aiohttp.ClientSession() as s:
                busy = asyncio.create_task(c.generate([3, 4], {"max_new_tokens": 30, "ignore_eos": True}))
                while not h.engine.busy():
                    await asyncio.sleep(0.005)
                async with s.post(url + "/release_memory_occupation", json={}) as r:
                    refused = r.status, await r.json()
                await busy
                async with s.post(url + "/release_memory_occupation", json={"tags": ["weights"]}) as r:
                    released = r.status, await r.json()
                held = asyncio.create_task(c.generate([3, 4], {"max_new_tokens": 3, "ignore_eos": True}))
                await asyncio.sleep(0.2)
                was_held = not held.done() and [r.admitted for r in h.engine.active.values()] == [False]
                async with s.post(url + "/resume_memory_occupation", json={"tags": ["bogus"]}) as r:
                    bad_tag = r.status
                async with s.post(url + "/resume_memory_occupation", json={"tags": ["weights"]}) as r:
                    resumed = r.status, await r.json()
                return refused, released, was_held, bad_tag, resumed, await held

        refused, released, was_held, bad_tag, resumed, out = asyncio.run(memory())
        metrics = _call(url, "GET", "/metrics")[1]
    assert refused[0] == 400 and "idle" in refused[1]["error"]["message"]
    assert released == (200, None) and resumed == (200, None) and was_held and bad_tag == 400
    assert len(out.output_ids) == 3 and out.weight_version == "w7"
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
    assert float(samples['sglang:num_requests_total{model_name="slime-corr-tiny"}']) == 3
    assert float(samples['sglang:generation_tokens_total{model_name="slime-corr-tiny"}']) == 2 + 30 + 3
