"""Device-agnostic by construction, checked without a GPU: every tensor the code makes must be on its inputs' device.

CPU tests cannot see a tensor created on the wrong device (everything is on the CPU). `DeviceCheck` makes it
visible: run the code on tensors of another device (`meta`: shapes and dtypes only, no data, no GPU) inside
`with DeviceCheck("meta") as check:`. Every aten op that takes or returns a tensor on a device other than the
expected one is recorded with the op and the source line that called it (a factory call without `device=`, a
module-level CPU constant, a `.cpu()` / `.to("cpu")`), and `check.assert_clean()` names them. Collectives can be
checked too: `fake_process_groups(size, expect="meta")` patches `torch.distributed` so that `all_reduce` and friends
accept only tensors on the expected device (and leave them as they are), with groups of `size` ranks, so the DP / CP
code paths run on one process.

    with fake_process_groups(2, expect="meta") as groups, DeviceCheck("meta") as check:
        compute_policy_loss(lp.to("meta"), ..., cp_group=groups.cp, dp_group=groups.dp)
    check.assert_clean()

On `meta`, code that reads a tensor's value (`.item()`, `.tolist()`, a Python `if` on a tensor) raises: the
correction core and the losses read none (their metrics reach the host in one transfer, `metrics_to_host`, outside
the checked region).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_PACKAGE = str(Path(__file__).resolve().parent)


def _caller() -> str:
    """The innermost frame of slime_corr (else the innermost outside torch) that led to the current op."""
    frames = traceback.extract_stack()[:-3]
    ours = [f for f in frames if f.filename.startswith(_PACKAGE) and not f.filename.endswith("device_check.py")]
    frame = ours[-1] if ours else next((f for f in reversed(frames) if "/torch/" not in f.filename), frames[-1])
    return f"{Path(frame.filename).name}:{frame.lineno} ({frame.line})"


class DeviceCheck(TorchDispatchMode):
    """Records every op whose tensor arguments or results are not on `device` (`.problems`: one line each)."""

    def __init__(self, device: str | torch.device = "meta") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.problems: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        leaves = tree_flatten((args, kwargs))[0] + tree_flatten(out)[0]
        wrong = sorted({str(t.device) for t in leaves if isinstance(t, torch.Tensor) and t.device != self.device})
        if wrong:
            self.problems.append(f"{func}: a tensor on {', '.join(wrong)} (expected {self.device}) at {_caller()}")
        return out

    def assert_clean(self) -> None:
        if not self.ops:
            raise AssertionError("DeviceCheck saw no tensor op: nothing was checked")
        if self.problems:
            lines = "\n  ".join(dict.fromkeys(self.problems))
            raise AssertionError(f"tensors created off the inputs' device {self.device}:\n  {lines}")


class _FakeGroup(dist.ProcessGroup):
    """A process group object with no backend: only the patched functions of `fake_process_groups` use it."""


@dataclass
class FakeGroups:
    """Distinct fake process groups of `fake_process_groups`; `collectives` lists the collectives called."""

    cp: Any
    dp: Any
    tp: Any
    collectives: list[str]


@contextlib.contextmanager
def fake_process_groups(size: int = 2, expect: str | torch.device = "meta", rank: int = 0) -> Iterator[FakeGroups]:
    """`torch.distributed` as if initialized with groups of `size` ranks (this one `rank`): collectives check that
    every tensor is on `expect` and return without communicating (values are not reduced: for device checks)."""
    device = torch.device(expect)
    groups = FakeGroups(*(_FakeGroup(rank, size) for _ in range(3)), collectives=[])

    def check(name: str, *tensors: Any) -> None:
        flat = [t for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor)]
        wrong = [str(t.device) for t in flat if t.device != device]
        if wrong:
            raise AssertionError(f"dist.{name} on a tensor on {', '.join(wrong)}, expected {device} "
                                 f"(called at {_caller()})")
        groups.collectives.append(name)

    def collective(name: str) -> Any:
        def fn(tensor: Any, *args: Any, **kwargs: Any) -> None:
            check(name, tensor, args, kwargs.get("tensor_list"), kwargs.get("output_tensor_list"))
        return fn

    def all_gather(tensor_list: list, tensor: Any, *args: Any, **kwargs: Any) -> None:
        check("all_gather", tensor_list, tensor)
        for t in tensor_list:
            t.copy_(tensor)

    with contextlib.ExitStack() as stack:
        patch = lambda name, value: stack.enter_context(mock.patch.object(dist, name, value))  # noqa: E731
        patch("is_available", lambda: True)
        patch("is_initialized", lambda: True)
        patch("get_world_size", lambda group=None: size)
        patch("get_rank", lambda group=None: rank)
        for name in ("all_reduce", "broadcast", "reduce"):
            patch(name, collective(name))
        patch("all_gather", all_gather)
        patch("all_gather_into_tensor", lambda out, inp, *a, **k: check("all_gather_into_tensor", out, inp))
        patch("reduce_scatter_tensor", lambda out, inp, *a, **k: check("reduce_scatter_tensor", out, inp))
        yield groups


__all__ = ["DeviceCheck", "FakeGroups", "fake_process_groups"]
