"""`--partial-rollout` (slime's flag): the weights reach the engines right after training, while the next rollout
is still generating (pause -> update -> continue through the client), so its requests finish under the new
weights and each token keeps the version that sampled it; `--mask-offpolicy-in-partial-rollout` takes the tokens
before a sample's last update out of the loss.

Timing: rollout k+1 starts generating when rollout k is done, which is also when the step that trains rollout k
starts; the sync lands one training step (~0.4 s here, longer under load) into rollout k+1. The embedded engine is
throttled (`SLIME_CORR_EMBEDDED_STEP_DELAY`, 0.02 s after each decoding step of ~0.1 s) and samples 32 tokens: its
first token comes ~0.1 s in, its last ~3.5 s in, so the sync lands inside the responses whatever the load within
a factor of ~4 either way. (A throttle near the training step's length, as 0.2 s was, makes the update land before
or after the first token by chance: the engine sleeps after rollout k's last token before it starts rollout k+1.)

A checkpoint takes the in-flight rollout whole (the weights wait for it at a save), so a run resumed from it trains
its first step on the samples, token versions and masks the uninterrupted run trained on.

CI cost: three one-process runs (~15-20 s each alone).
"""

from __future__ import annotations

import json

import pytest

from slime_corr.errors import ConfigError
from slime_corr.samples import Sample
from slime_corr.trainer.config import TrainerConfig
from slime_corr.trainer.data import mask_offpolicy_tokens, mask_stale_tokens
from tests.trainer.test_trainer_launch import compared, launch

pytestmark = pytest.mark.cost(40)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)

THROTTLE = ("SLIME_CORR_EMBEDDED_STEP_DELAY", "0.02")
LONG = ["--rollout-max-response-len", "32"]


def test_tokens_before_the_last_update_leave_the_loss():
    resumed = Sample(prompt_tokens=[1], response_tokens=[5, 6, 7, 8], rollout_log_probs=[-1.0] * 4,
                     loss_mask=[1, 0, 1, 1], weight_version="step-3",
                     weight_versions=[("step-2", 0, 3), ("step-3", 3, 4)])
    masked, count = mask_offpolicy_tokens(resumed)
    assert masked.loss_mask == [0, 0, 0, 1] and count == 2 and resumed.loss_mask == [1, 0, 1, 1]
    one = Sample(prompt_tokens=[1], response_tokens=[5, 6], rollout_log_probs=[-1.0] * 2, weight_version="step-3",
                 weight_versions=[("step-3", 0, 2)])
    assert mask_offpolicy_tokens(one) == (one, 0)


def test_tokens_older_than_the_token_staleness_bound_leave_the_loss():
    """--max-token-staleness K, at the step that trains the sample: per token, not per sample."""
    resumed = Sample(prompt_tokens=[1], response_tokens=[5, 6, 7, 8, 9], rollout_log_probs=[-1.0] * 5,
                     loss_mask=[1, 0, 1, 1, 1], weight_version="step-4",
                     weight_versions=[("step-2", 0, 2), ("step-3", 2, 4), ("step-4", 4, 5)])
    assert mask_stale_tokens(resumed, 4, 1)[0].loss_mask == [0, 0, 1, 1, 1]  # lags 2, 2, 1, 1, 0
    masked, count = mask_stale_tokens(resumed, 5, 1)  # one step later: lags 3, 3, 2, 2, 1
    assert masked.loss_mask == [0, 0, 0, 0, 1] and count == 3 and resumed.loss_mask == [1, 0, 1, 1, 1]
    assert mask_stale_tokens(resumed, 4, 2) == (resumed, 0)
    plain = Sample(prompt_tokens=[1], response_tokens=[5, 6], rollout_log_probs=[-1.0] * 2, weight_version="step-1")
    old_plain, count = mask_stale_tokens(plain, 3, 1)  # one version, two steps old: every token
    assert old_plain.loss_mask == [0, 0] and count == 2
    with pytest.raises(ConfigError, match=r"--max-token-staleness 0 must be an integer >= --num-steps-per-rollout "
                                          r"− 1 = 1"):
        TrainerConfig(max_token_staleness=0, num_steps_per_rollout=2, rollout_batch_size=2, n_samples_per_prompt=2)
    assert TrainerConfig(max_token_staleness=1, num_steps_per_rollout=2, rollout_batch_size=2,
                         n_samples_per_prompt=2).max_token_staleness == 1


