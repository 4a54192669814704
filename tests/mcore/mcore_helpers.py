"""Shared pieces of the multi-process tests: gloo process spawning (`spawn` with Megatron's parallel state,
`spawn_group` a bare process group), the case a worker checks named in its failure (`checking`), and for the
Megatron-glue tests the test batch, layouts and references.

Multi-process tests spawn ONE set of processes and loop over (TP, CP, DP) layouts inside it (`init_layout`, which
destroys the previous layout's groups: slime_corr/mcore/parallel_groups.py). The processes are forked from a server
that has imported the project and Megatron (tests/job_runner.py), so a launch costs no imports.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slime_corr.mcore.cpu_compat import apply_cpu_compat
from slime_corr.mcore.parallel_groups import destroy_model_parallel_groups
from slime_corr.ports import agent_store_environment, host_store, init_world_of_one
from tests.job_runner import spawn_processes

N_MB = 2  # micro-batches per step
B_GLOBAL = 4  # rows of one global micro-batch (split over DP)
S = 16  # divisible by 2 * CP for CP <= 4
V = 32  # divisible by TP
TEMPERATURE = 0.7


def _entry(rank: int, store_env: dict[str, str] | None, world: int, fn: Callable[..., Any], args: tuple,
           hide_gpus: bool = False) -> None:
    if hide_gpus:  # before anything initializes CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    if store_env is None:
        init_world_of_one("gloo")
    else:
        os.environ.update(store_env)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    checking("")
    try:
        apply_cpu_compat()
        fn(rank, world, *args)
    except BaseException as error:
        _name_the_case(error)
        traceback.print_exc()
        raise
    finally:
        destroy_model_parallel_groups(world=True)


def spawn_on_hosted_store(entry: Callable[..., Any], nprocs: int, *args: Any) -> None:
    """`entry(rank, store_env, *args)` in `nprocs` spawned processes; `store_env` the variables that join them to a
    store this process hosts (as torchrun's agent hosts its ranks' store: `slime_corr.ports`), on a port the OS
    picked as it bound it, so no other process can take it before the ranks connect. Raises the first failure."""
    store = host_store(world_size=nprocs)
    try:
        spawn_processes(entry, nprocs, (agent_store_environment(store), *args))
    finally:
        del store


def spawn(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """Run `fn(rank, world, *args)` in `world` gloo processes joined by a store this process hosts (forked from
    tests/job_runner.py's server: the imports are done); raise on any failure.

    The processes never see a GPU (CUDA_VISIBLE_DEVICES is empty for them), so on a GPU machine these tests run
    unchanged: Megatron then allocates its DDP buffers on the CPU like the models, and gloo reduces CPU tensors.
    """
    spawn_on_hosted_store(_entry, world, world, fn, args, True)


def run_in_process(fn: Callable[..., Any], *args: Any) -> None:
    """Run `fn(0, 1, *args)` as a one-rank gloo group in THIS process (no spawn: no import cost; an in-process
    store: no port), then leave torch.distributed and Megatron's parallel state as they were (uninitialized)."""
    threads = torch.get_num_threads()
    try:
        _entry(0, None, 1, fn, args)
    finally:
        torch.set_num_threads(threads)


@contextmanager
def joined_group(rank: int, world: int, store_env: dict[str, str], backend: str = "gloo") -> Iterator[None]:
    """This process as `rank` of a `world`-process group (`backend`) over the store that `store_env` names
    (`spawn_on_hosted_store`), destroyed when the block ends."""
    os.environ.update(store_env)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _group_entry(rank: int, store_env: dict[str, str], world: int, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    checking("")
    with joined_group(rank, world, store_env):
        try:
            fn(rank, *args)
        except BaseException as error:
            _name_the_case(error)
            raise


def spawn_group(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """Run `fn(rank, *args)` in `world` processes (forked from tests/job_runner.py's server) joined in one gloo
    process group over a store this process hosts, one thread each, the group destroyed after `fn`; raise the first
    failure. No Megatron state: for the collectives of the correction itself (`spawn` sets Megatron's up)."""
    spawn_on_hosted_store(_group_entry, world, world, fn, args)


_case = ""  # the case this process checks now (`checking`)


def checking(case: str) -> None:
    """Say which case this worker checks now: a failure of the worker (run by `spawn`, `spawn_group` or
    `run_in_process`) then names it, as a note at the end of the traceback the test's failure shows. For workers
    that loop over several cases (layouts, presets, modes) inside one spawned group."""
    global _case
    _case = case


def _name_the_case(error: BaseException) -> None:
    if _case:
        error.add_note(f"while checking: {_case}")


_NEVER_NAMED: set[int] = set()  # threads that kept their creator's name past a wait (OpenMP's, torch's inter-op)


def gloo_threads(timeout: float = 10.0) -> int:
    """This process's gloo device-loop threads (`gloo_tcp_loop` in /proc/self/task, Linux): one per live gloo
    process group, each awake every 10 ms (slime_corr/mcore/parallel_groups.py). A new thread names itself when it
    first runs, and until then carries its creator's name: under load a count missed the world's this way (CI:
    [0, 21, 21, 21, 1]), so the count first waits, at most `timeout` s, until no thread but Python's own carries
    the main thread's name."""
    main = Path("/proc/self/comm").read_text().strip()
    deadline = time.monotonic() + timeout
    while True:
        names = {}
        for task in Path("/proc/self/task").iterdir():
            try:
                names[int(task.name)] = (task / "comm").read_text().strip()
            except OSError:  # a thread that ended meanwhile
                pass
        python_threads = {thread.native_id for thread in threading.enumerate()}
        unnamed = {tid for tid, name in names.items() if name == main} - python_threads - _NEVER_NAMED
        if not unnamed:
            break
        if time.monotonic() > deadline:
            _NEVER_NAMED.update(unnamed)
            break
        time.sleep(0.01)
    return list(names.values()).count("gloo_tcp_loop")


def init_layout(tp: int, cp: int, pp: int = 1) -> None:
    """Megatron's parallel state for (TP, CP, PP), the previous layout's groups destroyed first."""
    from megatron.core import parallel_state as ps

    destroy_model_parallel_groups()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 pipeline_model_parallel_size=pp)


# per (micro-batch, row) noise scale of lp_old and lp_rollout around the model's log-probs: 1e-4 rows pass the
# presets' geometric RS (|mean lr| < log 1.001), 0.3 rows are rejected by it and get non-trivial IS weights
NOISE = ((1e-4, 0.3, 1e-4, 1e-4), (0.3, 1e-4, 1e-4, 0.3))
CATASTROPHIC = (1, 3, 6)  # (micro-batch, row, position): lr ≈ -12 < log(1e-4), vetoed by decoupled_geo_rs / pg_rs


def step_data(
    seed: int = 0, dtype: torch.dtype = torch.float64, logits: torch.Tensor | None = None
) -> list[dict[str, torch.Tensor]]:
    """N_MB global micro-batches [B_GLOBAL, S]: uneven masks (a sequence ending inside the first chunk, one
    fully masked, one with holes), so CP ranks hold different token counts. lp_old and lp_rollout are the
    log-probs of `logits` [N_MB, B_GLOBAL, S, V] at TEMPERATURE (random when None) plus per-row noise
    (NOISE), so every preset keeps some sequences and rejects, truncates or vetoes others."""
    g = torch.Generator().manual_seed(seed)
    out = []
    lengths = [(15, 3, 0, 11), (16, 7, 1, 9)]
    starts = [(2, 1, 0, 4), (0, 2, 0, 5)]
    for k in range(N_MB):
        tokens = torch.randint(0, V, (B_GLOBAL, S), generator=g)
        labels = torch.roll(tokens, -1, dims=1)
        pos = torch.arange(S)
        mask = ((pos[None] >= torch.tensor(starts[k])[:, None]) & (pos[None] < torch.tensor(lengths[k])[:, None]))
        mask[3, ::4] = False
        if logits is None:
            model_lp = -torch.rand(B_GLOBAL, S, generator=g, dtype=dtype) * 3
        else:
            z = torch.log_softmax(logits[k].to(dtype) / TEMPERATURE, dim=-1)
            model_lp = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        noise = torch.tensor(NOISE[k], dtype=dtype)[:, None]
        rollout = model_lp + noise * torch.randn(B_GLOBAL, S, generator=g, dtype=dtype)
        old = model_lp + noise * torch.randn(B_GLOBAL, S, generator=g, dtype=dtype)
        if k == CATASTROPHIC[0]:
            rollout[CATASTROPHIC[1], CATASTROPHIC[2]] += 12.0
        # a reference policy's log-probs (KL term), from a generator of their own: the other entries stay as they were
        ref = model_lp + 0.3 * torch.randn(B_GLOBAL, S, generator=torch.Generator().manual_seed(seed * 100 + k),
                                           dtype=dtype)
        out.append(
            dict(
                tokens=tokens,
                labels=labels,
                position_ids=pos.expand(B_GLOBAL, S).clone(),
                loss_mask=mask.to(torch.float32),
                rollout_log_probs=rollout * mask,
                advantages=torch.randn(B_GLOBAL, 1, generator=g, dtype=dtype).expand(B_GLOBAL, S) * mask,
                old_log_probs=old * mask,
                ref_log_probs=ref,
            )
        )
    return out


def full_logits(seed: int = 1, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """[N_MB, B_GLOBAL, S, V] logits standing in for a model's output."""
    g = torch.Generator().manual_seed(seed)
    return 2.0 * torch.randn(N_MB, B_GLOBAL, S, V, generator=g, dtype=dtype)


def local_rows(t: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    n = t.size(0) // dp
    return t[dp_rank * n : (dp_rank + 1) * n]


def assert_metrics_close(got: dict[str, float], want: dict[str, float], tag: str, rtol: float = 1e-6) -> None:
    assert set(got) == set(want), f"{tag}: keys differ {set(got) ^ set(want)}"
    for k, v in want.items():
        assert abs(got[k] - v) <= rtol * max(1.0, abs(v)), f"{tag} {k}: {got[k]} != {v}"
