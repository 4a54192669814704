"""Impossible values (issue 22, items 3 and 7): counted on the device with the step's statistics, no host sync,
and an error (or, for inputs, a warning with --warn-invalid-inputs) when the metrics reach the host."""

from __future__ import annotations

import math

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig as C
from slime_corr.correction import (
    checks,
    compute_rollout_correction,
    correction_metrics,
    merge_stats,
    metrics_to_host,
)
from slime_corr.correction.checks import InputValueError
from slime_corr.losses import compute_policy_loss

B, S = 3, 5
LP = -torch.linspace(0.1, 2.0, B * S, dtype=torch.float64).reshape(B, S)
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
METRICS = C(get_mismatch_metrics=True)
WARN = METRICS.replace(warn_invalid_inputs=True)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(checks, "_WARNED", set())


def _counts(lp_t=LP, lp_r=LP, mask=MASK, cfg=METRICS):
    m = metrics_to_host(compute_rollout_correction(lp_t, lp_r, mask, cfg).metrics)  # no config: counts only
    return m["mis_invalid_mask_count"], m["mis_positive_logprob_count"], m["mis_nan_logprob_count"]


def test_valid_inputs_count_nothing_and_pass():
    assert _counts() == (0, 0, 0)
    assert _counts(mask=MASK.bool()) == (0, 0, 0) and _counts(mask=MASK.long()) == (0, 0, 0)
    lp = LP.clone()
    lp[0, 0] = 0.0  # log 1: possible
    lp[0, 1] = 5e-5  # rounding above 0, within the tolerance
    lp[1, 0] = -math.inf  # a token of probability 0: possible (its sequence is rejected as non-finite)
    lp[2, 4] = 7.0  # outside the mask: not looked at
    lp[0, 4] = math.nan
    res = compute_rollout_correction(lp, LP, MASK, METRICS)
    assert metrics_to_host(res.metrics, METRICS)["mis_nonfinite_seq_count"] == 1  # no error raised


@pytest.mark.parametrize("where, value, counts", [
    ("mask", -1.0, (1, 0, 0)), ("mask", math.nan, (1, 0, 0)), ("mask", 2.0, (1, 0, 0)), ("mask", 0.5, (1, 0, 0)),
    ("mask", math.inf, (1, 0, 0)),
    ("lp_train", 0.3, (0, 1, 0)), ("lp_rollout", 0.3, (0, 1, 0)), ("lp_train", math.inf, (0, 1, 0)),
    ("lp_train", math.nan, (0, 0, 1)), ("lp_rollout", math.nan, (0, 0, 1)),
])
def test_each_impossible_value_is_counted_and_raises_when_read(where, value, counts):
    lp_t, lp_r, mask = LP.clone(), LP.clone(), MASK.clone()
    {"mask": mask, "lp_train": lp_t, "lp_rollout": lp_r}[where][1, 2] = value
    assert _counts(lp_t, lp_r, mask) == counts
    key = ("mis_invalid_mask_count", "mis_positive_logprob_count", "mis_nan_logprob_count")[counts.index(1)]
    res = compute_rollout_correction(lp_t, lp_r, mask, METRICS)
    with pytest.raises(InputValueError, match=rf"1 .*\({key}\).*--warn-invalid-inputs"):
        metrics_to_host(res.metrics, METRICS)
    with pytest.warns(RuntimeWarning, match=key):
        assert metrics_to_host(res.metrics, WARN)[key] == 1


def test_counts_add_up_over_micro_batches_and_the_loss_path():
    """The counts are batch statistics: merged over a step's micro-batches, and the same through the loss."""
    lp = LP.clone()
    lp[0, :3] = 0.5  # 3 positive
    mask = MASK.clone()
    mask[2, 3] = -1.0  # 1 invalid mask value
    parts = [compute_rollout_correction(x, LP, m, METRICS).stats for x, m in ((lp, MASK), (LP, mask), (lp, mask))]
    step = metrics_to_host(correction_metrics(merge_stats(parts), METRICS))
    assert (step["mis_invalid_mask_count"], step["mis_positive_logprob_count"]) == (2, 6)
    cfg = C.preset("decoupled_token_is")
    out = compute_policy_loss(lp.clone().requires_grad_(), lp, LP, torch.ones(B), mask, cfg)
    with pytest.raises(InputValueError, match=r"1 loss-mask value.*; 3 log-prob"):
        metrics_to_host(out.metrics, cfg)


