"""Routing mismatch and routing replay on the tiny Qwen3-MoE against the REAL SGLang server (not part of the tests).

    python bench/moe_routing.py [--dtypes bfloat16 float32] [--samples 32] [--max-new-tokens 32] [--temperature 1.0]
                                [--markdown docs/benchmarks.md]   # also writes the table there (block moe_routing.py)

For each engine dtype (one server at a time, on 127.0.0.1, stopped by its PID): generate `--samples` responses
with `return_routed_experts`, then in this process build the trainer's fp32 Megatron model from the same
checkpoint (mbridge, `moe_enable_routing_replay=True`) and, per response, compare
- without replay: the trainer's own routes vs the engine's (`correction.routing.routing_mismatch_metrics`), and
  `train_rollout_logprob_abs_diff` / `mismatch_k3_kl` (token means of |lr| and exp(lr) - lr - 1, lr = lp_train -
  lp_rollout), split into tokens with and without a routing difference at their position;
- with replay of the engine's routes: the same log-prob mismatch, and the routes the trainer then reports.
Also prints the bytes per token the routes take in a sample (uint8 `layers x top_k`) and on the wire (base64 int32).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from markdown_table import caption_line, write_block  # noqa: E402  # bench/markdown_table.py

from slime_corr.correction.routing import routing_mismatch_metrics  # noqa: E402
from slime_corr.engines.sglang_server import SGLangServerConfig, launch_sglang_server, sglang_python  # noqa: E402
from slime_corr.models.tiny_moe import TinyMoEArgs, make_tiny_moe_checkpoint  # noqa: E402
from slime_corr.rollout.client import SGLangClient  # noqa: E402
from slime_corr.rollout.rollout import generate_sample  # noqa: E402
from slime_corr.routed_experts import RoutedExpertsSpec  # noqa: E402
from slime_corr.samples import Sample  # noqa: E402


def _init_megatron() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from slime_corr.mcore.cpu_compat import apply_cpu_compat
    from slime_corr.ports import init_world_of_one

    init_world_of_one("gloo")
    apply_cpu_compat()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)


async def _generate(url: str, spec: RoutedExpertsSpec, n: int, max_new: int, temperature: float) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 255, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    params = {"max_new_tokens": max_new, "temperature": temperature, "ignore_eos": True}
    async with SGLangClient(url) as c:
        return list(await asyncio.gather(*(generate_sample(c, Sample(prompt_tokens=p), params, routed_experts=spec)
                                           for p in prompts)))


def _trainer_pass(model, samples: list[Sample], temperature: float, replay: bool):
    from slime_corr.mcore.routing import capture_routes, replay_routes

    routes, lps = [], []
    for s in samples:
        ids = torch.tensor([s.prompt_tokens + s.response_tokens[:-1]])
        ctx = replay_routes(model, s.routed_experts[None]) if replay else torch.no_grad()
        with torch.no_grad(), ctx, capture_routes(model, 1) as got:
            logits = model(input_ids=ids, position_ids=torch.arange(ids.size(1))[None], attention_mask=None)
        lp = torch.log_softmax(logits[0, len(s.prompt_tokens) - 1 :].double() / temperature, -1)
        lps.append(lp.gather(-1, torch.tensor(s.response_tokens)[:, None])[:, 0])
        routes.append(got[0][0])
    return routes, lps


DTYPE_LABELS = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def _report(dtype: str, samples: list[Sample], model, temperature: float) -> list[list[str]]:
    """Prints the engine's mismatch without and with replay; returns them as rows of the markdown table."""
    print(f"\nengine {dtype}: {len(samples)} samples, {sum(s.response_length for s in samples)} response tokens")
    rows = []
    for replay in (False, True):
        routes, lps = _trainer_pass(model, samples, temperature, replay)
        # per response token (position t of the trainer's forward predicts token t+1): routes at that position
        eng = torch.cat([s.routed_experts[len(s.prompt_tokens) - 1 :] for s in samples])
        trn = torch.cat([r[len(s.prompt_tokens) - 1 :] for r, s in zip(routes, samples, strict=True)])
        lp_t = torch.cat(lps)
        lp_r = torch.cat([s.rollout_log_probs.double() for s in samples])
        m = {k: float(v) for k, v in routing_mismatch_metrics(eng, trn, torch.ones(len(lp_t)), lp_t, lp_r).items()}
        lr = lp_t - lp_r
        k3 = float((lr.exp() - lr - 1).mean())
        all_routes = routing_mismatch_metrics(torch.cat([s.routed_experts for s in samples]), torch.cat(routes),
                                              torch.ones(sum(s.total_length - 1 for s in samples)))
        layers = " ".join(f"{m[k]:.4f}" for k in sorted(m) if k.startswith("routing_mismatch_layer_"))
        print(f"  replay={'on ' if replay else 'off'}: routing_mismatch_frac={m['routing_mismatch_frac']:.4f} "
              f"token_frac={m['routing_mismatch_token_frac']:.4f} (per layer {layers}; all tokens incl. prompt "
              f"{float(all_routes['routing_mismatch_token_frac']):.4f})")
        print(f"    train_rollout_logprob_abs_diff={float(lr.abs().mean()):.3e} mismatch_k3_kl={k3:.3e} "
              f"| abs diff on tokens routed differently {m['logprob_abs_diff_routing_diff']:.3e} "
              f"({int(m['routing_mismatch_tokens'])} tokens), same {m['logprob_abs_diff_routing_same']:.3e}")
        abs_diff = f"{float(lr.abs().mean()):.1e}"
        if m["routing_mismatch_tokens"] > 0:
            abs_diff += (f" ({m['logprob_abs_diff_routing_diff']:.1e} on the tokens routed differently, "
                         f"{m['logprob_abs_diff_routing_same']:.1e} on the others)")
        rows.append([DTYPE_LABELS.get(dtype, dtype), "on" if replay else "off",
                     f"{m['routing_mismatch_frac']:.1%} / {m['routing_mismatch_token_frac']:.1%}", abs_diff,
                     f"{k3:.1e}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--markdown", metavar="FILE", help="also write the table into FILE between its markers")
    a = ap.parse_args()
    args = TinyMoEArgs()
    spec = RoutedExpertsSpec(args.num_hidden_layers, args.num_experts_per_tok, args.num_experts)
    routes = (f"routes: {spec.bytes_per_token} bytes/token in a sample ({spec.dtype}), "
              f"{4 * spec.num_layers * spec.top_k * 4 / 3:.1f} on the wire (base64 int32)")
    print(routes)
    rows = []
    _init_megatron()
    from slime_corr.models import build_gpt_from_hf

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(make_tiny_moe_checkpoint(Path(tmp) / "moe", args))
        model, _ = build_gpt_from_hf(ckpt, config_overrides={"moe_enable_routing_replay": True})
        model.eval()
        for dtype in a.dtypes:
            cfg = SGLangServerConfig(model_path=ckpt, python=sglang_python(), dtype=dtype, skip_tokenizer_init=True,
                                     extra_args=("--enable-return-routed-experts",), log_dir=Path(tmp) / "logs")
            with launch_sglang_server(cfg, name=f"moe-{dtype}") as eng:
                samples = asyncio.run(_generate(eng.url, spec, a.samples, a.max_new_tokens, a.temperature))
            rows += _report(dtype, samples, model, a.temperature)
    if a.markdown:
        caption = caption_line(sys.argv, "cpu", torch.get_num_threads(),
                               f"the real SGLang server (CPU) and the fp32 Megatron trainer, the tiny Qwen3-MoE, "
                               f"{a.samples} samples × {a.max_new_tokens} tokens, T = {a.temperature:g}; {routes}")
        write_block(a.markdown, "moe_routing.py", caption,
                    ["engine", "replay", "routing mismatch (decisions / tokens)", "`train_rollout_logprob_abs_diff`",
                     "`mismatch_k3_kl`"], rows, title="Routing mismatch on the tiny MoE (bench/moe_routing.py)")


if __name__ == "__main__":
    main()
