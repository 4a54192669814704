"""The embedded engine's MoE routes (`engines.embedded.routes`) on the tiny Qwen3-MoE (`models.tiny_moe`), served as
the trainer serves it (`models.load_engine_module`, the HF model), returned as SGLang 0.5.23 returns them:

- the routes of generated samples (plain and streamed requests sharing padded forwards, seeded ones in forwards of
  their own, a sample paused, resumed after a weight update, and one whose weights change mid-request) are the
  experts the trainer's own Megatron model (built from the same checkpoints through mbridge, fp32) picks
  teacher-forced on the same tokens, under the weights that first computed each token; each row lists them in
  the router's top-k order (an independent reference: Megatron's routers, not the HF model the engine runs);
- the wire format: base64 int32 `[prompt + output - 1, layers, top_k]` that the project's decoder reads, only in
  the finishing event of a stream (cumulative and incremental), batches, `routed_experts_start_len` (and its 400),
  a running request aborted (routes) and a waiting one (none);
- without the equivalent of `--enable-return-routed-experts` the request field is ignored, and enabling it on a
  dense model fails the start, as the real server does.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch

from slime_corr.engines.embedded.engine import start_local_engine
from slime_corr.engines.embedded.model import TorchEngineModel
from slime_corr.models.hf_checkpoint import load_engine_module
from slime_corr.models.tiny_moe import TinyMoEArgs, make_tiny_moe_checkpoint
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.protocol import ResponseError, StreamAccumulator, parse_generate_response
from slime_corr.rollout.rollout import PausePolicy, generate_sample
from slime_corr.routed_experts import RoutedExpertsSpec, decode_routed_experts
from slime_corr.samples import Sample, SampleStatus

from .engine_helpers import wait_tokens

pytestmark = pytest.mark.cost(15)  # CI seconds, roughly (tests/conftest.py)

ARGS = TinyMoEArgs()
SPEC = RoutedExpertsSpec(ARGS.num_hidden_layers, ARGS.num_experts_per_tok, ARGS.num_experts)
PROMPTS = [[5, 17, 200, 3], [9, 9, 1], [42], list(range(30, 50))]
PARAMS = {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True}
LOGPROB_TOL = 1e-4  # fp32 engine (HF eager) vs fp32 Megatron


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    """{weight version: checkpoint dir}: the tiny Qwen3-MoE at seed 0 ("default") and at seed 1 ("v1")."""
    root = tmp_path_factory.mktemp("tiny_moe")
    return {"default": str(make_tiny_moe_checkpoint(root / "v0", ARGS)),
            "v1": str(make_tiny_moe_checkpoint(root / "v1", TinyMoEArgs(seed=1)))}


def _serve(path: str, dtype: torch.dtype = torch.float32, enable_return_routed_experts: bool = True, **kw):
    return start_local_engine(path, model=TorchEngineModel(path, factory=load_engine_module, dtype=dtype),
                              enable_return_routed_experts=enable_return_routed_experts, **kw)


@pytest.fixture(scope="module")
def moe(moe_dirs):
    """An fp32 engine serving the seed-0 model (routes returned: the default for an MoE model)."""
    with _serve(moe_dirs["default"]) as h:
        yield h


def _post(url: str, body: dict) -> tuple[int, Any]:
    async def go():
        async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
            return r.status, await r.json(content_type=None)

    return asyncio.run(go())


def _server_info(url: str) -> dict:
    async def go():
        async with aiohttp.ClientSession() as s, s.get(url + "/server_info") as r:
            return await r.json()

    return asyncio.run(go())


def _stream(url: str, body: dict) -> list[dict | str]:
    async def go():
        async with aiohttp.ClientSession() as s, s.post(url + "/generate", json={**body, "stream": True}) as r:
            text = await r.text()
        return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]

    return [e if e == "[DONE]" else json.loads(e) for e in asyncio.run(go())]


def _ints(meta: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")




# ---------------------------------------------------------------- (a) the routes are the trainer's own
def _megatron_routes(rank: int, world: int, dirs: dict[str, str], seqs: list[list[int]], out: dict) -> None:
    """Per weight version, Megatron's own routes `[tokens - 1, L, k]` (ascending) and teacher-forced fp32
    log-probs `[tokens - 1, V]` of each sequence (one-rank gloo group)."""
    from megatron.core import tensor_parallel

    from slime_corr.mcore.routing import capture_routes
    from slime_corr.models import build_gpt_from_hf
    from tests.mcore.mcore_helpers import init_layout

    init_layout(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    for version, path in dirs.items():
        model, _ = build_gpt_from_hf(path, dtype=torch.float32)
        model.eval()
        for i, seq in enumerate(seqs):
            ids = torch.tensor([seq[:-1]])  # the tokens that were inputs of a forward
            with torch.no_grad(), capture_routes(model, 1) as own:
                logits = model(input_ids=ids, position_ids=torch.arange(ids.size(1))[None], attention_mask=None)
            out[version, i] = (own[0][0], torch.log_softmax(logits[0].float(), -1))


def _row_versions(s: Sample) -> list[str]:
    """The weight version of each routed row: row r was first computed by the step that sampled output token
    max(0, r - prompt + 1) (the prompt's rows by the first one). A resumed sample keeps the rows of its first
    response, and the resumed request computes the rest: the same rule."""
    token = _token_versions(s)
    return [token[max(0, r - len(s.prompt_tokens) + 1)] for r in range(s.total_length - 1)]


def _token_versions(s: Sample) -> list[str]:
    return [v for v, a, b in s.weight_versions for _ in range(a, b)]


def test_routes_are_the_trainer_models_own(moe, moe_dirs):
    h = moe

    async def go():
        async with SGLangClient(h.url) as c:
            def one(p, stream, **extra):
                return generate_sample(c, Sample(prompt_tokens=list(p)), {**PARAMS, **extra}, stream=stream,
                                       routed_experts=SPEC)

            batched = await asyncio.gather(*(one(p, stream) for stream in (False, True) for p in PROMPTS))
            seeded = await asyncio.gather(*(one(p, True, sampling_seed=i) for i, p in enumerate(PROMPTS[:2])))
            h.engine.step_delay = 0.02  # a pause / an update lands mid-request (>= 0.8 s left to send it)
            try:
                # paused mid-request (abort mode), weights updated, resumed from prompt + partial output
                task = asyncio.create_task(generate_sample(c, Sample(prompt_tokens=list(PROMPTS[0])),
                                                           {**PARAMS, "max_new_tokens": 48}, stream=True,
                                                           pause_policy=PausePolicy.RESUME, routed_experts=SPEC))
                await wait_tokens(h.engine, c, 4)
                await c.pause("abort")
                await c.update_weights_from_disk(moe_dirs["v1"], weight_version="v1", flush_cache=False)
                await c.continue_generation()
                resumed = await task
                # weights updated under a running request (no pause): its later rows use the new weights
                await c.update_weights_from_disk(moe_dirs["default"], weight_version="default", flush_cache=False)
                task = asyncio.create_task(one(PROMPTS[3], False, max_new_tokens=48))
                await wait_tokens(h.engine, c, 4)
                await c.update_weights_from_disk(moe_dirs["v1"], weight_version="v1", flush_cache=False)
                in_flight = await task
            finally:
                h.engine.step_delay = 0.0
                await c.update_weights_from_disk(moe_dirs["default"], weight_version="default")
            return [*batched, *seeded, resumed, in_flight]

    samples = asyncio.run(go())
    for s in samples:
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED), s.failure_reason
        assert s.routed_experts is not None and s.routed_experts.dtype == torch.uint8
        assert s.routed_experts.shape == (s.total_length - 1, SPEC.num_layers, SPEC.top_k)
    resumed, in_flight = samples[-2:]
    assert resumed.attempts == 2 and [v for v, _, _ in resumed.weight_versions] == ["default", "v1"]
    assert [v for v, _, _ in in_flight.weight_versions] == ["default", "v1"]

    from tests.mcore.mcore_helpers import run_in_process

    ref: dict = {}
    seqs = [s.prompt_tokens + s.response_tokens for s in samples]
    run_in_process(_megatron_routes, moe_dirs, seqs, ref)
    rows = tokens = 0
    out_of_order = 0
    for i, s in enumerate(samples):
        want = torch.stack([ref[v, i][0][r] for r, v in enumerate(_row_versions(s))])
        engine = s.routed_experts.long()
        got = engine.sort(-1).values
        assert torch.equal(got, want), (i, (got != want).any(-1).nonzero().tolist())
        out_of_order += int((engine[..., 0] > engine[..., 1]).sum())
        rows += engine.shape[0]
        # and the log-probs are that model's, token by token (the weights each token was sampled with)
        p = len(s.prompt_tokens)
        lp = torch.stack([ref[v, i][1][p - 1 + j, t] for j, (t, v) in enumerate(zip(s.response_tokens,
                                                                                   _token_versions(s), strict=True))])
        assert (lp - s.rollout_log_probs).abs().max() <= LOGPROB_TOL, i
        tokens += s.response_length
    assert out_of_order > 0  # the rows are not sorted ids: the order is the router's (checked below)
    print(f"embedded routes = Megatron's own on {rows} rows x {SPEC.num_layers} layers ({tokens} sampled tokens, "
          f"{out_of_order} (row, layer) pairs not in ascending id order)")


def test_topk_order_is_the_routers(moe, moe_dirs):
    """Each row lists the experts by decreasing router probability, as SGLang's top-k does: checked on the HF
    model's router logits teacher-forced (a forward of its own, not the engine's)."""
    from slime_corr.models.hf_checkpoint import load_hf_causal_lm
    from slime_corr.models.tiny_moe import hf_router_logits

    status, body = _post(moe.url, {"input_ids": PROMPTS[3], "sampling_params": PARAMS, "return_routed_experts": True})
    assert status == 200
    seq = torch.tensor([PROMPTS[3] + body["output_ids"][:-1]])
    logits = hf_router_logits(load_hf_causal_lm(moe_dirs["default"]), seq)
    want = torch.stack([lg[0].topk(SPEC.top_k, dim=-1).indices for lg in logits], dim=1)  # sorted: largest first
    got = torch.from_numpy(_ints(body["meta_info"]).copy()).view(-1, SPEC.num_layers, SPEC.top_k).long()
    assert torch.equal(got, want)


# ---------------------------------------------------------------- (b) the wire format, as SGLang's
def test_response_format_stream_and_batches(moe):
    url = moe.url
    body = {"input_ids": PROMPTS[0], "sampling_params": {**PARAMS, "sampling_seed": 3}, "return_routed_experts": True,
            "return_logprob": True}
    status, plain = _post(url, body)
    assert status == 200
    meta = plain["meta_info"]
    n = len(plain["output_ids"])
    assert n == PARAMS["max_new_tokens"] and _ints(meta).size == (4 + n - 1) * SPEC.num_layers * SPEC.top_k
    routes = parse_generate_response(plain, routed_experts=SPEC).routed_experts
    assert routes.shape == (4 + n - 1, SPEC.num_layers, SPEC.top_k)
    assert torch.equal(routes, decode_routed_experts(meta["routed_experts"], 4 + n - 1, SPEC))
    # streams: the routes only with the finishing event, the whole request's in a delta stream too
    for incremental in (False, True):
        moe.engine.incremental = incremental
        try:
            events = _stream(url, body)
        finally:
            moe.engine.incremental = False
        assert events[-1] == "[DONE]" and len(events) == n + 1
        assert [("routed_experts" in e["meta_info"]) for e in events[:-1]] == [False] * (n - 1) + [True]
        acc = StreamAccumulator(routed_experts=SPEC)
        for e in events[:-1]:
            acc.feed(e)
        acc.feed_line("[DONE]")
        assert acc.mode == ("incremental" if incremental else "cumulative")
        assert torch.equal(acc.result().routed_experts, routes)  # seeded: the same tokens, the same routes
    # routed_experts_start_len: rows [start, prompt + output - 1)
    for start in (2, 4):
        status, part = _post(url, {**body, "routed_experts_start_len": start})
        assert status == 200 and part["output_ids"] == plain["output_ids"]
        assert torch.equal(decode_routed_experts(part["meta_info"]["routed_experts"], 4 + n - 1 - start, SPEC),
                           routes[start:])
    status, one = _post(url, {"input_ids": [7], "sampling_params": {"max_new_tokens": 1}, "return_routed_experts": True,
                              "routed_experts_start_len": 1})
    assert status == 200 and one["meta_info"]["routed_experts"] == ""  # no row: the field is there, empty
    for start, words in ((5, "is higher than the number of input tokens"), (-1, "is lower than 0")):
        status, err = _post(url, {**body, "routed_experts_start_len": start})
        assert status == 400 and words in err["error"]["message"], err
        events = _stream(url, {**body, "routed_experts_start_len": start})
        assert words in events[0]["error"]["message"] and events[-1] == "[DONE]"
    # a batch: each answer its own routes; SGLang's lax boolean; a list is refused
    status, both = _post(url, {"input_ids": [PROMPTS[0], PROMPTS[2]],
                               "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
                               "return_routed_experts": "yes"})
    assert status == 200
    assert [_ints(b["meta_info"]).size for b in both] == [(4 + 3 - 1) * 4, (1 + 3 - 1) * 4]
    status, err = _post(url, {**body, "return_routed_experts": [True]})
    assert status == 400 and "return_routed_experts" in str(err)
    # not asked for: no field
    status, plain_no = _post(url, {**body, "return_routed_experts": False})
    assert status == 200 and "routed_experts" not in plain_no["meta_info"]


def test_aborted_running_and_waiting_requests(moe):
    """A running request aborted returns the routes of what it computed (prompt + output - 1 rows), in a stream
    too; one aborted while waiting (retracted by a pause) returns none, as SGLang's waiting queue does."""
    h = moe
    long = {"max_new_tokens": 200, "ignore_eos": True}

    async def go():
        async with SGLangClient(h.url) as c:
            h.engine.step_delay = 0.01
            try:
                out = []
                for stream in (False, True):
                    task = asyncio.create_task(c.generate(PROMPTS[0], long, stream=stream, routed_experts=SPEC))
                    await wait_tokens(h.engine, c, 4)
                    await c.abort()
                    out.append(await task)
                task = asyncio.create_task(c.generate(PROMPTS[1], long, routed_experts=SPEC))
                await wait_tokens(h.engine, c, 4)
                await c.pause("retract")
                await c.abort()
                waiting = await task
                await c.continue_generation()
                return out, waiting
            finally:
                h.engine.step_delay = 0.0

    running, waiting = asyncio.run(go())
    for res in running:
        assert res.finish_reason["type"] == "abort" and 4 <= len(res.output_ids) < 200
        assert res.routed_experts.shape == (4 + len(res.output_ids) - 1, SPEC.num_layers, SPEC.top_k)
    assert waiting.finish_reason["type"] == "abort" and len(waiting.output_ids) >= 4
    assert waiting.routed_experts is None


