"""The engine's own nucleus in the trainer (`--rollout-nucleus-logprobs`): where the micro-batch carries the
engine's log-mass, `renormalize_batch` uses it, so the IS log-ratio is exactly lp_old_trunc − (lp_rollout − log M_μ),
checked against both policies' FULL logits (an independent reference: sort, SGLang's rule, softmax mass); elsewhere
the trainer's log M_π_old, as before. The report's engine share and mass log-ratio by hand, and the IS weights of a
decoupled token-level run from the exact ratio."""

from __future__ import annotations

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.engines.embedded.sampling import sample_next_token
from slime_corr.layout.micro_batch import NUCLEUS_KNOWN_KEY, NUCLEUS_MASS_KEY
from slime_corr.mcore.context_parallel import ParallelGroups
from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
from slime_corr.mcore.nucleus import TRAINER_LOG_MASS, UNTRUNCATED_MASK, Truncation, nucleus_report
from slime_corr.rollout.nucleus import engine_nucleus
from tests.mcore.test_nucleus import ref_keep  # SGLang's kept set, from the full softmax

B, S, V = 4, 12, 32


def _truncated(z: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π_trunc(label), log M) from full logits: z_y − logsumexp over the kept set, and the kept set's mass."""
    log_mass = torch.logsumexp(z.masked_fill(~keep, -torch.inf), -1) - torch.logsumexp(z, -1)
    lp = torch.log_softmax(z, -1).gather(-1, labels[..., None])[..., 0]
    return lp - log_mass, log_mass


