"""Mismatch diagnostics the reference frameworks do not log, as mergeable tensor statistics.

With lr = lp_train − lp_rollout at valid finite tokens, x = clamp(lr, ±20) and k3 = exp(x) − x − 1 (as in
`mismatch_k3_kl`), every valid token adds to one bucket of each view:

- `prob`: the rollout probability p = exp(lp_rollout), cut at PROB_EDGES (log10 steps, finer near 1): does the
  mismatch concentrate on low-probability tokens?
- `pos`: the position in the response (0 = first trained token), cut at powers of two;
- `lag`: the weight lag of the token (trainer version − the version that sampled it), 0 … MAX_LAG−1, ≥ MAX_LAG
  (an asynchronous rollout trained in K optimizer steps lags K … 2K−1 versions).

Per bucket the sums are (tokens, Σ −lr, Σ k3, Σ |lr|, Σ lag, tokens with |lr| > LARGE_LOG_RATIO). In decoupled
mode, with lp_current = log π_θ at the training forward, the drift splits into a = lp_old − lp_rollout
(rollout→old, the mismatch) and b = lp_current − lp_old (old→current, the update size): Σ k3(a), Σ k3(b),
Σ k3(a + b), Σ a², Σ b².
Per sequence (row): (tokens, Σ lr, Σ k3) and max |lr| with its response position, for the top-k table.

Cost model: `diagnostic_sums` is pure local tensor math on one micro-batch (scatter-adds into fixed-size buckets,
no boolean indexing, no collective, no host sync). A step merges its micro-batches (`merge_stats`: sums add, rows
concatenate) and `reduce_diagnostics` runs once: one SUM and one MAX all_reduce per group for the buckets
(`BatchStats`), one SUM and one MAX (two with CP) over CP for the rows, one all_gather over DP for the top-k
candidates, then ONE device→host transfer. Tokens with a non-finite log-prob are left out (the correction core
rejects their whole sequence and counts them).

Where the Megatron loss hook calls it (`RolloutCorrectionLoss(..., diagnostics_top_k=k)`, which already holds every
input):
- `loss_func`, after `compute_policy_loss`: `diagnostic_sums(old if decoupled else log_probs,
  batch["rollout_log_probs"], loss_mask, lp_current=log_probs if decoupled else None,
  positions=response_positions(loss_mask, batch["position_ids"], groups.cp), weight_lag=batch.get("weight_lag"),
  sample_ids=batch.get("sample_ids"))` — `log_probs.detach()` is what the loss already computed, so nothing is
  recomputed; `response_positions` adds one [B] all_reduce over CP only when CP > 1;
- `reduce_step_metrics` (or `pop_diagnostics`): `MismatchDiagnostics.reduce(cp_group, dp_group)` once per step,
  kept as `hook.last_diagnostics`; the trainer logs its metrics under `diag/`
  (`slime_corr.monitoring.step_diagnostics`). The sums stay in the hook rather than in Megatron's report dict,
  whose values Megatron-LM's `train_step` averages as 1- or 2-element tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from slime_corr.correction.reductions import BatchStats, ProcessGroup, group_size, valid_mask

PROB_EDGES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 0.5, 0.9, 0.99)
POSITION_EDGES = tuple(2**k for k in range(15))  # 1, 2, 4, ..., 16384
MAX_LAG = 16
BUCKET_SUMS = ("n", "neg_lr", "k3", "abs_lr", "lag", "large")
LARGE_LOG_RATIO = 0.1  # |lr| above it: the token's probability ratio is off by more than ~10 %
DRIFT_SUMS = ("n", "k3_mismatch", "k3_update", "k3_total", "sq_mismatch", "sq_update")
ROW_SUMS = ("n", "lr", "k3")
LOG_RATIO_CLAMP = 20.0


def _fmt(x: float) -> str:
    return f"{x:g}"


def bucket_labels(edges: Sequence[float]) -> list[str]:
    """Labels of the buckets `[.., e0), [e0, e1), ..., [e_last, ..)`: "lt_1e-06", "1e-06_1e-05", ..., "ge_0.99"."""
    inner = [f"{_fmt(a)}_{_fmt(b)}" for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return [f"lt_{_fmt(edges[0])}", *inner, f"ge_{_fmt(edges[-1])}"]


def position_labels() -> list[str]:
    """Response-position buckets: "0", "1", "2_3", "4_7", ..., "ge_16384" (integer ranges, inclusive)."""
    e = POSITION_EDGES
    return ["0", *(str(a) if b - a == 1 else f"{a}_{b - 1}" for a, b in zip(e[:-1], e[1:], strict=True)),
            f"ge_{e[-1]}"]


VIEWS: dict[str, list[str]] = {
    "prob": bucket_labels(PROB_EDGES),
    "pos": position_labels(),
    "lag": [*(str(k) for k in range(MAX_LAG)), f"ge_{MAX_LAG}"],
}


def k3(x: Tensor) -> Tensor:
    """exp(x) − x − 1 of clamp(x, ±20), via expm1 (no cancellation near 0)."""
    x = x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(x) - x


def response_positions(loss_mask: Tensor, position_ids: Tensor | None = None, cp_group: ProcessGroup = None) -> Tensor:
    """Position of each token in its response ([B, S] long): 0 at the row's first valid token.

    Padded rows: `position_ids` default to 0..S−1. Under CP the local slice holds zig-zag chunks, so pass the
    sliced `position_ids` (global positions) and `cp_group`: the row's first valid position is then a MIN over CP
    (one [B] all_reduce, done as a MAX of negatives).
    """
    valid = valid_mask(loss_mask)
    if position_ids is None:
        position_ids = torch.arange(valid.shape[-1], device=valid.device).expand_as(valid)
    big = torch.iinfo(torch.long).max
    first = torch.where(valid, position_ids.long(), big).amin(-1) if valid.shape[-1] else torch.full(
        valid.shape[:-1], big, dtype=torch.long, device=valid.device)
    if group_size(cp_group) > 1:
        neg = -first
        dist.all_reduce(neg, op=dist.ReduceOp.MAX, group=cp_group)
        first = -neg
    return (position_ids.long() - first.unsqueeze(-1)).clamp_min(0)


def _scatter_sums(index: Tensor, columns: Tensor, num_buckets: int) -> Tensor:
    """Σ of each column per bucket: columns [k, N] (zero at invalid tokens), index [N] -> [k, num_buckets]."""
    out = torch.zeros(columns.shape[0], num_buckets, dtype=columns.dtype, device=columns.device)
    return out.scatter_add_(1, index.expand(columns.shape[0], -1), columns)


def diagnostic_sums(
    lp_train: Tensor,
    lp_rollout: Tensor,
    loss_mask: Tensor,
    *,
    lp_current: Tensor | None = None,
    positions: Tensor | None = None,
    weight_lag: Tensor | None = None,
    sample_ids: Tensor | None = None,
) -> dict[str, Tensor]:
    """LOCAL diagnostic sums of one micro-batch ([B, S] slices; no collective, no host sync).

    `lp_train`: lp_old (decoupled) or lp.detach() (bypass); `lp_current`: log π_θ of the training forward in
    decoupled mode (enables the drift split); `positions`: `response_positions(...)` (default: from the mask,
    valid without CP); `weight_lag`: [B] or [B, S] integer lags (default 0); `sample_ids`: [B] ids carried into
    the top-k table (default −1). Returns bucket sums `diag_<view>` ([len(BUCKET_SUMS) · buckets], float64),
    `diag_drift` when `lp_current` is given, and the per-row `diag_rows` [B, 3 + 3] (ROW_SUMS, max |lr|, its
    position, sample id).
    """
    valid = valid_mask(loss_mask)
    lp_t = lp_train.detach().to(torch.float64)
    lp_r = lp_rollout.detach().to(torch.float64)
    lr = lp_t - lp_r
    ok = valid & lr.isfinite()
    if lp_current is not None:
        lp_c = lp_current.detach().to(torch.float64)
        ok = ok & lp_c.isfinite()
    okf = ok.to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=lr.device)
    lr = torch.where(ok, lr, zero)
    tok_k3 = k3(lr) * okf
    if positions is None:
        positions = response_positions(valid)
    if weight_lag is None:
        lag = torch.zeros_like(lr)
    else:  # [B] (one lag per sequence) or [B, S]
        lag = (weight_lag.unsqueeze(-1) if weight_lag.dim() == 1 else weight_lag).to(torch.float64)
        lag = lag.expand_as(lr).clamp_min(0) * okf

    columns = torch.stack([okf, -lr, tok_k3, lr.abs(), lag, (lr.abs() > LARGE_LOG_RATIO) * okf])
    columns = columns.reshape(len(BUCKET_SUMS), -1)
    p_index = torch.bucketize(torch.where(ok, lp_r, zero), lp_r.new_tensor([math.log(e) for e in PROB_EDGES]),
                              right=True)
    indices = {
        "prob": p_index,
        "pos": torch.bucketize(positions.long(), torch.tensor(POSITION_EDGES, device=lr.device), right=True),
        "lag": lag.round().long().clamp_max(MAX_LAG),
    }
    out = {f"diag_{view}": _scatter_sums(indices[view].reshape(-1), columns, len(VIEWS[view])).reshape(-1)
           for view in VIEWS}
    if lp_current is not None:
        a = lr
        b = torch.where(ok, lp_c - lp_t, zero)
        drift = torch.stack([okf, tok_k3, k3(b) * okf, k3(a + b) * okf, a * a, b * b])
        out["diag_drift"] = drift.reshape(len(DRIFT_SUMS), -1).sum(-1)

    abs_lr = lr.abs()
    row_max = abs_lr.amax(-1) if lr.shape[-1] else torch.zeros(lr.shape[:-1], dtype=lr.dtype, device=lr.device)
    at_max = abs_lr.argmax(-1, keepdim=True) if lr.shape[-1] else torch.zeros_like(row_max).long().unsqueeze(-1)
    row_pos = positions.long().gather(-1, at_max).squeeze(-1) if lr.shape[-1] else at_max.squeeze(-1)
    row_pos = torch.where(ok.any(-1), row_pos, -1)
    ids = torch.full_like(row_max, -1.0) if sample_ids is None else sample_ids.to(torch.float64)
    out["diag_rows"] = torch.stack([okf.sum(-1), lr.sum(-1), tok_k3.sum(-1), row_max, row_pos.to(torch.float64),
                                    ids], dim=-1)
    return out


@dataclass
class DiagnosticsResult:
    """A step's diagnostics on the host: flat `metrics` (keys without the `diag/` prefix) and `top` sequences."""

    metrics: dict[str, float] = field(default_factory=dict)
    top: list[dict[str, float]] = field(default_factory=list)


