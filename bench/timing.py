"""Interleaved timing shared by the benchmarks: a machine shared with other jobs slows every variant alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each function: one warm-up call each (first-call costs out), then `repeats`
    rounds calling every function once, in forward order on even rounds and in reverse on odd ones."""
    for fn in fns.values():
        fn()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}
