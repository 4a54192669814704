"""Packed (THD) micro-batches in the correction core and the losses: one row [1, T] whose sequences a `Segments`
gives equals the padded [B, S] layout (one sequence per row) — weights, masks, every metric, loss and gradient —
for every preset and aggregation, the example custom weighting function, token-level RS + veto and batch
normalization, with uneven lengths, empty and length-1 sequences, per-sequence padding inside the packed row,
positions past the last sequence, a non-finite sequence and an all-rejected batch. The padded layout is the
reference (it is itself checked against loop references in test_weights.py / test_losses.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slime_corr.config import PRESETS
from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import compute_rollout_correction, metrics_to_host
from slime_corr.layout.segments import Segments
from slime_corr.losses import compute_policy_loss
from tests.synthetic import policy_batch, response_mask

B, S = 7, 12
LENGTHS = (12, 3, 0, 7, 1, 9, 5)  # the positions each sequence occupies (mask holes inside some)
PADDED = (12, 4, 2, 8, 2, 10, 6)  # its positions in the packed row: per-sequence padding (a multiple of 2)
TRAILING = 3  # positions past the last sequence (belong to none)
AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
CUSTOM = f"{Path(__file__).resolve().parents[2] / 'examples' / 'custom_tis.py'}:length_aware_geometric_is"


def _data(seed: int = 0, dtype: torch.dtype = torch.float64):
    """Padded [B, S] data; lp_rollout close to lp_old in half of the rows (RS keeps them), far in the others."""
    noise = torch.tensor([1e-4, 0.3] * 4, dtype=dtype)[:B, None]
    lp, old, ro, adv, mask = policy_batch(seed, B, S, rollout_noise=noise, policy_noise=0.5 * noise,
                                          sequence_advantages=True, lengths=LENGTHS, dtype=dtype)
    mask[0, ::3] = False
    mask[5, 2] = False
    ro[5, 4] = float("nan")  # a non-finite sequence
    ro[6, 1] -= 12.0  # a catastrophic token (vetoed)
    return lp, old, ro * mask, adv, mask


def _offsets() -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(PADDED).cumsum(0).tolist()])


def _pack(x: torch.Tensor, fill=0) -> torch.Tensor:
    """[B, S] -> [1, T]: each row's LENGTHS positions, padded to PADDED with `fill`, then TRAILING positions."""
    parts = [torch.cat([x[i, :n], x.new_full((p - n,), fill)]) for i, (n, p) in enumerate(zip(LENGTHS, PADDED,
                                                                                                strict=True))]
    return torch.cat([*parts, x.new_full((TRAILING,), fill)]).unsqueeze(0)


def _unpack(y: torch.Tensor) -> torch.Tensor:
    off = _offsets().tolist()
    out = y.new_zeros(B, S)
    for i, n in enumerate(LENGTHS):
        out[i, :n] = y[0, off[i]:off[i] + n]
    return out


def _segments() -> Segments:
    return Segments.packed_row(_offsets(), sum(PADDED) + TRAILING)


def _within() -> torch.Tensor:
    return response_mask(LENGTHS, S)


def _cases() -> list[tuple[str, C]]:
    out = [(f"{name}/{agg}", C.preset(name, loss_agg_mode=agg)) for name in PRESETS for agg in AGG]
    out.append(("custom", C(use_tis=True, custom_tis_function_path=CUSTOM, loss_agg_mode="seq-mean-token-mean")))
    out.append(("token-is+normalize", C.preset("decoupled_token_is", tis_batch_normalize=True)))
    out.append(("seq-is+normalize", C.preset("pg_is", tis_batch_normalize=True, loss_agg_mode="seq-mean-token-sum")))
    out.append(("token-rs+veto+clip", C(use_tis=True, tis_mode="clip", use_rs=True, rs_level="token",
                                        rs_upper_bound=1.5, rs_veto_threshold=1e-3)))
    out.append(("mask-mode+keep-denominator", C(use_tis=True, tis_mode="mask", tis_upper_bound=1.3, use_rs=True,
                                                rs_level="geometric", rs_upper_bound=1.05, rs_keep_loss_denominator=True,
                                                loss_agg_mode="seq-mean-token-mean")))
    return out


