"""Divergence rejection (--rs-metric k2|k3|binary_kl, --rs-agg token|mean|max) and budgeted bounds (--rs-divergence-budget,
--tis-ess-target) against loop references: alone and combined with ratio RS, the veto and IS; packed rows; extreme
log-ratios, NaN, all-rejected; the budget reaching its target on synthetic values."""

from __future__ import annotations

import math

import pytest
import torch

from slime_corr.config import ConfigError
from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import compute_rollout_correction, metrics_to_host, quantiles
from slime_corr.correction.budget import bin_edge, bin_sums, ess, ess_bound, keep_below, mean_budget_key
from slime_corr.losses import compute_policy_loss
from tests.correction.corr_reference import ref_correction
from tests.correction.test_packed import _data, _pack, _segments, _unpack, _within
from tests.synthetic import response_mask


def _div(x: float, metric: str, lq: float = 0.0) -> float:
    if metric == "binary_kl":  # {token, rest} under q = π_rollout(y), p = π_train(y): KL(q ‖ p)
        q, p = math.exp(lq), math.exp(lq + x)
        if p >= 1.0:
            return 0.0 if q >= 1.0 else math.inf
        rest = (1 - q) * math.log((1 - q) / (1 - p)) if q < 1.0 else 0.0
        return q * math.log(q / p) + rest
    return 0.5 * x * x if metric == "k2" else math.expm1(x) - x


def ref_divergence_keep(lp_t, lp_r, mask, metric: str, agg: str, bound: float):
    """Loop reference: the divergence filter's keep mask [B, S] (valid tokens of finite sequences), and its own
    rejected (tokens, sequences) among the finite valid ones."""
    B, S = mask.shape
    keep = torch.zeros(B, S, dtype=torch.float64)
    rej_tok = rej_seq = 0
    for i in range(B):
        idx = [t for t in range(S) if mask[i, t]]
        lrs = [lp_t[i, t].item() - lp_r[i, t].item() for t in idx]
        if not idx or any(not math.isfinite(x) for x in lrs):
            continue
        d = [_div(x, metric, lp_r[i, t].item()) if abs(x) < 700 else math.inf for x, t in zip(lrs, idx, strict=True)]
        if agg == "token":
            k = [v <= bound for v in d]
        else:
            stat = {"mean": sum(d) / len(d), "sum": sum(d), "max": max(d)}[agg]
            k = [stat <= bound] * len(d)
        for t, kk in zip(idx, k, strict=True):
            keep[i, t] = float(kk)
        rej_tok += sum(not kk for kk in k)
        rej_seq += not any(k)
    return keep, rej_tok, rej_seq


def _inputs(seed=0, B=6, S=20, scale=0.4):
    g = torch.Generator().manual_seed(seed)
    lp_r = -torch.rand(B, S, generator=g, dtype=torch.float64) * 3
    lp_t = lp_r + scale * torch.randn(B, S, generator=g, dtype=torch.float64) * torch.linspace(0.05, 2, B)[:, None]
    mask = response_mask([20, 13, 1, 0, 17, 9][:B], S)
    mask[0, ::4] = False
    lp_r[4, 3] = float("nan")  # a non-finite sequence
    lp_t[1, 2] = lp_r[1, 2] + 60.0  # an extreme log-ratio: k3 overflows to inf, never NaN
    return lp_t, lp_r, mask


