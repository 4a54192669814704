"""The engine's nucleus from its top-N log-probs (`slime_corr.rollout.nucleus.engine_nucleus`) against independent
references: the trainer's exact threshold search (`truncated_logprobs.nucleus_keep`, on random logits without ties),
a plain loop over the sorted full distribution (ties, every rank), and the full softmax's mass; N too small to hold
the boundary gives "does not fit", and so does a top-p boundary within rounding of top_p. Also which top-N a
truncation asks for (`nucleus_request`)."""

from __future__ import annotations

import math

import pytest
import torch

from slime_corr.mcore.truncated_logprobs import nucleus_keep
from slime_corr.rollout.nucleus import BOUNDARY_TOLERANCE, NucleusRequest, engine_nucleus, nucleus_request


def _engine_view(z: torch.Tensor, n: int):
    """What SGLang returns from logits/T `z` [T, V]: its float32 log-probs, their top-n (values, ids)."""
    lp = torch.log_softmax(z.float(), -1)
    values, ids = lp.topk(n, -1)
    return lp, values.double(), ids


def _run(z: torch.Tensor, n: int, top_p: float, top_k: int, sampled: torch.Tensor | None = None):
    lp, values, ids = _engine_view(z, n)
    if sampled is None:
        sampled = ids[:, 0]
    return lp, ids, engine_nucleus(values, ids, sampled, lp.gather(-1, sampled[:, None])[:, 0].double(),
                                   top_p=top_p, top_k=top_k)


def _loop_reference(probs: list[float], top_p: float, top_k: int, n: int) -> tuple[bool, int, float]:
    """(fits, K, M) by SGLang's rule written out rank by rank over the whole sorted distribution, and whether the
    top-n entries decide it: the engine keeps rank i iff i < k and Σ_{j<i} p_j ≤ top_p."""
    before, kept = 0.0, 0
    for i, p in enumerate(probs):
        if (top_k > 0 and i >= top_k) or (top_p < 1.0 and before > top_p):
            break
        kept, before = i + 1, before + p
    total_n = sum(probs[:n])
    fits = (top_k > 0 and top_k <= n) or (top_p < 1.0 and total_n > top_p) or kept < n
    return fits and kept <= n, kept, sum(probs[:kept])


@pytest.mark.parametrize("top_p, top_k, n, temperature", [
    (0.9, -1, 20, 1.0), (0.9, -1, 20, 0.6), (1.0, 10, 10, 0.6), (0.8, 10, 20, 1.0), (0.95, 50, 20, 1.3),
    (0.5, -1, 5, 1.0), (0.9, 5, 3, 0.6), (0.7, 3, 8, 1.0)])
def test_the_kept_set_is_nucleus_keeps_wherever_it_fits(top_p, top_k, n, temperature):
    g = torch.Generator().manual_seed(11)
    vocab, rows = 300, 400
    logits = torch.randn(rows, vocab, generator=g) * torch.linspace(0.3, 5.0, rows)[:, None]
    z = logits / temperature
    lp, ids, e = _run(z, n, top_p, top_k)
    keep = nucleus_keep(z.float(), top_k, top_p, vocab, None)
    fits = e.fits
    assert fits.any()
    mine = torch.zeros_like(keep).scatter(-1, ids, torch.arange(n)[None, :] < e.kept[:, None])
    assert torch.equal(mine[fits], keep[fits])
    mass = (torch.softmax(z.double(), -1) * keep).sum(-1).log()
    torch.testing.assert_close(e.log_mass[fits], mass[fits], rtol=0, atol=2e-6)
    assert e.log_mass[~fits].isnan().all() and (e.kept[~fits] == 0).all() and (e.kept[fits] >= 1).all()
    assert e.inside[fits].all()  # the most likely token is always kept


@pytest.mark.parametrize("top_p, top_k", [(0.9, -1), (1.0, 4), (0.6, 6), (0.3, -1)])
def test_against_a_loop_over_the_sorted_distribution_with_ties(top_p, top_k):
    """Tied probabilities (logits on a coarse grid): the engine keeps by rank, the loop reference too; the mass of
    the first K ranks and the fit decision match for every position."""
    g = torch.Generator().manual_seed(5)
    z = torch.randint(-4, 3, (400, 24), generator=g).double() * 0.5  # many exact ties
    n = 6
    lp, ids, e = _run(z, n, top_p, top_k)
    assert (lp.topk(n + 1, -1).values.diff(dim=-1) == 0).any()  # there are ties inside the top-n
    for i in range(z.shape[0]):
        probs = sorted(lp[i].double().exp().tolist(), reverse=True)
        fits, kept, mass = _loop_reference(probs, top_p, top_k, n)
        ambiguous = top_p < 1.0 and any(abs(sum(probs[:j]) - top_p) <= BOUNDARY_TOLERANCE for j in range(n + 1))
        if ambiguous:  # the grid puts a few cumulative sums at top_p exactly: the engine's float32 may go either way
            continue
        assert bool(e.fits[i]) == fits, (i, probs[:n + 1])
        if fits:
            assert int(e.kept[i]) == kept and math.isclose(float(e.log_mass[i]), math.log(mass), abs_tol=1e-6)


