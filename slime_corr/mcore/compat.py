"""megatron-core version differences, in one place (0.16.x and 0.19.x are tested; see scripts/test.sh).

| what | 0.16.x | 0.19.x |
| --- | --- | --- |
| `pipeline_parallel.schedules` | imports | imports `triton` (transformer/moe/ops/paged_stash.py): triton must be installed, also on CPU |
| `utils.get_batch_on_this_cp_rank` | `(batch, cp_group=None)`; None = parallel_state's CP group | `(batch, is_hybrid_cp, cp_group=None, ...)`; None = the WHOLE world |
| `megatron.training` (Megatron-LM's loop) | not shipped | shipped; imports `typing.override` (Python ≥ 3.12) |
| Python | ≥ 3.10 | declares ≥ 3.12; installs on 3.11 with `pip install --ignore-requires-python` |

Nothing here imports megatron at module import time.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import sys
import typing
from types import ModuleType
from typing import Any

import torch.distributed as dist
from packaging.version import Version


def mcore_version() -> Version:
    """The installed megatron-core version."""
    from megatron.core.package_info import __version__

    return Version(__version__)


def import_schedules() -> ModuleType:
    """`megatron.core.pipeline_parallel.schedules`, with a clear error where triton is missing (0.19+)."""
    try:
        return importlib.import_module("megatron.core.pipeline_parallel.schedules")
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        raise ImportError(
            f"megatron-core {mcore_version()} imports triton (megatron/core/transformer/moe/ops/paged_stash.py, "
            "reached from pipeline_parallel.schedules), and triton is not installed: `pip install triton` "
            "(also on CPU machines, where it is only imported)."
        ) from e


def get_forward_backward_func() -> Any:
    """Megatron's schedule for the current parallel state (`get_forward_backward_func()`)."""
    import_schedules()
    from megatron.core.pipeline_parallel import get_forward_backward_func as get

    return get()


def get_batch_on_this_cp_rank(
    batch: dict[str, Any], cp_group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """Megatron's zig-zag CP slice of every [B, S] entry of `batch` (in place; returned), on every version.

    `cp_group` None means parallel_state's CP group (0.19 would take None as the whole world, so the group is
    always passed explicitly). Megatron's function slices every entry: pass tensors only.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import utils

    if cp_group is None:
        cp_group = ps.get_context_parallel_group()
    if "is_hybrid_cp" in inspect.signature(utils.get_batch_on_this_cp_rank).parameters:  # 0.19
        return utils.get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return utils.get_batch_on_this_cp_rank(batch, cp_group=cp_group)


def has_megatron_training() -> bool:
    """Whether Megatron-LM's training loop (`megatron.training`) is installed (megatron-core ≥ 0.19 ships it)."""
    return importlib.util.find_spec("megatron.training") is not None


def import_megatron_training() -> ModuleType:
    """`megatron.training`, importable on Python 3.11 too.

    The shim: 0.19's megatron/training/models imports `typing.override` (new in Python 3.12). On older Pythons
    it is added to `typing` as what it is at run time, a decorator that returns its argument unchanged (it only
    marks a method for type checkers; typing_extensions defines it the same way).
    """
    if not hasattr(typing, "override"):
        typing.override = _override  # type: ignore[attr-defined]
    return importlib.import_module("megatron.training")


def _override(method: Any) -> Any:
    try:
        method.__override__ = True
    except (AttributeError, TypeError):
        pass
    return method


def megatron_lm_args() -> argparse.Namespace | None:
    """Megatron-LM's parsed arguments (`megatron.training.get_args()`) when a Megatron-LM launch has set them,
    else None. Never imports megatron.training itself: a launch that set them has imported it."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_ARGS", None) if global_vars is not None else None


__all__ = [
    "get_batch_on_this_cp_rank",
    "get_forward_backward_func",
    "has_megatron_training",
    "import_megatron_training",
    "import_schedules",
    "mcore_version",
    "megatron_lm_args",
]