@pytest.mark.parametrize("metric", ["k2", "k3", "binary_kl"])
@pytest.mark.parametrize("agg,bound", [("token", 0.02), ("mean", 0.05), ("sum", 0.4), ("max", 0.3)])
def test_divergence_rejection_matches_loop_reference(metric, agg, bound):
    lp_t, lp_r, mask = _inputs()
    cfg = C(rs_metric=metric, rs_agg=agg, rs_divergence_bound=bound)
    out = compute_rollout_correction(lp_t, lp_r, mask, cfg)
    keep, rej_tok, rej_seq = ref_divergence_keep(lp_t, lp_r, mask, metric, agg, bound)
    assert torch.equal(out.loss_mask.double(), keep)
    assert out.weights is None
    m = metrics_to_host(out.metrics)
    n_tok, n_seq = m["mis_valid_token_count"] - m["mis_nonfinite_token_count"], 4  # 6 rows: one empty, one NaN
    n_tok = sum(1 for i in range(6) for t in range(20) if mask[i, t] and i != 4)
    assert m["mis_div_rejected_token_fraction"] == pytest.approx(rej_tok / n_tok)
    assert m["mis_div_rejected_seq_fraction"] == pytest.approx(rej_seq / n_seq)
    assert 0 < rej_tok < n_tok  # the data exercises the filter
    assert m["mis_rejected_token_fraction"] == pytest.approx(1 - keep.sum().item() / mask.sum().item())


@pytest.mark.parametrize("agg", ["token", "mean", "sum", "max"])
def test_divergence_combines_with_ratio_rs_veto_and_is(agg):
    """The final mask is the ratio-RS/veto reference's mask times the divergence filter's; the IS weights are the
    reference's on the kept tokens."""
    lp_t, lp_r, mask = _inputs(seed=1)
    bound = {"token": 0.05, "mean": 0.08, "sum": 0.8, "max": 0.5}[agg]
    for base in (C(use_tis=True, use_rs=True, rs_level="token", rs_upper_bound=3.0, rs_veto_threshold=0.2),
                 C(use_tis=True, tis_level="sequence", tis_upper_bound=5.0, use_rs=True, rs_level="sequence",
                   rs_lower_bound=0.05, rs_upper_bound=20.0),
                 C(use_rs=True, rs_level="geometric", rs_upper_bound=1.3, rs_veto_threshold=0.1)):
        cfg = base.replace(rs_metric="k3", rs_agg=agg, rs_divergence_bound=bound)
        out = compute_rollout_correction(lp_t, lp_r, mask, cfg)
        w_ref, f_ref, _ = ref_correction(lp_t, lp_r, mask, base)
        keep, _, _ = ref_divergence_keep(lp_t, lp_r, mask, "k3", agg, bound)
        final = f_ref * keep
        assert torch.equal(out.loss_mask.double(), final), (agg, base)
        assert 0 < final.sum() < f_ref.sum(), (agg, base)  # both filters act
        if base.use_tis:
            torch.testing.assert_close(out.weights.double() * final, w_ref * final)
            assert out.weights[final == 0].abs().sum() == 0


def test_divergence_with_a_custom_function_and_keep_denominator():
    from pathlib import Path
    custom = f"{Path(__file__).resolve().parents[2] / 'examples' / 'custom_tis.py'}:length_aware_geometric_is"
    lp_t, lp_r, mask = _inputs(seed=2)
    for agg, bound in (("token", 0.05), ("max", 0.4)):
        cfg = C(use_tis=True, custom_tis_function_path=custom, rs_metric="k2", rs_agg=agg, rs_divergence_bound=bound,
                rs_keep_loss_denominator=True)
        out = compute_rollout_correction(lp_t, lp_r, mask, cfg)
        keep, _, _ = ref_divergence_keep(lp_t, lp_r, mask, "k2", agg, bound)
        assert (out.loss_mask.double() <= keep).all() and out.loss_mask.sum() > 0
        assert torch.equal(out.denominator_mask.bool(), mask)


def test_all_rejected_gives_a_finite_zero_loss_and_gradient():
    lp_t, lp_r, mask = _inputs(seed=3)
    lp = lp_t.clone().requires_grad_()
    cfg = C(rs_metric="k3", rs_agg="max", rs_divergence_bound=1e-12)
    out = compute_policy_loss(lp, lp_t, lp_r, torch.randn(6), mask, cfg)
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros_like(lp))
    assert out.metrics["mis_all_rejected"].item() == 1.0


