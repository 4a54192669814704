"""A tiny Qwen3-MoE checkpoint built in code (random weights), the Mixture-of-Experts model of the routing tests,
and the HF side's routes: which experts its routers pick for each token.

Qwen3-MoE's router: `probs = softmax(x @ W_gate^T)` over all experts, the `top_k` largest kept and renormalized
(`norm_topk_prob=True`, which equals Megatron's `moe_router_score_function="softmax"` with
`moe_router_pre_softmax=False`: top-k of the logits, then softmax over those k). No shared expert, no bias.
Served by SGLang with `--skip-tokenizer-init` (token ids in and out); the word-level tokenizer written beside the
weights ('t0' .. 't254', '</s>' = eos) only makes it a complete checkpoint for `read_hf_checkpoint`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass(frozen=True)
class TinyMoEArgs:
    """Sizes of the tiny Qwen3-MoE (every layer sparse). `vocab_size` 256: byte tokens, divisible by TP=2."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    intermediate_size: int = 96  # unused (no dense layer) but required by the config
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    seed: int = 0
    weight_std: float = 0.2  # std 0.02 init gives near-uniform logits and near-tied router scores
    tie_word_embeddings: bool = False  # tied: the checkpoint has no lm_head.weight (as Hugging Face saves one)

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"TinyMoEArgs: num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")


def tiny_moe_config(args: TinyMoEArgs):  # -> transformers.Qwen3MoeConfig
    from transformers import Qwen3MoeConfig

    fields = {k: v for k, v in asdict(args).items() if k not in ("seed", "weight_std")}
    return Qwen3MoeConfig(
        **fields, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        router_aux_loss_coef=0.0, output_router_logits=False, attention_bias=False, use_sliding_window=False,
        eos_token_id=args.vocab_size - 1, bos_token_id=None, pad_token_id=None,
        architectures=["Qwen3MoeForCausalLM"],
    )


def make_tiny_moe_checkpoint(out: str | os.PathLike[str], args: TinyMoEArgs = TinyMoEArgs()) -> Path:
    """Random-init `Qwen3MoeForCausalLM` of `args` (weights N(0, weight_std), norms U(0.5, 1.5)), saved with
    `save_pretrained` (safetensors, per-expert HF names) in `out`."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM(tiny_moe_config(args))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, args.weight_std)
    out = Path(out)
    model.save_pretrained(out)
    _word_tokenizer(out, args.vocab_size)
    cfg = json.loads((out / "config.json").read_text())
    if not cfg.get("architectures"):  # SGLang picks its model class by it
        cfg["architectures"] = ["Qwen3MoeForCausalLM"]
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _word_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {"</s>": vocab_size - 1}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="t0").save_pretrained(out)


def hf_router_logits(model: nn.Module, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the router (gate) logits `[batch, seq, num_experts]` of a teacher-forced HF forward of
    `input_ids` `[batch, seq]`, captured by forward hooks on each layer's `mlp.gate`."""
    layers = model.model.layers
    captured: list[torch.Tensor | None] = [None] * len(layers)
    hooks = []
    for i, layer in enumerate(layers):
        def hook(_mod, _inp, out, i=i):
            logits = out[0] if isinstance(out, tuple) else out
            captured[i] = logits.detach()
        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    b, s = input_ids.shape
    return [c.reshape(b, s, -1) for c in captured]  # type: ignore[union-attr]


def topk_routes(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Expert ids `[..., layers, top_k]` (int64), each row sorted ascending: the top-k set of each layer's logits
    (softmax is monotone, so top-k of the logits = top-k of the probabilities)."""
    ids = torch.stack([lg.topk(top_k, dim=-1).indices for lg in router_logits], dim=-2)
    return ids.sort(dim=-1).values


__all__ = ["TinyMoEArgs", "tiny_moe_config", "make_tiny_moe_checkpoint", "hf_router_logits", "topk_routes"]
