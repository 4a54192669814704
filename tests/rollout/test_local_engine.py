"""Real HTTP on loopback against the embedded engine: sampling semantics, streaming, control endpoints."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from types import SimpleNamespace

import aiohttp
import pytest
import torch

from slime_corr.engines.embedded.engine import start_local_engine
from slime_corr.engines.embedded.model import (
    EngineModel,
    TorchEngineModel,
    load_tiny_lm,
    teacher_forced_logprobs,
)
from slime_corr.engines.embedded.sampling import sample_next_token
from slime_corr.rollout.client import GenerationError, SGLangClient
from slime_corr.rollout.rollout import generate_sample
from slime_corr.samples import Sample, SampleStatus

PROMPT = [72, 101, 108, 108, 111, 32]


def _gen(url: str, prompt=PROMPT, stream: bool = False, **params):
    async def go():
        async with SGLangClient(url) as c:
            return await c.generate(prompt, params, stream=stream)

    return asyncio.run(go())


def _raw(url: str, path: str, body: dict):
    async def go():
        async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
            return r.status, await r.json()

    return asyncio.run(go())


def test_stream_and_nonstream_agree(engine, tiny_ckpt):
    params = dict(max_new_tokens=24, sampling_seed=7, temperature=0.9, ignore_eos=True)
    a = _gen(engine.url, **params)
    b = _gen(engine.url, stream=True, **params)
    with start_local_engine(tiny_ckpt, incremental_streaming_output=True) as inc:
        c = _gen(inc.url, stream=True, **params)
    assert a.finish_reason == {"type": "length", "length": 24}
    assert len(a.output_ids) == 24
    assert a.output_ids == b.output_ids == c.output_ids
    assert a.log_probs == b.log_probs == c.log_probs


def test_logprobs_match_teacher_forced_bf16(engine, tiny_ckpt):
    """bf16 engine vs an fp32 teacher-forced recomputation: close, but not identical (a real mismatch)."""
    ref_model = load_tiny_lm(tiny_ckpt)
    res = _gen(engine.url, max_new_tokens=40, sampling_seed=3, temperature=0.8, ignore_eos=True)
    ref = teacher_forced_logprobs(ref_model, PROMPT, res.output_ids, temperature=0.8)
    got = torch.tensor(res.log_probs)
    diff = (got - ref).abs()
    assert diff.max() < 0.15, diff
    assert diff.max() > 1e-6  # bf16 really differs from fp32


def test_logprobs_exact_in_fp32_mode_and_not_renormalized(tiny_ckpt):
    """fp32 engine: log-probs equal log_softmax(logits / T) of the sampled token, NOT renormalised by top-k/p."""
    ref_model = load_tiny_lm(tiny_ckpt)
    with start_local_engine(tiny_ckpt, dtype=torch.float32) as h:
        res = _gen(h.url, max_new_tokens=30, sampling_seed=5, temperature=1.3, top_k=3, top_p=0.9,
                   ignore_eos=True)
        greedy = _gen(h.url, max_new_tokens=10, temperature=0.0, ignore_eos=True)
    ref = teacher_forced_logprobs(ref_model, PROMPT, res.output_ids, temperature=1.3)
    torch.testing.assert_close(torch.tensor(res.log_probs), ref, atol=1e-4, rtol=0)
    # renormalising over the top-k set would raise every log-prob noticeably
    ids = torch.tensor([PROMPT + res.output_ids])
    with torch.no_grad():
        logits = ref_model(ids)[0, len(PROMPT) - 1 : -1] / 1.3
    top = torch.topk(logits, 3).values
    renorm = logits.gather(-1, torch.tensor(res.output_ids)[:, None])[:, 0] - torch.logsumexp(top, -1)
    assert (renorm - ref).max() > 0.05
    # every sampled token lies in the top-3 set
    assert all(lg[t] >= top_row[-1] for lg, t, top_row in zip(logits, res.output_ids, torch.topk(logits, 3).values,
                                                               strict=True))
    # greedy: argmax tokens, log-prob of the raw logits
    ref_g = teacher_forced_logprobs(ref_model, PROMPT, greedy.output_ids, temperature=0.0)
    torch.testing.assert_close(torch.tensor(greedy.log_probs), ref_g, atol=1e-4, rtol=0)
    with torch.no_grad():
        seq = list(PROMPT)
        for t in greedy.output_ids:
            assert int(ref_model(torch.tensor([seq]))[0, -1].argmax()) == t
            seq.append(t)


def test_stop_token_kept_in_output(engine):
    base = _gen(engine.url, max_new_tokens=12, sampling_seed=11, ignore_eos=True)
    stop_tok = base.output_ids[5]
    first = base.output_ids.index(stop_tok)
    res = _gen(engine.url, max_new_tokens=12, sampling_seed=11, ignore_eos=True, stop_token_ids=[stop_tok])
    assert res.finish_reason == {"type": "stop", "matched": stop_tok}
    assert res.output_ids == base.output_ids[: first + 1]  # the matched token stays
    assert len(res.log_probs) == len(res.output_ids)


def test_bad_request_is_not_retried(engine):
    with pytest.raises(ValueError, match="unknown keys"):
        _gen(engine.url, max_new_tokens=2, bogus=1)
    status, body = _raw(engine.url, "/generate", {"input_ids": PROMPT, "sampling_params": {"bogus": 1}})
    assert status == 400 and "bogus" in body["error"]
    with pytest.raises(GenerationError, match="HTTP 400") as ei:
        _gen(engine.url, prompt=[9999], max_new_tokens=2)
    assert ei.value.attempts == 1


def test_batch_request(engine):
    status, body = _raw(engine.url, "/generate", {
        "input_ids": [PROMPT, PROMPT[:3]], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        "return_logprob": True})
    assert status == 200 and isinstance(body, list) and len(body) == 2
    assert all(len(b["meta_info"]["output_token_logprobs"]) == 3 for b in body)


def test_info_health_and_flush(engine):
    async def go():
        async with SGLangClient(engine.url) as c:
            assert await c.control.health() and await c.control.health(generate=True)
            mi, si = await c.control.model_info(), await c.control.server_info()
            await c.flush_cache()
            return mi, si

    mi, si = asyncio.run(go())
    assert mi["is_generation"] is True and mi["weight_version"] == "default"
    assert si["max_context_length"] == 256 and si["incremental_streaming_output"] is False


def test_health_false_when_nothing_listens():
    from .fault_server import closed_port_url

    async def go():
        async with SGLangClient(closed_port_url()) as c:
            return await c.control.health()

    assert asyncio.run(go()) is False


def test_update_weights_from_disk_and_flush_while_busy(tiny_ckpt, tiny_ckpt_v1, tmp_path):
    new_model = load_tiny_lm(tiny_ckpt_v1)

    async def go(url, engine):
        async with SGLangClient(url) as c:
            engine.step_delay = 0.01
            busy = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 30, "ignore_eos": True}))
            while not engine.active:
                await asyncio.sleep(0.005)
            status, _ = await c.control._post(url, "/flush_cache")
            assert status == 400  # SGLang refuses to flush with requests in flight
            await busy
            engine.step_delay = 0.0
            await c.update_weights_from_disk(tiny_ckpt_v1, weight_version="v1")
            res = await c.generate(PROMPT, {"max_new_tokens": 20, "ignore_eos": True, "sampling_seed": 1})
            info = await c.control.model_info()
            with pytest.raises(RuntimeError, match="update_weights_from_disk"):  # a folder without a checkpoint
                await c.update_weights_from_disk(str(tmp_path))
            return res, info

    with start_local_engine(tiny_ckpt, dtype=torch.float32) as h:
        res, info = asyncio.run(go(h.url, h.engine))
    assert res.weight_version == "v1" and info["weight_version"] == "v1"
    ref = teacher_forced_logprobs(new_model, PROMPT, res.output_ids)
    torch.testing.assert_close(torch.tensor(res.log_probs), ref, atol=1e-4, rtol=0)


def test_requests_spread_over_several_servers(tiny_ckpt):
    with start_local_engine(tiny_ckpt) as a, start_local_engine(tiny_ckpt) as b:
        async def go():
            async with SGLangClient([a.url, b.url], max_concurrency_per_server=2) as c:
                return await asyncio.gather(*(c.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True})
                                              for _ in range(8)))

        res = asyncio.run(go())
    assert {r.server for r in res} == {a.url, b.url}
    assert all(len(r.output_ids) == 4 for r in res)


def test_client_disconnect_aborts_the_request(tiny_ckpt):
    """Like SGLang, the engine aborts a request whose client went away (no orphaned generation)."""
    with start_local_engine(tiny_ckpt, step_delay=0.01) as h:
        async def go():
            body = {"input_ids": PROMPT, "stream": True, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
            async with aiohttp.ClientSession() as s:
                async with s.post(h.url + "/generate", json=body) as r:
                    await r.content.readuntil(b"\n\n")
                    assert len(h.engine.active) == 1
            for _ in range(300):
                if not h.engine.active:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("request still running after the client disconnected")

        asyncio.run(go())


def test_real_server_killed_mid_stream_samples_move_to_the_other_server(tiny_ckpt):
    """A real engine process is SIGKILLed while streaming: its samples are regenerated on the other server
    with new rids; every sample ends exactly once, complete, with a single consistent set of log-probs."""
    cmd = [sys.executable, "-m", "slime_corr.engines.embedded.engine", "--checkpoint", tiny_ckpt, "--fp32",
           "--step-delay", "0.05", "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY "), line
        doomed = line.split()[1]
        with start_local_engine(tiny_ckpt, dtype=torch.float32) as live:
            async def go():
                async with SGLangClient([doomed, live.url], max_concurrency_per_server=8) as c:
                    samples = [Sample(prompt_tokens=list(PROMPT), index=i) for i in range(4)]
                    tasks = [asyncio.create_task(generate_sample(c, s, {"max_new_tokens": 40, "ignore_eos": True},
                                                                 stream=True)) for s in samples]
                    for _ in range(2000):  # until the doomed server is streaming its share
                        info = await c.control.server_info(doomed)
                        if info["internal_states"][0]["num_running"] >= 2:
                            break
                        await asyncio.sleep(0.01)
                    proc.send_signal(signal.SIGKILL)
                    return await asyncio.gather(*tasks)

            samples = asyncio.run(go())
    finally:
        proc.kill()
        proc.wait(30)
    assert [s.index for s in samples] == [0, 1, 2, 3]
    assert all(s.status == SampleStatus.TRUNCATED and s.response_length == 40 for s in samples)
    assert sorted(s.attempts for s in samples) == [1, 1, 2, 2]  # the doomed server's two, retried once each
    ref_model = load_tiny_lm(tiny_ckpt)
    for s in samples:  # no token or log-prob of the killed attempt leaked into a sample
        ref = teacher_forced_logprobs(ref_model, PROMPT, s.response_tokens)
        torch.testing.assert_close(s.rollout_log_probs, ref, atol=1e-4, rtol=0)


def test_sampling_filters_follow_sglang_and_logprobs_are_not_renormalized():
    """top-p on the cumulative sum of the FULL distribution (not renormalised after top-k), as SGLang does;
    the returned log-prob is log_softmax(logits / T) of the sampled token, whatever the filters kept."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log() * 2.0  # temperature 2 gives back ``probs``
    gen = torch.Generator().manual_seed(0)
    # top_k=2 then top_p=0.55: SGLang keeps {0, 1} (0.5 < 0.55); renormalising after top-k would keep {0}
    draws = [sample_next_token(logits, {"temperature": 2.0, "top_k": 2, "top_p": 0.55}, gen) for _ in range(300)]
    assert {t for t, _ in draws} == {0, 1}
    for t, lp in draws:
        assert lp == pytest.approx(float(probs[t].log()), abs=1e-6)
    # min_p relative to the largest probability: 0.5 * 0.35 = 0.175 keeps {0, 1}
    assert {sample_next_token(logits, {"temperature": 2.0, "min_p": 0.35}, gen)[0] for _ in range(300)} == {0, 1}
    # greedy: argmax, log-prob of the raw logits
    tok, lp = sample_next_token(logits, {"temperature": 0.0}, gen)
    assert tok == 0 and lp == pytest.approx(float(torch.log_softmax(logits, -1)[0]), abs=1e-6)


