"""The policy the trainer trains, built by ONE function (`build_policy`) from the config: the model on this rank,
the frozen reference policy (KL term), how to run it on a micro-batch, and how the rollout engines serve it.

Today the policy is the tiny Megatron GPTModel (`slime_corr.mcore.model`) with byte tokens. A pretrained model
(`--model smollm2-135m`, `slime_corr.models`) plugs in here: its bridge builds the model and exports HF-named
weights, and the engine serves the HF model (`slime_corr.models.hf_checkpoint.load_engine_module`).

The engines run the model unsharded beside the TP-sharded trainer, in the driver's process: the engine's GPTModel
gets process groups of its own (`single_rank_groups`), so its layers never enter the trainer's collectives.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from slime_corr.trainer.config import TrainerConfig

WEIGHTS_FILE = "model.pt"
ModelForward = Callable[[nn.Module, dict[str, Tensor]], Tensor]


class EngineGPT:
    """The trainer's GPTModel architecture served by the embedded engine (`TorchEngineModel`'s module): built
    unsharded with its own single-rank process groups, weights from `WEIGHTS_FILE` (the trainer's names)."""

    def __init__(self, model_args: Any, checkpoint_dir: str) -> None:
        from slime_corr.mcore.model import build_tiny_gpt, single_rank_groups

        self.module = build_tiny_gpt(model_args, ddp=False, pg_collection=single_rank_groups())
        state = torch.load(Path(checkpoint_dir) / WEIGHTS_FILE, weights_only=True)
        result = self.module.load_state_dict(state, strict=False)  # the file holds tensors, not _extra_state
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise ValueError(f"{checkpoint_dir}: weights do not fit the model (missing {missing[:3]}, unexpected "
                             f"{result.unexpected_keys[:3]})")
        self.cfg = types.SimpleNamespace(vocab_size=model_args.vocab_size, eos_token_id=None,
                                         max_seq_len=model_args.max_position_embeddings)

    def to(self, dtype: torch.dtype) -> EngineGPT:
        self.module = self.module.to(dtype)
        return self

    def eval(self) -> EngineGPT:
        self.module.eval()
        return self

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def __call__(self, input_ids: Tensor) -> Tensor:
        position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)
        return self.module(input_ids=input_ids, position_ids=position_ids, attention_mask=None)


@dataclass
class Policy:
    """The trained policy on this rank (see the module doc)."""

    model: nn.Module  # Megatron DDP around this rank's GPTModel shard
    reference: nn.Module | None  # the frozen initial policy (KL term), or None
    forward: ModelForward  # logits [B, S_local, V/TP] of this rank's (CP-sliced) micro-batch
    engine_module: Callable[[str], Any]  # checkpoint dir -> the module an embedded engine serves
    pad_token_id: int = 0

    @property
    def module(self) -> nn.Module:
        """The GPTModel inside the DDP wrapper."""
        return self.model.module

    def full_weights(self) -> dict[str, Tensor]:
        """Every weight as its full tensor (TP shards gathered): COLLECTIVE over the TP group."""
        from slime_corr.mcore.params import full_named_tensors

        return {name: t.clone() for name, t in full_named_tensors(self.module)}

    @staticmethod
    def save_engine_checkpoint(weights: dict[str, Tensor], directory: Path) -> str:
        """Write `weights` where an engine loads them from (`/update_weights_from_disk`); returns the directory."""
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / (WEIGHTS_FILE + ".tmp")
        torch.save(weights, tmp)
        tmp.replace(directory / WEIGHTS_FILE)  # atomic: an engine never reads half a file
        return str(directory)


def build_policy(config: TrainerConfig, *, with_reference: bool) -> Policy:
    """The policy of `config` on the current parallel_state (call `apply_cpu_compat()` first on CPU). Collective:
    every rank builds its shard (same seed: same full weights) and the engines' single-rank process groups."""
    from slime_corr.mcore.loss_hook import default_model_forward
    from slime_corr.mcore.model import build_tiny_gpt, emulated_cp_forward, single_rank_groups

    args = config.model
    model = build_tiny_gpt(args, ddp=True)
    reference = None
    if with_reference:  # the initial policy: the same seed builds the same weights
        reference = build_tiny_gpt(args, ddp=False).eval()
        reference.requires_grad_(False)
    single_rank_groups()
    emulated = config.context_parallel_size > 1 or config.use_dynamic_batch_size  # CP / THD attention on CPU
    forward = emulated_cp_forward if emulated else default_model_forward
    engine_args = dataclasses.replace(args, params_dtype=torch.float32)  # the engine casts to --engine-dtype
    return Policy(model=model, reference=reference, forward=forward,
                  engine_module=lambda directory: EngineGPT(engine_args, directory))


__all__ = ["EngineGPT", "Policy", "WEIGHTS_FILE", "build_policy"]
