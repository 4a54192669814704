"""AReaL's real code, from its PyPI wheel, for the tests that compare with it (as bench/vs_verl.py does for verl).

`pip download --no-deps areal==VERSION` once into the git-ignored `bench/.cache/areal/`; `areal_functions(names)`
then compiles the named top-level functions of one of its modules, exactly as the wheel has them, into a namespace
that holds torch (AReaL's package imports its whole trainer stack on import, which these functions do not use).

    from vs_areal import areal_functions
    m2po = areal_functions("areal/trainer/ppo/actor.py", ("_apply_m2po_masking", "_get_m2po_loss_mask"))
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import torch

AREAL_VERSION = "1.0.4"
CACHE = Path(__file__).resolve().parent / ".cache" / "areal"


def fetch_areal(version: str = AREAL_VERSION, cache: Path = CACHE) -> Path:
    """The AReaL wheel (downloaded once into `cache`)."""
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"areal-{version}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"areal=={version}",
                        "-d", str(cache)], check=True)
        wheels = sorted(cache.glob(f"areal-{version}-*.whl"))
    return wheels[-1]


def areal_functions(module_path: str, names: Iterable[str], version: str = AREAL_VERSION) -> SimpleNamespace:
    """The top-level functions `names` of the wheel's `module_path`, compiled from its source with torch in scope."""
    with zipfile.ZipFile(fetch_areal(version)) as wheel:
        source = wheel.read(module_path).decode()
    wanted = set(names)
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    missing = wanted - {node.name for node in tree.body}
    if missing:
        raise LookupError(f"areal {version} {module_path} has no {', '.join(sorted(missing))}")
    namespace: dict = {"torch": torch, "__name__": f"areal_{version}"}
    exec(compile(tree, f"areal-{version}/{module_path}", "exec"), namespace)  # AReaL's own code, unchanged
    return SimpleNamespace(version=version, **{name: namespace[name] for name in wanted})
