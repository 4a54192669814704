"""The tiny Megatron GPTModel as a Hugging Face OPT checkpoint, the form the real SGLang server serves it in.

The tiny model (`slime_corr.mcore.model`: pre-LayerNorm, learned absolute positions, exact GELU MLP, biases,
untied output layer, byte tokens) is exactly HF's `OPTForCausalLM` with `do_layer_norm_before=True`,
`activation_function="gelu"`, `tie_word_embeddings=False`: SGLang 0.5.23 serves it through its `OPTForCausalLM`
(`--skip-tokenizer-init`: requests carry `input_ids`, so no tokenizer files are needed). The names map one to one
except two:

- Megatron's fused `linear_qkv` holds, per attention head, that head's q, k and v rows in turn; OPT has separate
  `q_proj`, `k_proj`, `v_proj`;
- OPT looks position p up at row p + 2 of `embed_positions` (an offset kept from fairseq): rows 0 and 1 are unused.

`opt_weights` converts (name, tensor) pairs as they stream from the trainer (disk and distributed sync alike),
`write_opt_checkpoint` writes the folder `/update_weights_from_disk` and `--model-path` take.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

OPT_POSITION_OFFSET = 2
WEIGHTS_FILE = "model.safetensors"

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_LAYER_NAMES = {
    "input_layernorm": "self_attn_layer_norm",
    "self_attention.linear_proj": "self_attn.out_proj",
    "pre_mlp_layernorm": "final_layer_norm",
    "mlp.linear_fc1": "fc1",
    "mlp.linear_fc2": "fc2",
}


def opt_config(model_args: Any) -> dict[str, Any]:
    """config.json of the OPT form of the tiny model (`mcore.model.TinyGPTArgs`)."""
    return {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "vocab_size": model_args.vocab_size,
        "hidden_size": model_args.hidden_size,
        "word_embed_proj_dim": model_args.hidden_size,
        "num_hidden_layers": model_args.num_layers,
        "num_attention_heads": model_args.num_attention_heads,
        "ffn_dim": 4 * model_args.hidden_size,  # Megatron's default ffn_hidden_size
        "max_position_embeddings": model_args.max_position_embeddings,
        "do_layer_norm_before": True,
        "_remove_final_layer_norm": False,
        "activation_function": "gelu",
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "tie_word_embeddings": False,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "layerdrop": 0.0,
        # byte tokens: no special token; EOS never ends a response (the embedded engine has none either)
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": "float32",
    }


def opt_weights(named: Iterable[tuple[str, Tensor]], num_attention_heads: int) -> Iterator[tuple[str, Tensor]]:
    """The tiny model's (Megatron name, full tensor) pairs as (OPT name, tensor) pairs."""
    for name, t in named:
        if name == "embedding.word_embeddings.weight":
            yield "model.decoder.embed_tokens.weight", t
        elif name == "embedding.position_embeddings.weight":
            yield "model.decoder.embed_positions.weight", torch.cat([t.new_zeros(OPT_POSITION_OFFSET, t.shape[1]), t])
        elif name.startswith("decoder.final_layernorm."):
            yield "model.decoder.final_layer_norm." + name.rsplit(".", 1)[1], t
        elif name == "output_layer.weight":
            yield "lm_head.weight", t
        elif (m := _LAYER.fullmatch(name)) is not None:
            layer, rest = m.groups()
            module, kind = rest.rsplit(".", 1)
            prefix = f"model.decoder.layers.{layer}."
            if module == "self_attention.linear_qkv":
                q, k, v = t.reshape(num_attention_heads, 3, -1, *t.shape[1:]).unbind(1)
                for proj, part in zip("qkv", (q, k, v), strict=True):
                    yield f"{prefix}self_attn.{proj}_proj.{kind}", part.reshape(-1, *t.shape[1:])
            elif module in _LAYER_NAMES:
                yield f"{prefix}{_LAYER_NAMES[module]}.{kind}", t
            else:
                raise KeyError(f"tiny model weight {name!r} has no OPT counterpart")
        else:
            raise KeyError(f"tiny model weight {name!r} has no OPT counterpart")


def write_opt_checkpoint(weights: dict[str, Tensor], model_args: Any, directory: str | Path) -> str:
    """Write `weights` (OPT names, from `opt_weights`) with the OPT config of `model_args` in `directory`
    (config.json + model.safetensors, the weights renamed into place: a server never reads half a file); returns
    the directory."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(opt_config(model_args), indent=1))
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file({n: t.detach().to("cpu", torch.float32).contiguous() for n, t in weights.items()}, str(tmp),
              metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_FILE)
    return str(out)


__all__ = ["OPT_POSITION_OFFSET", "opt_config", "opt_weights", "write_opt_checkpoint"]
