"""IS weights, RS, veto, normalization: hand-computed values and a loop-based reference for every combination."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import compute_rollout_correction, metrics_to_host
from tests.correction.corr_reference import ref_correction
from tests.synthetic import correction_batch

# One sequence with token ratios [3, 0.25, 1] plus one padding token; a second sequence with ratios [1.5, 1].
LR = torch.tensor([[math.log(3.0), math.log(0.25), 0.0, 7.0], [math.log(1.5), 0.0, 0.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
LP_R = torch.full_like(LR, -1.0)
LP_T = LP_R + LR
G = 0.75 ** (1 / 3)  # geometric mean of seq 0


def run(cfg, lp_t=LP_T, lp_r=LP_R, mask=MASK):
    return compute_rollout_correction(lp_t, lp_r, mask, cfg)


@pytest.mark.parametrize(
    "level,mode,expected0,expected1",
    [
        ("token", "truncate", [2.0, 0.25, 1.0], [1.5, 1.0]),
        ("token", "clip", [2.0, 0.5, 1.0], [1.5, 1.0]),
        ("token", "mask", [0.0, 0.0, 1.0], [1.5, 1.0]),
        ("sequence", "truncate", [0.75] * 3, [1.5] * 2),
        ("sequence", "clip", [0.75] * 3, [1.5] * 2),
        ("sequence", "mask", [0.75] * 3, [1.5] * 2),
        ("geometric", "truncate", [G] * 3, [1.5**0.5] * 2),
    ],
)
def test_hand_computed_is_weights(level, mode, expected0, expected1):
    res = run(C(use_tis=True, tis_level=level, tis_mode=mode, tis_upper_bound=2.0))
    torch.testing.assert_close(res.weights[0, :3], torch.tensor(expected0, dtype=torch.float64))
    torch.testing.assert_close(res.weights[1, :2], torch.tensor(expected1, dtype=torch.float64))
    assert res.weights[0, 3] == 0 and (res.weights[1, 2:] == 0).all()
    assert torch.equal(res.loss_mask, MASK.float())  # IS (even mask mode) never edits the loss mask
    assert res.weights.grad_fn is None


def test_hand_computed_sequence_mask_mode_and_slime_tis_clip():
    res = run(C(use_tis=True, tis_level="sequence", tis_mode="mask", tis_upper_bound=1.2))
    torch.testing.assert_close(res.weights[:, :3], torch.tensor([[0.0] * 3, [0.0, 0.0, 0.0]], dtype=torch.float64))
    res = run(C(use_tis=True, tis_clip=2.5, tis_clip_low=0.5))  # slime flags: clamp to [0.5, 2.5]
    torch.testing.assert_close(res.weights[0, :3], torch.tensor([2.5, 0.5, 1.0], dtype=torch.float64))


def test_hand_computed_rs_and_veto():
    tok = run(C(use_rs=True, rs_level="token", rs_upper_bound=2.0))
    assert tok.loss_mask.tolist() == [[0, 0, 1, 0], [1, 1, 0, 0]]
    seq = run(C(use_rs=True, rs_level="sequence", rs_upper_bound=1.4))  # 0.75 kept, 1.5 rejected
    assert seq.loss_mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    geo = run(C(use_rs=True, rs_level="geometric", rs_upper_bound=1.2))  # 0.909 kept, 1.22 rejected
    assert geo.loss_mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    veto = run(C(rs_veto_threshold=0.3))  # 0.25 < 0.3 vetoes sequence 0; works without --use-rs
    assert veto.loss_mask.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]
    assert veto.weights is None
    m = metrics_to_host(veto.metrics)
    assert m["mis_catastrophic_token_fraction"] == pytest.approx(1 / 5)
    assert m["mis_catastrophic_seq_fraction"] == pytest.approx(1 / 2)
    assert m["mis_rejected_token_fraction"] == pytest.approx(3 / 5)
    keep = run(C(rs_veto_threshold=0.3, rs_keep_loss_denominator=True))
    assert keep.loss_mask.tolist() == veto.loss_mask.tolist()
    assert torch.equal(keep.denominator_mask, MASK.float())
    assert keep.seq_token_count.tolist() == [3, 2]


def test_hand_computed_batch_normalization():
    tok = run(C(use_tis=True, tis_batch_normalize=True))  # truncate: [2, .25, 1, 1.5, 1], mean 1.15
    torch.testing.assert_close(tok.weights[0, :3], torch.tensor([2.0, 0.25, 1.0], dtype=torch.float64) / 1.15)
    assert metrics_to_host(tok.metrics)["mis_batch_norm_factor"] == pytest.approx(1.15)
    seq = run(C(use_tis=True, tis_level="sequence", tis_batch_normalize=True))  # per-seq 0.75 and 1.5
    torch.testing.assert_close(seq.weights[1, :2], torch.tensor([1.5, 1.5], dtype=torch.float64) / 1.125)
    m = metrics_to_host(seq.metrics)
    assert m["mis_ratio_mean_after_mis"] == pytest.approx(1.0)
    assert m["mis_ess"] == pytest.approx((2.25**2) / (2 * (0.75**2 + 1.5**2)))
    # normalization uses contributing (post-veto) units only: seq 0 vetoed -> weight 1.5 / 1.5 = 1
    vet = run(C(use_tis=True, tis_level="sequence", tis_batch_normalize=True, rs_veto_threshold=0.3))
    torch.testing.assert_close(vet.weights[1, :2], torch.ones(2, dtype=torch.float64))
    assert (vet.weights[0] == 0).all()


LEVELS = ("token", "sequence", "geometric")


def _configs():
    for level, mode, rs_level, veto, norm in itertools.product(
        LEVELS, ("truncate", "clip", "mask"), (None, *LEVELS), (None, 0.05), (False, True)
    ):
        rs = {} if rs_level is None else dict(use_rs=True, rs_level=rs_level, rs_upper_bound=1.5 if rs_level != "geometric" else 1.05)
        yield C(use_tis=True, tis_level=level, tis_mode=mode, tis_batch_normalize=norm, rs_veto_threshold=veto, **rs)
    for rs_level in LEVELS:
        yield C(use_rs=True, rs_level=rs_level, rs_upper_bound=1.5, rs_veto_threshold=0.05)


def _batch(seed, B=6, S=12):
    lp_t, lp_r, mask = correction_batch(seed, B, S, spread=3.0, noise=0.3, dropped=0.25)
    lp_t[0, 3] = lp_r[0, 3] - 4.0  # catastrophic token (ratio 0.018 < 0.05)
    mask[5] = False  # empty sequence
    return lp_t, lp_r, mask


@pytest.mark.parametrize("cfg", list(_configs()), ids=lambda c: f"{c.tis_level}-{c.tis_mode}-{c.use_tis}-{c.use_rs and c.rs_level}-{c.rs_veto_threshold}-{c.tis_batch_normalize}")
def test_every_combination_matches_loop_reference(cfg):
    lp_t, lp_r, mask = _batch(1)
    res = run(cfg, lp_t, lp_r, mask)
    w_ref, f_ref, factor = ref_correction(lp_t, lp_r, mask, cfg)
    assert torch.equal(res.loss_mask.double(), f_ref)
    if w_ref is None:
        assert res.weights is None
    else:
        torch.testing.assert_close(res.weights, w_ref, rtol=1e-12, atol=1e-12)
    m = metrics_to_host(res.metrics)
    if factor is not None:
        assert m["mis_batch_norm_factor"] == pytest.approx(factor, rel=1e-12)
    assert m["mis_rejected_token_fraction"] == pytest.approx(1 - f_ref.sum().item() / mask.sum().item())
    assert all(math.isfinite(v) for v in m.values())


@pytest.fixture(scope="module")
def default_weights_as_custom(tmp_path_factory):
    """`default_weights` behind a wrapper, so the core takes its general (custom-function) path for it."""
    f = tmp_path_factory.mktemp("custom") / "wrapped_default.py"
    f.write_text(
        "from slime_corr.correction import default_weights\n"
        "def wrapped(inputs, config):\n"
        "    return default_weights(inputs, config)\n"
    )
    return f"{f}:wrapped"


@pytest.mark.parametrize("cfg", list(_configs()), ids=lambda c: f"{c.tis_level}-{c.tis_mode}-{c.use_tis}-{c.use_rs and c.rs_level}-{c.rs_veto_threshold}-{c.tis_batch_normalize}")
def test_builtin_path_matches_default_weights_as_a_custom_function(cfg, default_weights_as_custom):
    """The core's built-in path (per-sequence shapes, counts from the reduced sums) and the general path running
    `default_weights` give the same weights, masks and metrics, non-finite sequences included."""
    lp_t, lp_r, mask = _batch(4)
    lp_t[1, 2], mask[1, 2] = math.nan, True  # a non-finite sequence
    mask[0, 3] = True  # the catastrophic token of `_batch` (ratio 0.018), vetoed at threshold 0.05
    builtin = run(cfg, lp_t, lp_r, mask)
    general = run(cfg.replace(custom_tis_function_path=default_weights_as_custom), lp_t, lp_r, mask)
    assert builtin.loss_mask.sum() > 0 and torch.equal(builtin.loss_mask, general.loss_mask)
    if builtin.weights is None:
        assert general.weights is None
    else:
        torch.testing.assert_close(builtin.weights, general.weights, rtol=1e-12, atol=1e-12)
    m_builtin, m_general = metrics_to_host(builtin.metrics), metrics_to_host(general.metrics)
    assert m_general.pop("mis_custom_nonfinite_weight_count", 0) == 0  # absent without IS weights
    assert m_general.pop("mis_custom_negative_weight_count", 0) == 0
    assert m_builtin.keys() == m_general.keys()
    assert m_builtin["mis_nonfinite_seq_count"] == 1
    if cfg.rs_veto_threshold is not None:
        assert m_builtin["mis_catastrophic_seq_fraction"] > 0
    for key, value in m_builtin.items():
        assert m_general[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_float32_and_float_mask_match_float64_bool():
    lp_t, lp_r, mask = _batch(2)
    cfg = C.preset("decoupled_seq_is_rs")
    a = run(cfg, lp_t, lp_r, mask)
    b = run(cfg, lp_t.float(), lp_r.float(), mask.float())
    assert torch.equal(a.loss_mask, b.loss_mask)
    torch.testing.assert_close(a.weights.float(), b.weights, rtol=1e-5, atol=1e-6)


def test_nonfinite_sequences_are_rejected_and_counted():
    lp_t, lp_r, mask = _batch(3)
    mask[1, 2] = mask[2, 4] = True
    lp_t[1, 2] = float("nan")
    lp_r[2, 4] = -float("inf")
    lp_t[3, ~mask[3]] = float("nan")  # NaN at padding: harmless
    res = run(C(use_tis=True, tis_level="sequence", tis_batch_normalize=True), lp_t, lp_r, mask)
    assert (res.loss_mask[1:3] == 0).all() and torch.equal(res.loss_mask[3], mask[3].float())
    assert torch.isfinite(res.weights).all()
    m = metrics_to_host(res.metrics)
    assert m["mis_nonfinite_seq_count"] == 2 and m["mis_nonfinite_token_count"] == 2
    assert all(math.isfinite(v) for v in m.values())


def test_extreme_log_ratios_are_finite():
    lp_r = torch.zeros(3, 5)
    lp_t = torch.tensor([[1e4, -1e4, 0, 0, 0], [-1e4] * 5, [3e38, -3e38, 0, 0, 0]])
    for level in LEVELS:
        res = run(C(use_tis=True, tis_level=level, tis_mode="clip", tis_batch_normalize=True), lp_t, lp_r, torch.ones(3, 5))
        assert torch.isfinite(res.weights).all()
        assert all(math.isfinite(v) for v in metrics_to_host(res.metrics).values())


def test_metrics_only_returns_mask_unchanged_and_no_weights():
    lp_t, lp_r, mask = _batch(4)
    res = run(C(get_mismatch_metrics=True), lp_t, lp_r, mask.float())
    assert res.weights is None and torch.equal(res.loss_mask, mask.float())
    assert "mismatch_kl" in res.metrics and not any(k.startswith("mis_rs") for k in res.metrics)
    off = run(C(), lp_t, lp_r, mask)
    assert off.metrics == {} and off.weights is None


def test_custom_weight_function_by_path(tmp_path):
    f = tmp_path / "my_tis.py"
    f.write_text(
        "import torch\n"
        "from slime_corr.correction import WeightOutputs\n"
        "def halve(inputs, config):\n"
        "    w = torch.full_like(inputs.log_ratio, 0.5)\n"
        "    keep = inputs.seq_token_count.unsqueeze(-1) > 3\n"
        "    return WeightOutputs(weights=w, loss_mask=inputs.loss_mask & keep, metrics={'my_metric': torch.tensor(7.0)})\n"
    )
    lp_t, lp_r, mask = _batch(5)
    cfg = C(use_tis=True, tis_batch_normalize=True, custom_tis_function_path=f"{f}:halve")
    res = run(cfg, lp_t, lp_r, mask)
    keep = (mask.sum(-1, keepdim=True) > 3) & mask
    assert torch.equal(res.loss_mask, keep.float())
    torch.testing.assert_close(res.weights, keep.double())  # 0.5 normalized by its mean 0.5, 0 at padding
    assert metrics_to_host(res.metrics)["my_metric"] == 7.0


def test_custom_weight_function_nonfinite_weights_reject_their_tokens(tmp_path):
    f = tmp_path / "nan_tis.py"
    f.write_text(
        "import torch\n"
        "from slime_corr.correction import WeightOutputs\n"
        "def first_token_nan(inputs, config):\n"
        "    w = torch.ones_like(inputs.log_ratio)\n"
        "    w[:, 0] = float('nan')\n"
        "    w[0, 1] = float('inf')\n"
        "    return WeightOutputs(weights=w, loss_mask=inputs.loss_mask)\n"
    )
    lp_t = torch.zeros(2, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)  # row 1's first token is padding
    res = run(C(use_tis=True, custom_tis_function_path=f"{f}:first_token_nan"), lp_t, lp_t.clone(), mask)
    assert res.loss_mask.tolist() == [[0, 0, 1, 0], [0, 1, 1, 1]]
    assert res.weights.tolist() == [[0, 0, 1, 0], [0, 1, 1, 1]]
    m = metrics_to_host(res.metrics)
    assert m["mis_custom_nonfinite_weight_count"] == 2
    assert m["mis_rs_rejected_token_fraction"] == pytest.approx(2 / 6)
    assert m["mis_weight_max"] == 1.0 and m["mis_ratio_mean_after_mis"] == 1.0


def test_custom_raw_weights_nonfinite_count_as_the_ceiling(tmp_path):
    """A custom function's overflowing raw weight (+inf) counts as exp(20), so it is "above U"; NaN counts as 0."""
    f = tmp_path / "raw_tis.py"
    f.write_text(
        "import torch\n"
        "from slime_corr.correction import WeightOutputs\n"
        "def raw_overflow(inputs, config):\n"
        "    raw = torch.tensor([[float('inf'), 1.0, 1.0], [float('nan'), 3.0, 1.0]], dtype=inputs.log_ratio.dtype)\n"
        "    return WeightOutputs(weights=raw.clamp(max=2.0).nan_to_num(0.0), loss_mask=inputs.loss_mask, raw_weights=raw)\n"
    )
    lp = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    res = run(C(use_tis=True, tis_upper_bound=2.0, custom_tis_function_path=f"{f}:raw_overflow"), lp, lp.clone(), mask)
    m = metrics_to_host(res.metrics)
    assert m["mis_truncate_fraction"] == pytest.approx(2 / 6)  # exp(20) and 3.0
    assert m["mis_mean_is_weight_before_clip"] == pytest.approx((math.exp(20.0) + 1 + 1 + 0 + 3 + 1) / 6)


