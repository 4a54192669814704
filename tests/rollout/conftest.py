"""Shared fixtures: a tiny checkpoint, a running local engine, and SGLang's own API schema module."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from slime_corr.engines.embedded.engine import start_local_engine
from slime_corr.engines.embedded.model import create_tiny_checkpoint
from slime_corr.engines.router import router_available

SGLANG_VERSION = "0.5.23"
API_TYPES = "sglang/api/v1/api_types.py"


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "v0"), seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_v1(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "v1"), seed=1)


@pytest.fixture(scope="module")
def engine(tiny_ckpt: str):
    """A bf16 local engine on 127.0.0.1 (cumulative streaming), shared by a test module."""
    with start_local_engine(tiny_ckpt) as handle:
        yield handle


def _cache_dir() -> Path:
    env = os.environ.get("SLIME_CORR_TEST_CACHE")
    return Path(env) if env else Path(__file__).resolve().parents[1] / ".cache"


def _installed_api_types() -> Path | None:
    """The file from an installed sglang 0.5.23 (e.g. ``pip install --no-deps sglang==0.5.23``), not imported."""
    try:
        from importlib.metadata import version

        if version("sglang") != SGLANG_VERSION:
            return None
        spec = importlib.util.find_spec("sglang")  # locates the package without running its __init__
    except Exception:  # noqa: BLE001 - not installed
        return None
    roots = list(spec.submodule_search_locations or []) if spec else []
    path = Path(roots[0]).parent / API_TYPES if roots else None
    return path if path is not None and path.is_file() else None


def _unavailable(msg: str) -> None:
    """Skip on a developer machine without PyPI; under CI (CI=true) the conformance tests must run: fail."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{msg} (CI must run the SGLang conformance tests)")
    pytest.skip(msg)


def require_router() -> None:
    """Skip without sglang-router on a developer machine; under CI (which installs the dev extra) fail."""
    if not router_available():
        _unavailable("sglang-router is not installed (pip install -e .[dev])")


@pytest.fixture(scope="session")
def api_types():
    """sglang 0.5.23's ``sglang/api/v1/api_types.py`` (needs only msgspec), never stored in the repo.

    Taken from an installed sglang 0.5.23 if there is one, else from the wheel that ``pip download --no-deps``
    fetches from PyPI once into the test cache (``tests/.cache`` or ``$SLIME_CORR_TEST_CACHE``); only that
    one file is kept. Without PyPI it skips, except under CI where it fails.
    """
    try:
        import msgspec  # noqa: F401
    except ImportError:
        _unavailable("msgspec is needed to load SGLang's API schema (pip install -e .[dev])")
    cache = _cache_dir() / f"sglang-{SGLANG_VERSION}"
    target = _installed_api_types() or cache / "api_types.py"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        wheels = list(cache.glob("sglang-*.whl"))
        errors = []
        pips = [[sys.executable, "-m", "pip"]] + ([[shutil.which("pip")]] if shutil.which("pip") else [])
        for pip in pips:  # a venv without pip (e.g. made by uv) falls back to the pip on PATH
            if wheels:
                break
            proc = subprocess.run([*pip, "download", "--no-deps", f"sglang=={SGLANG_VERSION}", "-d", str(cache),
                                   "-q"], capture_output=True, text=True, timeout=300)
            wheels = list(cache.glob("sglang-*.whl"))
            errors.append(proc.stderr.strip()[-300:])
        if not wheels:
            _unavailable(f"cannot download sglang=={SGLANG_VERSION} from PyPI to check conformance: {errors}")
        with zipfile.ZipFile(wheels[0]) as zf:
            tmp = target.with_suffix(".tmp")
            tmp.write_bytes(zf.read(API_TYPES))
            tmp.replace(target)
        for w in wheels:  # keep only the one file
            w.unlink()
    spec = importlib.util.spec_from_file_location("sglang_api_types_v1", target)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
