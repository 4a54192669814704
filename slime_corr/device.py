"""The one place that decides where this process's tensors live and how its processes talk: device and backend.

Decided once per process, as Megatron-LM does: with a GPU, CUDA device `LOCAL_RANK` (`torch.cuda.set_device`) and
NCCL; without one, the CPU, gloo and Megatron's CPU adaptations (`slime_corr.mcore.cpu_compat`, which asks
`Placement.needs_cpu_compat`). The choice: the trainer's `--device {auto,cpu,cuda}`, else `$SLIME_CORR_DEVICE`
(same values), else auto (CUDA when torch sees a GPU). The trainer calls `setup` before its process group; any
other reader gets the same decision from `current` (made on first use when nobody called `setup`).

Who reads it: model building (`mcore.model.build_tiny_gpt`, the HF bridge, hence the tiny MoE and the reference
model: built, then moved with `place_module`), the embedded engine's model (its token and position ids follow the
model), the trainer's micro-batches (`to_device`, once per step: pinned memory and `non_blocking` on CUDA), the
trainer's process group (`backend`), the weight sync (`weight_sync_backend`, `collective_device`), the SGLang
servers the trainer launches, the data iterator's collective, and `cpu_compat`.

Device checks without a GPU: `use("meta")` points every reader at `meta` for a block, so code run under
`slime_corr.device_check.DeviceCheck("meta")` shows any tensor that stays on the CPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slime_corr.addresses import pin_gloo_interface
from slime_corr.errors import DeviceError
from slime_corr.ports import init_world_of_one

DEVICE_ENV = "SLIME_CORR_DEVICE"
DEVICE_CHOICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Placement:
    """Where this process computes (`device`) and the backend of its process groups (`backend`)."""

    device: torch.device
    backend: str  # "nccl" or "gloo"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def needs_cpu_compat(self) -> bool:
        """Megatron runs here only with `cpu_compat`'s adaptations (no CUDA device)."""
        return not self.is_cuda

    @property
    def cpu_initialization(self) -> bool:
        """Megatron's `use_cpu_initialization` for models made where they run: on the CPU; elsewhere Megatron makes
        them on its current device (on CUDA the GPU `setup` set)."""
        return self.device.type == "cpu"


def resolve(choice: str | None = None) -> Placement:
    """The placement `choice` asks for (None: `$SLIME_CORR_DEVICE`, else auto); changes nothing. Raises
    DeviceError for CUDA without a GPU, or a `LOCAL_RANK` past this machine's GPUs."""
    name = choice or os.environ.get(DEVICE_ENV) or "auto"
    source = f"--device {name}" if choice else f"${DEVICE_ENV}={name}"
    if name not in DEVICE_CHOICES:
        raise DeviceError(f"{source} is not one of {', '.join(DEVICE_CHOICES)}.")
    cuda = torch.cuda.is_available()
    if name == "cuda" and not cuda:
        raise DeviceError(f"{source}: torch {torch.__version__} sees no GPU (torch.cuda.is_available() is False): "
                          "install a CUDA build of torch, or use --device cpu.")
    if name == "cpu" or not cuda:
        return Placement(torch.device("cpu"), "gloo")
    local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= count:
        raise DeviceError(f"LOCAL_RANK {local_rank}: this machine has {count} GPU(s); launch at most {count} "
                          "processes per node (torchrun --nproc-per-node), one per GPU.")
    return Placement(torch.device("cuda", local_rank), "nccl")


_current: Placement | None = None


def setup(choice: str | None = None) -> Placement:
    """Decide (`resolve`) and make it this process's placement; on CUDA `torch.cuda.set_device` (before the
    process group, so NCCL and Megatron's buffers use that GPU)."""
    global _current
    placement = resolve(choice)
    if placement.is_cuda:
        torch.cuda.set_device(placement.device)
    _current = placement
    return placement


def current() -> Placement:
    """This process's placement (`setup()` on first use when nobody called it)."""
    return _current if _current is not None else setup()


@contextlib.contextmanager
def use(device: str | torch.device, backend: str | None = None) -> Iterator[Placement]:
    """Every reader sees `device` inside the block (tests: `meta` for device checks, `cpu` to keep a CPU test on
    the CPU of a GPU machine); `backend` defaults to NCCL for CUDA, gloo otherwise. Sets no CUDA device."""
    global _current
    saved = _current
    dev = torch.device(device)
    _current = Placement(dev, backend or ("nccl" if dev.type == "cuda" else "gloo"))
    try:
        yield _current
    finally:
        _current = saved


def place_module(module: nn.Module) -> nn.Module:
    """`module` moved to this process's device (in place, as `nn.Module.to`); returned."""
    return module.to(current().device)


def to_device(batch: dict[str, Any]) -> dict[str, Any]:
    """`batch`'s tensors moved to this process's device, in place (the same dict, returned; other values kept).
    From the CPU to CUDA through pinned memory with `non_blocking=True`: no host sync per tensor."""
    placement = current()
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.device == placement.device:
            continue
        if placement.is_cuda and value.device.type == "cpu":
            batch[key] = value.pin_memory().to(placement.device, non_blocking=True)
        else:
            batch[key] = value.to(placement.device)
    return batch


def collective_device(backend: str) -> torch.device:
    """Where a collective over a group of `backend` takes its tensors: NCCL this process's device, gloo the CPU
    (as SGLang's weight-update groups define them)."""
    return current().device if backend == "nccl" else torch.device("cpu")


def weight_sync_backend(engines_share_device: bool) -> str:
    """The backend of the trainer → engines weight-update group: NCCL from a CUDA trainer to engines on other
    GPUs; gloo (CPU tensors) on the CPU, and to engines on this process's GPU (NCCL refuses two ranks on one
    device; the embedded engines run in the trainer's process)."""
    return "nccl" if current().is_cuda and not engines_share_device else "gloo"


def engine_device() -> str:
    """The device SGLang servers launched by this process run on (SGLang's `--device`): "cuda" or "cpu"."""
    return "cuda" if current().is_cuda else "cpu"


def init_distributed(timeout_minutes: float | None = None, device: str | None = None) -> bool:
    """Decide this process's device (`slime_corr.device.setup(device)`: `--device`; on CUDA the GPU LOCAL_RANK),
    then join torchrun's process group with its backend (NCCL on CUDA, gloo on CPU), or make a one-process one;
    True when this call created it. Across nodes gloo binds the interface that routes to MASTER_ADDR
    (`slime_corr.addresses.pin_gloo_interface`; GLOO_SOCKET_IFNAME, when set, decides). Every collective then fails
    after `timeout_minutes` (`--distributed-timeout-minutes`) instead of the backend's default."""
    backend = setup(device).backend
    if dist.is_initialized():
        return False
    timeout = None if timeout_minutes is None else timedelta(minutes=timeout_minutes)
    if "RANK" in os.environ:  # torchrun's world
        pin_gloo_interface()  # across nodes, gloo (gloo's groups on a GPU too) binds the interface toward MASTER_ADDR
        dist.init_process_group(backend, **({} if timeout is None else {"timeout": timeout}))
        return True
    # `python -m slime_corr.main`: a world of one over an in-process store (no port to race for), named in the call
    # rather than in os.environ (a RANK left there would make every child process, e.g. a test's next job, think
    # it is under torchrun)
    init_world_of_one(backend, timeout)
    return True


__all__ = ["DEVICE_CHOICES", "DEVICE_ENV", "DeviceError", "Placement", "collective_device", "current",
           "engine_device", "init_distributed", "place_module", "resolve", "setup", "to_device", "use", "weight_sync_backend"]
