"""`--max-staleness K` (optimizer steps) and `--staleness-policy`: the pieces, then the main job through its entry
point (one process, embedded engine, float64 trainer).

The producer runs A = (K + 1) // S − 1 rollouts ahead (S = steps per rollout); which weights sample each rollout
follows from (rollout, A) alone, so the bound holds however slow the trainer is. Checked: with K = 2 and one step
per rollout the oldest token trained is 0, 1, 2, 2 steps old (never > K, and K is reached); with S = 2 steps per
rollout (a trainer that takes longer per rollout) and K = 5, 0..5; K = 1 logs exactly what `--async-rollout` alone
logs (today's one-rollout overlap); a run saved after each rollout with two rollouts pending resumes to the
uninterrupted run's metrics; resumed with a smaller K, the pending samples over it are dropped (counted, out of the
loss) or regenerated with the current weights.

CI cost: 5 one-process runs (~8 s each alone, ~25 s on a loaded 2-core machine); the regenerate run is slow.
"""

from __future__ import annotations

import json

import pytest

from slime_corr.samples import Sample, SampleStatus
from slime_corr.trainer.config import TrainerConfig
from slime_corr.trainer.data import oldest_version_step, stale_samples
from tests.trainer.test_trainer_launch import compared, launch

pytestmark = pytest.mark.cost(90)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)


def _sample(version: str | None, spans=(), status=SampleStatus.COMPLETED) -> Sample:
    return Sample(prompt_tokens=[1], response_tokens=[2, 3, 4], rollout_log_probs=[-1.0, -1.0, -1.0],
                  weight_version=version, weight_versions=list(spans), status=status,
                  failure_reason="test" if status == SampleStatus.FAILED else None)


def test_the_oldest_token_decides_and_each_sample_is_judged_at_its_own_step():
    resumed = _sample("step-5", [("step-2", 0, 1), ("step-5", 1, 3)])  # resumed across an update
    assert oldest_version_step(resumed) == 2 and oldest_version_step(_sample(None)) is None
    assert oldest_version_step(_sample("other-7")) is None  # not this trainer's name: unknown, never stale
    # 2 steps of 2 samples from step 10: slice 0 is trained at step 10, slice 1 at step 11
    samples = [_sample("step-8"), resumed, _sample("step-8"), _sample("step-3", status=SampleStatus.FAILED)]
    assert stale_samples(samples, 10, 2, 2) == [1, 2]  # 10-2 = 8 > 2; 11-8 = 3 > 2; failed: not trained anyway
    assert stale_samples(samples, 10, 2, 3) == [1]
    assert stale_samples(samples, 10, 2, 8) == []
    assert stale_samples([], 10, 2, 0) == []


@pytest.mark.parametrize("steps, k, ahead", [(1, None, 1), (1, 1, 1), (1, 2, 2), (1, 4, 4), (2, None, 1), (2, 3, 1),
                                             (2, 4, 1), (2, 5, 2), (4, 11, 2)])
def test_the_bound_sets_how_many_rollouts_the_producer_runs_ahead(steps, k, ahead):
    cfg = TrainerConfig(async_rollout=True, max_staleness=k, num_steps_per_rollout=steps)
    assert cfg.rollouts_ahead == ahead
    assert (ahead + 1) * steps - 1 <= cfg.staleness_bound  # the oldest a sample of the last rollout ahead gets
    assert TrainerConfig(num_steps_per_rollout=steps).rollouts_ahead == 0


FLAGS = ["--async-rollout", "--rollout-correction-preset", "ppo_is_bypass", "--num-steps-per-rollout", "1",
         "--num-rollout", "4", "--kl-loss-coef", "0", "--entropy-coef", "0"]


def _oldest(run: dict) -> list[float]:
    return [run["steps"][s]["rollout/staleness_oldest_max"] for s in sorted(run["steps"])]


