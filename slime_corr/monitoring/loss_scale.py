"""The fp16 loss scaler's skipped steps, said out loud: a run whose optimizer skips its steps trains nothing.

Megatron's dynamic loss scaler (`--fp16`) starts at `--initial-loss-scale` (2^32 by default, as in Megatron-LM) and
halves the scale at every step whose gradients overflow, skipping that step: the first ~20 steps of a run started
at 2^32 are typically skipped, and a short run can skip every one. `SkippedSteps` watches the step metrics: a notice
at the first skipped step, and at the end of the run a summary line when more than half (or all) were skipped, with
the fix. The report (`slime-corr report`) says the same from metrics.jsonl (`skipped_steps_line`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

SKIPPED_KEY = "train/skipped_steps"  # 1.0 on a step the loss scaler skipped (fp16 runs only)
LOSS_SCALE_KEY = "train/loss_scale"
FIX = ("start the scaler lower, as Megatron-LM users do, with --initial-loss-scale 65536 (or 4096), or train in "
       "--bf16, which needs no loss scale")


def skipped_steps_line(skipped: int, steps: int, last_scale: float | None = None) -> str | None:
    """The summary of a run with `skipped` of `steps` optimizer steps skipped: None unless more than half were."""
    if not steps or 2 * skipped <= steps:
        return None
    scale = f" (the loss scale was {last_scale:g} at the end)" if last_scale is not None else ""
    what = "every one" if skipped == steps else f"{skipped} of {steps}"
    return (f"the fp16 loss scaler skipped {what} of the run's {steps} optimizer steps (gradient overflow at the "
            f"scale of the step){scale}: the model trained on {steps - skipped} step(s). To train from the first "
            f"steps, {FIX}.")


class SkippedSteps:
    """Counts the steps the loss scaler skipped (`observe` each step's metrics; `summary` at the end)."""

    def __init__(self) -> None:
        self.steps = self.skipped = 0
        self.last_scale: float | None = None

    def observe(self, step: int, metrics: Mapping[str, float]) -> str | None:
        """A notice for the run's first skipped step, else None."""
        if SKIPPED_KEY not in metrics:
            return None
        self.steps += 1
        self.last_scale = metrics.get(LOSS_SCALE_KEY, self.last_scale)
        if metrics[SKIPPED_KEY] < 1:
            return None
        self.skipped += 1
        if self.skipped > 1:
            return None
        scale = f"; the scale is now {self.last_scale:g}" if self.last_scale is not None else ""
        return (f"step {step}: the fp16 loss scaler skipped this step (its gradients overflowed: no update, "
                f"trained=0 skipped=1 on its line{scale}). A run started at Megatron's default --initial-loss-scale "
                f"2^32 skips its first ~20 steps; to train from the first ones, {FIX}.")

    def summary(self) -> str | None:
        return skipped_steps_line(self.skipped, self.steps, self.last_scale)


def summary_of_records(records: Iterable[Mapping[str, float]]) -> str | None:
    """`skipped_steps_line` of a run's logged step records (the report)."""
    watch = SkippedSteps()
    for record in records:
        if record.get(SKIPPED_KEY) is not None:
            watch.steps += 1
            watch.skipped += record[SKIPPED_KEY] >= 1
            watch.last_scale = record.get(LOSS_SCALE_KEY, watch.last_scale)
    return watch.summary()


__all__ = ["SKIPPED_KEY", "SkippedSteps", "skipped_steps_line", "summary_of_records"]