def _rollout(top_p: float, top_k: int, n: int, t: float, seed: int = 0):
    """Engine logits μ, trainer logits π (= μ + noise), tokens drawn by the embedded engine's sampler, and the
    micro-batch the trainer would get: SGLang's log μ(y) and the engine's log-mass from its top-n log-probs."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(1.0, 4.0, S, dtype=torch.float64)[:, None]  # from flat to peaked positions
    mu = torch.randn(B, S, V, generator=g, dtype=torch.float64) * scale
    pi = mu + 0.1 * torch.randn(B, S, V, generator=g, dtype=torch.float64)
    params = {"temperature": t, "top_p": top_p, "top_k": top_k}
    drawn = [sample_next_token(row.float(), params, torch.Generator().manual_seed(seed * 1000 + i))
             for i, row in enumerate(mu.reshape(-1, V))]
    labels = torch.tensor([tok for tok, _ in drawn]).reshape(B, S)
    lp_rollout = torch.tensor([lp for _, lp in drawn]).reshape(B, S)
    engine_lp = torch.log_softmax(mu.reshape(-1, V).float() / t, -1)
    values, ids = engine_lp.topk(n, -1)
    nucleus = engine_nucleus(values.double(), ids, labels.reshape(-1), lp_rollout.reshape(-1).double(),
                             top_p=top_p, top_k=top_k)
    assert nucleus.inside[nucleus.fits].all()
    mask = torch.ones(B, S)
    mask[3, 8:] = 0
    known = nucleus.fits.reshape(B, S) & (mask > 0)
    batch = {"labels": labels, "loss_mask": mask, "rollout_log_probs": lp_rollout * mask,
             "advantages": torch.randn(B, S, generator=g, dtype=torch.float64), "logits": pi,
             NUCLEUS_MASS_KEY: torch.where(known, nucleus.log_mass.reshape(B, S), 0.0).float(),
             NUCLEUS_KNOWN_KEY: known}
    return mu, pi, batch


@pytest.mark.parametrize("top_p, top_k, n, t", [(0.9, -1, 6, 1.0), (1.0, 5, 5, 0.8), (0.8, 8, 6, 1.2)])
def test_on_the_engine_path_the_is_log_ratio_is_exact(top_p, top_k, n, t):
    mu, pi, batch = _rollout(top_p, top_k, n, t)
    known = batch[NUCLEUS_KNOWN_KEY].clone()
    raw = batch["rollout_log_probs"].double().clone()
    hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("decoupled_token_is"), groups=ParallelGroups(),
                                 truncation=Truncation(top_p=top_p, top_k=top_k), temperature=t, keep_outputs=True,
                                 model_forward=lambda model, b: b["logits"])
    hook.compute_old_log_probs(object(), [batch])
    keep_pi = ref_keep(pi / t, top_k, top_p)
    lp_old_trunc, log_m_old = _truncated(pi / t, batch["labels"], keep_pi)
    _, log_m_mu = _truncated(mu / t, batch["labels"], ref_keep(mu / t, top_k, top_p))
    in_pi = keep_pi.gather(-1, batch["labels"][..., None])[..., 0]
    kept = (batch[UNTRUNCATED_MASK] > 0) & in_pi
    assert torch.equal(batch["loss_mask"] > 0, kept)
    on_engine, fallback = kept & known, kept & ~known
    assert on_engine.sum() >= 10 and (fallback.sum() >= 5 or top_p == 1.0)
    log_ratio = batch["old_log_probs"].double() - batch["rollout_log_probs"].double()
    exact = lp_old_trunc - (raw - log_m_mu)  # log π_old_trunc(y) − log μ_trunc(y)
    torch.testing.assert_close(log_ratio[on_engine], exact[on_engine], rtol=0, atol=2e-5)
    fallback_ref = lp_old_trunc - (raw - log_m_old)  # the trainer's mass: log π_old(y) − log μ(y)
    torch.testing.assert_close(log_ratio[fallback], fallback_ref[fallback], rtol=0, atol=2e-5)
    assert (exact - fallback_ref)[on_engine].abs().max() > 1e-3  # the two paths differ here: the test can fail
    # the IS weights of the update (token level, truncated at 2) come from the exact ratio
    _, _, report = hook.loss_func(batch, pi.clone().requires_grad_())
    weights = hook.outputs[-1].correction.weights
    torch.testing.assert_close(weights[on_engine].double(), exact[on_engine].exp().clamp(max=2.0), rtol=0, atol=5e-5)
    r = {k: (v[0] / v[1]).item() for k, v in report.items() if k.startswith("mismatch_nucleus")}
    valid = batch[UNTRUNCATED_MASK] > 0
    assert r["mismatch_nucleus_engine_share"] == pytest.approx(((valid & known).sum() / valid.sum()).item())
    gap = (log_m_old - log_m_mu)[on_engine]
    assert r["mismatch_nucleus_mass_log_ratio"] == pytest.approx(gap.mean().item(), abs=1e-5)
    assert r["mismatch_nucleus_mass_abs_log_ratio"] == pytest.approx(gap.abs().mean().item(), abs=1e-5)


def test_bypass_renormalizes_by_the_engine_mass_where_known():
    mu, pi, batch = _rollout(0.85, -1, 8, 1.0, seed=3)
    known = batch[NUCLEUS_KNOWN_KEY].clone()
    raw = batch["rollout_log_probs"].double().clone()
    hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("pg_is"), groups=ParallelGroups(),
                                 truncation=Truncation(top_p=0.85), model_forward=lambda model, b: b["logits"])
    hook.loss_func(batch, pi.clone().requires_grad_())
    _, log_m_mu = _truncated(mu, batch["labels"], ref_keep(mu, -1, 0.85))
    _, log_m_pi = _truncated(pi, batch["labels"], ref_keep(pi, -1, 0.85))
    kept = batch["loss_mask"] > 0
    want = torch.where(known, raw - log_m_mu, raw - log_m_pi)
    torch.testing.assert_close(batch["rollout_log_probs"].double()[kept], want[kept], rtol=0, atol=2e-5)
    torch.testing.assert_close(batch[TRAINER_LOG_MASS][kept].double(), log_m_pi[kept], rtol=0, atol=2e-6)


def test_the_report_by_hand_and_without_the_engine_keys():
    batch = {"rollout_log_probs": torch.tensor([[-1.0, -2.0, -3.0, -0.5]]), "loss_mask": torch.tensor([[1, 1, 1, 0]]),
             UNTRUNCATED_MASK: torch.tensor([[1, 1, 1, 0]]), "rollout_log_probs_untruncated": torch.zeros(1, 4),
             TRAINER_LOG_MASS: torch.tensor([[-0.2, -0.1, -0.3, 0.0]]),
             NUCLEUS_MASS_KEY: torch.tensor([[-0.25, 0.0, -0.1, 0.0]]),
             NUCLEUS_KNOWN_KEY: torch.tensor([[True, False, True, False]])}
    batch["loss_mask"] = torch.tensor([[1, 1, 0, 0]])  # the third token left the trainer's nucleus
    r = {k: (v[0] / v[1]).item() for k, v in nucleus_report(batch, torch.zeros(1, 4)).items()}
    assert r["mismatch_nucleus_engine_share"] == pytest.approx(2 / 3)
    assert r["mismatch_nucleus_mass_log_ratio"] == pytest.approx(0.05)  # only the first: -0.2 - (-0.25)
    assert r["mismatch_nucleus_mass_abs_log_ratio"] == pytest.approx(0.05)
    for key in (NUCLEUS_MASS_KEY, NUCLEUS_KNOWN_KEY):
        del batch[key]
    plain = nucleus_report(batch, torch.zeros(1, 4))
    assert plain["mismatch_nucleus_engine_share"][0] == 0 and plain["mismatch_nucleus_mass_log_ratio"][0] == 0
