"""The tiny Qwen3-MoE (`slime_corr.models.tiny_moe`) served by the REAL SGLang 0.5.23 server on CPU (fp32,
`--enable-return-routed-experts`; one server for the module): log-probs equal HF's teacher-forced ones, and the
routes the server returns (through the rollout client, plain, streamed and across an abort/resume) equal the top-k
of HF's router logits for the same tokens; replayed in the trainer's Megatron model (built from the same checkpoint
through mbridge) they are the experts its routers report, and its routing-mismatch metric is 0."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from slime_corr.models.bridge import write_hf_checkpoint
from slime_corr.models.hf_checkpoint import load_hf_causal_lm
from slime_corr.models.tiny_moe import TinyMoEArgs, hf_router_logits, make_tiny_moe_checkpoint, topk_routes
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.rollout import generate_sample
from slime_corr.routed_experts import RoutedExpertsSpec
from slime_corr.samples import Sample, SampleStatus
from tests.real_sglang.sglang_helpers import ServerSpec, slowed_down, tokens_streamed

pytestmark = pytest.mark.cost(90)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

ARGS = TinyMoEArgs()
TIED_ARGS = TinyMoEArgs(tie_word_embeddings=True, seed=1)
SPEC = RoutedExpertsSpec(ARGS.num_hidden_layers, ARGS.num_experts_per_tok, ARGS.num_experts)
PROMPTS = [[5, 17, 200, 3], [9, 9, 1], [42], list(range(30, 50))]
LOGPROB_TOL = 1e-4  # fp32 server vs fp32 HF (SGLANG_ON_CPU.md: 1.0-1.8e-5 measured on the dense model)
# issue 32: a tied model served from the trainer's checkpoint (a zero head: |Δ| ~ 1 or more). The fp32 rounding of two
# implementations sets the floor, as above: 1e-5 failed CI38 at 1.67e-05 (tied Llama, 38 sampled tokens)
TIED_TOL = LOGPROB_TOL


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return str(make_tiny_moe_checkpoint(tmp_path_factory.mktemp("tiny_moe"), ARGS))


@pytest.fixture(scope="module")
def tied_dirs(tmp_path_factory):
    """(as Hugging Face saves a tied Qwen3-MoE: no lm_head.weight, as the trainer hands it to SGLang)"""
    hf_dir = make_tiny_moe_checkpoint(tmp_path_factory.mktemp("tied_moe"), TIED_ARGS)
    written = write_hf_checkpoint(load_file(hf_dir / "model.safetensors"), hf_dir, tmp_path_factory.mktemp("served"))
    return hf_dir, written


@pytest.fixture(scope="module")
def tied_dense_dirs(tmp_path_factory):
    """A tiny tied Llama as Hugging Face saves it (no lm_head.weight), and as the trainer hands it to SGLang."""
    from tests.models.models_helpers import make_tiny_checkpoint

    hf_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("tied_llama"), "llama", seed=3, tie_word_embeddings=True)
    written = write_hf_checkpoint(load_file(hf_dir / "model.safetensors"), hf_dir, tmp_path_factory.mktemp("served"))
    return hf_dir, written


@pytest.fixture(scope="module")
def servers(launch, moe_dir, tied_dirs, tied_dense_dirs):
    flags = ("--enable-return-routed-experts",)
    untied, tied, dense = launch(ServerSpec(moe_dir, extra_args=flags, name="moe"),
                                 ServerSpec(str(tied_dirs[1]), extra_args=flags, name="moe-tied"),
                                 ServerSpec(str(tied_dense_dirs[1]), name="llama-tied"))
    return untied.url, tied.url, dense.url


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def hf(moe_dir):
    return load_hf_causal_lm(moe_dir)


def _check(hf, samples: list[Sample], temperature: float) -> tuple[float, int]:
    """max |lp_server - lp_hf| over the samples; asserts every sample's routes equal HF's router top-k."""
    worst, tokens = 0.0, 0
    for s in samples:
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED), s.failure_reason
        seq = torch.tensor([s.prompt_tokens + s.response_tokens])
        with torch.no_grad():
            logits = hf(seq).logits[0, len(s.prompt_tokens) - 1 : -1].float() / temperature
        ref = torch.log_softmax(logits, -1).gather(-1, seq[0, len(s.prompt_tokens):, None])[:, 0]
        worst = max(worst, float((s.rollout_log_probs - ref).abs().max()))
        hf_routes = topk_routes(hf_router_logits(hf, seq[:, :-1]), SPEC.top_k)[0]
        assert s.routed_experts is not None and s.routed_experts.dtype == torch.uint8
        assert s.routed_experts.shape == (s.total_length - 1, SPEC.num_layers, SPEC.top_k)
        got = s.routed_experts.long().sort(dim=-1).values  # the server lists them in top-k order
        assert torch.equal(got, hf_routes), (got != hf_routes).any(-1).nonzero().tolist()
        tokens += s.total_length - 1
    assert worst <= LOGPROB_TOL, worst
    return worst, tokens


async def _samples(url: str, stream: bool, temperature: float, routes: RoutedExpertsSpec | None = SPEC,
                   prompts: list[list[int]] = PROMPTS):
    params = {"max_new_tokens": 12, "temperature": temperature}
    async with SGLangClient(url) as c:
        return list(await asyncio.gather(*(
            generate_sample(c, Sample(prompt_tokens=list(p)), params, stream=stream, routed_experts=routes)
            for p in prompts)))


def test_logprobs_and_routes_equal_hf(server, hf):
    for temperature in (1.0, 0.7):
        samples = asyncio.run(_samples(server, False, temperature)) + asyncio.run(_samples(server, True, temperature))
        worst, tokens = _check(hf, samples, temperature)
        print(f"T={temperature}: max |lp_server - lp_hf| = {worst:.2e}; routes equal HF's on {tokens} tokens x "
              f"{SPEC.num_layers} layers")
    plain = asyncio.run(_samples(server, True, 1.0, routes=None))  # not asked for: none returned, none kept
    assert all(s.routed_experts is None and s.response_length > 0 for s in plain)


def test_a_tied_model_is_served_with_its_lm_head(servers, tied_dirs):
    """SGLang 0.5.23's Qwen3-MoE never ties its LM head: from Hugging Face's tied checkpoint (no lm_head.weight) it
    served a zero head, every log-prob -log(vocab). The trainer writes the head out (`write_hf_checkpoint`)."""
    hf_dir, written = tied_dirs
    assert "lm_head.weight" not in load_file(hf_dir / "model.safetensors")
    assert "lm_head.weight" in load_file(written / "model.safetensors")
    samples = asyncio.run(_samples(servers[1], True, 1.0))
    worst, tokens = _check(load_hf_causal_lm(hf_dir), samples, 1.0)
    print(f"tied Qwen3-MoE: max |lp_server - lp_hf| = {worst:.2e} over {tokens} tokens")
    assert worst <= TIED_TOL, worst


def test_a_tied_dense_model_is_served_with_its_lm_head(servers, tied_dense_dirs):
    """The same for a dense tied model (Llama, as SmolLM2): SGLang's Llama ties the head itself; the explicit
    lm_head.weight the trainer writes must not change what it serves."""
    hf_dir, written = tied_dense_dirs
    assert "lm_head.weight" in load_file(written / "model.safetensors")
    prompts = [[p % 127 for p in prompt] for prompt in PROMPTS]  # the tiny Llama's vocabulary: 128 ids
    samples = asyncio.run(_samples(servers[2], True, 1.0, routes=None, prompts=prompts))
    hf = load_hf_causal_lm(hf_dir)
    worst, tokens = 0.0, 0
    for s in samples:
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED), s.failure_reason
        seq = torch.tensor([s.prompt_tokens + s.response_tokens])
        with torch.no_grad():
            logits = hf(seq).logits[0, len(s.prompt_tokens) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, seq[0, len(s.prompt_tokens):, None])[:, 0]
        worst, tokens = max(worst, float((s.rollout_log_probs - ref).abs().max())), tokens + s.response_length
    print(f"tied Llama: max |lp_server - lp_hf| = {worst:.2e} over {tokens} tokens")
    assert tokens > 0 and worst <= TIED_TOL, worst


def test_routes_across_abort_and_resume(server, hf):
    """A pause (mode abort) mid-generation: the sample resumes with prompt + partial output, and its routes
    (first response's rows, then the resumed one's) still cover every token and equal HF's."""
    params = {"max_new_tokens": 120, "temperature": 1.0, "ignore_eos": True}

    async def go():
        async with SGLangClient(server) as c:
            with tokens_streamed() as streamed:
                task = asyncio.create_task(generate_sample(c, Sample(prompt_tokens=list(PROMPTS[0])), params,
                                                           stream=True, routed_experts=SPEC))
                await streamed(1)  # running on the server, and for >= 2.4 s more (the throttle)
            await c.pause("abort")
            await asyncio.sleep(0.2)
            await c.continue_generation()
            return await task

    with slowed_down(server, 0.02):
        sample = asyncio.run(go())
    assert sample.attempts == 2 and sample.response_length == 120, (sample.attempts, sample.failure_reason)
    _check(hf, [sample], 1.0)