@pytest.fixture(scope="module")
def k2(tmp_path_factory):
    """K = 2, one step per rollout, saved after each rollout (two rollouts pending in each checkpoint)."""
    root = tmp_path_factory.mktemp("k2")
    return launch(root / "run", *FLAGS, "--max-staleness", "2", "--save", str(root / "ckpt"), "--save-interval", "1")


def test_k2_runs_two_rollouts_ahead_and_never_exceeds_the_bound(k2):
    steps = k2["steps"]
    assert _oldest(k2) == [0, 1, 2, 2]  # rollouts 1, 2 sampled by step-0 weights; rollout 3 by step-1's
    assert [steps[s]["rollout/staleness_max"] for s in (1, 2, 3, 4)] == [0, 1, 2, 2]
    assert all(s["rollout/staleness_dropped"] == 0 and s["rollout/staleness_regenerated"] == 0 for s in steps.values())
    top = [json.loads(line) for line in (k2["dir"] / "top_mismatch.jsonl").read_text().splitlines()]
    assert {(t["step"], t["weight_version"]) for t in top} == {(1, "step-0"), (2, "step-0"), (3, "step-0"),
                                                               (4, "step-1")}


def test_more_steps_per_rollout_stay_within_the_bound(tmp_path):
    run = launch(tmp_path / "s2", *FLAGS, "--num-steps-per-rollout", "2", "--max-staleness", "5", "--num-rollout", "4")
    assert _oldest(run) == [0, 1, 2, 3, 4, 5, 4, 5]  # 2 rollouts ahead: up to (2 + 1) × 2 − 1 = 5 steps


def test_k1_is_the_one_rollout_overlap_of_async_rollout(tmp_path):
    plain = launch(tmp_path / "plain", *FLAGS, "--num-rollout", "3")
    k1 = launch(tmp_path / "k1", *FLAGS, "--num-rollout", "3", "--max-staleness", "1")
    assert {s: compared(r) for s, r in k1["steps"].items()} == {s: compared(r) for s, r in plain["steps"].items()}
    assert _oldest(k1) == [0, 1, 1]


def test_a_resumed_run_with_rollouts_pending_continues_as_the_uninterrupted_one(k2, tmp_path):
    ckpt = k2["dir"].parent / "ckpt"
    resumed = launch(tmp_path / "resumed", *FLAGS, "--max-staleness", "2", "--load", str(ckpt), "--ckpt-step", "2")
    assert sorted(resumed["steps"]) == [3, 4]
    assert {s: compared(r) for s, r in resumed["steps"].items()} == \
        {s: compared(k2["steps"][s]) for s in (3, 4)}


@pytest.mark.parametrize("policy", ["drop", pytest.param("regenerate", marks=pytest.mark.slow)])
def test_resumed_with_a_smaller_bound_the_stale_pending_samples_are_dropped_or_regenerated(policy, k2, tmp_path):
    ckpt = k2["dir"].parent / "ckpt"  # pending at step 2: rollout 2 (step-0 weights) and rollout 3 (step-1)
    run = launch(tmp_path / policy, *FLAGS, "--max-staleness", "1", "--staleness-policy", policy,
                 "--load", str(ckpt), "--ckpt-step", "2")
    steps = run["steps"]
    assert sorted(steps) == [3, 4]
    samples = 32  # 4 prompts × 8 samples
    if policy == "drop":  # both are 2 steps old at their step > 1: nothing trained, no loss metric
        assert [steps[s]["rollout/staleness_dropped"] for s in (3, 4)] == [samples, samples]
        assert all(steps[s]["rollout/trained_samples"] == 0 and "train/pg_loss" not in steps[s] for s in (3, 4))
        assert "stale" not in run["err"]
    else:  # regenerated with the step-2 / step-3 weights: 0 steps old, trained
        assert [steps[s]["rollout/staleness_regenerated"] for s in (3, 4)] == [samples, samples]
        assert _oldest(run) == [0, 0]
        assert all(steps[s]["rollout/trained_samples"] > 0 and "train/pg_loss" in steps[s] for s in (3, 4))