def test_custom_weight_function_bad_signature(tmp_path):
    from slime_corr.config import ConfigError

    f = tmp_path / "bad.py"
    f.write_text("def f(x):\n    return x\n")
    with pytest.raises(ConfigError):
        run(C(use_tis=True, custom_tis_function_path=f"{f}:f"))


# ---------------------------------------------------------------------------------------------------------------
# Hand-computed grid: every IS level x mode x RS level x veto x batch normalization on one tiny batch.
# Tokens (valid only): seq 0 ratios [3, 0.25, 1], seq 1 ratios [1.5, 1], seq 2 empty (garbage at padding).
# IS bounds U = 1.2, L = 1/1.2 = 5/6. Sequence ratios: 0.75 and 1.5; geometric: g0 = 0.75^(1/3), g1 = 1.5^(1/2).
GRID_LR = torch.tensor(
    [[math.log(3.0), math.log(0.25), 0.0, 7.0], [math.log(1.5), 0.0, -50.0, 0.0], [float("nan"), 1e4, -1e4, 0.0]],
    dtype=torch.float64,
)
GRID_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
GRID_POS = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]  # the five valid tokens, in this order
G0, G1 = 0.75 ** (1 / 3), 1.5**0.5
L6 = 5 / 6
HAND_WEIGHTS = {  # (level, mode) -> weight of each valid token, before rejection and normalization
    ("token", "truncate"): [1.2, 0.25, 1.0, 1.2, 1.0],
    ("token", "clip"): [1.2, L6, 1.0, 1.2, 1.0],
    ("token", "mask"): [0.0, 0.0, 1.0, 0.0, 1.0],
    ("sequence", "truncate"): [0.75, 0.75, 0.75, 1.2, 1.2],
    ("sequence", "clip"): [L6, L6, L6, 1.2, 1.2],
    ("sequence", "mask"): [0.0, 0.0, 0.0, 0.0, 0.0],
    ("geometric", "truncate"): [G0, G0, G0, 1.2, 1.2],
    ("geometric", "clip"): [G0, G0, G0, 1.2, 1.2],
    ("geometric", "mask"): [G0, G0, G0, 0.0, 0.0],
}
HAND_RS = {  # rs level -> (config, keep of each valid token)
    None: ({}, [1, 1, 1, 1, 1]),
    "token": (dict(rs_upper_bound=2.0), [0, 0, 1, 1, 1]),  # keep ratio in [0.5, 2]
    "sequence": (dict(rs_upper_bound=1.4), [1, 1, 1, 0, 0]),  # 0.75 in [0.714, 1.4], 1.5 not
    "geometric": (dict(rs_lower_bound=0.95, rs_upper_bound=1.3), [0, 0, 0, 1, 1]),  # g0 0.909 < 0.95, g1 1.22 ok
}
HAND_VETO = {None: [1, 1, 1, 1, 1], 0.3: [0, 0, 0, 1, 1]}  # 0.25 < 0.3 vetoes sequence 0


