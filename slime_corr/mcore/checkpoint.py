"""Checkpoints through Megatron's `dist_checkpointing`, in Megatron-LM's directory layout, on CPU with gloo.

    ROOT/latest_checkpointed_iteration.txt     the last complete iteration (written after every rank saved)
    ROOT/iter_0000012/                          dist_checkpointing's torch_dist format (*.distcp, metadata.json,
                                                common.pt)

What is saved: the model's `sharded_state_dict()` (each TP shard once, DP/CP replicas deduplicated: a checkpoint
loads at another TP size), the optimizer state sharded like its parameters (a plain `torch.optim` optimizer: its
per-parameter state tensors follow the parameter's sharding; Adam's scalar `step` goes to the common state;
Megatron's optimizer of --bf16 / --fp16: its own `sharded_state_dict`, fp32 main params and the loss scaler too), a
`common` dict (the same on every rank: counters), one picklable object per rank (`rank_state`, e.g. RNG states;
loaded only at the same world size) and one object only rank 0 has (`rank0_state`, e.g. what the rollout driver
holds), saved from rank 0 and given back to every rank.

Measured here: with megatron-core 0.16 and gloo the torch_dist strategy saves and loads on CPU. Its writer hands
the write results back through a queue that megatron-core (0.16 and 0.19) serves from a `multiprocessing` manager
started with "spawn": a fresh interpreter that imports the launching module again, here the whole job (measured: 5
CPU-s and 0.4 GB per rank, and the first save waits ~5 s for it). A synchronous save writes and reads them in this
process, so `save_checkpoint` gives it a plain queue instead (`_write_results_in_process`) and no manager starts.
"""

from __future__ import annotations

import contextlib
import queue
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from slime_corr.disk import FULL, out_of_space, write_failure, write_text
from slime_corr.mcore.precision import is_megatron_optimizer

TRACKER_FILE = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the directory and the fix."""


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str | Path) -> int | None:
    """The iteration in ROOT's tracker file, or None when there is none."""
    tracker = Path(root) / TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{tracker}: expected an iteration number, got {text!r}: write the number of a "
                              f"complete iter_* directory there (saved: {_saved(root)}), or pass --ckpt-step N."
                              ) from None


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _sharded_state(module: torch.nn.Module, optimizer: Any, common: dict[str, Any], rank_state: Any,
                   rank0_state: Any, loading: bool = False) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model_state = module.sharded_state_dict()
    world, rank = dist.get_world_size(), dist.get_rank()
    ranks = {"rank_state": ShardedObject("rank_state", rank_state, (world,), (rank,), replica_id=0),
             "rank0_state": ShardedObject("rank0_state", rank0_state, (1,), (0,), replica_id=rank)}
    if is_megatron_optimizer(optimizer):  # its own sharded state: fp32 main params, Adam's moments, the scaler
        return {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=loading),
                **ranks, "common": common}
    optim_state = optimizer.state_dict()
    # state_dict() hands out the optimizer's own per-parameter dicts: edit copies (a save must not change the run)
    optim_state["state"] = {k: dict(v) for k, v in optim_state["state"].items()}
    steps = {int(st.pop("step")) for st in optim_state["state"].values() if "step" in st}
    if len(steps) > 1:
        raise CheckpointError(f"optimizer: parameters at different steps {sorted(steps)}; cannot save one step")
    id_map = get_param_id_to_sharded_param_map(model_state, _params(optimizer))
    optim_state_to_sharding_state(optim_state, id_map)
    return {"model": model_state, "optimizer": optim_state, "optimizer_step": steps.pop() if steps else None,
            **ranks, "common": common}


@contextlib.contextmanager
def _write_results_in_process() -> Iterator[None]:
    """The torch_dist writer's results queue as a plain `queue.Queue` for one synchronous save (module doc): its
    writer puts the results and its finalization reads them, both in this process. The module's own queue (None
    unless a save other than ours made one) is put back after. Without that module attribute (another megatron-core
    release) the save makes its own queue, as before."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        yield
        return
    kept = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = kept


def save_checkpoint(root: str | Path, iteration: int, module: torch.nn.Module, optimizer: Any,
                    common: dict[str, Any], rank_state: Any = None, rank0_state: Any = None) -> Path:
    """Save on every rank (collective); the tracker names `iteration` once all ranks are done. `module` is the
    model without its DDP wrapper."""
    from megatron.core import dist_checkpointing

    path = iteration_dir(root, iteration)
    try:
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        with _write_results_in_process():
            dist_checkpointing.save(_sharded_state(module, optimizer, common, rank_state, rank0_state), str(path))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a full disk surfaces from the writer in many forms
        raise _save_failure(root, path, e) from None
    dist.barrier()
    if dist.get_rank() == 0:  # the tracker names the iteration only once every rank saved it
        write_text(Path(root) / TRACKER_FILE, f"{iteration}\n")
    dist.barrier()
    return path


def _save_failure(root: str | Path, path: Path, error: BaseException) -> OSError | CheckpointError:
    """The half-written `path` removed (the tracker still names the last complete one) and one named error: a full
    disk (DiskWriteError), else CheckpointError with the writer's own error."""
    shutil.rmtree(path, ignore_errors=True)
    latest = latest_iteration(root) if (Path(root) / TRACKER_FILE).is_file() else None
    last = f"the last complete checkpoint is {iteration_dir(root, latest).name} (--load {root} resumes from it)" \
        if latest is not None else "no complete checkpoint was saved yet"
    done = f"the half-written {path.name} was removed; {last}"
    if isinstance(error, OSError) and error.errno in FULL or out_of_space(path):
        return write_failure(path, error, done)
    return CheckpointError(f"--save {root}: saving {path.name} failed ({type(error).__name__}: {error}); {done}.")


