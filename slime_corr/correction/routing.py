"""Routing mismatch of a Mixture-of-Experts policy: how often two routers (the rollout engine's and the trainer's)
pick different expert sets for the same token, and the log-prob mismatch split by it. Pure tensor math.

Routes are expert ids `[..., T, L, k]` (any integer dtype; the order within the k is ignored: a route is a set).
With a valid-token mask `m` `[..., T]`, `d[t, l] = 1` when the top-k sets of layer l differ at token t:
- `routing_mismatch_frac`       = Σ m·d / (L·Σ m)        share of router decisions (token, layer) that differ
- `routing_mismatch_token_frac` = Σ m·max_l d / Σ m      share of tokens routed differently in at least one layer
- `routing_mismatch_layer_{l}`  = Σ m·d[:, l] / Σ m      per layer
- `logprob_abs_diff_routing_same` / `_diff`: mean |lp_a - lp_b| over valid tokens without / with a difference at
  their own position (alignment is the caller's: position t's routes with the log-prob computed at t), and
  `routing_mismatch_tokens` / `routing_tokens`: the counts behind them.
Every statistic is a ratio of sums reduced over the optional CP and DP groups in one all_reduce per group
(`routing_mismatch_metrics`), or given as the local (numerator, denominator) sums (`routing_mismatch_pairs`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_corr.correction.reductions import ProcessGroup, float_mask, global_sum, valid_mask


def routes_differ(routes_a: Tensor, routes_b: Tensor) -> Tensor:
    """`[..., L, k]` x2 -> `[..., L]` bool: True where the two top-k expert *sets* differ."""
    if routes_a.shape != routes_b.shape:
        raise ValueError(f"routes_differ: shapes {tuple(routes_a.shape)} and {tuple(routes_b.shape)} differ "
                         "(both [..., tokens, layers, top_k])")
    a = routes_a.long().sort(dim=-1).values
    b = routes_b.long().sort(dim=-1).values
    return (a != b).any(dim=-1)


def topk_routes(router_logits: Tensor, top_k: int) -> Tensor:
    """`[..., L, E]` router logits (or scores) -> `[..., L, k]` ids of the top-k experts (softmax is monotone,
    so logits and probabilities give the same set)."""
    return router_logits.topk(top_k, dim=-1).indices


def _local_sums(routes_a: Tensor, routes_b: Tensor, mask: Tensor, lp_a: Tensor | None,
                lp_b: Tensor | None) -> tuple[int, Tensor]:
    """(L, this rank's sums as one float64 vector): [Σm, Σm·d, Σm·max_l d, Σm·d[:, l] (L), then with log-probs
    Σ|Δlp|·m·max_l d, Σ|Δlp|·m·(1 - max_l d)]."""
    if routes_a.dim() < 3 or mask.shape != routes_a.shape[:-2]:
        raise ValueError(f"routing_mismatch_metrics: mask {tuple(mask.shape)} must be routes' [..., T] "
                         f"(routes {tuple(routes_a.shape)}: [..., T, layers, top_k])")
    if (lp_a is None) != (lp_b is None) or (lp_a is not None and (lp_a.shape != mask.shape or lp_b.shape != mask.shape)):
        raise ValueError("routing_mismatch_metrics: give both lp_a and lp_b, shaped like mask, or neither")
    num_layers = routes_a.shape[-2]
    m = float_mask(valid_mask(mask), torch.float64)
    d = float_mask(routes_differ(routes_a, routes_b), torch.float64)  # [..., T, L]
    any_d = d.amax(dim=-1) if num_layers else torch.zeros_like(m)
    parts = [m.sum(), (d.sum(-1) * m).sum(), (any_d * m).sum(), (d * m.unsqueeze(-1)).flatten(0, -2).sum(0)]
    if lp_a is not None:
        abs_diff = (lp_a.double() - lp_b.double()).abs()
        abs_diff = torch.where(m > 0, abs_diff, torch.zeros_like(abs_diff))  # NaN at masked positions ignored
        parts += [(abs_diff * any_d).sum(), (abs_diff * (1 - any_d)).sum()]
    return num_layers, torch.cat([p.reshape(-1) for p in parts])


def _pairs(num_layers: int, tot: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    tokens, decisions_diff, tokens_diff = tot[0], tot[1], tot[2]
    out = {
        "routing_mismatch_frac": (decisions_diff, tokens * num_layers),
        "routing_mismatch_token_frac": (tokens_diff, tokens),
        **{f"routing_mismatch_layer_{i}": (tot[3 + i], tokens) for i in range(num_layers)},
    }
    if tot.numel() > 3 + num_layers:
        out["logprob_abs_diff_routing_diff"] = (tot[3 + num_layers], tokens_diff)
        out["logprob_abs_diff_routing_same"] = (tot[4 + num_layers], tokens - tokens_diff)
    return out


def routing_mismatch_pairs(
    routes_a: Tensor, routes_b: Tensor, mask: Tensor, lp_a: Tensor | None = None, lp_b: Tensor | None = None
) -> dict[str, tuple[Tensor, Tensor]]:
    """The ratio statistics of the module doc as this rank's `(numerator, denominator)` sums (float64, no
    collective): summed over micro-batches and ranks, numerator / denominator is the statistic of the whole
    batch (Megatron's `[numerator, denominator]` reporting pairs)."""
    return _pairs(*_local_sums(routes_a, routes_b, mask, lp_a, lp_b))


def routing_mismatch_metrics(
    routes_a: Tensor,
    routes_b: Tensor,
    mask: Tensor,
    lp_a: Tensor | None = None,
    lp_b: Tensor | None = None,
    cp_group: ProcessGroup = None,
    dp_group: ProcessGroup = None,
) -> dict[str, Tensor]:
    """The statistics of the module doc (0-dim float64 tensors; 0 where a denominator is 0). `routes_*`
    `[..., T, L, k]`, `mask` `[..., T]` (bool or 0/1; NaN invalid), `lp_*` `[..., T]` optional."""
    num_layers, flat = _local_sums(routes_a, routes_b, mask, lp_a, lp_b)
    tot = global_sum(flat, cp_group, dp_group)

    def div(num: Tensor, den: Tensor) -> Tensor:
        return torch.where(den > 0, num / den.clamp(min=1), torch.zeros_like(num))

    return {"routing_tokens": tot[0], "routing_mismatch_tokens": tot[2],
            **{k: div(n, d) for k, (n, d) in _pairs(num_layers, tot).items()}}


__all__ = ["routes_differ", "topk_routes", "routing_mismatch_metrics", "routing_mismatch_pairs"]
