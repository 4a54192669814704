"""A Python environment without some of the test run's packages, for following an install hint for real: a fresh
venv (`venv`, with pip) that sees this run's site-packages, less the distributions named, through a folder of links
(`site.addsitedir`, so their `.pth` files, slime_corr's editable finder included, work there too).

What the hint says to install is then installed into that venv by its own pip (from the same indexes this machine's
pip configuration names), and the original command runs again with that venv's python: nothing of the test run's
environment changes. The venv is the test's, in its tmp_path.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sysconfig
import venv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PIP_TIMEOUT_S = 600  # a bound on one followed pip command (local indexes: seconds to a minute)


def _top_level_entries(distribution: str) -> set[str]:
    """The site-packages entries (packages, modules, dist-info) an installed distribution owns."""
    files = importlib.metadata.distribution(distribution).files or []
    return {str(f).split("/")[0] for f in files} - {"..", "__pycache__"}


@dataclass(frozen=True)
class BareEnv:
    """A venv at `root` whose python lacks some distributions (`make_bare_env`) and sees everything else of this
    run."""

    root: Path

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    def env(self) -> dict[str, str]:
        """This process's environment with the venv's bin first on PATH (so a hint's `pip` is the venv's)."""
        env = dict(os.environ, PATH=f"{self.root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
                   VIRTUAL_ENV=str(self.root), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        env.pop("PYTHONHOME", None)
        return env

    def run(self, argv: Sequence[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        """`argv` with the venv's python in place of `python` (argv[0])."""
        argv = [self.python if argv[0] == "python" else argv[0], *argv[1:]]
        return subprocess.run(argv, cwd=cwd, env=self.env(), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def follow(self, command: str, cwd: Path) -> subprocess.CompletedProcess:
        """A hint's shell command (`pip install ...`) as the user would type it, in the venv."""
        if not re.fullmatch(r"pip install [-\w.=<>' \[\],]+", command):
            raise ValueError(f"not a pip command a hint may give: {command!r}")
        return subprocess.run(["bash", "-c", command], cwd=cwd, env=self.env(), capture_output=True, text=True,
                              timeout=PIP_TIMEOUT_S, stdin=subprocess.DEVNULL)


def make_bare_env(root: Path, hidden: Sequence[str]) -> BareEnv:
    """A venv at `root` that sees this run's site-packages except the distributions in `hidden`."""
    shared = root.with_name(root.name + "-site")
    shared.mkdir(parents=True)
    site_packages = Path(sysconfig.get_paths()["purelib"])
    left_out = set().union(*(_top_level_entries(d) for d in hidden))
    for entry in site_packages.iterdir():
        if entry.name not in left_out:
            (shared / entry.name).symlink_to(entry)
    venv.create(root, with_pip=True, symlinks=True)
    purelib = subprocess.run([str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "zz_test_run_site.pth").write_text(f"import site; site.addsitedir({str(shared)!r})\n")
    bare = BareEnv(root)
    for distribution in hidden:
        probe = bare.run(["python", "-c", f"import importlib.metadata as m; m.version({distribution!r})"],
                         cwd=root, timeout=60)
        assert probe.returncode != 0, f"{distribution} is still installed in the bare env"
    return bare


def pip_commands(message: str) -> list[str]:
    """The `pip install ...` commands a message tells the user to run, in order, without the alternatives it offers
    in parentheses (`(or pip install ...)`, for another environment): each runs up to a comma, ` in the ` (the
    folder it is run in), a parenthesis or the end of its sentence."""
    main_text = re.sub(r"\(or pip install[^)]*\)", "", message)
    return [m.strip() for m in re.findall(r"pip install .+?(?=,| in the |\(|\)|\.\s|\.$|$)", main_text)]


__all__ = ["BareEnv", "make_bare_env", "pip_commands"]
