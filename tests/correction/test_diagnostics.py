"""Mismatch diagnostics: bucket statistics against a plain per-token loop, against the core's own metrics, merged
over micro-batches, on meta tensors (no host sync), and over DP x CP (gloo, one spawn)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import compute_rollout_correction, metrics_to_host
from slime_corr.correction.diagnostics import (
    MAX_LAG,
    POSITION_EDGES,
    PROB_EDGES,
    VIEWS,
    MismatchDiagnostics,
    diagnostic_sums,
    merge_diagnostics,
    reduce_diagnostics,
    response_positions,
)
from tests.mcore.mcore_helpers import checking, spawn_group

B, S = 6, 16


def _data(seed: int = 0, bad: bool = True):
    g = torch.Generator().manual_seed(seed)
    lp_r = -torch.rand(B, S, generator=g, dtype=torch.float64) * 14  # p from ~1e-6 to 1
    lp_r[0, :6] = torch.tensor([-1e-4, -0.005, -0.05, -0.3, -2.0, -16.0], dtype=torch.float64)
    lp_t = lp_r + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)
    lp_c = lp_t + 0.1 * torch.randn(B, S, generator=g, dtype=torch.float64)
    starts = torch.tensor([0, 3, 5, 2, 0, 7])
    lengths = torch.tensor([16, 9, 0, 1, 12, 6])  # an empty row, a one-token row, padding at both ends
    cols = torch.arange(S)[None, :]
    mask = (cols >= starts[:, None]) & (cols < (starts + lengths)[:, None])
    mask[4, 5:8] = False  # a hole (tool tokens) inside a response
    lp_t[3, 2] = lp_r[3, 2] + 45.0  # an extreme log-ratio (clamped in k3)
    if bad:
        lp_r[1, 4] = float("nan")  # non-finite at a valid position: the token is left out
        lp_t[5, 8] = float("inf")
        lp_c[4, 2] = float("nan")  # only pi_theta is non-finite: left out too (the drift split needs it)
    lag = torch.tensor([0, 1, 2, 3, 4, 17])  # 17 > MAX_LAG: the last bucket
    return lp_t, lp_r, lp_c, mask, lag


def _k3(x: float) -> float:
    x = max(-20.0, min(20.0, x))
    return math.expm1(x) - x


def _bucket(value: float, edges) -> int:
    return sum(value >= e for e in edges)


def _reference(lp_t, lp_r, lp_c, mask, lag):
    """Per-token Python loop: {view: {bucket: [n, Σ-lr, Σk3, Σ|lr|, Σlag, #|lr|>0.1]}}, drift sums, rows."""
    tables = {view: [[0.0] * 6 for _ in labels] for view, labels in VIEWS.items()}
    drift = [0.0] * 6
    rows = []
    for b in range(B):
        valid = [t for t in range(S) if mask[b, t]]
        first = valid[0] if valid else 0
        n = s_lr = s_k3 = best = 0.0
        best_pos = -1
        for t in valid:
            a, r, c = float(lp_t[b, t]), float(lp_r[b, t]), float(lp_c[b, t])
            if not (math.isfinite(a) and math.isfinite(r) and math.isfinite(c)):
                continue
            lr = a - r
            idx = {"prob": _bucket(math.exp(r), PROB_EDGES), "pos": _bucket(t - first, POSITION_EDGES),
                   "lag": min(int(lag[b]), MAX_LAG)}
            for view, i in idx.items():
                cell = tables[view][i]
                for j, v in enumerate((1.0, -lr, _k3(lr), abs(lr), float(lag[b]), float(abs(lr) > 0.1))):
                    cell[j] += v
            upd = c - a
            for j, v in enumerate((1.0, _k3(lr), _k3(upd), _k3(lr + upd), lr * lr, upd * upd)):
                drift[j] += v
            n, s_lr, s_k3 = n + 1, s_lr + lr, s_k3 + _k3(lr)
            if abs(lr) > best:
                best, best_pos = abs(lr), t - first
        rows.append((n, s_lr, s_k3, best, best_pos, b))
    return tables, drift, rows


def _check_against_reference(result, tables, drift, rows, top_k):
    m = result.metrics
    total = sum(cell[0] for cell in tables["prob"])
    assert m["tokens"] == pytest.approx(total)
    for view, labels in VIEWS.items():
        view_k3 = sum(cell[2] for cell in tables[view])
        for label, (n, neg_lr, k3, abs_lr, lag, large) in zip(labels, tables[view], strict=True):
            key = f"{view}/{label}"
            if n == 0:
                assert f"{key}/token_frac" not in m, key
                continue
            assert m[f"{key}/token_frac"] == pytest.approx(n / total, rel=1e-12), key
            assert m[f"{key}/kl"] == pytest.approx(neg_lr / n, rel=1e-9, abs=1e-12), key
            assert m[f"{key}/k3"] == pytest.approx(k3 / n, rel=1e-9), key
            assert m[f"{key}/abs_log_ratio"] == pytest.approx(abs_lr / n, rel=1e-9), key
            assert m[f"{key}/large_lr_frac"] == pytest.approx(large / n, rel=1e-12), key
            assert m[f"{key}/k3_share"] == pytest.approx(k3 / view_k3, rel=1e-9), key
            assert m[f"{key}/lag"] == pytest.approx(lag / n, rel=1e-12), key
    assert m["lag/mean"] == pytest.approx(sum(c[4] for c in tables["lag"]) / total, rel=1e-12)
    assert m["large_lr_frac"] == pytest.approx(sum(c[5] for c in tables["prob"]) / total, rel=1e-12)
    n = drift[0]
    assert m["drift/rollout_to_old_k3"] == pytest.approx(drift[1] / n, rel=1e-9)
    assert m["drift/old_to_current_k3"] == pytest.approx(drift[2] / n, rel=1e-9)
    assert m["drift/rollout_to_current_k3"] == pytest.approx(drift[3] / n, rel=1e-9)
    assert m["drift/mismatch_share"] == pytest.approx(drift[4] / (drift[4] + drift[5]), rel=1e-9)
    want = sorted((r for r in rows if r[0] > 0), key=lambda r: -abs(r[1]))[:top_k]
    assert [t["sample_id"] for t in result.top] == [r[5] for r in want]
    for got, (n_tok, s_lr, s_k3, best, pos, _) in zip(result.top, want, strict=True):
        assert got["tokens"] == n_tok and got["max_position"] == pos
        assert got["seq_log_ratio"] == pytest.approx(s_lr, rel=1e-12)
        assert got["mean_k3"] == pytest.approx(s_k3 / n_tok, rel=1e-9)
        assert got["max_abs_log_ratio"] == pytest.approx(best, rel=1e-12)


def test_buckets_drift_and_top_rows_match_a_per_token_loop():
    lp_t, lp_r, lp_c, mask, lag = _data()
    diag = MismatchDiagnostics(top_k=3)
    diag.add(lp_t, lp_r, mask, lp_current=lp_c, weight_lag=lag, sample_ids=torch.arange(B))
    result = diag.reduce()
    _check_against_reference(result, *_reference(lp_t, lp_r, lp_c, mask, lag), top_k=3)
    assert all(math.isfinite(v) for v in result.metrics.values())
    assert diag.parts == []  # reduce clears the step


def test_micro_batches_of_different_padding_merge_to_the_whole_batch():
    lp_t, lp_r, lp_c, mask, lag = _data()
    whole = reduce_diagnostics(diagnostic_sums(lp_t, lp_r, mask, lp_current=lp_c, weight_lag=lag,
                                               sample_ids=torch.arange(B)), top_k=4)
    parts = []
    for rows, extra in ((slice(0, 2), 3), (slice(2, 5), 0), (slice(5, 6), 7)):  # right-padded differently
        def pad(t, fill, rows=rows, extra=extra):
            return torch.cat([t[rows], torch.full((t[rows].shape[0], extra), fill, dtype=t.dtype)], dim=1)
        ids = torch.arange(B)[rows]
        parts.append(diagnostic_sums(pad(lp_t, 0.0), pad(lp_r, 0.0), pad(mask, False), lp_current=pad(lp_c, 0.0),
                                     weight_lag=lag[rows], sample_ids=ids))
    merged = reduce_diagnostics(merge_diagnostics(parts), top_k=4)
    assert merged.metrics.keys() == whole.metrics.keys()
    for key, value in whole.metrics.items():
        assert merged.metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    assert merged.top == whole.top


def test_token_totals_agree_with_the_cores_metrics():
    lp_t, lp_r, _, mask, _ = _data(seed=3, bad=False)
    core = metrics_to_host(compute_rollout_correction(lp_t, lp_r, mask, RolloutCorrectionConfig(
        get_mismatch_metrics=True)).metrics)
    m = MismatchDiagnostics()
    m.add(lp_t, lp_r, mask)
    got = m.reduce().metrics
    assert got["tokens"] == core["mis_valid_token_count"]
    labels = VIEWS["prob"]
    k3 = sum(got.get(f"prob/{b}/k3", 0.0) * got.get(f"prob/{b}/token_frac", 0.0) for b in labels)
    kl = sum(got.get(f"prob/{b}/kl", 0.0) * got.get(f"prob/{b}/token_frac", 0.0) for b in labels)
    assert k3 == pytest.approx(core["mismatch_k3_kl"], rel=1e-9)
    assert kl == pytest.approx(core["mismatch_kl"], rel=1e-9)
    assert sum(got.get(f"prob/{b}/k3_share", 0.0) for b in labels) == pytest.approx(1.0)
    assert "drift/mismatch_share" not in got  # no lp_current: no drift split


def test_all_masked_and_empty_inputs_give_no_buckets_and_no_rows():
    lp = torch.zeros(3, 5)
    m = MismatchDiagnostics()
    m.add(lp, lp, torch.zeros(3, 5, dtype=torch.bool))
    m.add(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0))
    result = m.reduce()
    assert result.metrics == {"tokens": 0.0, "lag/mean": 0.0, "large_lr_frac": 0.0} and result.top == []
    m.add(torch.full((1, 3), -1.0), torch.full((1, 3), -1.2), torch.ones(1, 3), weight_lag=torch.zeros(1))
    assert not any(k.endswith("/lag") for k in m.reduce().metrics)  # nothing stale: no per-bucket lag
    assert MismatchDiagnostics().reduce().metrics == {}


def test_per_micro_batch_work_has_no_data_dependent_step():
    # Meta tensors carry no data: any .item(), bool(tensor), nonzero or boolean indexing (a host sync on GPU)
    # would raise here. The per-micro-batch path is pure tensor math.
    meta = {"device": "meta"}
    out = diagnostic_sums(torch.empty(4, 9, **meta), torch.empty(4, 9, **meta), torch.empty(4, 9, dtype=torch.bool, **meta),
                          lp_current=torch.empty(4, 9, **meta), weight_lag=torch.empty(4, 9, dtype=torch.long, **meta),
                          positions=torch.empty(4, 9, dtype=torch.long, **meta), sample_ids=torch.empty(4, **meta))
    assert {k: tuple(v.shape) for k, v in out.items()} == {
        "diag_prob": (6 * len(VIEWS["prob"]),), "diag_pos": (6 * len(VIEWS["pos"]),),
        "diag_lag": (6 * len(VIEWS["lag"]),), "diag_drift": (6,), "diag_rows": (4, 6)}


def test_response_positions_start_at_the_first_valid_token():
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    pos = response_positions(mask)
    assert pos[0, 2:].tolist() == [0, 1, 2, 3] and pos[1, :2].tolist() == [0, 1]
    shifted = response_positions(mask, torch.arange(10, 16).expand(3, 6))  # e.g. packed/CP global positions
    assert torch.equal(shifted[:2], pos[:2])


# ------------------------------------------------------------------------------------------------ DP x CP
WORLD = 4
LAYOUTS = ((2, 2), (1, 4))  # (dp, cp): DP gather and CP reduction together, and CP alone over 4 ranks


def _zigzag(cp_rank: int, cp: int) -> torch.Tensor:
    c = S // (2 * cp)
    return torch.cat([torch.arange(k * c, (k + 1) * c) for k in (cp_rank, 2 * cp - 1 - cp_rank)])


def _worker(rank: int) -> None:
    lp_t, lp_r, lp_c, mask, lag = _data()
    want = reduce_diagnostics(diagnostic_sums(lp_t, lp_r, mask, lp_current=lp_c, weight_lag=lag,
                                              sample_ids=torch.arange(B)), top_k=3)
    for dp, cp in LAYOUTS:
        checking(f"dp={dp} cp={cp} rank={rank}")
        cp_groups = [dist.new_group([d * cp + c for c in range(cp)]) for d in range(dp)]
        dp_groups = [dist.new_group([d * cp + c for d in range(dp)]) for c in range(cp)]
        d, c = divmod(rank, cp)
        cols = _zigzag(c, cp)
        diag = MismatchDiagnostics(top_k=3)
        for rows in (range(d, B, 2 * dp), range(d + dp, B, 2 * dp)):  # two micro-batches per DP rank
            rows = torch.tensor(list(rows), dtype=torch.long)
            sl = lambda t, rows=rows, cols=cols: t[rows][:, cols]  # noqa: E731
            pos = response_positions(sl(mask), sl(torch.arange(S).expand(B, S)), cp_groups[d])
            diag.add(sl(lp_t), sl(lp_r), sl(mask), lp_current=sl(lp_c), positions=pos, weight_lag=lag[rows],
                     sample_ids=rows)
        got = diag.reduce(cp_groups[d], dp_groups[c])
        tag = f"dp={dp} cp={cp} rank={rank}"
        assert got.metrics.keys() == want.metrics.keys(), tag
        for key, value in want.metrics.items():
            assert got.metrics[key] == pytest.approx(value, rel=1e-10, abs=1e-15), (tag, key)
        assert [t["sample_id"] for t in got.top] == [t["sample_id"] for t in want.top], tag
        for g, w in zip(got.top, want.top, strict=True):
            assert g["max_position"] == w["max_position"] and g["tokens"] == w["tokens"], tag
            assert g["seq_log_ratio"] == pytest.approx(w["seq_log_ratio"], rel=1e-12), tag


def test_dp_cp_split_reduces_to_the_single_rank_result():
    spawn_group(_worker, WORLD)