def merge_diagnostics(parts: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """A step's sums from its micro-batches': bucket sums add, per-row tables concatenate."""
    rows = [p["diag_rows"] for p in parts if "diag_rows" in p]
    merged: dict[str, Tensor] = {}
    for part in parts:
        for key, value in part.items():
            if key != "diag_rows":
                merged[key] = value if key not in merged else torch.add(merged[key], value)
    if rows:
        merged["diag_rows"] = torch.cat(rows)
    return merged


def _reduce_rows(rows: Tensor, cp_group: ProcessGroup) -> Tensor:
    """Whole-sequence rows: sums over CP, max |lr| over CP, and the position where that max sits."""
    if group_size(cp_group) == 1:
        return rows
    sums = rows[:, :3].contiguous()
    dist.all_reduce(sums, group=cp_group)
    local_max = rows[:, 3]
    gmax = local_max.clone()
    dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=cp_group)
    pos = torch.where(local_max == gmax, rows[:, 4], torch.full_like(gmax, -1.0))
    dist.all_reduce(pos, op=dist.ReduceOp.MAX, group=cp_group)
    return torch.cat([sums, gmax[:, None], pos[:, None], rows[:, 5:]], dim=-1)


def _top_rows(rows: Tensor, top_k: int, dp_group: ProcessGroup) -> Tensor:
    """The `top_k` rows with the largest |Σ lr| (rows without tokens excluded), over all DP ranks."""
    score = torch.where(rows[:, 0] > 0, rows[:, 1].abs(), torch.full_like(rows[:, 1], -1.0))
    k = min(top_k, rows.shape[0])
    local = rows[score.topk(k).indices] if k else rows[:0]
    if group_size(dp_group) > 1:  # fixed-size candidates: pad with empty rows (n = 0) before the gather
        pad = torch.zeros(top_k - k, rows.shape[1], dtype=rows.dtype, device=rows.device)
        local = torch.cat([local, pad])
        gathered = [torch.empty_like(local) for _ in range(group_size(dp_group))]
        dist.all_gather(gathered, local, group=dp_group)
        local = torch.cat(gathered)
        score = torch.where(local[:, 0] > 0, local[:, 1].abs(), torch.full_like(local[:, 1], -1.0))
        local = local[score.topk(min(top_k, local.shape[0])).indices]
    return local


