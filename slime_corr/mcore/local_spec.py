"""Megatron-Core's local layer spec (no TransformerEngine, no apex), completed with two things TE provides.

- **Packed (THD) rows.** Megatron-Core runs a packed row (`PackedSeqParams(qkv_format="thd")`: several samples one
  after the other in one `[T, 1, H]` row) through TE's attention only; the local `DotProductAttention` asserts that
  `packed_seq_params` is None. The rest of the THD path is plain torch and runs unchanged: rotary embeddings
  restart at each sample (`apply_rotary_pos_emb(..., cu_seqlens=...)`), the MLP / MoE layers see T tokens.
  `PackedDotProductAttention` is the local attention that also takes THD input: causal within each sample of
  `cu_seqlens_q_padded`, nothing across samples (a block-diagonal causal mask), as TE computes it.
- **Sequence parallelism** (which Megatron requires for MoE with TP > 1). The torch norms of the local spec
  (`WrappedTorchNorm`) assert `not config.sequence_parallel`, though a per-token norm is exact on a sequence
  shard; what SP needs is that the norm weights' gradients, partial on each TP rank, are summed over TP, which
  `finalize_model_grads` does for parameters marked `sequence_parallel`. `allow_sequence_parallel_norms()` makes
  `WrappedTorchNorm` build its norm and mark its parameters so (idempotent; the layers and the block's final norm
  all use that class when apex is absent).

`local_layer_spec(**kw)` is `get_gpt_layer_local_spec(**kw)` with that core attention; the tiny GPT (`mcore.model`)
and the HF-bridge models (`models.bridge`) are built with it.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor

from slime_corr.layout.context_parallel import block_causal_mask


class PackedDotProductAttention(DotProductAttention):
    """Megatron's local core attention, also for THD input (query/key/value `[T, heads, dim]`, one packed row)."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None) -> Tensor:
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if self.config.context_parallel_size > 1:
            raise NotImplementedError("PackedDotProductAttention runs whole packed rows: context parallelism on CPU "
                                      "is emulated (CP size 1 in the model's config, mcore.model.emulated_cp_forward)")
        p = packed_seq_params
        starts = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
        mask = block_causal_mask(starts, query.shape[0])
        # [T, heads, dim] -> one row [T, 1, heads, dim]; the caller reshapes the [T, 1, heads * dim] result
        return super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask,
                               attn_mask_type=attn_mask_type, attention_bias=attention_bias)


def local_layer_spec(**kwargs: Any) -> Any:
    """`get_gpt_layer_local_spec(**kwargs)` with `PackedDotProductAttention` as the core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(**kwargs)
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec


def allow_sequence_parallel_norms() -> None:
    """Let Megatron's `WrappedTorchNorm` run under sequence parallelism (see the module doc). Idempotent."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if getattr(WrappedTorchNorm, "_slime_corr_sequence_parallel", False):
        return
    build = WrappedTorchNorm.__new__

    def new(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False  # only for its assertion: the config object is the model's own
        try:
            norm = build(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel  # finalize_model_grads sums these over TP
        return norm

    WrappedTorchNorm.__new__ = staticmethod(new)  # type: ignore[method-assign]
    WrappedTorchNorm._slime_corr_sequence_parallel = True  # type: ignore[attr-defined]


__all__ = ["PackedDotProductAttention", "allow_sequence_parallel_norms", "local_layer_spec"]
