"""One SGLang install at a time, and nothing uses one half-done: scripts/setup_sglang.sh holds its environment's
install lock (flock) to its end; a second run of the script waits for it, and so does a job that looks for the
server (`wait_for_install`). scripts/test.sh relies on it: the tests start while .venv-sglang still installs.

The lock is held here by this process (another open file description: flock locks conflict between them), as the
script holds it; the script itself runs with PYTHON=false, so that once it has the lock it stops at creating the
environment instead of installing anything."""

from __future__ import annotations

import fcntl
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from slime_corr.engines.sglang_server import INSTALL_LOCK, INSTALL_STAMP, SGLangLaunchError, wait_for_install

ROOT = Path(__file__).resolve().parents[1]


def _hold(venv: Path):
    venv.mkdir(parents=True, exist_ok=True)
    f = open(venv / INSTALL_LOCK, "w")  # held until the test closes it
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def _finish(held) -> None:
    """The install's end: its stamp written, then its lock released."""
    (Path(held.name).parent / INSTALL_STAMP).write_text("stamp\n")
    held.close()


def test_a_job_waits_for_an_install_in_progress(tmp_path, capsys):
    wait_for_install(tmp_path / "never-installed")  # no lock file (none, or an install older than the lock): at once
    held = _hold(tmp_path / "venv")
    threading.Timer(0.6, _finish, [held]).start()
    start = time.monotonic()
    wait_for_install(tmp_path / "venv")
    assert time.monotonic() - start >= 0.5
    assert f"waiting for scripts/setup_sglang.sh to finish installing SGLang into {tmp_path / 'venv'}" in (
        capsys.readouterr().err)
    wait_for_install(tmp_path / "venv")  # the lock file stays, unlocked: at once


def test_an_install_that_did_not_finish_is_an_error_naming_the_environment(tmp_path):
    _hold(tmp_path / "venv").close()  # a failed or stopped install: its lock released, no stamp
    with pytest.raises(SGLangLaunchError, match=rf"{tmp_path / 'venv'}: its install did not finish .*no "
                                                rf"{INSTALL_STAMP}\); install it with `bash scripts/setup_sglang.sh`"):
        wait_for_install(tmp_path / "venv")


def test_an_install_that_never_ends_is_an_error_naming_the_environment(tmp_path):
    held = _hold(tmp_path / "venv")
    try:
        with pytest.raises(SGLangLaunchError, match=rf"{tmp_path / 'venv'}: scripts/setup_sglang.sh has been "
                                                    r"installing SGLang there for over 0 s .*stop it and run it again"):
            wait_for_install(tmp_path / "venv", timeout=0.3)
    finally:
        held.close()


def test_the_script_waits_for_another_install_and_goes_on_when_it_ends(tmp_path):
    venv = tmp_path / "venv"
    held = _hold(venv)
    script = subprocess.Popen(["bash", "scripts/setup_sglang.sh"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "VENV": str(venv), "PYTHON": "false"})
    try:
        time.sleep(1.0)
        assert script.poll() is None, script.communicate()  # waits
    finally:
        held.close()
    _, err = script.communicate(timeout=60)
    assert f"scripts/setup_sglang.sh: waiting for another install into {venv} to end" in err
    assert script.returncode != 0 and not (venv / "bin").exists()  # went on once released: `false -m venv` failed
