"""examples/slime/call_like_slime.py runs and its veto rejects the sequence it says it does."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_example_runs():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "slime" / "call_like_slime.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert "kept tokens per sample [5, 0, 3, 6]" in out.stdout
    assert "mis_rs_catastrophic_seq_fraction = 0.25" in out.stdout
