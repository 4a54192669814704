"""Megatron-Core's scratch state per thread for the embedded engine's forwards (`slime_corr.mcore.threads`): under
--async-rollout the engine's forwards run in threads of the trainer's process. Real Megatron-Core state, a one-rank
gloo group in this process, real threads."""

from __future__ import annotations

import threading

import torch

from slime_corr.mcore import threads as mcore_threads
from slime_corr.threads import inference_thread
from tests.mcore.mcore_helpers import init_layout, run_in_process


def _in_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn()))
    thread.start()
    thread.join(30)
    return out["value"]


def _check(rank: int, world: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    init_layout(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    mcore_threads.install()
    shape, dtype = (4, 8, 8), torch.float32
    ours = ps.get_global_memory_buffer().get_tensor(shape, dtype, "mpu").data_ptr()

    def engine_buffer() -> int:
        with inference_thread():
            return ps.get_global_memory_buffer().get_tensor(shape, dtype, "mpu").data_ptr()

    def plain_thread_buffer() -> int:
        return ps.get_global_memory_buffer().get_tensor(shape, dtype, "mpu").data_ptr()

    assert _in_thread(engine_buffer) != ours  # the attention scores of the engine's forward: not the trainer's memory
    assert _in_thread(plain_thread_buffer) == ours  # training threads: Megatron-Core's own buffer
    assert ps.get_global_memory_buffer().get_tensor(shape, dtype, "mpu").data_ptr() == ours

    def engine_fork_draws() -> tuple[bool, bool]:
        with inference_thread():
            before = torch.get_rng_state()
            with tensor_parallel.get_cuda_rng_tracker().fork():
                inside = torch.get_rng_state()
            return torch.equal(before, inside), torch.equal(before, torch.get_rng_state())

    assert _in_thread(engine_fork_draws) == (True, True)  # the engine's fork leaves the RNG alone
    before = torch.get_rng_state()
    with tensor_parallel.get_cuda_rng_tracker().fork():  # the trainer's fork swaps in the model-parallel state
        assert not torch.equal(before, torch.get_rng_state())
    assert torch.equal(before, torch.get_rng_state())
    mcore_threads.install()  # idempotent: still one wrapper of each
    assert isinstance(ps._GLOBAL_MEMORY_BUFFER, mcore_threads.PerThreadMemoryBuffer)
    assert not isinstance(ps._GLOBAL_MEMORY_BUFFER.shared, mcore_threads.PerThreadMemoryBuffer)
    assert not hasattr(tensor_parallel.get_cuda_rng_tracker.__wrapped__, "__wrapped__")


def test_an_inference_thread_gets_its_own_memory_buffer_and_leaves_the_rng_alone():
    run_in_process(_check)
