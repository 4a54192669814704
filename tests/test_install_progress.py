"""No install is silent for more than ~30 s (scripts/pip_quiet.sh's `install_step`, which scripts/setup_env.sh and
setup_sglang.sh run each pip step through): a line as a step starts, one every INSTALL_TICK_S seconds while it runs,
one with its time when it ends, all on stderr; stdout (the python path the scripts print) stays clean, the caller's
pipes close when the step ends (no sleeping ticker left holding them), and a failing step's status is its own."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_long_install_step_says_what_it_does_while_it_runs() -> None:
    script = f"""source {ROOT / 'scripts' / 'pip_quiet.sh'}
install_step "setup" "a slow step (~1 MB)" sleep 2.5
install_step "setup" "a failing step" false || echo "status $?"
"""
    start = time.monotonic()
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "INSTALL_TICK_S": "1"})
    elapsed = time.monotonic() - start
    assert proc.stdout == "status 1\n" and elapsed < 30, (proc.stdout, elapsed)  # a ticker left behind: 60 s
    lines = proc.stderr.splitlines()
    assert lines[0] == "setup: a slow step (~1 MB) ..."
    assert sum(line.startswith("setup: a slow step (~1 MB): still installing (") for line in lines) >= 2, lines
    assert any(line.startswith("setup: a slow step (~1 MB): done in ") for line in lines), lines
    assert "setup: a failing step ..." in lines and not any("a failing step: done" in line for line in lines)