@pytest.mark.parametrize("norm", (False, True))
@pytest.mark.parametrize("veto", (None, 0.3))
@pytest.mark.parametrize("rs_level", (None, *LEVELS))
@pytest.mark.parametrize("mode", ("truncate", "clip", "mask"))
@pytest.mark.parametrize("level", LEVELS)
def test_hand_computed_grid(level, mode, rs_level, veto, norm):
    rs_kw, rs_keep = HAND_RS[rs_level]
    rs_kw = dict(use_rs=True, rs_level=rs_level, **rs_kw) if rs_level else {}
    cfg = C(use_tis=True, tis_level=level, tis_mode=mode, tis_upper_bound=1.2, tis_batch_normalize=norm,
            rs_veto_threshold=veto, **rs_kw)
    w = HAND_WEIGHTS[(level, mode)]
    keep = [a * b for a, b in zip(rs_keep, HAND_VETO[veto], strict=True)]
    # batch-norm mean: over kept tokens (token level) or kept sequences, each once (sequence/geometric level)
    if level == "token":
        units = [w[k] for k in range(5) if keep[k]]
    else:  # a sequence contributes when any of its tokens is kept (token-level RS may keep part of it)
        units = [w[first] for first, toks in ((0, keep[:3]), (3, keep[3:])) if any(toks)]
    mean = sum(units) / len(units) if units else 0.0
    factor = mean if norm and mean > 1e-8 else 1.0

    for mask in (GRID_MASK, GRID_MASK.float()):
        res = run(cfg, GRID_LR - 1.0, torch.full_like(GRID_LR, -1.0), mask)
        exp_mask = torch.zeros(3, 4, dtype=torch.float64)
        exp_w = torch.zeros(3, 4, dtype=torch.float64)
        for k, (i, t) in enumerate(GRID_POS):
            exp_mask[i, t] = keep[k]
            exp_w[i, t] = keep[k] * w[k] / factor
        assert torch.equal(res.loss_mask.double(), exp_mask)
        assert torch.equal(res.denominator_mask, res.loss_mask)
        torch.testing.assert_close(res.weights, exp_w, rtol=1e-12, atol=1e-12)
        assert torch.isfinite(res.weights).all() and res.weights.grad_fn is None
        m = metrics_to_host(res.metrics)
        assert m["mis_rejected_token_fraction"] == pytest.approx(1 - sum(keep) / 5)
        assert m["mis_rejected_seq_fraction"] == pytest.approx(((sum(keep[:3]) == 0) + (sum(keep[3:]) == 0)) / 2)
        assert m["mis_all_rejected"] == float(sum(keep) == 0)
        if veto is not None:
            assert m["mis_catastrophic_token_fraction"] == pytest.approx(1 / 5)
            assert m["mis_catastrophic_seq_fraction"] == pytest.approx(1 / 2)
        if norm:
            assert m["mis_batch_norm_factor"] == pytest.approx(factor)
        if units:
            assert m["mis_weight_min"] == pytest.approx(min(units) / factor)
            assert m["mis_weight_max"] == pytest.approx(max(units) / factor)
            assert m["mis_ratio_mean_after_mis"] == pytest.approx(mean / factor)
            sq = sum(u * u for u in units)
            assert m["mis_ess"] == pytest.approx(sum(units) ** 2 / (len(units) * sq) if sq else 0.0)
        assert all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("level,expected", [("token", [2.5, 0.5, 1.0, 1.5, 1.0]), ("sequence", [0.8] * 3 + [1.2] * 2)])
