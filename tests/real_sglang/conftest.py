"""Fixtures for the tests against the REAL SGLang server (sglang 0.5.23 on CPU, installed by
scripts/setup_sglang.sh into .venv-sglang/; scripts/test.sh installs it while the first tests run, and
`sglang_python` waits for that install to end).

A tiny model's server takes ~1 GB (PSS) and ~10 CPU-s to start (docs/engines.md): servers are shared by the
modules of the run (`shared_servers`, one per spec name) or by the tests of a module (`launch`), and stopped by their
PID.
Without an SGLang install the tests skip with the reason on a developer machine, and FAIL under CI (CI=true): CI
must run them.

The tiny model's checkpoints are written the way the trainer writes them: the Megatron GPTModel of a seed, exported
as the HF OPT checkpoint it equals (`slime_corr.models.tiny_opt`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

from slime_corr.engines.group import _enter_all
from slime_corr.engines.launch import engine_device
from slime_corr.engines.sglang_server import (
    SGLangLaunchError,
    SGLangServerConfig,
    launch_sglang_server,
    sglang_python,
    stop_process_group,
)
from tests.real_sglang.sglang_helpers import ServerSpec, restore, server_group

SEEDS = {"v0": 1234, "v1": 4321}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:  # `pytest -m sglang` selects them (scripts/gpu_check.sh)
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.sglang)


def _unavailable(msg: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{msg} (CI must run the real-SGLang tests: scripts/test.sh installs the server)")
    pytest.skip(msg)


@pytest.fixture(scope="session")
def sglang_py() -> str:
    try:
        return sglang_python()
    except SGLangLaunchError as e:
        _unavailable(str(e))
        raise


def _export_tiny(rank: int, world: int, out: Path) -> None:
    from slime_corr.mcore.model import TinyGPTArgs, build_tiny_gpt
    from slime_corr.mcore.params import full_named_tensors
    from slime_corr.models.tiny_opt import opt_weights, write_opt_checkpoint
    from tests.mcore.mcore_helpers import init_layout

    init_layout(1, 1)
    for version, seed in SEEDS.items():
        args = TinyGPTArgs(vocab_size=256, seed=seed)
        named = dict(full_named_tensors(build_tiny_gpt(args, ddp=False)))
        write_opt_checkpoint(dict(opt_weights(named.items(), args.num_attention_heads)), args, out / version)
        torch.save(named, out / version / "megatron.pt")


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """{version: OPT checkpoint dir} of the tiny model at two seeds (v0, v1), with the Megatron weights beside."""
    from tests.mcore.mcore_helpers import run_in_process

    out = tmp_path_factory.mktemp("tiny_opt")
    run_in_process(_export_tiny, out)
    return {v: str(out / v) for v in SEEDS}


def _start(stack: contextlib.ExitStack, logs: Path, sglang_py: str, specs: tuple[ServerSpec, ...]) -> list:
    """Start `specs` concurrently; each is stopped (by PID) when `stack` closes."""
    managers = [launch_sglang_server(SGLangServerConfig(
        model_path=s.model_path, python=sglang_py, dtype=s.dtype, device=engine_device(), skip_tokenizer_init=True,
        weight_version="v0", extra_args=s.extra_args, log_dir=logs, startup_timeout=600), name=s.name)
        for s in specs]
    return _enter_all(stack, managers)


@pytest.fixture(scope="module")
def launch(sglang_py: str, tmp_path_factory: pytest.TempPathFactory):
    """`launch(ServerSpec(...), ...)` -> running real SGLang servers, started concurrently, stopped (by PID) at
    the end of the module: for a server the module alone uses (or kills)."""
    with contextlib.ExitStack() as stack:
        logs = tmp_path_factory.mktemp("sglang_logs")
        yield lambda *specs: _start(stack, logs, sglang_py, specs)


class SharedServers:
    """Real SGLang servers shared by the modules of the run, one per spec name (module doc of `shared_servers`)."""

    def __init__(self, stack: contextlib.ExitStack, logs: Path, sglang_py: str) -> None:
        self.stack, self.logs, self.sglang_py = stack, logs, sglang_py
        self.running: dict[str, tuple[ServerSpec, object]] = {}

    def __call__(self, *specs: ServerSpec) -> list:
        for spec in specs:
            if spec.name in self.running and self.running[spec.name][0] != spec:
                raise ValueError(f"shared server {spec.name!r}: asked as {spec}, running as "
                                 f"{self.running[spec.name][0]}")
        missing = tuple(s for s in specs if s.name not in self.running)
        for spec, server in zip(missing, _start(self.stack, self.logs, self.sglang_py, missing) if missing else [],
                                strict=True):
            self.running[spec.name] = (spec, server)
        for spec in specs:
            restore(self.running[spec.name][1].url, spec.model_path, "v0")
        return [self.running[s.name][1] for s in specs]

    def stop_all(self) -> None:
        """Stop every server (~1 GB each, and a group's servers are not needed after its last module)."""
        while self.running:
            stop_process_group(self.running.popitem()[1][1].proc)


@pytest.fixture(scope="session")
def shared_servers(sglang_py: str, tmp_path_factory: pytest.TempPathFactory):
    """`shared_servers(ServerSpec(...), ...)` -> running real SGLang servers shared by the modules of a group
    (sglang_helpers.SERVER_GROUPS: one pytest worker runs them one after the other, tests/conftest.py), one per spec
    name, started the first time a module asks (concurrently) and stopped after the group's last module
    (`pytest_runtest_teardown`). Handed out as a fresh server would be: the spec's checkpoint loaded again under
    weight version "v0" if a module before left other weights (a weight update or a main job's sync), and no
    throttle (`/slow_down`). A module that kills or reconfigures its server takes it from `launch` instead."""
    global _pool
    with contextlib.ExitStack() as stack:
        _pool = SharedServers(stack, tmp_path_factory.mktemp("sglang_shared_logs"), sglang_py)
        try:
            yield _pool
        finally:
            _pool = None


_pool: SharedServers | None = None  # the run's, once a module asked for one


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test of a server group (the next test this worker runs is not in it), stop its servers."""
    if _pool is not None and (nextitem is None or server_group(nextitem.nodeid) != server_group(item.nodeid)):
        _pool.stop_all()
