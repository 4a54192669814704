"""Suite-wide options: the device of the device-parametrized subset (`-m device`; everything else runs on the CPU), and
the order modules run in.

Scheduling: a module's tests stay in one worker (`--dist loadfile`: a module's servers and Megatron state), and so do
the modules of a real-SGLang server group (`pytest_xdist_make_scheduler`, tests/real_sglang/sglang_helpers.py), so
that the servers they share start once in the run. A worker beside one that runs a module that mostly waits
(`WAITING_MODULES`) takes the next module that computes, so that no core idles while two modules wait.

Order: modules marked `pytest.mark.cost(seconds)` (their rough CI time, subprocesses and servers included) run
first, longest first, then the rest in collection order; a module's own tests keep their order. scripts/test.sh runs
the modules in two pytest-xdist workers (`--dist loadfile --no-loadscope-reorder`), which take modules in this
order: with the long ones first the two workers end together, instead of one finishing a long module alone while
the other is idle (xdist's own order, most tests first, puts the long modules of few tests last).

At the end the run prints its slowest modules (set-up, call and tear-down of their tests summed, module-scoped
servers included): where CI's time goes, and what a module's `cost` mark should say.
"""

from __future__ import annotations

import gc
import os
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from slime_corr.device import DEVICE_ENV as RUN_DEVICE_ENV
from slime_corr.startup_gc import freeze_imports

DEVICE_ENV = "SLIME_CORR_TEST_DEVICE"
# The suite tests the CPU path (what CI runs): on a GPU machine too, every test and the jobs it launches compute on
# the CPU (`slime_corr.device`), unless $SLIME_CORR_DEVICE says otherwise; the `-m device` tests choose their
# device themselves (`--device`).
os.environ.setdefault(RUN_DEVICE_ENV, "cpu")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default=None,
                     help=f"device of the `-m device` tests: cpu (default), cuda, cuda:1 ... (or ${DEVICE_ENV})")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "device: runs on the device of --device / $SLIME_CORR_TEST_DEVICE "
                                       "(scripts/gpu_check.sh runs them on CUDA)")
    config.addinivalue_line("markers", "cost(seconds): a module's rough CI time; the costliest modules run first")
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):  # it collects
        # no cyclic garbage collection while the test modules import torch, Megatron and the project
        # (slime_corr/startup_gc.py; a collection of the suite: 8.4-10.2 -> 6.6 CPU-s)
        gc.disable()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The test modules and what they imported frozen (`freeze_imports`: gc's permanent generation, after one
    collection); cyclic garbage collection, off while they were imported (`pytest_configure`), back on."""
    freeze_imports()


def _module_cost(item: pytest.Item) -> float:
    marker = item.get_closest_marker("cost")
    return float(marker.args[0]) if marker is not None else 0.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest modules first (module doc); stable, so every module's tests stay together and in order."""
    position: dict[str, int] = {}
    for item in items:
        position.setdefault(item.nodeid.split("::")[0], len(position))
    items.sort(key=lambda item: (-_module_cost(item), position[item.nodeid.split("::")[0]]))


# Modules that mostly wait (on fault timeouts and stalls, on an SGLang server slowed down by `/slow_down`): run alone,
# each keeps less than 0.9 of a core busy (CPU over wall time, /proc/stat; test_client_faults 0.2,
# test_rollout_failures 0.3, test_sglang_partial_rollout 0.6). Two of them side by side leave a core idle: CI's
# idle time was mostly such pairs. The scheduler runs each beside a module that computes.
WAITING_MODULES = frozenset({
    "test_client_faults.py", "test_rollout_failures.py", "test_router.py", "test_fault_table.py",
    "test_sglang_partial_rollout.py", "test_sglang_endpoints.py", "test_cpu_stand_ins.py",
    "test_sglang_moe_trainer.py"})


def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN201 - xdist's scheduler
    """`--dist loadfile`, but the modules of a real-SGLang server group form one scope, and a worker beside one
    that runs a module that mostly waits takes the next module that computes (module doc, WAITING_MODULES)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    from tests.real_sglang.sglang_helpers import SERVER_GROUPS, server_group

    def waits(scope: str) -> bool:
        return any(Path(m).name in WAITING_MODULES for m in SERVER_GROUPS.get(scope, (scope,)))

    class ServerGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return server_group(nodeid) or super()._split_scope(nodeid)

        def _assign_work_unit(self, node) -> None:  # noqa: ANN001 - xdist's WorkerController
            """The queue's next scope, unless another worker has a waiting one left: then its next computing one."""
            beside_waiting = any(waits(scope) and not all(tests.values())
                                 for other, work in self.assigned_work.items() if other is not node
                                 for scope, tests in work.items())
            computing = next((scope for scope in self.workqueue if not waits(scope)), None)
            if beside_waiting and computing is not None:
                self.workqueue.move_to_end(computing, last=False)
            super()._assign_work_unit(node)

    return ServerGroupScheduling(config, log)


@pytest.fixture(scope="session")
def tiny_moe_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A model cache (`--model-cache-dir`) holding the generated tiny Qwen3-MoE (`--model tiny-moe`)."""
    from slime_corr.models.selection import TINY_MOE, generated_checkpoint

    root = tmp_path_factory.mktemp("models")
    generated_checkpoint(TINY_MOE, str(root))
    return str(root)


@pytest.fixture(scope="session")
def test_device(request: pytest.FixtureRequest) -> torch.device:
    """The device the `device` tests put their tensors on; asking for CUDA without one is an error, not a skip."""
    name = request.config.getoption("--device") or os.environ.get(DEVICE_ENV) or "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"--device / ${DEVICE_ENV} = {name!r}, but torch.cuda.is_available() is False "
                    f"(torch {torch.__version__}): install a CUDA build of torch or run with cpu.")
    return device


SLOWEST_MODULES = int(os.environ.get("SLIME_CORR_SLOWEST_MODULES", "15"))  # 0: every module
_module_seconds: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _module_seconds[report.nodeid.split("::")[0]] += report.duration  # on the xdist controller: every worker's


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _module_seconds or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slowest = sorted(_module_seconds.items(), key=lambda kv: -kv[1])[:SLOWEST_MODULES or None]
    terminalreporter.section(f"slowest {len(slowest)} modules (set-up + call + tear-down of their tests)")
    for path, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
