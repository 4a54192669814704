"""The loss hook replaying the engine's kept sets (`RolloutCorrectionLoss` on micro-batches with the kept-set key
pair): in decoupled and bypass mode the IS ratio's numerator, the PPO ratio and the policy gradient are those of
log π_trunc over the engine's sets (the hook's loss and logits gradient equal the loss built from a float64
dense-masked reference), the rollout log-prob is renormalized by the engine's exact mass, the KL term and the
entropy keep the full distribution (their gradient reaches logits outside the sets), the `mismatch_kept_*` report
pairs equal their definitions, and slime's per-sample keys fed through `RolloutStepIterator` train the same."""

from __future__ import annotations

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.layout.kept_sets import (
    KEPT_COUNTS_KEY,
    KEPT_IDS_KEY,
    KEPT_LOG_PROBS_KEY,
    SLIME_IDS_KEY,
    SLIME_OFFSETS_KEY,
)
from slime_corr.layout.micro_batch import NUCLEUS_KNOWN_KEY, NUCLEUS_MASS_KEY
from slime_corr.loss_terms import LossTermsConfig
from slime_corr.losses import compute_policy_loss
from slime_corr.mcore.context_parallel import ParallelGroups
from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
from slime_corr.mcore.nucleus import KEPT_REPORT_KEYS, NUCLEUS_KEYS, Truncation, nucleus_log_probs
from slime_corr.mcore.rollout_steps import RolloutStepIterator

B, S, V, T = 3, 7, 16, 0.9
TOP_P = 0.8


