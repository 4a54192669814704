"""`--prox-logp-method loglinear` in the main job (one process, embedded engine, float64 trainer and engine,
decoupled token IS, 2 rollouts × 2 steps): at a rollout's first step π_old's weights are π_θ's, so the step logs
what the recompute run logs (and a measured error of 0); at the second step π_old is the behaviour policy's
log-prob (synchronous: the tokens are one step old, α = 0), so the logged error against the recompute is the
rollout log-probs' float32 rounding: > 0 and small. The error is logged on the sampled rollouts only.

Under torchrun with DP=2 and packed micro-batches (the weight lags laid out by the packed layout, the error reduced
over DP) the loglinear run logs what one process logs.

CI cost: 2 one-process runs (~8 s each alone) and one torchrun launch of 2 processes (~15 s).
"""

from __future__ import annotations

import pytest

from tests.trainer.test_trainer_launch import assert_same_metrics, compared, launch

pytestmark = pytest.mark.cost(60)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

# a float64 engine: weights that differ by float64 rounding between layouts must not flip the engine's float32
# rounding of a log-prob (1e-7), which the diagnostics compared to 1e-8 would see
FLAGS = ["--rollout-correction-preset", "decoupled_token_is", "--kl-loss-coef", "0", "--entropy-coef", "0",
         "--engine-dtype", "float64"]
ERROR = ("train/prox_logp_abs_error_mean", "train/prox_logp_abs_error_max")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prox")
    return (launch(root / "recompute", *FLAGS),
            launch(root / "loglinear", *FLAGS, "--prox-logp-method", "loglinear", "--prox-logp-error-interval", "2"))


def test_loglinear_equals_recompute_where_the_versions_agree(runs):
    recompute, loglinear = runs
    want, got = compared(recompute["steps"][1]), compared(loglinear["steps"][1])
    assert set(got) - set(want) == set(ERROR)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert got["train/prox_logp_abs_error_max"] < 1e-12


def test_its_error_against_the_recompute_is_logged_on_sampled_rollouts(runs):
    _, loglinear = runs
    steps = loglinear["steps"]
    second = steps[2]  # π_old := the behaviour log-prob: off by its float32 storage
    assert 0 < second["train/prox_logp_abs_error_mean"] <= second["train/prox_logp_abs_error_max"] < 1e-3
    assert all(key not in steps[s] for s in (3, 4) for key in ERROR)  # rollout 1: not sampled (every 2nd)
    assert steps[4]["train/ppo_kl"] != 0  # the loss still sees π_θ ≠ π_old at a later step


def test_loglinear_under_dp2_packed_logs_what_one_process_logs(runs, tmp_path):
    _, loglinear = runs
    run = launch(tmp_path / "dp2", *FLAGS, "--prox-logp-method", "loglinear", "--prox-logp-error-interval", "2",
                 "--use-dynamic-batch-size", "--max-tokens-per-gpu", "140", nproc=2)
    # at the second step α = 0 and π_old is lp_rollout itself: every IS weight is exactly 1, so a std of the
    # weights is sqrt(rounding) (~1.5e-8), whose value depends on the summation order: compared to 1e-7
    def split(steps: dict) -> tuple[dict, dict]:
        return ({s: {k: v for k, v in r.items() if not k.endswith("_std")} for s, r in steps.items()},
                {s: {k: v for k, v in r.items() if k.endswith("_std")} for s, r in steps.items()})

    (got, got_std), (want, want_std) = split(run["steps"]), split(loglinear["steps"])
    assert_same_metrics(got, want, "loglinear dp2 packed")
    assert got_std.keys() == want_std.keys()
    for step, values in want_std.items():
        assert values.keys() == got_std[step].keys()
        assert all(abs(got_std[step][k] - v) < 1e-7 for k, v in values.items()), (step, values, got_std[step])