def test_a_sampled_token_tied_with_the_last_kept_one_is_inside():
    lp = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]], dtype=torch.float64))
    ids = torch.tensor([[7, 3, 5, 9]])
    for token, inside in ((7, True), (3, True), (5, True), (9, True), (11, False)):  # top_k=2: 7, 3 (5, 9 tied)
        e = engine_nucleus(lp, ids, torch.tensor([token]), lp[:, 2] if token != 11 else torch.tensor([-5.0]),
                           top_p=1.0, top_k=2)
        assert bool(e.fits[0]) and int(e.kept[0]) == 2 and bool(e.inside[0]) == inside, token
        assert math.isclose(float(e.log_mass[0]), math.log(0.6), rel_tol=1e-12)


def test_top_k_only_fits_exactly_when_k_is_within_n():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(50, 64, generator=g, dtype=torch.float64)
    _, _, within = _run(z, 8, 1.0, 8)
    _, _, beyond = _run(z, 8, 1.0, 9)
    assert within.fits.all() and (within.kept == 8).all() and not beyond.fits.any()
    mass = torch.softmax(z, -1).sort(-1, descending=True).values[:, :8].sum(-1).log()
    torch.testing.assert_close(within.log_mass, mass, rtol=0, atol=1e-6)


def test_top_p_fits_only_when_the_n_hold_more_than_top_p():
    """Two positions, the same top-3: one whose 3 tokens hold 0.95 > top_p fits, one holding 0.85 does not."""
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.15], [0.5, 0.2, 0.15]], dtype=torch.float64))
    ids = torch.tensor([[1, 2, 3], [1, 2, 3]])
    e = engine_nucleus(lp, ids, torch.tensor([1, 1]), lp[:, 0], top_p=0.9, top_k=-1)
    assert e.fits.tolist() == [True, False] and e.kept.tolist() == [3, 0]
    assert math.isclose(float(e.log_mass[0]), math.log(0.95), rel_tol=1e-12) and e.log_mass[1].isnan()
    # the same with top_k = 3 <= N fits both (top-k decides where top-p cannot be read)
    e = engine_nucleus(lp, ids, torch.tensor([1, 1]), lp[:, 0], top_p=0.9, top_k=3)
    assert e.fits.all() and e.kept.tolist() == [3, 3]


def test_a_top_p_boundary_within_rounding_does_not_fit():
    """Σ before rank 2 is 0.9 (+1e-7): the engine's float32 sum may keep rank 2 or not; its mass is unknown."""
    for p1 in (0.4 + 1e-7, 0.4 - 1e-7, 0.4):
        lp = torch.log(torch.tensor([[0.5, p1, 0.05, 0.03]], dtype=torch.float64))
        e = engine_nucleus(lp, torch.tensor([[0, 1, 2, 3]]), torch.tensor([0]), lp[:, 0], top_p=0.9, top_k=-1)
        assert not e.fits[0] and e.log_mass[0].isnan(), p1
    lp = torch.log(torch.tensor([[0.5, 0.38, 0.05, 0.03]], dtype=torch.float64))  # 2e-2 away: decided
    e = engine_nucleus(lp, torch.tensor([[0, 1, 2, 3]]), torch.tensor([2]), lp[:, 2], top_p=0.9, top_k=-1)
    assert e.fits[0] and int(e.kept[0]) == 3 and e.inside[0]


def test_a_sampled_token_outside_the_kept_set_is_flagged():
    lp = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.03]], dtype=torch.float64))
    ids = torch.tensor([[4, 5, 6, 7]])
    e = engine_nucleus(lp, ids, torch.tensor([6]), lp[:, 2], top_p=0.8, top_k=-1)
    assert e.fits[0] and int(e.kept[0]) == 2 and not e.inside[0]


def test_nothing_truncated_is_refused():
    with pytest.raises(ValueError, match="nothing is truncated"):
        engine_nucleus(torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                       torch.zeros(1), top_p=1.0, top_k=-1)


def test_the_request_asks_for_top_k_or_the_cap():
    assert nucleus_request({"top_p": 1.0, "top_k": 50}, 20) == NucleusRequest(1.0, 50, 50)  # top-k alone: exact
    assert nucleus_request({"top_p": 0.9, "top_k": 10}, 20) == NucleusRequest(0.9, 10, 10)  # k <= cap
    assert nucleus_request({"top_p": 0.9, "top_k": 50}, 20) == NucleusRequest(0.9, 50, 20)  # k > cap: the cap
    assert nucleus_request({"top_p": 0.9}, 20) == NucleusRequest(0.9, -1, 20)
    assert nucleus_request({"top_p": 0.9, "top_k": 0}, 20) == NucleusRequest(0.9, -1, 20)
    assert nucleus_request({"top_p": 0.9}, 0) is None  # the engine path off
    assert nucleus_request({"top_p": 1.0, "top_k": -1}, 20) is None and nucleus_request({}, 20) is None
    with pytest.raises(ValueError, match="top_p 1.5"):
        NucleusRequest(1.5, 3, 3)
