"""Check a converted checkpoint against plain Hugging Face, at the TP size of the launch.

    torchrun --nproc-per-node 2 -m slime_corr.models.check --hf-checkpoint DIR [--seq-len 32]
    python -m slime_corr.models.check --model smollm2-135m

Prints, in fp32: the max |logit difference| of the Megatron model against HF with eager attention (the op order
of Megatron's local attention) and with SDPA, whether Megatron -> HF export reproduces the checkpoint bitwise, and
the gap between log-probs of tokens HF sampled (KV-cache decoding) and Megatron's teacher-forced log-probs of them.
The tests call the same functions.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from slime_corr.device import init_distributed
from slime_corr.flags.model import add_model_args
from slime_corr.mcore.cpu_compat import apply_cpu_compat
from slime_corr.mcore.logprobs import vocab_parallel_log_probs
from slime_corr.models.bridge import MegatronHFBridge
from slime_corr.models.hf_checkpoint import load_hf_causal_lm
from slime_corr.models.selection import parse_model_source
from slime_corr.models.tokenizer import ChatTokenizer


def megatron_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [B, T, V] of a GPTModel on [B, T] ids (vocab shards gathered over TP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    pos = torch.arange(ids.size(1)).expand_as(ids)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, attention_mask=None)
        if ps.get_tensor_model_parallel_world_size() > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
    return logits


def max_logit_diff(model: nn.Module, hf_model: nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        ref = hf_model(input_ids=ids, use_cache=False).logits
    return (megatron_logits(model, ids) - ref).abs().max().item()


def round_trip_mismatches(bridge: MegatronHFBridge, model: nn.Module) -> list[str]:
    """HF names whose exported tensor is not bitwise the checkpoint's (plus names missing on either side)."""
    from safetensors import safe_open

    source: dict[str, torch.Tensor] = {}
    for f in sorted(bridge.hf_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            source.update({k: fh.get_tensor(k) for k in fh.keys()})
    exported = dict(bridge.export_weights(model))
    if bridge.spec.tie_word_embeddings:
        source.pop("lm_head.weight", None)
    bad = sorted(set(source) ^ set(exported))
    bad += [k for k in sorted(set(source) & set(exported))
            if source[k].dtype != exported[k].dtype or not torch.equal(source[k], exported[k])]
    return bad


@dataclass
class SampledLogProbs:
    tokens: list[int]
    sampled: torch.Tensor  # log_softmax(logits / T) at sampling time (HF, KV cache), as SGLang returns it
    hf_teacher_forced: torch.Tensor  # HF, one forward over prompt + response
    megatron_teacher_forced: torch.Tensor  # Megatron, one forward, vocab-parallel log-probs


def sample_and_rescore(model: nn.Module, hf_model: nn.Module, prompt: Sequence[int], max_new_tokens: int,
                       temperature: float, seed: int = 0) -> SampledLogProbs:
    """HF samples `max_new_tokens` (no top-k/top-p) and records each sampled token's log-prob; HF and Megatron then
    recompute them teacher-forced, each in one forward over prompt + response."""
    from megatron.core import parallel_state as ps

    ids = torch.tensor([list(prompt)])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = hf_model.generate(ids, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                max_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True,
                                pad_token_id=hf_model.config.eos_token_id)
    seq = out.sequences
    response = seq[0, ids.size(1):]
    sampled = torch.log_softmax(torch.stack([lg[0] for lg in out.logits]) / temperature, -1)
    sampled = sampled.gather(-1, response[:, None])[:, 0]
    tp_group = ps.get_tensor_model_parallel_group()
    if ps.get_tensor_model_parallel_world_size() > 1:  # the TP ranks must see the same tokens
        for t in (seq, sampled):
            dist.broadcast(t, src=dist.get_global_rank(tp_group, 0), group=tp_group)
        response = seq[0, ids.size(1):]
    with torch.no_grad():
        hf_logits = hf_model(input_ids=seq, use_cache=False).logits[0, ids.size(1) - 1 : -1]
        mc_logits = model(input_ids=seq, position_ids=torch.arange(seq.size(1))[None], attention_mask=None)
    hf_tf = torch.log_softmax(hf_logits / temperature, -1).gather(-1, response[:, None])[:, 0]
    mc_tf = vocab_parallel_log_probs(mc_logits[0, ids.size(1) - 1 : -1], response, temperature=temperature,
                                     tp_group=tp_group)
    return SampledLogProbs(response.tolist(), sampled, hf_tf, mc_tf)


def main(argv: list[str] | None = None) -> None:
    parser = add_model_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--seq-len", type=int, default=32, help="Tokens per sequence for the logit comparison.")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16, help="Tokens HF samples for the log-prob check.")
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args(argv)
    source = parse_model_source(parser, args)
    if not source.is_pretrained:
        parser.error("give --model or --hf-checkpoint")
    hf_dir = source.resolve()

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    init_distributed(device="cpu")  # the HF reference runs on the CPU: the Megatron model there too
    world = dist.get_world_size()
    apply_cpu_compat()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)

    bridge = MegatronHFBridge(hf_dir)
    model = bridge.build_model().eval()
    spec = bridge.spec
    ids = torch.randint(0, spec.vocab_size, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(0))
    say(f"{hf_dir}: {spec.model_type}, {spec.num_layers} layers, TP={world}, fp32, ids {tuple(ids.shape)}")
    for impl in ("eager", "sdpa"):
        diff = max_logit_diff(model, load_hf_causal_lm(hf_dir, attn_implementation=impl), ids)
        say(f"max |logits megatron - hf[{impl}]| = {diff:.3e}")
    bad = round_trip_mismatches(bridge, model)
    say(f"HF -> Megatron -> HF bitwise: {not bad}" + (f" (differ: {bad[:5]})" if bad else ""))
    tok = ChatTokenizer.from_pretrained(hf_dir)
    question = [{"role": "user", "content": "Name three colours of the rainbow."}]
    prompt = tok.chat_prompt_ids(question) if tok.has_chat_template else ids[0, :8].tolist()
    r = sample_and_rescore(model, load_hf_causal_lm(hf_dir), prompt, args.max_new_tokens, args.temperature)
    say(f"HF sampled {len(r.tokens)} tokens at T={args.temperature}: {tok.decode(r.tokens)!r}")
    say(f"  max |lp teacher-forced megatron - teacher-forced hf| = "
        f"{(r.megatron_teacher_forced - r.hf_teacher_forced).abs().max().item():.3e}")
    say(f"  max |lp teacher-forced megatron - sampled hf (KV cache)| = "
        f"{(r.megatron_teacher_forced - r.sampled).abs().max().item():.3e}")
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
