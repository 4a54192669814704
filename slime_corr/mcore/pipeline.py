"""Running the hook's passes through Megatron's schedules, pipeline parallelism (PP) included.

`run_schedule` calls Megatron's `forward_backward_func` over a step's micro-batches (a list, or a stream with
`len()`). `forward_only` is the forward-only pass the hook needs before a step (lp_old in decoupled mode, the
log-probs of a bypass normalization pre-pass): with PP it goes through Megatron's pipelined schedule
(`forward_only=True, collect_non_loss_data=True`), every stage running its layers on every micro-batch and the
LAST stage collecting the log-probs; the other stages get none, and need none: the loss runs on the last stage.

Under PP the stages exchange activations of shape [S, B, hidden]. Megatron takes that shape from the schedule's
`seq_length` / `micro_batch_size` unless the model's config has `variable_seq_lengths=True` (set on the config
object, as slime and NeMo-RL do: Megatron-LM has no flag, and the TransformerConfig constructor refuses it with
the default MoE dispatcher), in which case every exchange sends its shape first. Packed micro-batches, padded ones of
different lengths and streams (whose shapes are not known ahead) need it: `run_schedule` says so before the
schedule starts instead of letting a stage wait for a tensor of the wrong size.

`gather_stages` merges every stage's weights on the first stage (a model's full weights, e.g. for a rollout engine
that runs it unsplit); `from_last_stage` hands what the last stage computed (the loss's metrics) to every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from slime_corr.mcore.compat import get_forward_backward_func
from slime_corr.mcore.context_parallel import ParallelGroups

MicroBatches = Sequence[dict[str, Tensor]] | Iterator[dict[str, Tensor]]  # a stream must also have len()


def run_schedule(
    fb: Callable[..., Any],
    forward_step: Callable[..., Any],
    model: Any,
    micro_batches: MicroBatches,
    groups: ParallelGroups,
    **kwargs: Any,
) -> Any:
    """Run Megatron's schedule `fb` over `micro_batches`: a list, or a stream with `len()` (e.g. a
    `BufferMicroBatchIterator`) that the schedule reads one micro-batch per forward step. `seq_length` is the full
    (un-CP-sliced) length, as Megatron's pipelined schedules expect."""
    if isinstance(micro_batches, Sequence):
        b, s = micro_batches[0]["labels"].shape
        data = iter(micro_batches)
    else:  # shapes are not known ahead of a stream (`check_pipeline_shapes` requires variable shapes then)
        (b, s), data = (0, 0), micro_batches
    if groups.pp_size > 1:
        check_pipeline_shapes(model, micro_batches)
    return fb(
        forward_step_func=forward_step,
        data_iterator=data,
        model=model,
        num_microbatches=len(micro_batches),  # type: ignore[arg-type]
        seq_length=s * groups.cp_size,
        micro_batch_size=b,
        **kwargs,
    )


def check_pipeline_shapes(model: Any, micro_batches: MicroBatches) -> None:
    """Under PP: micro-batches whose shapes differ (or a stream) need `variable_seq_lengths=True` (module doc)."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0] if isinstance(model, list | tuple) else model)
    if getattr(config, "variable_seq_lengths", False):
        return
    if not isinstance(micro_batches, Sequence):
        what = "a stream of micro-batches (their shapes are not known ahead)"
    else:
        shapes = sorted({tuple(b["labels"].shape) for b in micro_batches})
        if len(shapes) == 1:
            return
        what = f"micro-batches of shapes {shapes}"
    raise ValueError(
        f"pipeline parallelism with {what}: the stages exchange activations whose shape Megatron takes from "
        "seq_length/micro_batch_size; set `config.variable_seq_lengths = True` on the model's TransformerConfig "
        "(Megatron-LM has no flag for it: set it in the model provider, after core_transformer_config_from_args) "
        "so that each exchange sends its shape first, or give every micro-batch one shape (padded, same length)."
    )


def forward_only(
    model: Any,
    micro_batches: Sequence[dict[str, Tensor]],
    model_forward: Callable[[Any, dict[str, Tensor]], Tensor],
    collect: Callable[[dict[str, Tensor], Tensor], Tensor],
    groups: ParallelGroups,
) -> list[Tensor]:
    """`collect(batch, logits)` for every micro-batch from a no-grad forward pass of the current weights.

    Without PP: one `model_forward` per micro-batch (it can also run from inside a training schedule). With PP:
    Megatron's pipelined schedule, forward-only; the results exist on the last stage ([] on the others)."""
    if groups.pp_size == 1:
        chunk = model[0] if isinstance(model, list | tuple) else model
        with torch.no_grad():
            return [collect(b, model_forward(chunk, b)) for b in micro_batches]

    def forward_step(data_iterator: Iterator[dict[str, Tensor]], model: Any) -> tuple[Tensor, Callable]:
        batch = next(data_iterator)
        return model_forward(model, batch), partial(_collected, collect, batch)

    with torch.no_grad():
        return run_schedule(get_forward_backward_func(), forward_step, model, micro_batches, groups,
                            forward_only=True, collect_non_loss_data=True)


def _collected(collect: Callable[[dict[str, Tensor], Tensor], Tensor], batch: dict[str, Tensor], output: Tensor,
               non_loss_data: bool = False) -> Tensor:
    """The schedule's loss_func in collect_non_loss_data mode: what it returns is stored per micro-batch."""
    return collect(batch, output)


def gather_stages(weights: dict[str, Tensor]) -> dict[str, Tensor] | None:
    """Without PP: `weights`. With PP: every stage's `weights` (named as in the unsplit model, e.g. by
    `params.full_named_tensors`) merged on the first stage; one object gather over the PP group of TP rank 0
    (a collective there; the other TP ranks return None at once), None off the first stage."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return weights
    if ps.get_tensor_model_parallel_rank() != 0:
        return None
    first = ps.is_pipeline_first_stage(ignore_virtual=True)
    parts: list[Any] | None = [None] * ps.get_pipeline_model_parallel_world_size() if first else None
    dist.gather_object(weights, parts, dst=ps.get_pipeline_model_parallel_first_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    if parts is None:
        return None
    merged: dict[str, Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def from_last_stage(obj: Any) -> Any:
    """Without PP: `obj`. With PP: the last stage's `obj` on every stage of this rank's pipeline (one object
    broadcast over the PP group; collective)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
    return box[0]


__all__ = ["check_pipeline_shapes", "forward_only", "from_last_stage", "gather_stages", "run_schedule"]