def _assert_same(padded, packed, tag: str) -> None:
    got, want = metrics_to_host(packed.metrics), metrics_to_host(padded.metrics)
    assert set(got) == set(want), tag
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), f"{tag} {key}"
    torch.testing.assert_close(packed.loss, padded.loss, rtol=1e-10, atol=1e-14, msg=tag)
    c_pad, c_pack = padded.correction, packed.correction
    assert (c_pad is None) == (c_pack is None), tag
    if c_pad is None:
        return
    assert torch.equal(_unpack(c_pack.loss_mask), c_pad.loss_mask), tag
    assert torch.equal(_unpack(c_pack.denominator_mask), c_pad.denominator_mask * _within()), tag
    torch.testing.assert_close(c_pack.seq_token_count, c_pad.seq_token_count, msg=tag)
    assert (c_pad.weights is None) == (c_pack.weights is None), tag
    if c_pad.weights is not None:
        torch.testing.assert_close(_unpack(c_pack.weights), c_pad.weights * _within(), rtol=1e-12, atol=1e-14,
                                   msg=tag)
        assert c_pack.weights[0, -TRAILING:].abs().sum() == 0, tag


@pytest.mark.parametrize("tag,cfg", _cases(), ids=[t for t, _ in _cases()])
def test_packed_equals_padded(tag, cfg):
    lp, old, ro, adv, mask = _data()
    x_pad = lp.clone().requires_grad_()
    x_pack = _pack(lp).requires_grad_()
    old_in = None if cfg.use_rollout_logprobs else old
    padded = compute_policy_loss(x_pad, old_in, ro, adv, mask, cfg, seq_length_for_norm=S)
    packed = compute_policy_loss(x_pack, None if old_in is None else _pack(old), _pack(ro), adv, _pack(mask), cfg,
                                 seq_length_for_norm=S, segments=_segments())
    padded.loss.backward()
    packed.loss.backward()
    _assert_same(padded, packed, tag)
    torch.testing.assert_close(_unpack(x_pack.grad), x_pad.grad * _within(), rtol=1e-12, atol=1e-14, msg=tag)
    assert x_pack.grad[0, -TRAILING:].abs().sum() == 0
    if cfg.use_rollout_correction and cfg.custom_tis_function_path is None and "normalize" not in tag:
        assert 0 < packed.metrics["mis_rejected_seq_fraction"] < 1, tag  # the data exercises rejection


def test_packed_per_token_advantages_and_an_all_rejected_batch():
    lp, old, ro, adv, mask = _data(seed=1)
    adv_tok = adv[:, None] * torch.linspace(0.5, 1.5, S, dtype=lp.dtype)
    cfg = C.preset("decoupled_geo_rs", rs_upper_bound=1.0 + 1e-9, rs_lower_bound=1.0 - 1e-9)
    x_pad, x_pack = lp.clone().requires_grad_(), _pack(lp).requires_grad_()
    padded = compute_policy_loss(x_pad, old, ro, adv_tok, mask, cfg)
    packed = compute_policy_loss(x_pack, _pack(old), _pack(ro), _pack(adv_tok), _pack(mask), cfg,
                                 segments=_segments())
    padded.loss.backward()
    packed.loss.backward()
    _assert_same(padded, packed, "all rejected")
    assert packed.metrics["mis_all_rejected"] == 1 and packed.loss == 0 and x_pack.grad.abs().sum() == 0


def test_packed_float32_inputs_match_padded():
    lp, old, ro, adv, mask = _data(dtype=torch.float32)
    cfg = C.preset("decoupled_seq_is_rs", loss_agg_mode="seq-mean-token-mean")
    padded = compute_rollout_correction(old, ro, mask, cfg)
    packed = compute_rollout_correction(_pack(old), _pack(ro), _pack(mask), cfg, segments=_segments())
    got, want = metrics_to_host(packed.metrics), metrics_to_host(padded.metrics)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert torch.equal(_unpack(packed.loss_mask), padded.loss_mask)


