"""slime_corr's slime hook, called as slime's policy_loss_function calls a --custom-tis-function-path function,
against slime's formulas re-derived in `slime_reference.py` (one process, CP = 1; CP/DP under gloo:
`test_slime_hook_parallel.py`)."""

from __future__ import annotations

import importlib
import itertools
import logging
import math
import os

import pytest
import torch

from slime_corr.config import ConfigError
from slime_corr.integrations.slime import config_from_slime_args
from tests.integrations.slime_reference import (
    apply_yaml,
    icepop_reference,
    make_batch,
    mis_reference,
    slime_args,
    sum_of_sample_mean,
    vanilla_reference,
)

FIXTURE = os.path.join(os.path.dirname(__file__), "mis.yaml")
BOUNDS = {"token": (0.5, 2.0), "sequence": (0.3, 3.0), "geometric": (0.95, 1.05)}


def load_function(path: str):
    """slime's load_function: 'pkg.module.fn' -> the function."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def call_like_slime(fn, args, batch):
    """The call of slime's policy_loss_function: tis_kwargs, per-sample lists, pg_loss concatenated."""
    train, rollout, masks, pg, totals, resp = batch
    tis_kwargs = {
        "args": args,
        "pg_loss": torch.cat(pg),
        "train_log_probs": [t.clone() for t in train],
        "rollout_log_probs": [r.clone() for r in rollout],
        "loss_masks": [m.clone() for m in masks],
        "total_lengths": totals,
        "response_lengths": resp,
    }
    return fn(**tis_kwargs)


def mis_args(mode, level, rs_level=None, veto=None, normalize=False):
    lo, up = BOUNDS[level]
    kw = dict(use_tis=True, tis_mode=mode, tis_level=level, tis_lower_bound=lo if mode != "truncate" else None,
              tis_upper_bound=up, use_rs=rs_level is not None, rs_level=rs_level or "token",
              rs_lower_bound=None, rs_upper_bound=None, rs_veto_threshold=veto, tis_batch_normalize=normalize)
    if rs_level is not None and rs_level != level:
        kw["rs_lower_bound"], kw["rs_upper_bound"] = BOUNDS[rs_level]
    return slime_args(custom_tis_function_path="slime_corr.integrations.slime.compute_mis_weights_with_cp", **kw)


def check_against(args, batch, weights, mods, got, atol=1e-10):
    train, rollout, masks, pg, totals, resp = batch
    pg_loss, got_masks, _ = got
    mod = torch.cat(mods)
    w = torch.cat(weights)
    assert len(got_masks) == len(masks)
    for g, want in zip(got_masks, mods, strict=True):
        torch.testing.assert_close(g.double(), want, atol=0, rtol=0)
    # equal where the loss reads them (slime's mis.py keeps raw weights at mask-rejected tokens)
    torch.testing.assert_close(pg_loss * mod, torch.cat(pg) * w * mod, atol=atol, rtol=1e-9)
    loss = sum_of_sample_mean(pg_loss * mod, masks)  # slime: numerator masked by the modified masks
    torch.testing.assert_close(torch.as_tensor(loss), torch.as_tensor(sum_of_sample_mean(torch.cat(pg) * w * mod,
                                                                                             masks)), atol=atol,
                               rtol=1e-9)


CASES = [(mode, level, rs) for mode, level, rs in itertools.product(("truncate", "clip", "mask"),
                                                                   ("token", "sequence", "geometric"),
                                                                   (None, "token", "sequence", "geometric"))]


@pytest.mark.parametrize("mode,level,rs", CASES)
def test_every_mode_and_level_equals_slime_mis(mode, level, rs):
    fn = load_function("slime_corr.integrations.slime.compute_mis_weights_with_cp")
    args = mis_args(mode, level, rs, veto=1e-4 if rs else None)
    batch = make_batch(seed=CASES.index((mode, level, rs)), empty=True, extreme=True)
    weights, mods = mis_reference(args, *batch[:3])
    got = call_like_slime(fn, args, batch)
    check_against(args, batch, weights, mods, got)
    # something was bounded / rejected, so the comparison is not vacuous
    if mode == "mask" or rs:
        assert sum(float(m.sum()) for m in mods) < sum(float(m.sum()) for m in batch[2])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "clip"])
def test_batch_normalization_equals_slime_without_rejection(mode, level):
    """One rank, one micro-batch, nothing rejected: slime's batch mean is slime_corr's."""
    fn = load_function("slime_corr.integrations.slime.compute_mis_weights_with_cp")
    args = mis_args(mode, level, normalize=True)
    batch = make_batch(seed=7)
    weights, mods = mis_reference(args, *batch[:3])
    got = call_like_slime(fn, args, batch)
    check_against(args, batch, weights, mods, got)
    assert abs(float(got[2]["mis_batch_norm_factor"][0]) - 1.0) > 1e-3  # the normalization did something


