"""The loss hook's parts alone, on CPU without a process group: `PolicyLogProbs` (log-probs from logits and by
forward-only passes) and `StepPrepass` over it (the step's `--tis-batch-normalize` mean), built without a
`RolloutCorrectionLoss`."""

from __future__ import annotations

import torch

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import compute_rollout_correction
from slime_corr.mcore.context_parallel import ParallelGroups
from slime_corr.mcore.policy_log_probs import PolicyLogProbs
from slime_corr.mcore.step_prepass import PRECOMPUTED_CORRECTION, StepPrepass

TEMPERATURE = 0.7


class _LogitsModel:
    """Stands in for a model: a micro-batch carries its logits; counts forward passes."""

    def __init__(self) -> None:
        self.forwards = 0


def _logits_forward(model: _LogitsModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model.forwards += 1
    return batch["logits"]


def _micro_batches(seed: int, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [dict(logits=torch.randn(2, 6, 10, generator=g, dtype=torch.float64),
                 labels=torch.randint(0, 10, (2, 6), generator=g),
                 loss_mask=torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]).float(),
                 rollout_log_probs=-torch.rand(2, 6, generator=g, dtype=torch.float64),
                 advantages=torch.randn(2, 6, generator=g, dtype=torch.float64)) for _ in range(n)]


def _want_log_probs(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    lp = torch.log_softmax(batch["logits"] / TEMPERATURE, -1)
    return lp.gather(-1, batch["labels"].unsqueeze(-1))[..., 0]


def _policy(config: RolloutCorrectionConfig, **kwargs) -> PolicyLogProbs:
    return PolicyLogProbs(config, model_forward=_logits_forward, groups=ParallelGroups(), temperature=TEMPERATURE,
                          **kwargs)


def test_policy_log_probs_alone_from_logits_and_by_a_forward_only_pass():
    prepared = []
    policy = _policy(RolloutCorrectionConfig.preset("decoupled_token_is"), on_rollout_prepared=prepared.append)
    batches = _micro_batches(0, 3)
    lp, entropy = policy.log_probs(batches[0]["logits"], batches[0]["labels"])
    torch.testing.assert_close(lp, _want_log_probs(batches[0]))
    assert entropy is None and policy.needs_old_log_probs and not policy.needs_ref_log_probs
    model = _LogitsModel()
    policy.prepare_rollout(model, batches)  # decoupled mode: lp_old of every micro-batch, stored in it
    assert model.forwards == 3 and prepared == [batches]
    for b in batches:
        torch.testing.assert_close(b["old_log_probs"], _want_log_probs(b))


def test_the_step_prepass_alone_takes_the_mean_over_the_whole_step():
    cfg = RolloutCorrectionConfig.preset("decoupled_token_is", tis_batch_normalize=True)
    policy = _policy(cfg)
    prepass = StepPrepass(cfg, policy)
    batches = _micro_batches(1, 3)
    model = _LogitsModel()
    assert not prepass.can_stream(3) and not prepass.budgeted
    prepass.prepare_step(model, batches)  # lp_old by the policy's pass, then the step's mean from it
    assert model.forwards == 3 and all(PRECOMPUTED_CORRECTION in b for b in batches)
    whole = compute_rollout_correction(*(torch.cat([b[key] for b in batches]) for key in
                                         ("old_log_probs", "rollout_log_probs", "loss_mask")), cfg, normalize=False)
    mask = whole.loss_mask
    want = (whole.weights * mask).sum() / mask.sum()
    torch.testing.assert_close(prepass.step_batch_norm_mean, want.to(prepass.step_batch_norm_mean.dtype))
