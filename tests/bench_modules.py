"""The bench scripts (bench/*.py) as modules for the tests that reuse them.

bench/ is a folder of scripts (`python bench/vs_verl.py`) that import each other by bare name from their own
directory, not a package: a test loads one by its file path, once, as `bench_<name>` in sys.modules (dataclasses
look their module up there).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_module(name: str) -> ModuleType:
    """bench/NAME.py, executed the first time it is asked for."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]
