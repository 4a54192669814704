"""Progress of a step's rollout: a tqdm bar on a terminal, a few plain lines in CI logs.

    progress = RolloutProgress(total=num_samples, step=step, mode=config.rollout_progress)
    buffer = ProgressSampleBuffer(maxsize, progress)   # counts every group the rollout puts
    ...                                                # rollout + training
    progress.close()

`update` may be called from the rollout's event-loop thread. Plain lines are printed when the count crosses a
quarter of the total (so at most four per rollout): `rollout 3: 8/16 samples (50%), 96 tokens, 1 failed, 0.8 s`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

from slime_corr.rollout.buffer import SampleBuffer
from slime_corr.samples import Sample, SampleStatus

LINE_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


class RolloutProgress:
    """Counts finished samples (and their tokens, failures) of one step's rollout."""

    def __init__(self, total: int, *, step: int, mode: str = "auto", stream: TextIO | None = None) -> None:
        self.total, self.step = total, step
        self.stream = stream or sys.stderr
        self.done = self.tokens = self.failed = 0
        self.start = time.perf_counter()
        self._lock = threading.Lock()
        self._next_line = 0
        if mode == "auto":
            mode = "bar" if _isatty(self.stream) and _has_tqdm() else "lines"
        self.mode = mode
        self._bar: Any = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=f"rollout {step}", unit="sample", file=self.stream, leave=False,
                             dynamic_ncols=True)

    def update(self, samples: Sequence[Sample]) -> None:
        """Count finished samples (thread-safe)."""
        with self._lock:
            self.done += len(samples)
            self.tokens += sum(s.response_length for s in samples)
            self.failed += sum(s.status == SampleStatus.FAILED for s in samples)
            if self._bar is not None:
                self._bar.update(len(samples))
                self._bar.set_postfix(tokens=self.tokens, failed=self.failed, refresh=False)
            elif self.mode == "lines":
                crossed = False
                while self._next_line < len(LINE_FRACTIONS) and self.done >= LINE_FRACTIONS[self._next_line] * self.total:
                    self._next_line += 1
                    crossed = True
                if crossed:
                    print(self.line(), file=self.stream, flush=True)

    def line(self) -> str:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        failed = f", {self.failed} failed" if self.failed else ""
        return (f"rollout {self.step}: {self.done}/{self.total} samples ({pct:.0f}%), {self.tokens} tokens"
                f"{failed}, {time.perf_counter() - self.start:.1f} s")

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None


class ProgressSampleBuffer(SampleBuffer):
    """A `SampleBuffer` that reports each group put into it to a `RolloutProgress`."""

    def __init__(self, maxsize: int, progress: RolloutProgress) -> None:
        super().__init__(maxsize)
        self.progress = progress

    async def put_group(self, samples: list[Sample]) -> None:
        await super().put_group(samples)
        self.progress.update(samples)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _has_tqdm() -> bool:
    import importlib.util

    return importlib.util.find_spec("tqdm") is not None


__all__ = ["ProgressSampleBuffer", "RolloutProgress"]