def test_not_enabled_and_dense_models(moe_dirs, tiny_ckpt):
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
            "return_routed_experts": True}
    with _serve(moe_dirs["default"], dtype=torch.bfloat16, enable_return_routed_experts=False) as off:
        status, res = _post(off.url, body)
        assert status == 200 and "routed_experts" not in res["meta_info"]  # ignored, as without the server flag
        status, _ = _post(off.url, {**body, "routed_experts_start_len": 9})
        assert status == 400  # validated all the same, as SGLang does
        assert _server_info(off.url)["enable_return_routed_experts"] is False
        with pytest.raises(ResponseError, match="--enable-return-routed-experts"):
            parse_generate_response(res, want_logprobs=False, routed_experts=SPEC)  # the client names the flag
    with start_local_engine(tiny_ckpt) as dense:  # a dense model: routes are off by default, the field ignored
        status, res = _post(dense.url, {**body, "input_ids": [72, 101]})
        assert status == 200 and "routed_experts" not in res["meta_info"] and len(res["output_ids"]) == 3
        assert _server_info(dense.url)["enable_return_routed_experts"] is False
    with pytest.raises(ValueError, match="enable_return_routed_experts: the model is dense"):
        with start_local_engine(tiny_ckpt, enable_return_routed_experts=True):  # SGLang does not start either
            pass