@pytest.mark.parametrize("cfg", [
    C(rs_metric="k3", rs_agg="mean", rs_divergence_bound=0.05, loss_agg_mode="seq-mean-token-mean"),
    C(rs_metric="k2", rs_agg="max", rs_divergence_bound=0.5, use_rs=True, rs_level="token", rs_upper_bound=2.0),
    C(rs_metric="k3", rs_agg="token", rs_divergence_bound=0.05, use_tis=True, rs_veto_threshold=1e-3),
    C(rs_metric="k2", rs_agg="token", rs_divergence_budget=0.02, use_tis=True, tis_level="sequence"),
    C(rs_metric="k3", rs_agg="mean", rs_divergence_budget=0.01, use_tis=True, tis_ess_target=0.8),
], ids=["mean", "max+token-rs", "token+veto", "token-budget", "mean-budget+ess"])
def test_packed_equals_padded(cfg):
    lp, old, ro, adv, mask = _data()
    x_pad, x_pack = lp.clone().requires_grad_(), _pack(lp).requires_grad_()
    padded = compute_policy_loss(x_pad, old, ro, adv, mask, cfg)
    packed = compute_policy_loss(x_pack, _pack(old), _pack(ro), adv, _pack(mask), cfg, segments=_segments())
    padded.loss.backward()
    packed.loss.backward()
    got, want = metrics_to_host(packed.metrics), metrics_to_host(padded.metrics)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    assert torch.equal(_unpack(packed.correction.loss_mask), padded.correction.loss_mask)
    torch.testing.assert_close(_unpack(x_pack.grad), x_pad.grad * _within(), rtol=1e-12, atol=1e-14)
    assert 0 < want["mis_div_rejected_token_fraction"] < 1


# ------------------------------------------------------------------------------------------------ budgets


def _sorted_mean_optimum(v: torch.Tensor, budget: float) -> int:
    """How many of the smallest values an exact threshold keeps with their mean ≤ budget."""
    s = v.sort().values.double()
    means = s.cumsum(0) / torch.arange(1, s.numel() + 1, dtype=torch.float64)
    return int((means <= budget).sum())


@pytest.mark.parametrize("scale,budget", [(1e-3, 1e-7), (0.3, 0.01), (1.0, 0.05), (2.0, 0.5)])
def test_mean_budget_reaches_its_target_within_one_bin(scale, budget):
    g = torch.Generator().manual_seed(7)
    v = (scale * torch.randn(20000, generator=g, dtype=torch.float64)).square() * 0.5  # k2 values
    unit = torch.ones_like(v)
    last = mean_budget_key(bin_sums(v, unit, 1, []), budget)
    keep = keep_below(v, last) > 0
    assert v[keep].mean() <= budget  # the target holds
    k_opt = _sorted_mean_optimum(v, budget)
    assert keep.sum() <= k_opt
    edge = bin_edge(last + 1).item()  # every value below the bound is kept; the next bin would break it
    assert torch.equal(keep, v < edge)
    nxt = v < bin_edge(last + 2).item()
    assert nxt.sum() == keep.sum() or v[nxt].mean() > budget
    assert keep.sum() >= (v < v.sort().values[k_opt - 1] / 1.07).sum()  # within one bin (~3 %) of the optimum


def test_mean_budget_keeps_all_or_none():
    v = torch.full((100,), 0.1, dtype=torch.float64)
    unit = torch.ones_like(v)
    none = mean_budget_key(bin_sums(v, unit, 1, []), 0.05)
    assert keep_below(v, none).sum() == 0
    every = mean_budget_key(bin_sums(v, unit, 1, []), 1.0)
    assert keep_below(v, every).sum() == 100 and bin_edge(every + 1).item() == pytest.approx(0.1, rel=0.04)