def test_hand_computed_slime_tis_clip_flags(level, expected):
    # slime's --tis-clip C / --tis-clip-low c: a two-sided clamp to [c, C] (c defaults to 0)
    cfg = C(use_tis=True, tis_level=level, tis_clip=2.5 if level == "token" else 1.2, tis_clip_low=0.5 if level == "token" else 0.8)
    res = run(cfg, GRID_LR - 1.0, torch.full_like(GRID_LR, -1.0), GRID_MASK)
    got = [res.weights[i, t].item() for i, t in GRID_POS]
    assert got == pytest.approx(expected)
    only_high = run(C(use_tis=True, tis_clip=2.5), GRID_LR - 1.0, torch.full_like(GRID_LR, -1.0), GRID_MASK)
    assert [only_high.weights[i, t].item() for i, t in GRID_POS] == pytest.approx([2.5, 0.25, 1.0, 1.5, 1.0])


def test_hand_computed_rs_keep_loss_denominator():
    cfg = C(use_rs=True, rs_level="sequence", rs_upper_bound=1.4, rs_keep_loss_denominator=True)
    res = run(cfg, GRID_LR - 1.0, torch.full_like(GRID_LR, -1.0), GRID_MASK)
    assert res.loss_mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert torch.equal(res.denominator_mask, GRID_MASK.float())
    assert res.seq_token_count.tolist() == [3, 2, 0]
    assert res.global_token_count.item() == 5 and res.global_seq_count.item() == 2
    drop = run(cfg.replace(rs_keep_loss_denominator=False), GRID_LR - 1.0, torch.full_like(GRID_LR, -1.0), GRID_MASK)
    assert drop.seq_token_count.tolist() == [3, 0, 0]
    assert drop.global_token_count.item() == 3 and drop.global_seq_count.item() == 1