def reduce_diagnostics(
    sums: dict[str, Tensor], *, top_k: int = 4, cp_group: ProcessGroup = None, dp_group: ProcessGroup = None
) -> DiagnosticsResult:
    """Reduce a step's merged sums over DP × CP (collectives once per step), bring them to the host in one
    transfer and finalize them (`finalize_diagnostics`); the top-k rows become `top`."""
    stats = BatchStats()
    for name, value in sums.items():
        if name != "diag_rows":
            stats.add_sum(name, value)
    reduced = stats.reduce(cp_group, dp_group)
    rows = sums.get("diag_rows")
    if rows is not None:
        top = _top_rows(_reduce_rows(rows.to(torch.float64), cp_group), top_k, dp_group)
        reduced["diag_rows"] = top.reshape(-1)
    names = sorted(reduced)
    flat = torch.cat([reduced[n].reshape(-1).to(torch.float64) for n in names]).tolist() if names else []
    host: dict[str, list[float]] = {}
    start = 0
    for n in names:
        size = reduced[n].numel()
        host[n] = flat[start:start + size]
        start += size
    return finalize_diagnostics(host)


def finalize_diagnostics(host: dict[str, list[float]]) -> DiagnosticsResult:
    """Host sums -> metrics. Per non-empty bucket of each view: `<view>/<label>/token_frac`, `kl` (mean −lr),
    `k3`, `abs_log_ratio`, `large_lr_frac` (its tokens' fraction with |lr| > LARGE_LOG_RATIO), `k3_share` (its part
    of the view's Σ k3), and `lag` (mean weight lag) when some token is stale (e.g. by position: resumed samples
    mix versions along the response); `tokens`; `lag/mean`; `large_lr_frac` over all tokens; and the drift split
    `drift/rollout_to_old_k3`, `drift/old_to_current_k3`, `drift/rollout_to_current_k3`, `drift/mismatch_share` =
    Σa² / (Σa² + Σb²)."""
    out: dict[str, float] = {}
    for view, labels in VIEWS.items():
        values = host.get(f"diag_{view}")
        if values is None:
            continue
        table = {name: values[i * len(labels):(i + 1) * len(labels)] for i, name in enumerate(BUCKET_SUMS)}
        total_n, total_k3, stale = sum(table["n"]), sum(table["k3"]), sum(table["lag"]) > 0
        if view == "prob":
            out["tokens"] = total_n
            out["lag/mean"] = sum(table["lag"]) / total_n if total_n else 0.0
            out["large_lr_frac"] = sum(table["large"]) / total_n if total_n else 0.0
        for b, label in enumerate(labels):
            n = table["n"][b]
            if n <= 0:
                continue
            key = f"{view}/{label}"
            out[f"{key}/token_frac"] = n / total_n
            out[f"{key}/kl"] = table["neg_lr"][b] / n
            out[f"{key}/k3"] = table["k3"][b] / n
            out[f"{key}/abs_log_ratio"] = table["abs_lr"][b] / n
            out[f"{key}/large_lr_frac"] = table["large"][b] / n
            out[f"{key}/k3_share"] = table["k3"][b] / total_k3 if total_k3 > 0 else 0.0
            if stale:
                out[f"{key}/lag"] = table["lag"][b] / n
    drift = host.get("diag_drift")
    if drift is not None:
        d = dict(zip(DRIFT_SUMS, drift, strict=True))
        n = max(d["n"], 1.0)
        out["drift/rollout_to_old_k3"] = d["k3_mismatch"] / n
        out["drift/old_to_current_k3"] = d["k3_update"] / n
        out["drift/rollout_to_current_k3"] = d["k3_total"] / n
        sq = d["sq_mismatch"] + d["sq_update"]
        out["drift/mismatch_share"] = d["sq_mismatch"] / sq if sq > 0 else 0.0
    top: list[dict[str, float]] = []
    rows = host.get("diag_rows", [])
    width = 6
    for i in range(0, len(rows), width):
        n, s_lr, s_k3, max_abs, pos, sid = rows[i:i + width]
        if n <= 0:
            continue
        top.append({"sample_id": int(sid), "tokens": int(n), "seq_log_ratio": s_lr, "mean_k3": s_k3 / n,
                    "max_abs_log_ratio": max_abs, "max_position": int(pos)})
    return DiagnosticsResult(metrics=out, top=top)


