"""The start-up agreement check: on the first step the job trains from samples of the weights being trained (staleness
0: not a resumed run's pending rollouts, not a later step of the same rollout), the engine's log-probs and the
trainer's must agree as well as their precisions allow, or the run stops with the numbers and the likely causes.

On that step both sides hold the same weights (the engines were given the trainer's, and lp_old, or lp in bypass
mode, is computed before the step's update), so `train_rollout_logprob_abs_diff` = mean |lp_train − lp_rollout| is the
mismatch of precision and kernels alone. Measured here (tiny model, 2 layers): 1e-5 with both sides in fp32,
7e-4 with a bf16 engine against the fp32 trainer. A model the engine serves differently is far above that: a tied
Qwen3-MoE whose LM head SGLang left at zero gave 0.13 in fp32, and every log-prob at -log(vocab). The bounds leave
two to three orders of magnitude of room. `--no-engine-agreement-check` turns the check off (a model whose
mismatch is large on purpose).
"""

from __future__ import annotations

from collections.abc import Mapping

METRIC = "rollout_corr/train_rollout_logprob_abs_diff"
FULL_PRECISION = ("float32", "float64")
BOUND_FULL = 0.01  # nats, both sides in fp32 or fp64
BOUND_HALF = 0.25  # nats, either side in bf16 or fp16


class EngineAgreementError(RuntimeError):
    """The engine's and the trainer's log-probs of the first step disagree beyond their precisions."""


def agreement_bound(engine_dtype: str, trainer_dtype: str) -> float:
    """The largest mean |lp_train − lp_rollout| the two precisions explain (nats)."""
    full = engine_dtype in FULL_PRECISION and trainer_dtype in FULL_PRECISION
    return BOUND_FULL if full else BOUND_HALF


def precision_notice(engine_dtype: str, trainer_dtype: str, corrects: bool) -> str | None:
    """A line for a run whose engine and trainer compute in different precisions, one of them in half precision
    (bf16, fp16; the trainer's under --bf16 / --fp16), with no correction on (their log-probs differ by the precision
    alone: with the tiny model here a bf16 engine against the fp32 trainer was 7e-4 nats per token, an fp16 one
    9e-5), else None. The default pairing (fp32 trainer, bf16 engine) gets it; a bf16 trainer with a bf16 engine
    is a matched pair."""
    full = engine_dtype in FULL_PRECISION and trainer_dtype in FULL_PRECISION
    if full or engine_dtype == trainer_dtype or corrects:
        return None
    narrow = (f"--engine-dtype {trainer_dtype} matches the trainer" if trainer_dtype not in FULL_PRECISION else
              "--engine-dtype float16 keeps 3 more mantissa bits than bfloat16, float32 closes it")
    return (f"the engine samples in {engine_dtype} and the trainer computes in {trainer_dtype}, and no rollout "
            "correction is on: the training is off-policy by that precision gap. Add a correction (e.g. "
            f"--rollout-correction-preset decoupled_seq_is_rs), or narrow the gap: {narrow}.")


def check_agreement(metrics: Mapping[str, float], engine_dtype: str, trainer_dtype: str, step: int) -> None:
    """Raise EngineAgreementError when the first step's `METRIC` exceeds `agreement_bound`; nothing when the step
    logged no such metric (no correction metrics, or no token trained)."""
    diff = metrics.get(METRIC)
    if diff is None:
        return
    bound = agreement_bound(engine_dtype, trainer_dtype)
    if not diff <= bound:  # also NaN
        raise EngineAgreementError(
            f"step {step}: the engine's log-probs and the trainer's disagree at the same weights: mean |lp_train - "
            f"lp_rollout| = {diff:.4g} nats, above the {bound:g} that an engine in {engine_dtype} and a trainer in "
            f"{trainer_dtype} explain. Likely causes: the engine serves another model than the trainer's (tied "
            "embeddings whose LM head it loads otherwise, a config key it reads otherwise: rope scaling, norm "
            "epsilon, attention bias), another tokenizer or chat template, or other weights (a stale checkpoint). "
            "Compare both on one prompt; --no-engine-agreement-check runs anyway.")


__all__ = ["EngineAgreementError", "agreement_bound", "check_agreement", "precision_notice"]