def test_batch_normalization_differs_on_purpose():
    """With rejection slime averages over every masked unit (rejected ones too), slime_corr over the units left in
    the loss: the weights left in the loss average to 1 there. Geometric: slime refuses, slime_corr normalizes."""
    fn = load_function("slime_corr.integrations.slime.compute_mis_weights_with_cp")
    for level in ("token", "geometric"):
        args = mis_args("truncate", level, rs_level="token", normalize=True)
        batch = make_batch(seed=3)
        pg = torch.cat(batch[3])
        pg_loss, masks, _ = call_like_slime(fn, args, batch)
        m = torch.cat(masks).double()
        w = pg_loss / pg
        if level == "token":
            assert float((w * m).sum() / m.sum()) == pytest.approx(1.0, rel=1e-9)
        else:
            per_seq = [float(x[mm > 0][0]) for x, mm in zip(w.split(batch[5]), masks, strict=True) if mm.sum() > 0]
            assert sum(per_seq) / len(per_seq) == pytest.approx(1.0, rel=1e-9)


def test_vanilla_and_icepop_equal_slime():
    from slime_corr.integrations.slime import icepop_function, vanilla_tis_function

    for fn, ref, low in ((vanilla_tis_function, vanilla_reference, 0.0), (vanilla_tis_function, vanilla_reference, 0.8),
                         (icepop_function, icepop_reference, 0.0), (icepop_function, icepop_reference, 0.5)):
        args = slime_args(use_tis=True, tis_clip=1.5, tis_clip_low=low)
        batch = make_batch(seed=11, noise=0.5)
        w, tis, clipfrac, tis_abs = ref(args, batch[0], batch[1])
        pg_loss, masks, metrics = call_like_slime(fn, args, batch)
        torch.testing.assert_close(pg_loss * torch.cat(batch[2]), torch.cat(batch[3]) * w * torch.cat(batch[2]),
                                   atol=1e-12, rtol=1e-9)
        for g, m in zip(masks, batch[2], strict=True):  # slime keeps the masks
            torch.testing.assert_close(g, m, atol=0, rtol=0)
        torch.testing.assert_close(metrics["tis"].double(), tis, rtol=1e-9, atol=0)
        torch.testing.assert_close(metrics["tis_abs"].double(), tis_abs, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(metrics["tis_clipfrac"].double(), clipfrac, rtol=0, atol=0)
        assert 0 < float(clipfrac.mean()) < 1
    # without mis.py settings, the main hook is slime's default TIS
    args = slime_args(use_tis=True, tis_clip=1.5, tis_clip_low=0.8)
    batch = make_batch(seed=12, noise=0.5)
    w = vanilla_reference(args, batch[0], batch[1])[0]
    pg_loss, _, metrics = call_like_slime(load_function("slime_corr.integrations.slime.tis_function"), args, batch)
    assert {"tis", "tis_clipfrac", "tis_abs"} <= set(metrics)  # slime's default TIS keys
    m = torch.cat(batch[2])  # equal where the loss reads it (slime_corr's weights are 0 outside the mask)
    torch.testing.assert_close(pg_loss * m, torch.cat(batch[3]) * w * m, atol=1e-12, rtol=1e-9)


def test_metrics_only_and_slime_metric_shapes():
    fn = load_function("slime_corr.integrations.slime.compute_mis_weights_with_cp")
    batch = make_batch(seed=5)
    args = slime_args(get_mismatch_metrics=True, use_rollout_logprobs=True,
                      custom_tis_function_path="slime_corr.integrations.slime.compute_mis_weights_with_cp")
    pg_loss, masks, metrics = call_like_slime(fn, args, batch)
    torch.testing.assert_close(pg_loss, torch.cat(batch[3]), atol=0, rtol=0)
    assert all(m is orig for m, orig in zip(masks, batch[2], strict=False)) or all(
        torch.equal(m, o) for m, o in zip(masks, batch[2], strict=True))
    n = sum(batch[5])
    assert all(v.shape == (n,) for v in metrics.values())
    # slime's key = slime_corr's value; slime's reducer of a constant per-token metric gives the value
    train, rollout, masks0 = batch[:3]
    lr = torch.cat(train) - torch.cat(rollout)
    m = torch.cat(masks0)
    k3 = float(((lr.exp() - lr - 1) * m).sum() / m.sum())
    assert float(metrics["mis_k3_kl"][0]) == pytest.approx(k3, rel=1e-9)
    assert float(metrics["mismatch_k3_kl"][0]) == pytest.approx(k3, rel=1e-9)
    assert "train_rollout_logprob_abs_diff" not in metrics  # slime logs its own
    reduced = sum_of_sample_mean(metrics["mis_k3_kl"].double(), masks0) / len(masks0)
    assert float(reduced) == pytest.approx(k3, rel=1e-9)
    args.metric_names = "slime"
    _, _, metrics = call_like_slime(fn, args, batch)
    assert "mis_k3_kl" in metrics and "mismatch_k3_kl" not in metrics


def test_nonfinite_sample_is_rejected_not_propagated():
    fn = load_function("slime_corr.integrations.slime.compute_mis_weights_with_cp")
    args = mis_args("truncate", "sequence")
    batch = make_batch(seed=9)
    batch[1][3][2] = float("nan")
    pg_loss, masks, metrics = call_like_slime(fn, args, batch)
    assert float(masks[3].sum()) == 0 and all(float(m.sum()) > 0 for i, m in enumerate(masks) if i != 3)
    assert torch.isfinite(pg_loss).all()
    assert float(metrics["mis_nonfinite_seq_count"][0]) == 1


@pytest.mark.parametrize("break_it,message", [
    (lambda b: b[4].__setitem__(2, b[5][2] - 1), r"sample 2: response_length \d+ and total_length \d+: a response is "
                                                 r"part of its sample"),
    (lambda b: b[5].__setitem__(1, b[5][1] + 1), r"sample 1: loss_masks has \d+ entries, response_length \d+"),
    (lambda b: b[5].pop(), r"train_log_probs, .*response_lengths must have one entry per sample, got lengths \[\d+, \d+\]"),
    (lambda b: b[3].__setitem__(0, b[3][0][:-1]), r"pg_loss has shape \(\d+,\); expected \(\d+,\)"),
])
def test_inconsistent_lengths_are_named(break_it, message):
    fn = load_function("slime_corr.integrations.slime.compute_mis_weights_with_cp")
    batch = make_batch(seed=3)
    break_it(batch)
    with pytest.raises(ValueError, match="slime hook: " + message):
        call_like_slime(fn, mis_args("truncate", "token"), batch)


def test_slime_mis_yaml_loads_with_slime_meaning(caplog):
    args = apply_yaml(slime_args(use_tis=False), FIXTURE)
    config, notices = config_from_slime_args(args)
    assert config.use_tis and config.tis_mode == "truncate" and config.tis_upper_bound == 2.0
    assert config.tis_lower_bound is None and any("tis_lower_bound 0.5 ignored" in n for n in notices)
    assert config.use_rs and config.rs_level == "token"
    assert (config.rs_lower_bound, config.rs_upper_bound) == (0.5, 2.0)  # null RS bounds: the IS bounds
    assert config.rs_veto_threshold == 1e-4 and config.tis_batch_normalize
    # and the hook equals slime's mis.py on it (nothing rejected by RS there is the veto's sample only)
    batch = make_batch(seed=21, extreme=True)
    args.tis_batch_normalize = False  # with RS rejections slime's batch mean differs on purpose (docs/integrations.md)
    weights, mods = mis_reference(args, *batch[:3])
    with caplog.at_level(logging.WARNING):
        got = call_like_slime(load_function("slime_corr.integrations.slime.compute_mis_weights_with_cp"), args,
                              batch)
    check_against(args, batch, weights, mods, got)
    assert float(mods[2].sum()) == 0  # the veto hit


def test_slime_settings_notices_and_errors():
    # without --use-tis: metrics only, RS ignored with a notice
    config, notices = config_from_slime_args(slime_args(use_rs=True, rs_upper_bound=2.0, get_mismatch_metrics=True))
    assert not config.use_rollout_correction and notices and "without --use-tis" in notices[0]
    # veto without use_rs: applied (slime documents it independent of IS/RS), with a notice
    config, notices = config_from_slime_args(slime_args(use_tis=True, tis_mode="truncate", rs_veto_threshold=1e-3))
    assert config.rs_veto_threshold == 1e-3 and "rs_veto_threshold" in notices[0]
    # a bad value names the key
    with pytest.raises(ConfigError, match="tis-mode"):
        config_from_slime_args(slime_args(use_tis=True, tis_mode="trunc"))
    with pytest.raises(ConfigError, match="--rs-lower-bound 3.0 > --rs-upper-bound 2.0"):
        config_from_slime_args(slime_args(use_tis=True, use_rs=True, rs_lower_bound=3.0, rs_upper_bound=2.0))
    # slime refuses --use-rollout-logprobs with --use-tis; so does the hook, naming both
    with pytest.raises(ConfigError, match="--use-tis with --use-rollout-logprobs"):
        config_from_slime_args(slime_args(use_tis=True, tis_mode="truncate", use_rollout_logprobs=True))
    assert math.isclose(config_from_slime_args(slime_args(use_tis=True, tis_mode="clip",
                                                          tis_upper_bound=4.0))[0].tis_bounds[0], 0.25)