@pytest.mark.parametrize("sigma", [0.1, 0.5, 1.5])
@pytest.mark.parametrize("target", [0.3, 0.6, 0.9, 0.99])
def test_ess_bound_reaches_its_target_within_one_bin(sigma, target):
    g = torch.Generator().manual_seed(11)
    w = (sigma * torch.randn(30000, generator=g, dtype=torch.float64)).exp()
    unit = torch.ones_like(w)
    u = ess_bound(bin_sums(w, unit, 2, []), target).item()
    assert ess(w.clamp(max=u), unit) >= target * (1 - 1e-9)
    if u < w.max():  # truncating: the next bin edge up no longer keeps the target
        key = quantiles.level1_keys(torch.tensor([u], dtype=torch.float64))
        assert ess(w.clamp(max=bin_edge(key + 1).item()), unit) < target
    else:
        assert ess(w, unit) >= target


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_ess_target_in_the_core(level):
    lp_t, lp_r, mask = _inputs(seed=4, B=6, S=20, scale=0.5)
    for target in (0.5, 0.9, 1.0):
        cfg = C(use_tis=True, tis_level=level, tis_ess_target=target)
        out = compute_rollout_correction(lp_t, lp_r, mask, cfg)
        m = metrics_to_host(out.metrics)
        assert m["mis_ess"] >= target * (1 - 1e-9), (level, target)
        u = m["mis_tis_ess_bound"]
        fixed = compute_rollout_correction(lp_t, lp_r, mask, C(use_tis=True, tis_level=level, tis_upper_bound=u))
        torch.testing.assert_close(out.weights, fixed.weights)  # the same as that bound given by hand


def test_divergence_budget_in_the_core_keeps_its_mean():
    lp_t, lp_r, mask = _inputs(seed=5, B=6, S=20, scale=0.6)
    ok = mask.clone()
    ok[4] = False  # the non-finite sequence
    ok[1, 2] = False  # the extreme token (its sequence stays at token level)
    for agg, budget in (("token", 0.01), ("mean", 0.02), ("sum", 0.2)):
        cfg = C(rs_metric="k3", rs_agg=agg, rs_divergence_budget=budget)
        out = compute_rollout_correction(lp_t, lp_r, mask, cfg)
        d = torch.expm1(lp_t - lp_r) - (lp_t - lp_r)
        kept = out.loss_mask > 0
        if agg == "token":
            assert d[kept].mean() <= budget
        else:
            seq_stat = torch.where(mask, d.nan_to_num(0.0), 0.0).sum(-1)
            seq_stat = seq_stat / mask.sum(-1).clamp_min(1) if agg == "mean" else seq_stat
            assert seq_stat[kept.any(-1)].mean() <= budget
        m = metrics_to_host(out.metrics)
        assert 0 < m["mis_div_rejected_token_fraction"] < 1 and m["mis_rs_divergence_bound"] > 0


