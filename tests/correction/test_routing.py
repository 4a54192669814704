"""Routing-mismatch metrics: hand-computed values, set (not order) comparison, uneven masks, empty and
all-masked batches, NaN log-probs at masked positions, and the same numbers over DP x CP gloo ranks (one spawn)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from slime_corr.correction.routing import routes_differ, routing_mismatch_metrics, topk_routes
from tests.mcore.mcore_helpers import spawn_group


def _host(m: dict) -> dict[str, float]:
    return {k: float(v) for k, v in m.items()}


def test_hand_computed():
    # 1 sequence, 3 tokens, 2 layers, top-2
    a = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [1, 3]]]], dtype=torch.uint8)
    b = torch.tensor([[[[1, 0], [2, 3]], [[4, 6], [6, 7]], [[0, 2], [3, 2]]]], dtype=torch.int16)
    # token 0: same sets (order differs); token 1: layer 0 differs; token 2: layer 1 differs ({1,3} vs {2,3})
    assert routes_differ(a, b).tolist() == [[[False, False], [True, False], [False, True]]]
    lp_a = torch.tensor([[-1.0, -2.0, -3.0]])
    lp_b = torch.tensor([[-1.5, -2.0, -2.0]])
    got = _host(routing_mismatch_metrics(a, b, torch.ones(1, 3), lp_a, lp_b))
    assert got == pytest.approx({
        "routing_tokens": 3, "routing_mismatch_tokens": 2, "routing_mismatch_frac": 2 / 6,
        "routing_mismatch_token_frac": 2 / 3, "routing_mismatch_layer_0": 1 / 3, "routing_mismatch_layer_1": 1 / 3,
        "logprob_abs_diff_routing_diff": (0.0 + 1.0) / 2, "logprob_abs_diff_routing_same": 0.5})
    # token 1 masked out (and a NaN log-prob there is ignored)
    lp_a[0, 1] = float("nan")
    got = _host(routing_mismatch_metrics(a, b, torch.tensor([[1.0, 0.0, 1.0]]), lp_a, lp_b))
    assert got["routing_tokens"] == 2 and got["routing_mismatch_layer_0"] == 0.0
    assert got["routing_mismatch_token_frac"] == 0.5 and got["logprob_abs_diff_routing_diff"] == 1.0


def test_identical_empty_and_all_masked():
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 8, (3, 5, 4, 2), generator=g)
    same = routing_mismatch_metrics(r, r.flip(-1), torch.ones(3, 5))
    assert float(same["routing_mismatch_frac"]) == 0.0 and float(same["routing_tokens"]) == 15
    for mask in (torch.zeros(3, 5), torch.zeros(3, 5, dtype=torch.bool)):
        m = _host(routing_mismatch_metrics(r, (r + 1) % 8, mask, torch.zeros(3, 5), torch.ones(3, 5)))
        assert all(v == 0.0 for v in m.values()), m  # no token: zeros, not NaN
    empty = _host(routing_mismatch_metrics(r[:, :0], r[:, :0], torch.ones(3, 0)))
    assert empty["routing_tokens"] == 0.0 and empty["routing_mismatch_frac"] == 0.0


def test_against_a_plain_loop_with_uneven_masks():
    g = torch.Generator().manual_seed(1)
    B, T, L, E, k = 4, 9, 3, 6, 2
    logits_a = torch.randn(B, T, L, E, generator=g)
    logits_b = logits_a + 0.4 * torch.randn(B, T, L, E, generator=g)
    a, b = topk_routes(logits_a, k), topk_routes(logits_b, k)
    mask = torch.arange(T)[None] < torch.tensor([9, 0, 4, 7])[:, None]
    lp_a, lp_b = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    got = _host(routing_mismatch_metrics(a, b, mask, lp_a, lp_b))
    n = n_diff = 0
    per_layer, lp_d, lp_s = [0] * L, [], []
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            n += 1
            diff = [set(a[i, t, layer].tolist()) != set(b[i, t, layer].tolist()) for layer in range(L)]
            for layer in range(L):
                per_layer[layer] += diff[layer]
            n_diff += any(diff)
            (lp_d if any(diff) else lp_s).append(abs(float(lp_a[i, t] - lp_b[i, t])))
    assert 0 < n_diff < n  # the data exercise both sides
    assert got["routing_mismatch_token_frac"] == pytest.approx(n_diff / n)
    assert got["routing_mismatch_frac"] == pytest.approx(sum(per_layer) / (n * L))
    for layer in range(L):
        assert got[f"routing_mismatch_layer_{layer}"] == pytest.approx(per_layer[layer] / n)
    assert got["logprob_abs_diff_routing_diff"] == pytest.approx(sum(lp_d) / len(lp_d))
    assert got["logprob_abs_diff_routing_same"] == pytest.approx(sum(lp_s) / len(lp_s))


def test_bad_inputs_name_the_argument():
    r = torch.zeros(2, 3, 2, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="routes_differ: shapes"):
        routing_mismatch_metrics(r, r[:, :, :1], torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"mask \(2, 4\)"):
        routing_mismatch_metrics(r, r, torch.ones(2, 4))
    with pytest.raises(ValueError, match="lp_a and lp_b"):
        routing_mismatch_metrics(r, r, torch.ones(2, 3), torch.zeros(2, 3))


WORLD = 4  # DP=2 x CP=2


def _data():
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 4, (4, 8, 2, 2), generator=g)
    b = torch.where(torch.rand(4, 8, 2, 1, generator=g) < 0.3, torch.randint(0, 4, (4, 8, 2, 2), generator=g), a)
    mask = torch.arange(8)[None] < torch.tensor([8, 3, 0, 6])[:, None]
    return a, b, mask, torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _worker(rank: int) -> None:
    cp_groups = [dist.new_group([2 * d, 2 * d + 1]) for d in range(2)]
    dp_groups = [dist.new_group([c, 2 + c]) for c in range(2)]
    d, c = divmod(rank, 2)
    a, b, mask, lp_a, lp_b = _data()
    ref = _host(routing_mismatch_metrics(a, b, mask, lp_a, lp_b))
    rows, cols = slice(2 * d, 2 * d + 2), slice(4 * c, 4 * c + 4)  # any split of tokens over CP ranks
    got = _host(routing_mismatch_metrics(a[rows, cols], b[rows, cols], mask[rows, cols], lp_a[rows, cols],
                                         lp_b[rows, cols], cp_group=cp_groups[d], dp_group=dp_groups[c]))
    assert got == pytest.approx(ref, rel=1e-12), (rank, got, ref)


def test_dp_cp_sharding_matches_single_rank():
    spawn_group(_worker, WORLD)
