"""Cyclic garbage collection at start-up: off while a process imports torch, Megatron and SGLang, then back on with
what the imports made frozen (`gc.freeze()`). In `python -m slime_corr.main` (slime_corr/main.py) and in the real
SGLang server's main process on CPU (slime_corr/engines/sglang_cpu/sitecustomize.py: frozen right before it forks its
scheduler, on in the parent and the child); never in a process that only imports the package (a library user's),
nor in another interpreter the server's environment starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from slime_corr.engines.sglang_server import CPU_STAND_INS

ROOT = Path(__file__).resolve().parents[1]
MARK = "gc-state "  # the lines the processes report on: MARK + JSON
GC_STATE = f"import gc, json; print({MARK!r} + json.dumps([gc.isenabled(), gc.get_freeze_count()]))"


def _python(*args: str, pythonpath: str = str(ROOT)) -> list:
    """The MARK lines of `python ARGS` run with PYTHONPATH = `pythonpath`."""
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": pythonpath})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line[len(MARK):]) for line in proc.stdout.splitlines() if line.startswith(MARK)]


def test_the_main_job_collects_again_after_its_imports_with_them_frozen():
    (enabled, frozen), = _python("-c",  # the job's code as `python -m` runs it, to its --help (after every import)
        "import runpy, sys\nsys.argv = ['slime_corr.main', '--help']\ntry:\n"
        "    runpy.run_module('slime_corr.main', run_name='__main__', alter_sys=True)\nexcept SystemExit:\n"
        f"    pass\n{GC_STATE}")
    assert enabled and frozen > 100_000, (enabled, frozen)


def test_importing_the_main_job_as_a_library_leaves_collection_alone():
    (enabled, frozen), = _python("-c", f"import slime_corr.main\n{GC_STATE}")
    assert enabled and frozen == 0, (enabled, frozen)


def test_the_sglang_server_process_freezes_its_imports_before_it_forks(tmp_path):
    """A stand-in `sglang.launch_server` (this test's, in place of the real server: what is tested is the
    interpreter start-up the launcher gives every server) reports the collector's state before its first fork, in
    the child, and in the parent after it."""
    server = tmp_path / "sglang"
    server.mkdir()
    (server / "__init__.py").write_text("")
    (server / "launch_server.py").write_text(
        f"import gc, json, os\nMARK = {MARK!r}\n"
        "state = {'imports': [gc.isenabled(), gc.get_freeze_count()]}\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    print(MARK + json.dumps({'child': [gc.isenabled(), gc.get_freeze_count()]}), flush=True)\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "state['parent'] = [gc.isenabled(), gc.get_freeze_count()]\n"
        "pid = os.fork()\n"  # a later fork freezes nothing more
        "if pid == 0:\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "state['later'] = [gc.isenabled(), gc.get_freeze_count()]\n"
        "print(MARK + json.dumps(state))\n")
    paths = f"{CPU_STAND_INS}:{tmp_path}:{ROOT}"
    child, parent = _python("-m", "sglang.launch_server", pythonpath=paths)
    assert parent["imports"] == [False, 0], parent  # no collection (and nothing frozen) while it imports
    (enabled, frozen), (child_enabled, child_frozen) = parent["parent"], child["child"]
    assert enabled and child_enabled and frozen > 1000 and child_frozen > 1000, (child, parent)
    assert parent["later"] == [True, frozen], parent
    (enabled, frozen_helper), = _python("-c", GC_STATE, pythonpath=paths)  # another interpreter with that environment
    assert enabled and frozen_helper == 0
