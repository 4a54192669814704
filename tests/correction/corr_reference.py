"""Independent, loop-based references for the correction core (python floats, one sequence at a time)."""

from __future__ import annotations

import math

import torch


def _bound(w: float, mode: str, lower: float, upper: float) -> float:
    if mode == "truncate":
        return min(w, upper)
    if mode == "clip":
        return min(max(w, lower), upper)
    return w if lower <= w <= upper else 0.0


def _agg(lrs: list[float], level: str, k: int) -> float:
    if level == "token":
        return lrs[k]
    s = sum(lrs)
    return s if level == "sequence" else s / len(lrs)


def ref_correction(lp_t, lp_r, mask, cfg):
    """Returns (weights or None, final mask, batch-norm factor or None) as float64 tensors."""
    lp_t, lp_r = lp_t.double().tolist(), lp_r.double().tolist()
    m = (mask > 0).tolist()
    B, S = len(m), len(m[0])
    W = [[0.0] * S for _ in range(B)]
    F = [[0.0] * S for _ in range(B)]
    for i in range(B):
        idx = [t for t in range(S) if m[i][t]]
        lrs = [lp_t[i][t] - lp_r[i][t] for t in idx]
        if not idx or any(not math.isfinite(x) for x in lrs):
            continue
        keep = [True] * len(idx)
        if cfg.use_rs:
            lo, up = cfg.rs_bounds
            for k in range(len(idx)):
                v = _agg(lrs, cfg.rs_level, k)
                keep[k] = (math.log(lo) <= v <= math.log(up))
        if cfg.rs_veto_threshold is not None and any(x < math.log(cfg.rs_veto_threshold) for x in lrs):
            keep = [False] * len(idx)
        for k, t in enumerate(idx):
            if not keep[k]:
                continue
            F[i][t] = 1.0
            if cfg.use_tis:
                lo, up = cfg.tis_bounds
                raw = math.exp(min(max(_agg(lrs, cfg.tis_level, k), -20.0), 20.0))
                W[i][t] = _bound(raw, cfg.effective_tis_mode, lo, up)
    factor = None
    if cfg.use_tis and cfg.tis_batch_normalize:
        if cfg.tis_level == "token":
            vals = [W[i][t] for i in range(B) for t in range(S) if F[i][t]]
        else:
            vals = []
            for i in range(B):
                ws = [W[i][t] for t in range(S) if F[i][t]]
                if ws:
                    vals.append(sum(ws) / len(ws))
        mean = sum(vals) / len(vals) if vals else 0.0
        factor = mean if mean > 1e-8 else 1.0
        W = [[w / factor for w in row] for row in W]
    weights = torch.tensor(W, dtype=torch.float64) if cfg.use_tis else None
    return weights, torch.tensor(F, dtype=torch.float64), factor


def ref_mismatch_metrics(lp_t, lp_r, mask) -> dict[str, float]:
    """SPEC mismatch metrics, written the obvious way (sequences with a non-finite value excluded)."""
    lp_t, lp_r = lp_t.double().tolist(), lp_r.double().tolist()
    m = (mask > 0).tolist()
    toks, seqs = [], []
    for i in range(len(m)):
        idx = [t for t in range(len(m[i])) if m[i][t]]
        pairs = [(lp_t[i][t], lp_r[i][t]) for t in idx]
        if not pairs or any(not math.isfinite(a - b) for a, b in pairs):
            continue
        toks += pairs
        seqs.append(pairs)
    n = len(toks)
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    out = {}
    out["mismatch_kl"] = mean([b - a for a, b in toks])
    cl = lambda x: min(max(x, -20.0), 20.0)  # noqa: E731
    out["mismatch_k3_kl"] = mean([math.exp(cl(a - b)) - cl(a - b) - 1 for a, b in toks])
    out["mismatch_chi2_token"] = mean([math.exp(2 * cl(a - b)) - 1 for a, b in toks])
    out["train_rollout_logprob_abs_diff"] = mean([abs(a - b) for a, b in toks])
    mt = [mean([a for a, _ in s]) for s in seqs]
    mr = [mean([b for _, b in s]) for s in seqs]
    out["mismatch_training_log_ppl"] = mean([-x for x in mt])
    out["mismatch_rollout_log_ppl"] = mean([-x for x in mr])
    out["mismatch_training_ppl"] = mean([math.exp(-x) for x in mt])
    out["mismatch_rollout_ppl"] = mean([math.exp(-x) for x in mr])
    out["mismatch_log_ppl_diff"] = mean([r - t for t, r in zip(mt, mr, strict=True)])
    out["mismatch_log_ppl_abs_diff"] = mean([abs(r - t) for t, r in zip(mt, mr, strict=True)])
    out["mismatch_ppl_ratio"] = mean([math.exp(r - t) for t, r in zip(mt, mr, strict=True)])
    out["mismatch_chi2_seq"] = mean([math.exp(2 * cl(sum(a - b for a, b in s))) - 1 for s in seqs])
    pt = [math.exp(a) for a, _ in toks]
    pr = [math.exp(b) for _, b in toks]
    d = [abs(x - y) for x, y in zip(pt, pr, strict=True)]
    out["rollout_probs_diff_max"] = max(d) if d else 0.0
    out["rollout_probs_diff_mean"] = mean(d)
    out["rollout_probs_diff_std"] = math.sqrt(max(mean([x * x for x in d]) - mean(d) ** 2, 0.0))
    if n > 1:
        mx, my = mean(pt), mean(pr)
        cov = mean([(x - mx) * (y - my) for x, y in zip(pt, pr, strict=True)])
        vx, vy = mean([(x - mx) ** 2 for x in pt]), mean([(y - my) ** 2 for y in pr])
        out["rollout_actor_probs_pearson_corr"] = cov / math.sqrt(vx * vy) if vx * vy > 0 else 0.0
    return out


def ref_policy_loss(lp, old, A, weights, mask, den_mask, cfg, norm_len=None):
    """Loop-based loss value (float) for the four aggregation modes; lp/old/A are float64 tensors."""
    lo, hi = cfg.clip_range
    B, S = lp.shape
    per_seq, counts = [], []
    for i in range(B):
        tot = 0.0
        for t in range(S):
            if mask[i, t] <= 0:
                continue
            a = float(A[i, t])
            if cfg.loss_type == "ppo":
                r = math.exp(min(max(float(lp[i, t] - old[i, t]), -20.0), 20.0))
                l_ = max(-a * r, -a * min(max(r, lo), hi))
                if cfg.eps_clip_c is not None and a < 0:
                    l_ = min(l_, -a * cfg.eps_clip_c)
            else:
                l_ = -a * float(lp[i, t])
            if weights is not None:
                l_ *= float(weights[i, t])
            tot += l_
        per_seq.append(tot)
        counts.append(int((den_mask[i] > 0).sum()))
    mode = cfg.loss_agg_mode
    if mode == "token-mean":
        return sum(per_seq) / max(sum(counts), 1)
    nseq = sum(1 for c in counts if c > 0)
    if mode == "seq-mean-token-sum":
        return sum(per_seq) / max(nseq, 1)
    if mode == "seq-mean-token-mean":
        return sum(s / max(c, 1) for s, c in zip(per_seq, counts, strict=True)) / max(nseq, 1)
    return sum(s / (norm_len or S) for s in per_seq) / max(nseq, 1)
