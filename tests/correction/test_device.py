"""Device-agnostic by construction: the correction core, the losses and the diagnostics create every tensor on their
inputs' device.

- On `meta` (no GPU needed): every aten op is checked by `DeviceCheck` and every collective by
  `fake_process_groups`, so a factory call without `device=` (or a CPU constant) fails here, with its source line.
- `-m device` (the device-parametrized subset; `--device cuda` / SLIME_CORR_TEST_DEVICE=cuda on a GPU machine,
  `scripts/gpu_check.sh`): real values on that device against the same call on the CPU, single process and over
  DP x CP process groups (NCCL with one GPU per rank when there are enough GPUs, else gloo on the device's tensors).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import compute_rollout_correction, metrics_to_host, normalize_weights, weight_mean
from slime_corr.correction.diagnostics import MismatchDiagnostics, response_positions
from slime_corr.device_check import DeviceCheck, fake_process_groups
from slime_corr.layout.segments import Segments
from slime_corr.loss_terms import LossTermsConfig
from slime_corr.losses import compute_policy_loss
from tests.device_helpers import rank_placement

CUSTOM = f"{Path(__file__).resolve().parents[2] / 'examples' / 'custom_tis.py'}:length_aware_geometric_is"
CONFIGS = {
    "token_is": C.preset("decoupled_token_is"),
    "seq_is_rs": C.preset("decoupled_seq_is_rs"),
    "geo_mask_token_rs_veto": C(use_tis=True, tis_level="geometric", tis_mode="mask", tis_upper_bound=1.1,
                                use_rs=True, rs_level="token", rs_upper_bound=1.6, rs_veto_threshold=0.01),
    "clip_batch_norm": C(use_tis=True, tis_mode="clip", tis_upper_bound=1.5, tis_batch_normalize=True,
                         loss_agg_mode="seq-mean-token-mean"),
    "pg_is": C.preset("pg_is", tis_batch_normalize=True),
    "pg_rs": C.preset("pg_rs", rs_upper_bound=1.2),
    "metrics_only": C(get_mismatch_metrics=True),
    "off": C(loss_agg_mode="seq-mean-token-sum"),
    "custom": C(use_tis=True, custom_tis_function_path=CUSTOM),
}
B, S = 4, 16


def _inputs(device: torch.device | str, dtype: torch.dtype = torch.float64, b: int = B, s: int = S
            ) -> dict[str, torch.Tensor]:
    """lp, lp_old, lp_rollout, advantages, mask (uneven lengths, one empty row, one non-finite token), made on the
    CPU and moved to `device`."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(b, s, generator=g, dtype=torch.float64) * 2
    ro = old + 0.3 * torch.randn(b, s, generator=g, dtype=torch.float64)
    ro[1, 2] = float("nan")
    lp = old + 0.2 * torch.randn(b, s, generator=g, dtype=torch.float64)
    adv = torch.randn(b, s, generator=g, dtype=torch.float64)
    lengths = torch.tensor([s, 3, 0, s - 5] * (b // 4 + 1))[:b]
    mask = torch.arange(s)[None, :] < lengths[:, None]
    x = dict(lp=lp, old=old, ro=ro, adv=adv)
    out = {k: v.to(device=device, dtype=dtype) for k, v in x.items()}
    out["mask"] = mask.to(device)
    return out


def _loss(cfg: C, x: dict[str, torch.Tensor], groups=None, segments=None, **kw):
    lp = x["lp"].detach().clone().requires_grad_(True)
    g = {} if groups is None else dict(cp_group=groups.cp, dp_group=groups.dp)
    out = compute_policy_loss(lp, None if cfg.use_rollout_logprobs else x["old"], x["ro"], x["adv"], x["mask"], cfg,
                              segments=segments, **g, **kw)
    out.loss.backward()
    return out, lp.grad


# ------------------------------------------------------------------------------------------ meta: no GPU needed
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("parallel", [False, True], ids=["single", "dp2_cp2"])
def test_core_and_losses_create_tensors_on_the_inputs_device(name: str, parallel: bool) -> None:
    cfg = CONFIGS[name]
    x = _inputs("meta")
    terms = LossTermsConfig(kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coef=0.01)
    ctx = fake_process_groups(2, expect="meta") if parallel else contextlib.nullcontext()
    with ctx as groups, DeviceCheck("meta") as check:
        out, grad = _loss(cfg, x, groups, loss_terms=terms, ref_log_probs=x["old"] - 0.1, entropy=x["lp"].neg())
        if cfg.use_tis and cfg.tis_batch_normalize:  # the pre-pass path: unnormalized, then the step's divisor
            g = {} if groups is None else dict(cp_group=groups.cp, dp_group=groups.dp)
            res = compute_rollout_correction(x["old"], x["ro"], x["mask"], cfg, normalize=False, **g)
            normalize_weights(res, cfg, weight_mean(res.stats))
        diag = MismatchDiagnostics(top_k=2)
        diag.add(x["old"], x["ro"], x["mask"], lp_current=x["lp"],
                 positions=response_positions(x["mask"], None, None if groups is None else groups.cp),
                 sample_ids=torch.arange(B, device=x["lp"].device))
    check.assert_clean()
    assert grad.device.type == "meta" and out.loss.device.type == "meta"
    assert all(v.device.type == "meta" for v in out.metrics.values())
    if parallel:
        assert groups.collectives, "the DP/CP paths ran no collective"


@pytest.mark.parametrize("name", ["token_is", "seq_is_rs", "geo_mask_token_rs_veto", "metrics_only"])
def test_packed_rows_create_tensors_on_the_inputs_device(name: str) -> None:
    cfg = CONFIGS[name]
    x = {k: v.reshape(1, -1) for k, v in _inputs("meta").items()}
    seg = Segments.packed_row(torch.tensor([0, 16, 19, 19, 30], device="meta"), B * S)
    adv = torch.randn(4, device="meta")  # one advantage per sequence
    with fake_process_groups(2, expect="meta") as groups, DeviceCheck("meta") as check:
        _loss(cfg, dict(x, adv=adv), groups, segments=seg, seq_length_for_norm=S)
    check.assert_clean()


def test_the_check_fails_on_a_wrong_device_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks can fail: a factory call without `device=` in the core, and a collective on a CPU tensor."""
    import slime_corr.correction.core as core

    monkeypatch.setattr(core, "_zero_where", lambda cond, x: torch.where(cond, torch.zeros((), dtype=x.dtype), x))
    x = _inputs("meta")
    with DeviceCheck("meta") as check:
        _loss(CONFIGS["token_is"], x)
    with pytest.raises(AssertionError, match=r"aten\.zeros.*on cpu.*core\.py:\d+"):
        check.assert_clean()
    with fake_process_groups(2, expect="meta") as groups, pytest.raises(AssertionError, match="all_reduce on a "
                                                                                              "tensor on cpu"):
        dist.all_reduce(torch.zeros(2), group=groups.dp)


# ------------------------------------------------------------------------------------------ the device subset
def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().cpu()


@pytest.mark.device
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_on_device_matches_cpu(name: str, dtype: torch.dtype, test_device: torch.device) -> None:
    """Weights, masks, loss, gradient and every metric on the test device equal the CPU's (float64: to 1e-9; float32:
    to 1e-5, kernels sum in other orders), and every result stays on the device."""
    cfg = CONFIGS[name]
    (dev_out, dev_grad), (cpu_out, cpu_grad) = (_loss(cfg, _inputs(d, dtype)) for d in (test_device, "cpu"))
    tol = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    assert dev_grad.device == test_device or dev_grad.device.type == test_device.type
    for a in (dev_out.loss, *dev_out.metrics.values()):
        assert a.device.type == test_device.type
    torch.testing.assert_close(_to_host(dev_out.loss), cpu_out.loss.detach(), **tol)
    torch.testing.assert_close(_to_host(dev_grad), cpu_grad, **tol)
    dc, cc = dev_out.correction, cpu_out.correction
    if cc is not None:
        assert torch.equal(_to_host(dc.loss_mask), cc.loss_mask)
        if cc.weights is not None:
            torch.testing.assert_close(_to_host(dc.weights), cc.weights, **tol)
    got, want = metrics_to_host(dev_out.metrics), metrics_to_host(cpu_out.metrics)
    assert set(got) == set(want)
    for k, v in want.items():
        assert abs(got[k] - v) <= tol["rtol"] * 10 * max(1.0, abs(v)), (k, got[k], v)


WORLD = 2




def _dist_worker(rank: int, store: str, device_name: str, result_dir: str) -> None:
    device, backend = rank_placement(rank, WORLD, device_name)
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        x = _inputs("cpu")
        for layout in ("dp", "cp"):
            group = dist.group.WORLD
            rows = slice(rank * B // WORLD, (rank + 1) * B // WORLD) if layout == "dp" else slice(None)
            c = S // (2 * WORLD)  # zig-zag CP slice: chunks r and 2·C−1−r
            cols = (torch.arange(S) if layout == "dp" else
                    torch.cat([torch.arange(k * c, (k + 1) * c) for k in (rank, 2 * WORLD - 1 - rank)]))
            for name, cfg in CONFIGS.items():
                if name == "custom" and layout == "cp":
                    continue  # the example function's geometric mean reads whole rows
                ref, ref_grad = _loss(cfg, x)
                local = {k: v[rows][:, cols].to(device) for k, v in x.items()}
                g = dict(cp_group=group if layout == "cp" else None, dp_group=group if layout == "dp" else None)
                lp = local["lp"].clone().requires_grad_(True)
                out = compute_policy_loss(lp, None if cfg.use_rollout_logprobs else local["old"], local["ro"],
                                          local["adv"], local["mask"], cfg, **g)
                out.loss.backward()
                total = out.loss.detach().clone()
                dist.all_reduce(total)
                tag = f"{backend} {device} {layout} {name}"
                torch.testing.assert_close(total.cpu(), ref.loss.detach(), rtol=1e-9, atol=1e-12, msg=tag)
                torch.testing.assert_close(lp.grad.cpu(), ref_grad[rows][:, cols], rtol=1e-9, atol=1e-12, msg=tag)
                if ref.correction is not None:
                    got, want = metrics_to_host(out.metrics), metrics_to_host(ref.correction.metrics)
                    for k, v in want.items():
                        assert abs(got[k] - v) <= 1e-8 * max(1.0, abs(v)), f"{tag} {k}: {got[k]} != {v}"
        Path(result_dir, f"rank{rank}").write_text(f"{backend} {device}")
    finally:
        dist.destroy_process_group()


@pytest.mark.device
@pytest.mark.slow  # 30 s on 2 CPU cores; test_distributed.py covers gloo on the CPU in the default run
def test_dp_and_cp_on_device_match_single_rank(test_device: torch.device) -> None:
    """Two processes (DP=2, then zig-zag CP=2) on the test device give the single-rank CPU loss, gradient and
    metrics: NCCL when there is one GPU per rank, else gloo on the device's tensors (two processes on one GPU)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_dist_worker, args=(os.path.join(tmp, "store"), str(test_device), tmp), nprocs=WORLD, join=True)
        used = {Path(tmp, f"rank{r}").read_text() for r in range(WORLD)}
    print("backends:", used)
