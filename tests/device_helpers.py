"""Shared by the `-m device` tests that spawn ranks (tests/correction/test_device.py, tests/mcore/test_mcore_device.py)."""

from __future__ import annotations

import os

import torch

from slime_corr.device import setup as setup_device


def rank_placement(rank: int, world: int, device_name: str) -> tuple[torch.device, str]:
    """A spawned rank's device and backend for the test device `device_name`: on CUDA `slime_corr.device` (GPU
    LOCAL_RANK, set current) with NCCL when there is one GPU per rank, else every rank on the named GPU with gloo
    (NCCL refuses two ranks on one GPU); CPU or meta as named, with gloo."""
    requested = torch.device(device_name)
    if requested.type != "cuda":
        return requested, "gloo"
    one_per_rank = torch.cuda.device_count() >= world
    os.environ["LOCAL_RANK"] = str(rank if one_per_rank else requested.index or 0)
    placement = setup_device("cuda")
    return placement.device, placement.backend if one_per_rank else "gloo"
