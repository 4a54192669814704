"""Rollout-correction core: IS weights, rejection sampling, veto, batch normalization and mismatch metrics.

The IS/RS formulas and the built-in weighting function live in `builtin_weights.py`, the public records
(`WeightInputs`, `WeightOutputs`, `CorrectionResult`) in `public_types.py`, the records the stages pass each other
in `stage_records.py`, the weight stage in `weight_stage.py`, the orchestration (and the only collectives) in
`core.py`, metric definitions in `metrics.py`, the masked-reduction helpers in `reductions.py`, and the per-sequence
reductions of padded rows or packed (THD) rows in `slime_corr.layout.segments`.
"""

from slime_corr.correction.budget import StepBounds
from slime_corr.correction.builtin_weights import default_weights
from slime_corr.correction.core import (
    compute_rollout_correction,
    correction_metrics,
    normalize_weights,
    weight_function,
    weight_mean,
)
from slime_corr.correction.metrics import metrics_to_host
from slime_corr.correction.public_types import CorrectionResult, WeightInputs, WeightOutputs
from slime_corr.correction.statistics import BatchStatistics, merge_stats
from slime_corr.layout.segments import Segments

__all__ = [
    "BatchStatistics",
    "CorrectionResult",
    "Segments",
    "StepBounds",
    "WeightInputs",
    "WeightOutputs",
    "compute_rollout_correction",
    "correction_metrics",
    "merge_stats",
    "default_weights",
    "metrics_to_host",
    "normalize_weights",
    "weight_function",
    "weight_mean",
]