def test_sampling_seed_is_batch_and_resume_invariant(tiny_ckpt):
    """The same request with the same seed gives the same tokens alone, batched with other requests, on a
    busy engine, and resumed from its partial output (draws are keyed by seed and position)."""
    params = {"max_new_tokens": 20, "ignore_eos": True, "sampling_seed": 1234, "temperature": 1.0}
    with start_local_engine(tiny_ckpt) as h:  # bf16: its batched logits differ from unbatched ones
        async def go():
            async with SGLangClient(h.url) as c:
                alone = await c.generate(PROMPT, params)
                noise = [c.generate(list(range(5, 5 + n)), {"max_new_tokens": 25}) for n in (3, 9, 30)]
                batched, *_ = await asyncio.gather(c.generate(PROMPT, params, stream=True), *noise)
                head = await c.generate(PROMPT, {**params, "max_new_tokens": 8})
                tail = await c.generate(PROMPT + head.output_ids, {**params, "max_new_tokens": 12})
                other = await c.generate(PROMPT, {**params, "sampling_seed": 1235})
                return alone, batched, head, tail, other

        alone, batched, head, tail, other = asyncio.run(go())
    assert batched.output_ids == alone.output_ids and batched.log_probs == alone.log_probs
    assert head.output_ids + tail.output_ids == alone.output_ids
    assert head.log_probs + tail.log_probs == alone.log_probs
    assert other.output_ids != alone.output_ids  # the seed does matter