def load_checkpoint(root: str | Path, module: torch.nn.Module, optimizer: Any,
                    iteration: int | None = None) -> tuple[int, dict[str, Any], Any, Any]:
    """Load model and optimizer in place (collective); returns (iteration, common, this rank's rank_state,
    rank0_state). The latest iteration unless `iteration` is given."""
    from megatron.core import dist_checkpointing

    if iteration is None:
        iteration = latest_iteration(root)
        if iteration is None:
            raise CheckpointError(f"--load {root}: no {TRACKER_FILE} (no complete checkpoint was saved there); "
                                  "pass the --save directory of an earlier run.")
    path = iteration_dir(root, iteration)
    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"--load {root}: {path.name} is not a complete checkpoint (no metadata.json).")
    check_checkpoint_files(root, path)
    # a torch optimizer needs its state before it can describe it: one zero-gradient step with lr 0 creates it
    # (Megatron's makes its own when asked for a state to load)
    megatron = is_megatron_optimizer(optimizer)
    if not megatron and not optimizer.state:
        _init_optimizer_state(optimizer)
    template = _sharded_state(module, optimizer, {}, None, None, loading=True)
    template.pop("common")

    try:
        loaded = dist_checkpointing.load(template, str(path))
        module.load_state_dict(loaded["model"])
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - one message with the path and the fix
        raise CheckpointError(_load_failure(root, path, e)) from None
    optim_state = loaded["optimizer"]
    step = loaded.get("optimizer_step")
    if step is not None and not megatron:
        for state in optim_state["state"].values():
            # on the CPU on purpose: torch's Optimizer.load_state_dict keeps `step` there, or moves it to the
            # parameters' device itself when the optimizer is fused / capturable
            state["step"] = torch.tensor(float(step))
    optimizer.load_state_dict(optim_state)
    return iteration, loaded.get("common", {}), loaded["rank_state"], loaded["rank0_state"]


def _saved(root: str | Path) -> str:
    return ", ".join(sorted(p.name for p in Path(root).glob("iter_*"))) or "none"


def _damaged(root: str | Path, what: str) -> str:
    return (f"--load {root}: {what}. The checkpoint is damaged (a save interrupted, a partial copy, a full disk): "
            f"copy it again, or resume from another iteration with --ckpt-step N (saved: {_saved(root)}).")


def check_checkpoint_files(root: str | Path, path: Path) -> None:
    """Before loading: metadata.json and common.pt readable, every .distcp file as long as the checkpoint's index
    (.metadata) says; CheckpointError naming the file otherwise."""
    import json

    try:
        json.loads((path / "metadata.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(_damaged(root, f"{path / 'metadata.json'} is not valid JSON ({e})")) from None
    common = path / "common.pt"
    if common.is_file():
        try:
            torch.load(common, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - a truncated zip, a bad pickle...
            raise CheckpointError(_damaged(root, f"{common} cannot be read ({type(e).__name__}: "
                                                 f"{str(e).splitlines()[0][:160] if str(e) else ''})")) from None
    if not (path / ".metadata").is_file():
        raise CheckpointError(_damaged(root, f"{path / '.metadata'} (the index of the .distcp files) is missing"))
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(_damaged(root, f"{path / '.metadata'} cannot be read ({type(e).__name__})")) from None
    needed: dict[str, int] = {}
    for info in (storage or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        have = file.stat().st_size if file.is_file() else None
        if have is None:
            raise CheckpointError(_damaged(root, f"{file} is missing"))
        if have < size:
            raise CheckpointError(_damaged(root, f"{file} is truncated: {have} bytes, its index needs {size}"))


def _load_failure(root: str | Path, path: Path, error: Exception) -> str:
    """One message for a load that failed after the files checked out: most often another model's checkpoint."""
    text = str(error)
    shape = next((line.strip() for line in text.splitlines() if "shape mismatch" in line.lower()
                  or "size mismatch" in line.lower() or "Missing key" in line or "Unexpected key" in line), None)
    if shape is not None:
        return (f"--load {root}: {path.name} holds another model than this run builds ({shape[:300]}). Resume with "
                f"the model flags it was saved with (see the run's run_config.json), or start without --load.")
    first = text.strip().splitlines()[-1][:300] if text.strip() else type(error).__name__
    return _damaged(root, f"{path} cannot be loaded ({type(error).__name__}: {first})")


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    grads = []
    for p in _params(optimizer):
        grads.append(p.grad)
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p, g in zip(_params(optimizer), grads, strict=True):
        p.grad = g
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        group["lr"] = lr


__all__ = ["CheckpointError", "TRACKER_FILE", "check_checkpoint_files", "iteration_dir",
           "latest_iteration", "load_checkpoint", "save_checkpoint"]