def test_config_errors_name_the_flags():
    cases = [
        (dict(rs_metric="k3"), "--rs-metric k3 needs --rs-agg"),
        (dict(rs_metric="k3", rs_agg="max"), "exactly one of --rs-divergence-bound"),
        (dict(rs_agg="max"), "--rs-agg set but --rs-metric is ratio"),
        (dict(rs_metric="k2", rs_agg="token", rs_divergence_bound=-1.0), "--rs-divergence-bound=-1.0 must be"),
        (dict(rs_metric="k2", rs_agg="max", rs_divergence_budget=0.1), "--rs-divergence-budget works with"),
        (dict(rs_metric="k3", rs_agg="mean", rs_divergence_bound=0.1, use_rs=True, rs_upper_bound=0.01),
         "the --rs-metric k3 bound is --rs-divergence-bound"),
        (dict(tis_ess_target=0.5), "--tis-ess-target needs --use-tis"),
        (dict(use_tis=True, tis_ess_target=0.0), r"must be in \(0, 1\]"),
        (dict(use_tis=True, tis_ess_target=0.5, tis_upper_bound=3.0), "needs --tis-mode truncate and no"),
        (dict(rs_metric="kl"), "--rs-metric='kl' is not one of ratio, k2, k3"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            C(**kwargs)
    c = C(rs_metric="k3", rs_agg="mean", rs_divergence_bound=0.01)
    assert c.use_rollout_correction and c.requests_correction
    assert C.preset("decoupled_k3_rs", rs_metric="ratio", get_mismatch_metrics=True).rs_agg is None


def test_flags_and_yaml(tmp_path):
    import argparse

    from slime_corr.arguments import add_rollout_correction_args, parse_rollout_correction_config
    parser = add_rollout_correction_args(argparse.ArgumentParser())
    _, c = parse_rollout_correction_config(parser, ["--rs-metric", "k2", "--rs-agg", "max", "--rs-divergence-bound",
                                                    "2.5", "--policy-ratio-level", "sequence", "--eps-clip", "3e-4"])
    assert (c.rs_metric, c.rs_agg, c.rs_divergence_bound, c.policy_ratio_level) == ("k2", "max", 2.5, "sequence")
    f = tmp_path / "c.yaml"
    f.write_text("preset: decoupled_token_is\ntis_upper_bound: null\ntis_ess_target: 0.9\nrs_metric: k3\n"
                 "rs_agg: token\nrs_divergence_budget: 1e-3\n")
    c = C.from_yaml(f)
    assert c.tis_ess_target == 0.9 and c.rs_divergence_budget == 1e-3 and c.rs_agg == "token"


def test_the_report_suggests_budgets_from_the_run():
    from slime_corr.monitoring.recommend import recommend
    records = [{"rollout_corr/mismatch_k3_kl": k3, "rollout_corr/mis_ess": ess}
               for k3, ess in ((0.01, 0.97), (0.02, 0.95), (0.03, 0.93), (0.5, 0.4))]
    hint = [h for h in recommend(records).hints if h.startswith("budgets")]
    assert len(hint) == 1
    assert "--rs-divergence-budget 0.025" in hint[0] and "--tis-ess-target 0.94" in hint[0]
    C(rs_metric="k3", rs_agg="token", rs_divergence_budget=0.025, use_tis=True, tis_ess_target=0.94)  # valid
    only_k3 = recommend([{"rollout_corr/mismatch_k3_kl": 1e-4}]).hints
    assert any("--rs-divergence-budget 0.0001" in h and "--tis-ess-target" not in h for h in only_k3)


# ------------------------------------------------------------------------------------------------ step budgets


def _step(seed=8):
    """One optimizer step of four micro-batches of uneven sizes and masks (lp_train, lp_rollout, mask): the
    `_inputs` one (an empty, a non-finite and an extreme sequence), a near on-policy one, one without any valid
    token, and one far off-policy (everything in it rejected, its weights truncated)."""
    g = torch.Generator().manual_seed(seed)
    first = _inputs(seed=seed, B=6, S=20, scale=0.5)
    near_r = -torch.rand(3, 20, generator=g, dtype=torch.float64) * 3
    near = (near_r + 0.02 * torch.randn(3, 20, generator=g, dtype=torch.float64), near_r,
            torch.arange(20)[None] < torch.tensor([[4], [20], [11]]))
    empty = (-torch.rand(2, 20, generator=g, dtype=torch.float64), -torch.rand(2, 20, generator=g, dtype=torch.float64),
             torch.zeros(2, 20, dtype=torch.bool))
    far_r = -torch.rand(2, 20, generator=g, dtype=torch.float64) * 3
    far = (far_r + 2.0 + torch.rand(2, 20, generator=g, dtype=torch.float64), far_r,
           torch.arange(20)[None] < torch.tensor([[7], [20]]))
    return [first, near, empty, far]


STEP_CASES = [
    C(rs_metric="k2", rs_agg="token", rs_divergence_budget=0.02),
    C(rs_metric="k3", rs_agg="mean", rs_divergence_budget=0.01, use_tis=True, tis_ess_target=0.8),
    C(rs_metric="k2", rs_agg="sum", rs_divergence_budget=0.2, use_tis=True, tis_level="sequence",
      tis_ess_target=0.9, use_rs=True, rs_level="token", rs_upper_bound=4.0, rs_veto_threshold=1e-4),
    C(use_tis=True, tis_ess_target=0.7),
    C(use_tis=True, tis_level="geometric", tis_ess_target=0.95),
]


@pytest.mark.parametrize("cfg", STEP_CASES, ids=["token-k2", "mean-k3+ess", "sum-k2+seq-ess+rs+veto", "ess-token",
                                                  "ess-geometric"])
def test_step_bounds_equal_the_whole_step_as_one_batch(cfg):
    """`StepBounds`: every micro-batch decides with the bound of the step's concatenated tensors (the plain
    full-tensor reference), logs it, and the step reaches the target."""
    from slime_corr.correction import StepBounds, merge_stats
    from slime_corr.correction.core import correction_metrics

    mbs = _step()
    cat = [torch.cat(t) for t in zip(*mbs, strict=True)]
    ref = compute_rollout_correction(*cat, cfg)
    want = metrics_to_host(ref.metrics)
    bounds = StepBounds()
    for mb in mbs:  # collecting: results discarded
        compute_rollout_correction(*mb, cfg, step_bounds=bounds)
    bounds.finish([])
    outs = [compute_rollout_correction(*mb, cfg, step_bounds=bounds) for mb in mbs]
    keys = [k for k in ("mis_rs_divergence_bound", "mis_tis_ess_bound") if k in want]
    assert keys
    start = 0
    for mb, out in zip(mbs, outs, strict=True):
        rows = slice(start, start + mb[0].shape[0])
        start = rows.stop
        assert torch.equal(out.loss_mask, ref.loss_mask[rows])
        if ref.weights is not None:
            torch.testing.assert_close(out.weights, ref.weights[rows], rtol=1e-12, atol=0)
        m = metrics_to_host(out.metrics)
        for k in keys:  # every micro-batch (the empty and the all-rejected one too) logs the step's bound
            assert m[k] == want[k], (k, m[k], want[k])
    step = metrics_to_host(correction_metrics(merge_stats([o.stats for o in outs]), cfg))
    for k in (*keys, "mis_rejected_token_fraction", "mis_div_rejected_token_fraction", "mis_ess"):
        if k in want:
            assert step[k] == pytest.approx(want[k], rel=1e-12), k
    if cfg.rejects_divergence:
        assert outs[3].loss_mask.sum() == 0  # the far micro-batch: all rejected by the step's bound
        assert outs[0].loss_mask.sum() > 0 and outs[1].loss_mask.sum() > 0
        lp_t, lp_r, mask = cat
        d = token_divergence_ref(lp_t - lp_r, cfg.rs_metric)
        kept = ref.loss_mask > 0
        if cfg.rs_agg == "token":
            assert d[kept].mean() <= cfg.rs_divergence_budget  # the target holds over the step
        own = [metrics_to_host(compute_rollout_correction(*mb, cfg).metrics) for mb in mbs]
        # on its own the far micro-batch would keep nothing either, but the near one would keep a different set
        assert any(o["mis_rs_divergence_bound"] != want["mis_rs_divergence_bound"] for o in own)
    if cfg.tis_ess_target is not None and not cfg.rejects_divergence and not cfg.use_rs:
        assert step["mis_ess"] >= cfg.tis_ess_target * (1 - 1e-9)  # the ESS target holds over the step
        own = [metrics_to_host(compute_rollout_correction(*mb, cfg).metrics) for mb in mbs]
        assert any(o["mis_tis_ess_bound"] != want["mis_tis_ess_bound"] for o in own)


def token_divergence_ref(lr: torch.Tensor, metric: str) -> torch.Tensor:
    return 0.5 * lr * lr if metric == "k2" else torch.expm1(lr) - lr


def test_step_bounds_misuse_is_a_clear_error():
    from slime_corr.correction import StepBounds

    bounds = StepBounds().finish([])
    lp_t, lp_r, mask = _inputs()
    with pytest.raises(ValueError, match="no 'div' statistics were collected"):
        compute_rollout_correction(lp_t, lp_r, mask, C(rs_metric="k2", rs_agg="token", rs_divergence_budget=0.1),
                                   step_bounds=bounds)
    with pytest.raises(ValueError, match="already finished"):
        bounds.finish([])
