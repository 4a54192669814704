"""The main job needs nothing beyond the base install (`pip install .`, what `bash scripts/run.sh` installs).

The test environment has every extra (dev), so a module that only an extra brings in would pass every other test
and fail a new user's first command: safetensors did (the SGLang engine's weights are written as safetensors).
Here `python -m slime_corr.main` runs its default model and preset, one short rollout on the embedded engine, with
the top-level modules of every distribution that only an extra requires made unimportable, as on a machine without
them. The SGLang engine's checkpoint writer is not on that path (it needs a server): that safetensors comes with
the base install is checked on pyproject.toml itself.

CI cost: one one-process run (~10 s).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]

BLOCKER = """
import runpy, sys

class Hiding:  # a meta-path finder that does not see the blocked modules: they are not installed
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None
        return self.inner.find_spec(name, path, target)

sys.meta_path[:] = [Hiding(finder) for finder in sys.meta_path]
for name in [m for m in sys.modules if m.partition(".")[0] in BLOCKED]:
    del sys.modules[name]
sys.argv = ["slime_corr.main", *ARGS]
runpy.run_module("slime_corr.main", run_name="__main__", alter_sys=True)
"""


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def _closure(names: set[str]) -> set[str]:
    """`names` and every installed distribution they require, transitively (without their extras)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_name(text))
    return seen


def extras_only_modules() -> set[str]:
    """Top-level modules whose every installed distribution comes only with an extra of pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = _closure({_name(r) for r in project["dependencies"]})
    extras = {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs} - {"slime-corr"}
    only_extras = _closure(extras) - base
    return {module for module, dists in metadata.packages_distributions().items()
            if all(re.sub(r"[-_.]+", "-", d).lower() in only_extras for d in dists)}


def test_the_main_job_runs_without_the_extras(tmp_path):
    blocked = extras_only_modules()
    assert {"transformers", "pytest", "tensorboard"} <= blocked, sorted(blocked)  # the dev install has them
    assert "safetensors" not in blocked and "torch" not in blocked  # models.tiny_opt, the SGLang engine's weights
    args = ["--rollout-engine", "embedded", "--num-rollout", "1", "--rollout-progress", "none",
            "--work-dir", str(tmp_path / "run")]
    script = f"BLOCKED = {sorted(blocked)!r}\nARGS = {args!r}\n{BLOCKER}"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert (tmp_path / "run" / "metrics.jsonl").read_text().strip()
