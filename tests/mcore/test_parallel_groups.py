"""`destroy_model_parallel_groups` (slime_corr/mcore/parallel_groups.py): Megatron's process groups destroyed, not
only forgotten. Measured by what costs: each live gloo group keeps a thread named `gloo_tcp_loop` (gloo's tcp
device loop, awake every 10 ms), counted in /proc/self/task."""

from __future__ import annotations

import sys

import pytest
import torch

from slime_corr.mcore.model import TinyGPTArgs, build_tiny_gpt
from slime_corr.mcore.parallel_groups import destroy_model_parallel_groups
from tests.mcore.mcore_helpers import gloo_threads, init_layout, run_in_process

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")


def _layouts(rank: int, world: int, counts: list[int]) -> None:
    """Three layouts one after the other, as a test or a notebook running the job twice does, each with a
    DDP-wrapped model that keeps the output of its last forward (as Megatron's MoE token dispatchers keep their
    routing tensors): its autograd graph reaches DDP's gradient hooks, a cycle through C++ nodes."""
    counts.append(gloo_threads())  # the world's group
    for seed in range(3):
        init_layout(1, 1)
        model = build_tiny_gpt(TinyGPTArgs(vocab_size=32, seed=seed), ddp=True)
        model.module.last_output = model(input_ids=torch.zeros(1, 4, dtype=torch.long),
                                         position_ids=torch.arange(4)[None], attention_mask=None)
        counts.append(gloo_threads())  # Megatron's ~20 groups live
        del model
    destroy_model_parallel_groups()
    counts.append(gloo_threads())


def test_layouts_one_after_the_other_keep_no_group_of_the_ones_before() -> None:
    counts: list[int] = []
    before = gloo_threads()
    run_in_process(_layouts, counts)
    world, *live, left = counts
    assert all(n - world >= 10 for n in live), counts  # Megatron's groups are there while a layout is up
    assert len(set(live)) == 1, counts  # a layout inherits no group of the ones before it
    assert left == world, counts  # torn down: only the world's group is left (before: every layout's ~20 groups)
    assert gloo_threads() == before, counts  # and leaving the world leaves nothing behind in this process