class WordTokenizer:
    """A toy tokenizer that is not byte-level: ids 10.. are the lowercase letters, 1 is a space, 2 is EOS."""

    eos_token_id = 2

    def encode(self, text: str) -> list[int]:
        return [1 if ch == " " else 10 + ord(ch) - ord("a") for ch in text.lower() if ch == " " or ch.isalpha()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = {1: " ", 2: "" if skip_special_tokens else "</s>"}
        return "".join(out.get(i, chr(ord("a") + i - 10) if 10 <= i < 36 else "?") for i in ids)


def test_text_in_and_out_with_a_tokenizer(tiny_ckpt, engine):
    tok = WordTokenizer()
    _, plain = _raw(engine.url, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 5,
                                                                                "logit_bias": {"2": 100.0}}})
    assert plain["output_ids"] == [2] * 5  # with the byte-level default, id 2 is no EOS
    with start_local_engine(tiny_ckpt, tokenizer=tok) as h:
        status, body = _raw(h.url, "/generate", {"text": "hello world", "return_logprob": True,
                                                 "return_text_in_logprobs": True,
                                                 "sampling_params": {"max_new_tokens": 12, "sampling_seed": 3}})
        # the tokenizer's EOS ends generation (forced here by a logit bias)
        _, forced = _raw(h.url, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 5,
                                                                            "logit_bias": {"2": 100.0}}})
        # a stop string is matched in the tokenizer's text
        stop = body["text"][2:4] if len(body["text"]) >= 4 else "zz"
        _, stopped = _raw(h.url, "/generate", {"text": "hello world", "sampling_params": {
            "max_new_tokens": 12, "sampling_seed": 3, "stop": [stop]}})
    assert status == 200 and body["meta_info"]["prompt_tokens"] == len(tok.encode("hello world"))
    assert body["text"] == tok.decode(body["output_ids"])
    assert [e[2] for e in body["meta_info"]["output_token_logprobs"]] == [tok.decode([t]) for t in
                                                                          body["output_ids"]]
    fr, ids = body["meta_info"]["finish_reason"], body["output_ids"]
    eos = {0, 2}  # the model config's EOS and the tokenizer's
    if fr["type"] == "stop":
        assert fr["matched"] in eos and ids[-1] == fr["matched"] and not eos & set(ids[:-1])
    else:
        assert fr == {"type": "length", "length": 12} and not eos & set(ids)
    assert forced["output_ids"] == [2] and forced["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    if stop != "zz":
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stopped["text"] == body["text"][: body["text"].find(stop)]


class HFStyleLM(torch.nn.Module):
    """Shaped like a Hugging Face causal LM: ``config`` (EOS ids as a list, max_position_embeddings) and an
    output object with ``.logits`` - what an HF model served by the engine looks like."""

    def __init__(self, checkpoint_dir: str) -> None:
        super().__init__()
        self.inner = load_tiny_lm(checkpoint_dir)
        self.config = SimpleNamespace(vocab_size=256, eos_token_id=[7, 9], max_position_embeddings=64)

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.inner(input_ids))


def test_engine_serves_an_hf_shaped_model(tiny_ckpt):
    model = TorchEngineModel(tiny_ckpt, factory=HFStyleLM, dtype=torch.float32)
    assert isinstance(model, EngineModel) and model.max_seq_len == 64
    assert {n for n, _ in model.named_weights()} == {f"inner.{k}" for k in load_tiny_lm(tiny_ckpt).state_dict()}
    with start_local_engine(model=model) as h:
        res = _gen(h.url, max_new_tokens=10, ignore_eos=True, sampling_seed=2)
        eos = _gen(h.url, max_new_tokens=10, logit_bias={"9": 100.0})
    ref = teacher_forced_logprobs(load_tiny_lm(tiny_ckpt), PROMPT, res.output_ids)
    torch.testing.assert_close(torch.tensor(res.log_probs), ref, atol=1e-4, rtol=0)
    assert eos.output_ids == [9] and eos.finish_reason == {"type": "stop", "matched": 9}  # 2nd of its EOS ids
