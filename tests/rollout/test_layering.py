"""The rollout layer (the client side) must not pull in Megatron, the correction layer, sglang, or the engines: the
embedded engine and the SGLang launcher live in `slime_corr.engines`, which may use the client's protocol, never the
other way round."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_rollout_imports_no_megatron_nor_correction_nor_engines():
    code = (
        "import importlib, pkgutil, sys\n"
        "import slime_corr.rollout as pkg\n"
        "names = [m.name for m in pkgutil.iter_modules(pkg.__path__)]\n"
        "assert {'client', 'control', 'weight_sync', 'rollout'} <= set(names), names\n"
        "assert not any(n.startswith(('engine', 'local_engine', 'router')) for n in names), names\n"
        "for name in names:\n"
        "    importlib.import_module(f'slime_corr.rollout.{name}')\n"
        "bad = [m for m in sys.modules if m.startswith(('megatron', 'slime_corr.correction', 'transformers',\n"
        "                                              'sglang', 'slime_corr.engines'))]\n"
        "assert not bad, bad\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=root)


def test_engines_import_without_megatron():
    """The engines package (both engines, the router, the launcher) imports without Megatron or sglang."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import slime_corr.engines as pkg\n"
        "for m in pkgutil.walk_packages(pkg.__path__, 'slime_corr.engines.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = [m for m in sys.modules if m.startswith(('megatron', 'sglang'))]\n"
        "assert not bad, bad\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=root)