def test_segments_reductions_against_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.rand(B, 3, S, generator=g, dtype=torch.float64) * _within()[:, None]
    packed = torch.stack([_pack(x[:, k])[0] for k in range(3)]).unsqueeze(0)  # [1, 3, T]
    seg, rows = _segments(), Segments.rows(B, S)
    assert seg.num == B and seg.shape() == (1, sum(PADDED) + TRAILING)
    torch.testing.assert_close(seg.sum(packed), rows.sum(x))
    torch.testing.assert_close(seg.sum(packed[:, 0]), rows.sum(x[:, 0]))
    torch.testing.assert_close(seg.amax(packed[:, 1]), rows.amax(x[:, 1]))
    v = torch.arange(1.0, B + 1, dtype=torch.float64)
    assert torch.equal(_unpack(seg.expand(v)), v[:, None] * _within())
    assert seg.expand(v)[0, :-TRAILING].tolist() == [i + 1.0 for i, p in enumerate(PADDED) for _ in range(p)]
    assert seg.expand(v, fill=7.0)[0, -TRAILING:].tolist() == [7.0] * TRAILING
    assert seg.sizes().tolist() == list(PADDED)
    rows_view = seg.to_rows(_pack(x[:, 2]))
    assert rows_view.shape == (B, max(PADDED))
    torch.testing.assert_close(seg.from_rows(rows_view), _pack(x[:, 2]))
    torch.testing.assert_close(seg.from_rows(v[:, None]), seg.expand(v))


@pytest.mark.parametrize("offsets,message", [
    (torch.tensor([1, 3]), "must start at 0"),
    (torch.tensor([0, 4, 2]), "not decrease"),
    (torch.tensor([0, 99]), "end at most at the packed length"),
    (torch.tensor([0.0, 2.0]), "1-D integer tensor"),
])
def test_bad_offsets_are_a_clear_error(offsets, message):
    with pytest.raises(ValueError, match=message):
        Segments.packed_row(offsets, 10)


def test_packed_inputs_are_checked():
    lp, old, ro, adv, mask = _data()
    with pytest.raises(ValueError, match=r"segments describe tokens of shape \(1, 47\), but log_probs has shape"):
        compute_rollout_correction(old, ro, mask, C.preset("pg_is"), segments=_segments())
    with pytest.raises(TypeError, match="segments must be a slime_corr.layout.segments.Segments"):
        compute_rollout_correction(old, ro, mask, C.preset("pg_is"), segments=_offsets())
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm .* pass seq_length_for_norm"):
        compute_policy_loss(_pack(lp), _pack(old), _pack(ro), adv, _pack(mask),
                            C.preset("pg_is", loss_agg_mode="seq-mean-token-sum-norm"), segments=_segments())
    with pytest.raises(ValueError, match=r"advantages must have shape .* or \(7,\) / \(7, 1\) per sequence"):
        compute_policy_loss(_pack(lp), _pack(old), _pack(ro), adv[:3], _pack(mask), C.preset("pg_is"),
                            segments=_segments())


def test_packed_under_torch_compile_matches_eager():
    """`--rollout-correction-compile` traces the packed reductions too (one case: compiling takes seconds)."""
    lp, old, ro, adv, mask = _data()
    cfg = C(use_tis=True, use_rs=True, rs_level="geometric", rs_upper_bound=1.05, rs_veto_threshold=1e-3)
    eager = compute_rollout_correction(_pack(old), _pack(ro), _pack(mask), cfg, segments=_segments())
    compiled = compute_rollout_correction(_pack(old), _pack(ro), _pack(mask),
                                          cfg.replace(rollout_correction_compile=True), segments=_segments())
    got, want = metrics_to_host(compiled.metrics), metrics_to_host(eager.metrics)
    for key, value in want.items():  # std = sqrt(E w² - (E w)²) cancels: the fused sums' order shows at 1e-8
        assert got[key] == pytest.approx(value, rel=1e-7, abs=1e-9), key
    assert torch.equal(compiled.loss_mask, eager.loss_mask)
    torch.testing.assert_close(compiled.weights, eager.weights, rtol=1e-12, atol=1e-14)