def test_a_weight_update_reaches_the_requests_in_flight(tmp_path, monkeypatch):
    monkeypatch.setenv(*THROTTLE)
    run = launch(tmp_path / "partial", *LONG, "--async-rollout", "--partial-rollout",
                 "--mask-offpolicy-in-partial-rollout", "--rollout-correction-preset", "ppo_is_bypass", "--num-steps-per-rollout", "1", "--num-rollout", "3",
                 "--kl-loss-coef", "0", "--entropy-coef", "0")
    steps = run["steps"]
    partial = [steps[s]["rollout/partial_samples"] for s in (1, 2, 3)]
    masked = [steps[s]["rollout/offpolicy_masked_tokens"] for s in (1, 2, 3)]
    assert partial[0] == 0 and partial[1] > 0 and partial[2] > 0, partial  # rollout 0: before any update
    assert all((p > 0) == (m > 0) for p, m in zip(partial, masked, strict=True)), (partial, masked)
    assert all(steps[s]["rollout/staleness_oldest_max"] <= 1 for s in (1, 2, 3))  # the bound still holds
    top = [json.loads(line) for line in (run["dir"] / "top_mismatch.jsonl").read_text().splitlines()]
    assert all(t["weight_version"] in (f"step-{t['step'] - 1}", f"step-{max(0, t['step'] - 2)}") for t in top)


def test_the_token_staleness_bound_in_a_partial_run(tmp_path, monkeypatch):
    """--max-token-staleness 0, one step per rollout, one rollout ahead: rollout k trains at step k+1 and its tokens
    sampled before the sync after step k are one step old: out of the loss (and counted), the rest trained."""
    monkeypatch.setenv(*THROTTLE)
    run = launch(tmp_path / "bound", *LONG, "--async-rollout", "--partial-rollout", "--max-token-staleness", "0",
                 "--rollout-correction-preset", "ppo_is_bypass", "--num-steps-per-rollout", "1", "--num-rollout", "3",
                 "--kl-loss-coef", "0", "--entropy-coef", "0")
    steps = run["steps"]
    stale = [steps[s]["rollout/stale_masked_tokens"] for s in (1, 2, 3)]
    assert stale[0] == 0 and stale[1] > 0 and stale[2] > 0, stale
    assert all(steps[s]["rollout_corr/mis_valid_token_count"] > 0 for s in (2, 3))  # the newer tokens train


def test_a_checkpoint_holds_the_partial_run_s_pending_rollout_whole(tmp_path, monkeypatch):
    monkeypatch.setenv(*THROTTLE)
    flags = [*LONG, "--async-rollout", "--partial-rollout", "--mask-offpolicy-in-partial-rollout", "--rollout-correction-preset",
             "ppo_is_bypass", "--num-steps-per-rollout", "1", "--num-rollout", "4", "--kl-loss-coef", "0",
             "--entropy-coef", "0"]
    ckpt = tmp_path / "ckpt"
    whole = launch(tmp_path / "whole", *flags, "--save", str(ckpt), "--save-interval", "2")
    # saves after rollouts 1 and 3 (steps 2 and 4): the syncs after rollouts 0 and 2 land mid-request in rollouts 1
    # and 3; the one after rollout 1 waits for rollout 2 whole, which the checkpoint holds
    partial = [whole["steps"][s]["rollout/partial_samples"] for s in (1, 2, 3, 4)]
    assert partial[0] == partial[2] == 0 and partial[1] > 0 and partial[3] > 0, partial
    resumed = launch(tmp_path / "resumed", *flags, "--load", str(ckpt), "--ckpt-step", "2")
    assert sorted(resumed["steps"]) == [3, 4]
    # step 3 trains the pending rollout 2 from the checkpoint; rollout 3 is sampled anew (where an update lands
    # inside a response depends on timing)
    assert compared(resumed["steps"][3]) == compared(whole["steps"][3])