class MismatchDiagnostics:
    """One step's diagnostics accumulated over micro-batches: `add` per micro-batch (local tensor math),
    `reduce` once at the end of the step (see the module docstring for the collectives)."""

    def __init__(self, top_k: int = 4) -> None:
        self.top_k = top_k
        self.parts: list[dict[str, Tensor]] = []

    def add(self, lp_train: Tensor, lp_rollout: Tensor, loss_mask: Tensor, **kwargs: Tensor | None) -> None:
        """`diagnostic_sums(...)` of one micro-batch, kept for the step."""
        self.parts.append(diagnostic_sums(lp_train, lp_rollout, loss_mask, **kwargs))

    def reduce(self, cp_group: ProcessGroup = None, dp_group: ProcessGroup = None) -> DiagnosticsResult:
        """The step's result (every rank must call it: it runs collectives); clears the accumulator."""
        parts, self.parts = self.parts, []
        if not parts:
            return DiagnosticsResult()
        return reduce_diagnostics(merge_diagnostics(parts), top_k=self.top_k, cp_group=cp_group, dp_group=dp_group)


__all__ = [
    "DiagnosticsResult",
    "MismatchDiagnostics",
    "VIEWS",
    "diagnostic_sums",
    "finalize_diagnostics",
    "merge_diagnostics",
    "reduce_diagnostics",
    "response_positions",
]
