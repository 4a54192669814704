"""The engine's own nucleus, read from its top-N log-probs (SGLang's `top_logprobs_num`): which tokens its top-k /
top-p filter kept at each position and their mass M_μ, so the trainer can renormalize the rollout log-prob exactly,
lp_rollout − log M_μ = log μ_trunc(y), instead of by its own nucleus mass (`slime_corr.mcore.nucleus`).

SGLang 0.5's joint filter (the torch sampler; flashinfer's `filter_apply_order="joint"`; the embedded engine) on the
probabilities p_0 ≥ p_1 ≥ ... of log_softmax(logits / T), sorted: rank i is kept iff

    i < k   and   S_i = Σ_{j<i} p_j ≤ top_p          (S_0 = 0: the first rank is always kept)

so the kept set is the first K ranks, K = min(k, #{i : S_i ≤ top_p}), and M_μ = S_K. The engine returns the N
largest log-probs sorted descending (`meta_info.output_top_logprobs`), so K and M_μ are known from them when the
boundary lies within the N: S_N > top_p, or k ≤ N. Otherwise the position "does not fit" (the caller falls back to
the trainer's nucleus mass). A top-p boundary within `BOUNDARY_TOLERANCE` of top_p (the engine sums float32
probabilities, we sum its rounded log-probs in float64) is ambiguous and does not fit either. Exact ties of
probabilities keep the engine's rank order (the mass of the first K ranks does not depend on how ties are ordered;
a sampled token tied with the last kept one counts as kept).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

BOUNDARY_TOLERANCE = 1e-5  # |S_i − top_p| below this: the engine's float32 cumulative sum may decide either way
DEFAULT_NUCLEUS_LOGPROBS = 20  # the top-p cap of --rollout-nucleus-logprobs


@dataclass(frozen=True)
class NucleusRequest:
    """What to ask the engine for (`top_logprobs_num` = `num`) and how it samples (SGLang's `top_p`, `top_k`;
    `top_k` ≤ 0 is off)."""

    top_p: float
    top_k: int
    num: int

    def __post_init__(self) -> None:
        if self.num < 1:
            raise ValueError(f"top_logprobs_num {self.num} must be >= 1")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p {self.top_p} must be in (0, 1]")
        if not (self.top_p < 1.0 or self.top_k > 0):
            raise ValueError("top_p = 1 and no top_k: no truncation to read")


def nucleus_request(sampling_params: Mapping[str, Any], cap: int) -> NucleusRequest | None:
    """The top-N request for these sampling params: N = top_k when top-k decides alone or top_k ≤ `cap`, else
    `cap`; None when nothing is truncated (top_p = 1, no top_k) or `cap` is 0 (the engine path off)."""
    top_p = 1.0 if sampling_params.get("top_p") is None else float(sampling_params["top_p"])
    top_k = max(int(sampling_params.get("top_k") or -1), -1)
    if cap <= 0 or not (top_p < 1.0 or top_k > 0):
        return None
    exact_k = top_k > 0 and (top_p >= 1.0 or top_k <= cap)
    return NucleusRequest(top_p, top_k, top_k if exact_k else cap)


class EngineNucleus(NamedTuple):
    """Per position [T]: `kept` (the engine kept its first `kept` ranks; 0 where it does not fit), `log_mass`
    (log M_μ, float64, NaN where it does not fit), `fits`, and `inside` (the sampled token is among the kept,
    where it fits)."""

    kept: Tensor
    log_mass: Tensor
    fits: Tensor
    inside: Tensor


def engine_nucleus(top_log_probs: Tensor, top_ids: Tensor, sampled_ids: Tensor, sampled_log_probs: Tensor, *,
                   top_p: float, top_k: int, tolerance: float = BOUNDARY_TOLERANCE) -> EngineNucleus:
    """The engine's kept set and log M_μ per position (module doc) from its top-N log-probs `top_log_probs` [T, N]
    (sorted descending) with token ids `top_ids` [T, N], and the sampled tokens `sampled_ids` [T] with their
    log-probs `sampled_log_probs` [T]. Vectorized over T; `top_k` ≤ 0 and `top_p` = 1 are off (one must be on)."""
    use_p, use_k = top_p < 1.0, top_k > 0
    if not (use_p or use_k):
        raise ValueError("engine_nucleus: top_p = 1 and no top_k: nothing is truncated")
    lp = top_log_probs.to(torch.float64)
    rows, n = lp.shape
    rank = torch.arange(n, device=lp.device)
    before = torch.cat([lp.new_zeros(rows, 1), lp.exp().cumsum(-1)], -1)  # [T, N+1]: S_0 .. S_N
    k = top_k if use_k else n + 1  # (no top-k: never the binding limit)
    if use_p:
        count_p = (before[:, :n] <= top_p).sum(-1)  # K_p when the boundary is inside the N (≥ 1: S_0 = 0)
        known_p = (count_p < n) | (before[:, n] > top_p)
    else:
        count_p = torch.full((rows,), n, device=lp.device)
        known_p = torch.zeros(rows, dtype=torch.bool, device=lp.device)
    kept = count_p.clamp_max(k)
    fits = known_p | (use_k and k <= n)
    if use_p:  # a top-p boundary the engine's float32 sum may have drawn one rank earlier or later
        s_first_out = before.gather(-1, count_p[:, None])[:, 0]
        s_last_in = before.gather(-1, (count_p - 1).clamp_min(0)[:, None])[:, 0]
        one_more = known_p & (count_p < k) & (s_first_out - top_p <= tolerance)
        one_less = (kept == count_p) & (count_p >= 2) & (top_p - s_last_in < tolerance)
        fits = fits & ~one_more & ~one_less
    kept = torch.where(fits, kept, 0)
    in_set = rank[None, :] < kept[:, None]
    log_mass = lp.masked_fill(~in_set, -torch.inf).logsumexp(-1).clamp_max(0.0)
    log_mass = torch.where(fits, log_mass, torch.nan)
    listed = ((top_ids == sampled_ids[:, None]) & in_set).any(-1)
    last_kept = lp.gather(-1, (kept - 1).clamp_min(0)[:, None])[:, 0]
    inside = fits & (listed | (sampled_log_probs.to(torch.float64) == last_kept))
    return EngineNucleus(kept, log_mass, fits, inside)


__all__ = ["BOUNDARY_TOLERANCE", "DEFAULT_NUCLEUS_LOGPROBS", "EngineNucleus", "NucleusRequest", "engine_nucleus",
           "nucleus_request"]