def test_no_host_sync_before_the_metrics_are_read(monkeypatch):
    """Counting reads no tensor value: `.item()`/`.tolist()`/bool() are never called on the correction path."""
    lp = LP.clone()
    lp[0, 0] = 0.5

    def boom(*_a, **_k):
        raise AssertionError("host sync")

    for name in ("item", "tolist", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    res = compute_rollout_correction(lp, LP, MASK, C.preset("decoupled_seq_is_rs"))
    monkeypatch.undo()
    assert metrics_to_host(res.metrics)["mis_positive_logprob_count"] == 1


def test_an_empty_batch_reports_no_mismatch_value():
    empty = torch.zeros(0, S, dtype=torch.float64)
    cfg = C.preset("decoupled_token_is")
    m = metrics_to_host(compute_rollout_correction(empty, empty, empty, cfg).metrics, cfg)
    assert "mismatch_k3_kl" not in m and "mis_weight_p50" not in m and m["mis_valid_token_count"] == 0
    m = metrics_to_host(compute_rollout_correction(LP, LP, torch.zeros(B, S), cfg).metrics, cfg)
    assert "mismatch_k3_kl" not in m and "mismatch_kl" not in m and m["mis_valid_seq_count"] == 0
    m = metrics_to_host(compute_rollout_correction(LP, LP, MASK, cfg).metrics, cfg)
    assert m["mismatch_k3_kl"] == 0.0  # measured, and equal: a real 0


# ------------------------------------------------------------------------------------------ custom weighting functions
def _custom(tmp_path, body: str) -> C:
    f = tmp_path / "my_weights.py"
    f.write_text("import torch\nfrom slime_corr.correction import WeightOutputs\n"
                 "def weights(inputs, config):\n" + body)
    return C(use_tis=True, custom_tis_function_path=f"{f}:weights")


def test_custom_negative_weights_are_an_error_naming_the_function(tmp_path):
    cfg = _custom(tmp_path, "    w = torch.ones_like(inputs.log_ratio)\n    w[1, 1:3] = -0.5\n"
                            "    w[0, 4] = -3.0\n"  # outside the mask: not counted
                            "    return WeightOutputs(weights=w, loss_mask=inputs.loss_mask)\n")
    res = compute_rollout_correction(LP, LP, MASK, cfg)
    assert metrics_to_host(res.metrics)["mis_custom_negative_weight_count"] == 2
    with pytest.raises(InputValueError, match=r"--custom-tis-function-path .*my_weights.py:weights returned 2 "
                                              r"negative weight\(s\).*flips the sign"):
        metrics_to_host(res.metrics, cfg)
    with pytest.raises(InputValueError, match="negative"):  # not softened by the input flag
        metrics_to_host(res.metrics, cfg.replace(warn_invalid_inputs=True))


def test_custom_nonfinite_weights_warn_once_and_an_all_nonfinite_step_is_an_error(tmp_path):
    cfg = _custom(tmp_path, "    w = torch.ones_like(inputs.log_ratio)\n"
                            "    w[inputs.seq_token_count < 3] = float('nan')\n"  # row 2 (1 token)
                            "    w[inputs.seq_token_count > 9] = float('inf')\n"
                            "    return WeightOutputs(weights=w, loss_mask=inputs.loss_mask)\n")
    res = compute_rollout_correction(LP, LP, MASK, cfg)
    with pytest.warns(RuntimeWarning, match=r"my_weights.py:weights returned 1 NaN/inf weight.*warned once"):
        assert metrics_to_host(res.metrics, cfg)["mis_custom_nonfinite_weight_count"] == 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics_to_host(res.metrics, cfg)  # once: no second warning
    only_row_2 = MASK.clone()
    only_row_2[:2] = 0
    res = compute_rollout_correction(LP, LP, only_row_2, cfg)  # every weight the function gave is NaN
    with pytest.raises(InputValueError, match=r"returned only NaN/inf weights in this step \(1 tokens\).*nothing trains"):
        metrics_to_host(res.metrics, cfg)
    steps = [compute_rollout_correction(LP, LP, m, cfg).stats for m in (MASK, only_row_2)]
    metrics_to_host(correction_metrics(merge_stats(steps), cfg), cfg)  # the step as a whole kept finite weights


def test_the_flag_and_yaml_key():
    import argparse

    from slime_corr.arguments import add_rollout_correction_args, parse_rollout_correction_config

    _, cfg = parse_rollout_correction_config(add_rollout_correction_args(argparse.ArgumentParser()),
                                             ["--get-mismatch-metrics", "--warn-invalid-inputs"])
    assert cfg.warn_invalid_inputs and not C().warn_invalid_inputs
    assert C.from_dict({"warn_invalid_inputs": True}).warn_invalid_inputs
    with pytest.raises(ValueError, match="warn_invalid_inputs"):
        C(warn_invalid_inputs="yes")
