"""π_old (the proximal policy of decoupled PPO) without a forward pass: AReaL's log-linear approximation.

AReaL (inclusionAI/AReaL, docs/algorithms/prox_approx.md, `actor.prox_logp_method: loglinear`) interpolates
between the behaviour policy that sampled a token and the current policy, by weight version:

    α = (v_prox − v_behave) / (v_θ − v_behave),   log π_prox ≈ log π_behave + α · (log π_θ − log π_behave)

Here the versions are optimizer steps, given as lags from the current policy (what the trainer's micro-batches
carry): `behave_lag` = v_θ − v_behave per token (`weight_lag`), `prox_lag` = v_θ − v_prox (the steps trained on the
rollout so far), so α = (behave_lag − prox_lag) / behave_lag, clamped to [0, 1]. When π_prox and π_θ are the same
weights (prox_lag = 0, the rollout's first step) α = 1 and π_prox is π_θ, i.e. exactly the recomputed π_old; a
token whose behaviour version is π_θ's own or unknown (behave_lag = 0) takes π_θ too. Torch only; the result is
detached (π_old is a constant of the loss).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from slime_corr.config import RolloutCorrectionConfig

PROX_LOGP_METHODS = ("recompute", "loglinear")


def check_prox_logp_method(method: str, config: RolloutCorrectionConfig, truncated: bool) -> str:
    """`method` if it can run with the correction `config` (and the rollout's top-p / top-k `truncated`), else
    ValueError naming `--prox-logp-method` and the fix."""
    if method not in PROX_LOGP_METHODS:
        raise ValueError(f"--prox-logp-method {method!r} is not one of {', '.join(PROX_LOGP_METHODS)}.")
    if method == "recompute":
        return method
    if config.use_rollout_logprobs:
        raise ValueError("--prox-logp-method loglinear approximates decoupled mode's recomputed lp_old; bypass mode "
                         "(--use-rollout-logprobs) has none: drop one of the two.")
    if truncated:
        raise ValueError("--prox-logp-method loglinear with --rollout-top-p / --rollout-top-k: the recomputed lp_old "
                         "also renormalizes the rollout to the trainer's nucleus, which the interpolation cannot; "
                         "use --prox-logp-method recompute.")
    if config.use_tis and config.tis_batch_normalize:
        raise ValueError("--prox-logp-method loglinear with --tis-batch-normalize: the step's mean needs lp_old of "
                         "every micro-batch before the update; use --prox-logp-method recompute or drop "
                         "--tis-batch-normalize.")
    return method


def loglinear_alpha(behave_lag: Tensor, prox_lag: Tensor | int) -> Tensor:
    """α per token (see the module doc), float64 on `behave_lag`'s device."""
    lag = behave_lag.to(torch.float64)
    prox = torch.as_tensor(prox_lag, dtype=torch.float64, device=lag.device)
    alpha = (lag - prox) / lag.clamp(min=1.0)
    return torch.where(lag > 0, alpha.clamp(0.0, 1.0), torch.ones_like(alpha))


def loglinear_prox_log_probs(lp_behave: Tensor, lp_current: Tensor, behave_lag: Tensor,
                             prox_lag: Tensor | int) -> Tensor:
    """log π_prox ≈ log π_behave + α · (log π_θ − log π_behave), detached, in `lp_current`'s dtype; α from
    `loglinear_alpha`. A non-finite behaviour log-prob (a masked or padding token) gives π_θ's."""
    current = lp_current.detach()
    behave = lp_behave.to(current.dtype)
    alpha = loglinear_alpha(behave_lag, prox_lag).to(current.dtype)
    approx = behave + alpha * (current - behave)
    exact = alpha == 1  # π_θ itself, exactly (no rounding through the interpolation)
    return torch.where(exact | ~behave.isfinite(), current, approx)


def prox_error_sums(approx: Tensor, recomputed: Tensor, mask: Tensor) -> Tensor:
    """[Σ |approx − recomputed|, Σ mask, max |approx − recomputed|] over the masked tokens (float64): summed and
    maxed over ranks by the caller, then mean = sum / count."""
    diff = (approx.detach().to(torch.float64) - recomputed.to(torch.float64)).abs()
    keep = mask > 0
    diff = torch.where(keep, diff, torch.zeros_like(diff))  # also a masked token's inf/NaN
    return torch.stack([diff.sum(), keep.sum().to(torch.float64),
                        diff.max() if diff.numel() else diff.new_zeros(())])


__all__ = ["PROX_LOGP_METHODS", "check_prox_logp_method", "loglinear_alpha", "loglinear_prox_log_probs", "prox_error_sums"]