def _megatron_route_check(rank: int, world: int, moe_dir: str, samples: list[Sample], out: dict) -> None:
    """In a one-rank gloo group: the Megatron model's own routes of each sample (before replay), the routes and
    log-probs under replay of the engine's routes."""
    from megatron.core import tensor_parallel

    from slime_corr.mcore.routing import capture_routes, replay_routes
    from slime_corr.models import build_gpt_from_hf
    from tests.mcore.mcore_helpers import init_layout

    init_layout(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model, _ = build_gpt_from_hf(moe_dir, config_overrides={"moe_enable_routing_replay": True})
    model.eval()
    for s in samples:
        ids = torch.tensor([s.prompt_tokens + s.response_tokens[:-1]])  # the tokens that were forward inputs
        pos = torch.arange(ids.size(1))[None]
        engine = s.routed_experts[None]
        with torch.no_grad(), capture_routes(model, 1) as own:
            model(input_ids=ids, position_ids=pos, attention_mask=None)
        with torch.no_grad(), replay_routes(model, engine), capture_routes(model, 1) as replayed:
            logits = model(input_ids=ids, position_ids=pos, attention_mask=None)
        lp = torch.log_softmax(logits[0, len(s.prompt_tokens) - 1 :].float(), -1)
        lp = lp.gather(-1, torch.tensor(s.response_tokens)[:, None])[:, 0]
        out.setdefault("own", []).append(own[0][0])
        out.setdefault("replayed", []).append(replayed[0][0])
        out.setdefault("lp", []).append(lp)


def test_engine_routes_replayed_in_megatron(server, moe_dir):
    from slime_corr.correction.routing import routing_mismatch_metrics
    from tests.mcore.mcore_helpers import run_in_process

    samples = asyncio.run(_samples(server, True, 1.0))
    out: dict = {}
    run_in_process(_megatron_route_check, moe_dir, samples, out)
    for s, own, replayed, lp in zip(samples, out["own"], out["replayed"], out["lp"], strict=True):
        engine = s.routed_experts.long().sort(-1).values
        assert torch.equal(replayed, engine)  # replay: the trainer's routes are the engine's, token for token
        mask = torch.ones(engine.shape[0])
        before = routing_mismatch_metrics(engine, own, mask)
        assert float(before["routing_mismatch_frac"]) == 0.0  # fp32 engine and fp32 trainer agree anyway
        assert float(routing_mismatch_metrics(engine, replayed, mask)["routing_mismatch_token_frac"]) == 0.0
        assert (lp - s.rollout_log_probs).abs().max() <= LOGPROB_TOL