def _kept_mask(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """SGLang's top-p set of each row of z (sorted, exclusive cumulative sum of the full distribution ≤ top_p)."""
    probs, order = torch.softmax(z, -1).sort(-1, descending=True)
    kept = (probs.cumsum(-1) - probs) <= top_p
    return torch.zeros_like(kept).scatter(-1, order, kept)


def _batch(seed: int = 0, noise: float = 0.05):
    """A padded micro-batch sampled by an 'engine' whose logits differ a little from the trainer's: each trained
    token drawn from the engine's top-p set, with the engine's full log-prob, its exact mass, its kept set and the
    support log-probs; row 2 ends early (padding), position 0 of every row is a prompt position (no set)."""
    g = torch.Generator().manual_seed(seed)
    trainer = torch.randn(B, S, V, generator=g, dtype=torch.float64) * 2
    engine = trainer + noise * torch.randn(B, S, V, generator=g, dtype=torch.float64)
    z = engine / T
    keep = _kept_mask(z, TOP_P)
    mask = torch.ones(B, S)
    mask[:, 0] = 0
    mask[2, 5:] = 0
    keep &= mask[..., None] > 0
    trunc = torch.log_softmax(z.masked_fill(~keep, -torch.inf), -1)
    labels = torch.where(mask > 0, torch.multinomial(trunc.exp().nan_to_num(1.0 / V).reshape(-1, V), 1,
                                                     generator=g).reshape(B, S), 0)
    full = torch.log_softmax(z, -1)
    lp = full.gather(-1, labels[..., None])[..., 0]
    lp_trunc = trunc.gather(-1, labels[..., None])[..., 0]
    counts = keep.sum(-1).to(torch.int32)
    ids = keep.reshape(-1, V).nonzero()[:, 1].to(torch.int32)  # row-major, ascending ids within a token
    support = trunc.reshape(-1, V)[keep.reshape(-1, V)].float()
    batch = dict(labels=labels, loss_mask=mask, rollout_log_probs=torch.where(mask > 0, lp, 0.0).float(),
                 advantages=torch.randn(B, S, generator=g, dtype=torch.float64),
                 **{KEPT_COUNTS_KEY: counts, KEPT_IDS_KEY: ids, KEPT_LOG_PROBS_KEY: support,
                    NUCLEUS_MASS_KEY: torch.where(mask > 0, lp - lp_trunc, 0.0).float(), NUCLEUS_KNOWN_KEY: mask > 0})
    return trainer, batch, keep


def _masked_log_probs(logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The float64 reference: log-softmax of logits / T over each token's kept set (a dense mask), the full
    distribution's where a token has none."""
    z = logits / T
    has = keep.any(-1, keepdim=True)
    masked = torch.where(has & ~keep, -torch.inf, z)
    return torch.log_softmax(masked, -1).gather(-1, labels[..., None])[..., 0]


@pytest.mark.parametrize("preset", ["decoupled_token_is", "decoupled_seq_is_rs", "pg_is", "ppo_is_bypass"])
def test_the_policy_term_trains_on_the_engines_kept_sets(preset):
    cfg = RolloutCorrectionConfig.preset(preset)
    trainer, batch, keep = _batch(1)
    raw = batch["rollout_log_probs"].clone()
    hook = RolloutCorrectionLoss(cfg, groups=ParallelGroups(), temperature=T, truncation=Truncation(top_p=TOP_P),
                                 model_forward=lambda model, b: b["logits"], keep_outputs=True)
    batch["logits"] = trainer
    old = None
    if hook.needs_old_log_probs:
        hook.compute_old_log_probs(object(), [batch])
        old = _masked_log_probs(trainer, batch["labels"], keep)
        trained = batch["loss_mask"] > 0
        torch.testing.assert_close(batch["old_log_probs"][trained], old[trained], rtol=1e-12, atol=1e-12)
    moved = (trainer * 1.1 + 0.1).requires_grad_()  # the policy moved
    loss, count, report = hook.loss_func(batch, moved)
    loss.backward()
    # the rollout log-prob renormalized by the engine's own mass: log μ_trunc(y)
    torch.testing.assert_close(batch["rollout_log_probs"], (raw - batch[NUCLEUS_MASS_KEY]).float())
    # the same loss from the dense-masked float64 reference log-probs
    ref_logits = (trainer * 1.1 + 0.1).requires_grad_()
    lp = _masked_log_probs(ref_logits, batch["labels"], keep)
    ref = compute_policy_loss(lp, old, batch["rollout_log_probs"].double(), batch["advantages"], batch["loss_mask"],
                              cfg, finalize_metrics=False)
    ref.loss_sum.backward()
    torch.testing.assert_close(loss, ref.loss_sum, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(moved.grad, ref_logits.grad, rtol=1e-9, atol=1e-12)
    outside = ~keep & keep.any(-1, keepdim=True)
    assert moved.grad[outside].eq(0).all()  # no KL / entropy term: nothing reaches logits outside the sets
    assert set(KEPT_REPORT_KEYS) <= set(report) and set(NUCLEUS_KEYS) <= set(report)
    assert report["mismatch_nucleus_engine_share"].tolist() == [count_valid(batch)] * 2


def count_valid(batch) -> float:
    return float((batch["loss_mask"] > 0).sum())


def test_the_report_pairs_follow_their_definitions():
    trainer, batch, keep = _batch(2, noise=1.0)  # the engine's sets differ from the trainer's
    batch["logits"] = trainer
    trunc = Truncation(top_p=TOP_P)
    hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("decoupled_token_is"), groups=ParallelGroups(),
                                 temperature=T, truncation=trunc, model_forward=lambda model, b: b["logits"])
    hook.compute_old_log_probs(object(), [batch])
    _, _, report = hook.loss_func(batch, trainer)
    valid = batch["loss_mask"] > 0
    z = trainer / T
    kept_mass = torch.logsumexp(z.masked_fill(~keep, -torch.inf), -1) - torch.logsumexp(z, -1)
    pair = report["mismatch_kept_trainer_log_mass"]
    assert pair[1] == valid.sum()
    torch.testing.assert_close(pair[0], kept_mass[valid].sum(), rtol=1e-12, atol=1e-12)
    own = nucleus_log_probs(trainer, batch["labels"], trunc, temperature=T)
    assert report["mismatch_kept_outside_trainer_nucleus"].tolist() == [float((valid & ~own.in_nucleus).sum()),
                                                                          float(valid.sum())]
    assert report["mismatch_kept_outside_trainer_nucleus"][0] > 0  # the engine's sets differ from the trainer's
    trainer_trunc = torch.log_softmax(z.masked_fill(~keep, -torch.inf), -1)
    engine = torch.zeros(B, S, V, dtype=torch.float64)
    engine[keep] = batch[KEPT_LOG_PROBS_KEY].double()
    diff = (trainer_trunc - engine).abs()[keep]
    pair = report["mismatch_kept_abs_log_prob_diff"]
    assert pair[1] == keep.sum()
    torch.testing.assert_close(pair[0], diff.sum(), rtol=1e-6, atol=1e-9)


def test_the_kl_and_entropy_terms_keep_the_full_distribution():
    cfg = RolloutCorrectionConfig.preset("decoupled_token_is")
    terms = LossTermsConfig(kl_loss_coef=0.5, entropy_coef=0.1)
    trainer, batch, keep = _batch(3)
    ref_logits = trainer + 0.3 * torch.randn(trainer.shape, generator=torch.Generator().manual_seed(9),
                                             dtype=torch.float64)
    models = {"policy": trainer, "ref": ref_logits}
    hook = RolloutCorrectionLoss(cfg, groups=ParallelGroups(), temperature=T, loss_terms=terms, ref_model="ref",
                                 model_forward=lambda model, b: models[model], keep_outputs=True)
    hook.prepare_rollout("policy", [batch])
    full_ref = torch.log_softmax(ref_logits / T, -1).gather(-1, batch["labels"][..., None])[..., 0]
    valid = batch["loss_mask"] > 0
    torch.testing.assert_close(batch["ref_log_probs"][valid], full_ref[valid])  # the reference's: full
    moved = (trainer * 1.1).requires_grad_()
    loss, _, report = hook.loss_func(batch, moved)
    loss.backward()
    x = (trainer * 1.1).requires_grad_()
    lp = _masked_log_probs(x, batch["labels"], keep)
    full = torch.log_softmax(x / T, -1)
    entropy = -(full.exp() * full).sum(-1)
    ref = compute_policy_loss(lp, batch["old_log_probs"], batch["rollout_log_probs"].double(), batch["advantages"],
                              batch["loss_mask"], cfg, finalize_metrics=False, loss_terms=terms,
                              ref_log_probs=batch["ref_log_probs"], entropy=entropy,
                              kl_log_probs=full.gather(-1, batch["labels"][..., None])[..., 0])
    ref.loss_sum.backward()
    torch.testing.assert_close(loss, ref.loss_sum, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(moved.grad, x.grad, rtol=1e-9, atol=1e-12)
    outside = ~keep & keep.any(-1, keepdim=True)
    assert moved.grad[outside].abs().sum() > 0  # the KL and the entropy reach the logits outside the sets
    got_kl = hook.outputs[-1].metrics["kl_loss"]
    torch.testing.assert_close(got_kl, ref.metrics["kl_loss"])
    torch.testing.assert_close(report["entropy"][0] / report["entropy"][1], entropy[valid].mean().detach())


def test_a_label_outside_its_kept_set_is_refused():
    trainer, batch, keep = _batch(4)
    batch["labels"][1, 3] = int((~keep[1, 3]).nonzero()[0, 0])
    hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("pg_is"), groups=ParallelGroups(), temperature=T)
    with pytest.raises(ValueError, match="rollout_kept_token_ids: token 10 .* not exactly once in its kept set"):
        hook.loss_func(batch, trainer)
    _, batch, _ = _batch(4)
    batch[KEPT_COUNTS_KEY] = batch[KEPT_COUNTS_KEY].clone()
    batch[KEPT_IDS_KEY] = batch[KEPT_IDS_KEY][batch[KEPT_COUNTS_KEY][0, 1]:]
    batch[KEPT_COUNTS_KEY][0, 1] = 0  # a trained token without a set
    with pytest.raises(ValueError, match=r"rollout_kept_token_counts: the trained token at \[0, 1\] has no kept set"):
        hook.loss_func(batch, trainer)


def test_slimes_keys_through_the_rollout_step_iterator_train_the_same():
    """slime's per-sample keys (whole responses, offsets of response_length + 1) in a micro-batch read through
    `RolloutStepIterator`: the hook sees the kept-set key pair and computes the loss of our own layout."""
    trainer, ours, keep = _batch(5)
    ours["logits"] = trainer
    theirs = {k: v for k, v in ours.items() if k not in (KEPT_COUNTS_KEY, KEPT_IDS_KEY, KEPT_LOG_PROBS_KEY)}
    responses = (ours["loss_mask"] > 0).sum(-1).tolist()  # prompt = 2 tokens, the response's labels from t = 1
    totals = [r + 2 for r in responses]
    counts = ours[KEPT_COUNTS_KEY]
    starts = torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)
    ids, offsets = [], []
    for i, r in enumerate(responses):
        row = counts[i, 1:1 + r].long()
        first = int(starts[i * S + 1])
        ids.append(ours[KEPT_IDS_KEY][first: first + int(row.sum())])
        offsets.append(torch.cat([torch.zeros(1), row.cumsum(0)]).to(torch.int32))
    theirs.update({SLIME_IDS_KEY: ids, SLIME_OFFSETS_KEY: offsets, "total_lengths": totals,
                   "response_lengths": responses})
    cfg = RolloutCorrectionConfig.preset("pg_is")

    def hook():
        return RolloutCorrectionLoss(cfg, groups=ParallelGroups(), temperature=T,
                                     model_forward=lambda model, b: b["logits"])

    data = RolloutStepIterator([[theirs]], num_microbatches=1)
    h = hook()
    batch = h.next_micro_batch(data, object())
    assert torch.equal(batch[KEPT_COUNTS_KEY], ours[KEPT_COUNTS_KEY]) and SLIME_IDS_KEY not in batch
    got = h.loss_func(batch, trainer)
    want = hook().loss_func({k: v for k, v in ours.items()}, trainer)
    assert torch.equal(got[0], want[0]) and set(got[2]) == set(want[2])
