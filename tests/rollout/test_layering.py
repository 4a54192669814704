"""The rollout layer must not pull in Megatron, the correction layer, or sglang (the router runs as a process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_rollout_imports_no_megatron_nor_correction():
    code = (
        "import importlib, pkgutil, sys\n"
        "import slime_corr.rollout as pkg\n"
        "names = [m.name for m in pkgutil.iter_modules(pkg.__path__)]\n"
        "assert {'client', 'control', 'local_engine', 'router', 'weight_sync'} <= set(names), names\n"
        "for name in names:\n"
        "    importlib.import_module(f'slime_corr.rollout.{name}')\n"
        "bad = [m for m in sys.modules if m.startswith(('megatron', 'slime_corr.correction', 'transformers',\n"
        "                                              'sglang'))]\n"
        "assert not bad, bad\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=root)
