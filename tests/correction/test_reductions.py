"""The float-arithmetic mask helpers of `reductions.py` against the plain bool formulations they replace."""

from __future__ import annotations

import pytest
import torch

from slime_corr.correction.reductions import count_greater_, finite_indicator_, float_mask

SPECIALS = [0.0, -0.0, 1.0, -1.0, 1e-45, 1e30, -1e30, 3.0e38, -3.0e38, float("inf"), -float("inf"), float("nan")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_finite_indicator_matches_isfinite(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor(SPECIALS), torch.randn(500, generator=g) * 1e4]).to(dtype)
    x[::7] = float("nan")
    expected = torch.isfinite(x).to(dtype)
    got = finite_indicator_(x.clone())
    assert got.dtype == dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_count_greater_matches_bool_count(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 300, generator=g, dtype=dtype) * 10
    x[0, :5] = 2.5  # exactly at the threshold: not counted
    x[1] = torch.tensor([1e30, -1e30, 3e38, -3e38, 0.0, 2.5] * 50, dtype=dtype)
    for threshold in (2.5, -2.5, 0.0, 1e30):
        expected = (x > threshold).sum(-1).to(dtype)
        assert torch.equal(count_greater_(x.clone(), threshold), expected), threshold


def test_float_mask_matches_bool_to_float():
    g = torch.Generator().manual_seed(2)
    valid = torch.rand(5, 40, generator=g) > 0.4
    for mask in (valid, valid.t(), valid[:, ::3], valid[:1].expand(7, 40)):  # contiguous, strided, expanded
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            assert torch.equal(float_mask(mask, dtype), mask.to(dtype))


def test_count_greater_counts_exactly_in_half_precision():
    x = torch.ones(2, 1000, dtype=torch.bfloat16)  # 1000 is not representable in bf16
    assert count_greater_(x, 0.5).tolist() == [1000.0, 1000.0]
