"""One launch interface for both engines: `start_engines(spec, checkpoint_dir)` starts `spec.num_engines` engines
of `spec.kind` serving `checkpoint_dir`, behind sglang-router when there are several (`spec.router`), and stops
them all on exit. The client side sees only URLs that speak SGLang's protocol.

- ``sglang``: real SGLang servers (`sglang_server`), each its own process group, logs in `spec.log_dir`; the
  checkpoint is a Hugging Face folder (the tiny model as OPT, see `slime_corr.models.tiny_opt`).
- ``embedded``: this package's engine (`embedded.engine`) in the trainer's process, serving the module that
  `spec.embedded_module(checkpoint_dir)` builds, in `spec.dtype`. `SLIME_CORR_EMBEDDED_STEP_DELAY` (seconds, for
  tests and demos) throttles its decoding steps, e.g. so that a weight update reaches requests in flight.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slime_corr.device import engine_device
from slime_corr.engines.embedded.engine import start_local_engine
from slime_corr.engines.embedded.model import TorchEngineModel
from slime_corr.engines.group import EngineGroup, start_engine_group
from slime_corr.engines.sglang_server import SGLangServerConfig, launch_sglang_server, sglang_python

ENGINE_KINDS = ("sglang", "embedded")
STEP_DELAY_ENV = "SLIME_CORR_EMBEDDED_STEP_DELAY"


@dataclass(frozen=True)
class EngineSpec:
    """What to start (see the module doc). `sglang_args` are SGLang server flags appended last."""

    kind: str = "sglang"
    num_engines: int = 1
    router: str = "auto"
    dtype: str = "bfloat16"
    served_model_name: str = "slime-corr-tiny"
    seed: int | None = None
    log_dir: Path = field(default_factory=lambda: Path("."))
    # sglang
    sglang_python: str | None = None
    sglang_args: tuple[str, ...] = ()
    skip_tokenizer_init: bool = False
    device: str = "cpu"  # SGLang's --device: `engine_device()`, slime_corr.device's decision
    # embedded
    embedded_module: Callable[[str], Any] | None = None
    tokenizer: Any = None


ROUTES_FLAG = "--enable-return-routed-experts"  # SGLang's; the embedded engine takes it from `sglang_args` too


@contextlib.contextmanager
def start_engines(spec: EngineSpec, checkpoint_dir: str, weight_version: str) -> Iterator[EngineGroup]:
    """Start the engines of `spec` serving `checkpoint_dir` as `weight_version`; stop them on exit."""
    if spec.kind not in ENGINE_KINDS:
        raise ValueError(f"--rollout-engine {spec.kind!r} is not one of {', '.join(ENGINE_KINDS)}")
    if spec.kind == "sglang":
        server = SGLangServerConfig(
            model_path=checkpoint_dir, python=sglang_python(spec.sglang_python), dtype=spec.dtype, device=spec.device,
            skip_tokenizer_init=spec.skip_tokenizer_init, served_model_name=spec.served_model_name,
            weight_version=weight_version, random_seed=spec.seed, extra_args=spec.sglang_args, log_dir=spec.log_dir)

        def make_engine(i: int) -> Any:
            return launch_sglang_server(server, name=f"sglang-{i}")
    else:
        if spec.embedded_module is None:
            raise ValueError("EngineSpec.embedded_module: the embedded engine needs the module it serves")
        dtype = getattr(torch, spec.dtype)

        def make_engine(i: int) -> Any:
            model = TorchEngineModel(checkpoint_dir, factory=spec.embedded_module, dtype=dtype)
            return start_local_engine(checkpoint_dir, model=model, weight_version=weight_version,
                                      tokenizer=spec.tokenizer, served_model_name=spec.served_model_name,
                                      step_delay=float(os.environ.get(STEP_DELAY_ENV, "0")),
                                      enable_return_routed_experts=ROUTES_FLAG in spec.sglang_args)

    with start_engine_group(spec.num_engines, make_engine, router=spec.router) as group:
        yield group


__all__ = ["ENGINE_KINDS", "ROUTES_FLAG", "EngineSpec", "engine_device", "start_engines"]
