"""The rollout layer must not pull in Megatron or the correction layer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_rollout_imports_no_megatron_nor_correction():
    code = (
        "import sys\n"
        "import slime_corr.rollout.batching, slime_corr.rollout.buffer, slime_corr.rollout.client\n"
        "import slime_corr.rollout.local_engine, slime_corr.rollout.rollout\n"
        "bad = [m for m in sys.modules if m.startswith(('megatron', 'slime_corr.correction', 'transformers'))]\n"
        "assert not bad, bad\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=root)
