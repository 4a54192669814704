"""The exact weight-quantile sketch (`quantiles.py`) under both ways of counting its histograms: `counting`
(bincount / index_add_, the CPU's) and `sorting` (sort once, then searchsorted: every other device's, forced here
on the CPU). Each is checked against an independent reference (the smallest float32 value whose share of the sorted
units reaches q) on ties, spreads, weights within 1e-4 of 1, zeros, inf, masked and empty inputs, unit-weighted
inputs, merged over a real 2-process gloo group; both give the same statistics; the sorting path runs on `meta`
(no value read: no host sync, no data-dependent shape) without a contended scatter."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import compute_rollout_correction, metrics_to_host, quantiles
from slime_corr.correction.budget import bin_sums
from tests.mcore.mcore_helpers import checking, spawn_group

BACKENDS = ("counting", "sorting", "sorting in pieces")  # pieces: the sort split every 997 weights (`SORT_CHUNK`)


def use_backend(backend: str, monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    devices = {"cpu"} if backend == "counting" else set()
    chunk = 997 if backend == "sorting in pieces" else quantiles.SORT_CHUNK_DEFAULT
    if monkeypatch is None:
        quantiles.COUNTING_DEVICES, quantiles.SORT_CHUNK = devices, chunk
    else:
        monkeypatch.setattr(quantiles, "COUNTING_DEVICES", devices)
        monkeypatch.setattr(quantiles, "SORT_CHUNK", chunk)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    use_backend(request.param, monkeypatch)
    return request.param


def reference(w: torch.Tensor, unit: torch.Tensor) -> list[float]:
    """The smallest float32 w with Σ_{w_i <= w} u_i >= q·Σu (ranks as the sketch's, 1e-12 below), by sorting."""
    kept = unit.reshape(-1) > 0
    v = w.reshape(-1)[kept].float().double()
    if not v.numel():
        return [0.0] * len(quantiles.QUANTILES)
    v, order = v.sort()
    cum = unit.reshape(-1)[kept].double()[order].cumsum(0)
    out = []
    for q in quantiles.QUANTILES.values():
        i = int(torch.searchsorted(cum, torch.tensor([q * cum[-1].item() * (1 - 1e-12)], dtype=torch.float64)))
        out.append(v[min(i, v.numel() - 1)].item())
    return out


def sketch(w: torch.Tensor, unit: torch.Tensor, binary: bool, groups: list | None = None) -> dict[str, torch.Tensor]:
    """Level 1, its SUM over `groups`, then rounds 2 and 3: a call's statistics (with its own quantiles)."""
    hist, counts = quantiles.level1(w, unit, binary)
    for g in groups or []:
        dist.all_reduce(hist, group=g)
    return {quantiles.LEVEL1_KEY: hist, **quantiles.refine(counts, hist, groups or [])}


def cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (weights, 0/1 units); weights are 0 where their unit is 0."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for spread in (1e-6, 1e-4, 1e-2, 1.0, 10.0):
        out[f"spread {spread:g}"] = ((spread * torch.randn(20_000, generator=g)).exp(), torch.ones(20_000))
    near = 1 + 1e-4 * (2 * torch.rand(30_000, generator=g) - 1)  # every weight within 1e-4 of 1
    out["within 1e-4 of 1"] = (near, torch.ones_like(near))
    ties = torch.ones(30_000)
    ties[:5000] = 1 + 1e-7 * torch.randint(1, 4, (5000,), generator=g)
    ties[5000:5100] = 2.0
    ties[5100:5400] = 0.0
    ties[5400:5405] = math.exp(-20)
    out["ties and zeros"] = (ties, torch.ones_like(ties))
    inf = torch.rand(1000, generator=g)
    inf[950:] = math.inf  # the top 5 %: p99 is inf
    out["inf"] = (inf, torch.ones_like(inf))
    out["all zero"] = (torch.zeros(500), torch.ones(500))
    tiny = torch.tensor([0.0, 1e-45, 1e-40, 2.0**-70, 2.0**-64, 1.0, 2.0**64, 3.0e38] * 40)  # subnormals to 3e38
    out["every magnitude"] = (tiny, torch.ones_like(tiny))
    masked = (torch.randn(64, 128, generator=g) * 0.3).exp()
    unit = (torch.rand(64, 128, generator=g) > 0.4).float()
    unit[5] = 0.0  # an empty row
    out["masked 2-D"] = (masked * unit, unit)
    out["nothing counted"] = (torch.zeros(3, 7), torch.zeros(3, 7))
    out["no weight"] = (torch.zeros(0), torch.zeros(0))
    return out


@pytest.mark.parametrize("name", list(cases()))
def test_exact_against_sorting_reference(backend: str, name: str) -> None:
    w, unit = cases()[name]
    want = reference(w, unit)
    stats = sketch(w, unit, binary=True)
    assert stats[quantiles.CALL_KEY].tolist() == want, (backend, name)
    merged_form = {k: v for k, v in stats.items() if k != quantiles.CALL_KEY}  # read off the histograms instead
    assert quantiles.quantiles(merged_form).tolist() == want, (backend, name)


@pytest.mark.parametrize("name", ["spread 1", "ties and zeros", "inf", "masked 2-D"])
def test_exact_with_weighted_units(backend: str, name: str) -> None:
    """Units other than 0/1 (a custom function's share 1/n per token): summed in float64 per bin."""
    w, unit = cases()[name]
    g = torch.Generator().manual_seed(1)
    units = unit * torch.randint(1, 4, unit.shape, generator=g).double()
    assert sketch(w, units, binary=False)[quantiles.CALL_KEY].tolist() == reference(w, units), (backend, name)


@pytest.mark.parametrize("name", list(cases()))
def test_both_backends_give_the_same_statistics(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    w, unit = cases()[name]
    got = {}
    for b in BACKENDS:
        use_backend(b, monkeypatch)
        got[b] = sketch(w, unit, binary=True)
    for other in BACKENDS[1:]:
        assert got["counting"].keys() == got[other].keys()
        for key, value in got["counting"].items():
            assert torch.equal(value, got[other][key]), (name, key, other)


def test_budget_bin_sums_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """`budget.bin_sums` (Σ u·v^p per level-1 bin) counts the same way: the same sums either way."""
    g = torch.Generator().manual_seed(3)
    v = (torch.randn(5000, generator=g, dtype=torch.float64) * 2).exp()
    u = (torch.rand(5000, generator=g) > 0.3).double()
    got = {}
    for b in BACKENDS:
        use_backend(b, monkeypatch)
        got[b] = bin_sums(v, u, 2, [])
    torch.testing.assert_close(got["sorting"], got["counting"], rtol=1e-12, atol=1e-9)
    assert torch.equal(got["sorting"][0], got["counting"][0])  # counts: exact


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_through_the_core_with_either_backend(monkeypatch: pytest.MonkeyPatch, level: str) -> None:
    """The core's weights, masks and every metric are the same whichever way the histograms are counted."""
    g = torch.Generator().manual_seed(4)
    lp_r = -torch.rand(32, 96, generator=g)
    lp_t = lp_r + 0.05 * torch.randn(32, 96, generator=g)
    mask = torch.rand(32, 96, generator=g) > 0.2
    cfg = C(use_tis=True, tis_level=level, tis_upper_bound=1.5, use_rs=True, rs_level="sequence",
            rs_upper_bound=3.0, tis_batch_normalize=True)
    out = {}
    for b in BACKENDS:
        use_backend(b, monkeypatch)
        res = compute_rollout_correction(lp_t, lp_r, mask, cfg)
        out[b] = (res.weights, res.loss_mask, metrics_to_host(res.metrics))
    assert torch.equal(out["counting"][0], out["sorting"][0]) and torch.equal(out["counting"][1], out["sorting"][1])
    assert out["counting"][2] == out["sorting"][2]


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if name.startswith("index_put") and (len(args) > 3 and args[3] or (kwargs or {}).get("accumulate")):
            name += "(accumulate)"
        self.names.append(name)
        return func(*args, **(kwargs or {}))


CONTENDED = {"bincount", "index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce",
             "scatter_reduce_", "histc", "index_put(accumulate)", "index_put_(accumulate)", "_local_scalar_dense",
             "nonzero", "unique", "_unique2"}


@pytest.mark.parametrize("binary", [True, False])
def test_sorting_path_reads_no_value_and_scatters_nothing(binary: bool) -> None:
    """On `meta` (any value read raises, a data-dependent shape cannot be built) the non-CPU path runs the whole
    sketch and the budget sums with fixed shapes, and none of its ops is a contended scatter or a host read."""
    w = torch.empty(64, 512, device="meta")
    unit = torch.empty(64, 512, device="meta")
    with _Ops() as ops:
        stats = sketch(w, unit, binary)
        sums = bin_sums(w, unit, 2, [])
    assert stats[quantiles.CALL_KEY].shape == (len(quantiles.QUANTILES),) and stats["w_hist3"].shape == (quantiles.SLOTS, quantiles.SUB)
    assert sums.shape == (3, quantiles.LEVEL1_BINS)
    assert "sort" in ops.names and not CONTENDED & set(ops.names), sorted(set(ops.names))


@pytest.mark.parametrize("cfg", [C.preset("decoupled_token_is"), C.preset("pg_is"),
                                 C(use_tis=True, tis_mode="clip", tis_batch_normalize=True), C(get_mismatch_metrics=True)],
                         ids=["token_is", "pg_is", "clip_batch_norm", "metrics_only"])
def test_padded_core_on_a_device_scatters_nothing(cfg: C) -> None:
    """The whole correction of padded rows (weights, sketch, metrics) on a non-CPU device: no contended scatter,
    no host read."""
    lp = torch.empty(16, 64, device="meta")
    with _Ops() as ops:
        compute_rollout_correction(lp, lp, torch.empty(16, 64, dtype=torch.bool, device="meta"), cfg)
    assert not CONTENDED & set(ops.names), sorted(CONTENDED & set(ops.names))


def _worker(rank: int, backend: str) -> None:
    use_backend(backend)
    group = dist.group.WORLD
    for name, (w, unit) in cases().items():
        flat_w, flat_u = w.reshape(-1), unit.reshape(-1)
        cut = (flat_w.numel() * 2) // 5  # uneven halves
        part = slice(0, cut) if rank == 0 else slice(cut, None)
        for binary, units in ((True, flat_u), (False, flat_u * (1 + torch.arange(flat_u.numel()) % 3).float())):
            checking(f"{backend} {name} binary={binary}")
            got = sketch(flat_w[part], units[part], binary, [group])
            want = reference(flat_w, units)
            assert got[quantiles.CALL_KEY].tolist() == want, (backend, name, binary, got[quantiles.CALL_KEY].tolist(), want)
            merged_form = {k: v for k, v in got.items() if k != quantiles.CALL_KEY}
            if binary:
                assert quantiles.quantiles(merged_form).tolist() == want, (backend, name)
    # through the core: a DP split of the batch gives the single-process quantiles
    g = torch.Generator().manual_seed(5)
    lp_r = -torch.rand(8, 256, generator=g)
    lp_t = lp_r + 1e-4 * torch.randn(8, 256, generator=g)
    mask = torch.rand(8, 256, generator=g) > 0.3
    cfg = C(use_tis=True, tis_upper_bound=1e6)
    full = metrics_to_host(compute_rollout_correction(lp_t, lp_r, mask, cfg).metrics)
    rows = slice(rank * 4, rank * 4 + 4)
    local = metrics_to_host(compute_rollout_correction(lp_t[rows], lp_r[rows], mask[rows], cfg, dp_group=group).metrics)
    for name in quantiles.QUANTILES:
        assert local[f"mis_weight_{name}"] == full[f"mis_weight_{name}"], (backend, name)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_merged_over_a_two_process_gloo_group(backend_name: str) -> None:
    """Each rank holds part of the weights; the histograms are summed over the group (no gather): every rank gets
    the exact quantiles of all the weights."""
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    spawn_group(_worker, 2, backend_name)
