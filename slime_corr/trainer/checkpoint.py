"""What the trainer saves to resume exactly: model and optimizer (Megatron's `dist_checkpointing`,
`slime_corr.mcore.checkpoint`), the position (next rollout, optimizer steps done), every rank's RNG states, and
what only the driver holds: in asynchronous mode the next rollouts (one, or as many as `--max-staleness` lets the
producer run ahead), already generated with the weights before the checkpoint (they are trained first after a
resume, exactly as the uninterrupted run trains them). `--max-staleness` may change at a resume: pending samples
then older than the new bound are dropped or regenerated (`--staleness-policy`).

A resumed run rebuilds everything else from the flags: the prompts of rollout k come from (`--seed`, k), every
request's sampling seed from (`--seed`, k, sample), the reference policy from `--seed`, and the engines start from
the loaded weights. So its metrics continue those of the uninterrupted run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slime_corr.device import current
from slime_corr.errors import ConfigError
from slime_corr.mcore.checkpoint import load_checkpoint, save_checkpoint
from slime_corr.samples import Sample
from slime_corr.trainer.config import TrainerConfig


@dataclass
class TrainState:
    """Where the run is: `rollout` = the next rollout to train, `step` = optimizer steps done, `pending` = the
    driver's next rollouts already generated, in order from `rollout` (asynchronous mode: one, or up to the
    rollouts ahead that `--max-staleness` allows; empty on other ranks)."""

    rollout: int = 0
    step: int = 0
    pending: list[list[Sample]] = field(default_factory=list)


def _rng_states() -> dict[str, Any]:
    """This rank's RNG states: torch's CPU generator, Python's, Megatron's model-parallel tracker and, on CUDA, the
    GPU's default generator."""
    from megatron.core import tensor_parallel

    states = {"torch": torch.get_rng_state(), "python": random.getstate(),
              "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if current().is_cuda:
        states["cuda"] = torch.cuda.get_rng_state(current().device)
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])
    if "cuda" in states and current().is_cuda:  # (a CPU run's checkpoint has none)
        torch.cuda.set_rng_state(states["cuda"], current().device)


def _identity(config: TrainerConfig) -> dict[str, Any]:
    """Settings a checkpoint must agree with to resume the same run."""
    source = config.model_source
    return {"seed": config.seed, "samples_per_rollout": config.samples_per_rollout,
            "num_steps_per_rollout": config.num_steps_per_rollout, "async_rollout": config.async_rollout,
            "model": source.model or source.hf_checkpoint, "task": config.task,
            "precision": config.precision.dtype_name}  # --bf16 / --fp16 (None: fp32 / fp64, plain Adam)


def save_train_state(config: TrainerConfig, state: TrainState, module: torch.nn.Module, optimizer: Any) -> Path:
    """Collective: every rank saves its shard; the iteration is the optimizer step. `module`: the GPTModel
    (`Policy.module`); `optimizer`: torch's Adam, or Megatron's under --bf16 / --fp16."""
    assert config.save is not None
    common = {"rollout": state.rollout, "step": state.step, "run": _identity(config)}
    return save_checkpoint(config.save, state.step, module, optimizer, common, rank_state=_rng_states(),
                           rank0_state={"pending": state.pending})


def load_train_state(config: TrainerConfig, module: torch.nn.Module, optimizer: Any) -> TrainState:
    """Collective: model and optimizer in place, RNG restored; the run's position (`pending` on rank 0 only)."""
    import torch.distributed as dist

    assert config.load is not None
    _, common, rng, rank0 = load_checkpoint(config.load, module, optimizer, config.ckpt_step)
    saved, now = common.get("run", {}), _identity(config)
    changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    if changed:
        detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in changed.items())
        raise ConfigError(f"--load {config.load}: the checkpoint is of another run ({detail}); resume with the flags "
                          "it was saved with.")
    if rng is not None:
        _set_rng_states(rng)
    pending = (rank0["pending"] or []) if rank0 and dist.get_rank() == 0 else []
    if pending and isinstance(pending[0], Sample):  # saved before several rollouts could be pending: one rollout
        pending = [pending]
    return TrainState(rollout=common["rollout"], step=common["step"], pending=pending)


__all__ = ["TrainState", "load_train_state", "save_train_state"]
