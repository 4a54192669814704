"""Every main-job command line of the README and the docs pages runs as written (with `--num-rollout 1` in place of
its own and a `--run-dir` appended; commands that differ only in their --num-rollout run once), the torchrun ones
included: the commands are read from README.md and docs/*.md (`doc_pages`), so an edited page is tested as it
reads.

The engine: the main job's command (`bash scripts/run.sh`), the tensor-parallel one (its TP shards are gathered into
the weights the server loads), those that name `--rollout-engine` and the pretrained ones (marked slow) run on the
engine they get as written (the real SGLang server by default). The others (DP, CP, async) also get
`--rollout-engine embedded`: what they add is the trainer's layout, and a real server per command (~1 GB, ~10 s of
start-up, two at a time next to torchrun ranks) made this test the longest in CI.

`PY` points the scripts at this interpreter (no install); `torchrun` is this interpreter's. Commands that train a
pretrained model download nothing but take minutes on CPU: marked slow. Two commands run at a time.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.cost(240)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
JOB = re.compile(r"^(bash scripts/(run|launch_torchrun)\.sh|torchrun .*-m slime_corr\.main|python -m slime_corr\.main)")


def doc_pages() -> list[Path]:
    """README.md first (its first command is the main job's), then the docs pages in name order; docs/flags.md is
    left out: generated from the parser, it names modules (`python -m slime_corr.main`'s parser), not commands."""
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "flags.md")]


def readme_commands() -> list[str]:
    """The main-job command lines of README.md and the docs pages: lines of ```bash blocks (continuations joined,
    comments dropped) and inline `code` spans outside tables (a table row says what a script such as gpu_check.sh
    runs, not a command to type); placeholders (`...`, /path/to, a `$VARIABLE` an operator sets per node) left out."""
    lines: list[str] = []
    for page in doc_pages():
        text = page.read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            lines += [re.sub(r"\s+#.*$", "", line).strip() for line in block.replace("\\\n", " ").splitlines()]
        prose = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("|"))
        lines += re.findall(r"`([^`\n]+)`", prose)
    commands = [re.sub(r"\s+", " ", c) for c in lines if JOB.match(c) and "..." not in c and "/path/to" not in c
                and not re.search(r"\$[A-Z_]+", c)]
    return list(dict.fromkeys(commands))


def _env() -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    return {**os.environ, "PY": sys.executable, "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def _engine_flags(command: str) -> str:
    """` --rollout-engine embedded` for the commands that do not run on their own engine (module doc)."""
    as_written = (command == "bash scripts/run.sh" or "--tensor-model-parallel-size" in command
                  or "--rollout-engine" in command or _pretrained(command))
    return "" if as_written else " --rollout-engine embedded"


def _as_run(command: str) -> str:
    """The command line the test runs for `command`: its own `--num-rollout N` dropped (the test's
    `--num-rollout 1` replaces it), `_engine_flags` added. Commands that differ only in their --num-rollout run once."""
    return re.sub(r" --num-rollout \d+", "", command) + _engine_flags(command)


def _run(command: str, run_dir: Path) -> subprocess.CompletedProcess:
    full = f"{_as_run(command)} --num-rollout 1 --run-dir {run_dir}"
    return subprocess.run(full, shell=True, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)


def _run_all(commands: list[str], tmp_path: Path) -> dict:
    """{command: its process}, two at a time (the next starts when one ends); of commands that run the same line
    (`_as_run`), the first. The i-th command's run directory is `tmp_path / f"run{i}"`."""
    first: dict[str, str] = {}
    for command in commands:
        first.setdefault(_as_run(command), command)
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {c: pool.submit(_run, c, tmp_path / f"run{i}") for i, c in enumerate(first.values())}
    return {c: run.result() for c, run in runs.items()}  # a command that timed out raises here


def _pretrained(command: str) -> bool:
    return "--model" in command or "--hf-checkpoint" in command


def test_the_readme_lists_the_launches_it_documents():
    commands = readme_commands()
    for expected in ("bash scripts/run.sh", "bash scripts/run.sh --num-rollout 4 --async-rollout",
                     "bash scripts/launch_torchrun.sh 2 --num-rollout 3",
                     "bash scripts/launch_torchrun.sh 4 --tensor-model-parallel-size 2",
                     "torchrun --nproc-per-node 2 -m slime_corr.main --rollout-correction-preset"):
        assert any(c.startswith(expected) for c in commands), (expected, commands)


def test_every_readme_command_runs_as_written(tmp_path):
    commands = [c for c in readme_commands() if not _pretrained(c)]
    results = _run_all(commands, tmp_path)
    failures = []
    for command, proc in results.items():
        ok = proc.returncode == 0 and re.search(r"^step 1: trained=\d+ failed=0 ", proc.stdout, re.M)
        if not ok or "Traceback" in proc.stderr:
            failures.append(f"{command}: exit {proc.returncode}\n{proc.stdout[-1500:]}\n{proc.stderr[-2500:]}")
    assert not failures, "\n\n".join(failures)
    # the main job's command launched a real SGLang server and stopped it: its port (first line of its log, the
    # server's command) no longer answers
    main_job = tmp_path / "run0"
    assert "SGLang servers (bfloat16" in results["bash scripts/run.sh"].stdout
    logs = sorted((main_job / "engine_logs").glob("sglang-*.log"))
    assert len(logs) == 1, logs
    port = int(logs[0].read_text().split("--port ", 1)[1].split()[0])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    report = subprocess.run(["slime-corr", "report", str(main_job)], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]


@pytest.mark.slow
def test_every_pretrained_readme_command_runs_as_written(tmp_path):
    commands = [c for c in readme_commands() if _pretrained(c)]
    assert commands
    for command, proc in _run_all(commands, tmp_path).items():
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-1500:]}\n{proc.stderr[-2500:]}"
