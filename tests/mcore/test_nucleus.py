"""Training under top-p / top-k (`slime_corr.mcore.nucleus` and the hook's use of it): the nucleus mass against a
sort-based reference, the batch renormalization (idempotent, tokens outside the nucleus masked and finite), the
report pairs by hand, the loss hook end to end (decoupled and bypass: finite loss and gradient, the rollout log-probs
renormalized), the flags refused at parse time, and the point of it all: with the engine's own sampler, the
corrected ratio π_trunc / μ_trunĉ has mean ≈ 1 where π_trunc / μ (the rollout log-prob not renormalized) does not."""

from __future__ import annotations

import pytest
import torch

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.engines.embedded.sampling import sample_next_token
from slime_corr.mcore.context_parallel import ParallelGroups
from slime_corr.mcore.loss_hook import RolloutCorrectionLoss
from slime_corr.mcore.nucleus import (
    NUCLEUS_KEYS,
    UNTRUNCATED_MASK,
    UNTRUNCATED_ROLLOUT,
    NucleusLogProbs,
    Truncation,
    nucleus_log_probs,
    nucleus_report,
    renormalize_batch,
)

inf = float("inf")


def ref_keep(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The engine's kept set per row, as SGLang 0.5 / the embedded sampler build it: sort, exclusive cumulative sum
    of the full distribution ≤ top_p, rank < top_k."""
    probs = torch.softmax(z, -1)
    sorted_p, order = probs.sort(-1, descending=True)
    kept = (sorted_p.cumsum(-1) - sorted_p) <= top_p
    if top_k > 0:
        kept[..., top_k:] = False
    return torch.zeros_like(kept).scatter(-1, order, kept)


def test_truncation_values_and_engine_params():
    assert not Truncation().active and Truncation().sampling_params() == {"top_p": 1.0, "top_k": -1}
    assert Truncation(top_k=0).top_k == -1 and not Truncation(top_k=0).active
    assert Truncation(top_p=0.9).active and Truncation(top_k=5).sampling_params() == {"top_p": 1.0, "top_k": 5}
    for kwargs, flag in (({"top_p": 0.0}, "--rollout-top-p 0.0"), ({"top_p": 1.01}, "--rollout-top-p 1.01"),
                         ({"top_p": float("nan")}, "--rollout-top-p nan"), ({"top_k": -2}, "--rollout-top-k -2"),
                         ({"top_k": 2.5}, "--rollout-top-k 2.5")):
        with pytest.raises(ValueError, match=flag):
            Truncation(**kwargs)


@pytest.mark.parametrize("argv, message", [
    (["--rollout-top-p", "0"], "--rollout-top-p 0.0 must be in (0, 1]"),
    (["--rollout-top-p", "1.5"], "--rollout-top-p 1.5 must be in (0, 1]"),
    (["--rollout-top-k", "-5"], "--rollout-top-k -5 must be >= 1, or -1 / 0"),
    (["--rollout-top-k", "3.5"], "--rollout-top-k: invalid int value"),
])
def test_bad_top_p_top_k_flags_are_refused_at_parse_time(argv, message, capsys):
    from slime_corr.main import parse_run_config

    with pytest.raises(SystemExit) as e:
        parse_run_config([*argv, "--rollout-engine", "embedded"], check_urls=False)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_good_flags_reach_the_config_and_the_engine_params():
    from slime_corr.main import parse_run_config

    cfg = parse_run_config(["--rollout-top-p", "0.9", "--rollout-top-k", "0", "--rollout-engine", "embedded"],
                           check_urls=False).trainer
    assert (cfg.rollout_top_p, cfg.rollout_top_k) == (0.9, -1)
    assert cfg.truncation.sampling_params() == {"top_p": 0.9, "top_k": -1}
    assert cfg.rollout_nucleus_logprobs == 20  # the engine's top-20 log-probs by default
    off = parse_run_config(["--rollout-top-p", "0.9", "--rollout-nucleus-logprobs", "0", "--rollout-engine",
                            "embedded"], check_urls=False).trainer
    assert off.rollout_nucleus_logprobs == 0


@pytest.mark.parametrize("top_k, top_p, t", [(0, 0.9, 1.0), (6, 1.0, 0.8), (6, 0.7, 1.2)])
def test_nucleus_log_mass_matches_the_sort_based_reference(top_k, top_p, t):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 7, 40, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, 40, (4, 7), generator=g)
    labels[0, :2] = logits[0, :2].argmin(-1)  # outside any nucleus
    n = nucleus_log_probs(logits, labels, Truncation(top_p=top_p, top_k=top_k), temperature=t, chunk_size=5)
    z = logits / t
    keep = ref_keep(z, top_k, top_p)
    log_mass = torch.logsumexp(z.masked_fill(~keep, -torch.inf), -1) - torch.logsumexp(z, -1)
    inside = keep.gather(-1, labels[..., None])[..., 0]
    assert torch.equal(n.in_nucleus, inside) and not inside[0, :2].any()
    torch.testing.assert_close(n.log_mass, torch.where(inside, log_mass, 0.0))
    lp = torch.log_softmax(z, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(n.log_probs[inside], (lp - log_mass)[inside])
    assert torch.isneginf(n.log_probs[~inside]).all() and n.entropy is None


def _nucleus(lp, log_mass, inside):
    return NucleusLogProbs(torch.tensor(lp, dtype=torch.float64), torch.tensor(log_mass, dtype=torch.float64),
                           torch.tensor(inside), None)


def test_renormalize_batch_and_report_by_hand():
    batch = {"rollout_log_probs": torch.tensor([[-1.0, -2.0, -3.0, -0.5]]), "loss_mask": torch.tensor([[1, 1, 1, 0]])}
    first = _nucleus([[-0.5, -inf, -2.0, -1.0]], [[-0.2, 0.0, -0.1, -0.3]], [[True, False, True, True]])
    lp = renormalize_batch(batch, first)
    torch.testing.assert_close(batch["rollout_log_probs"], torch.tensor([[-0.8, -2.0, -2.9, -0.2]]))
    assert batch["loss_mask"].tolist() == [[1, 0, 1, 0]] and batch["loss_mask"].dtype == torch.int64
    torch.testing.assert_close(lp, torch.tensor([[-0.5, -2.0, -2.0, -1.0]], dtype=torch.float64))  # finite
    assert batch[UNTRUNCATED_ROLLOUT].tolist() == [[-1.0, -2.0, -3.0, -0.5]]
    report = nucleus_report(batch, lp)
    assert set(report) == set(NUCLEUS_KEYS)
    r = {k: (v[0] / v[1]).item() for k, v in report.items()}
    assert r["mismatch_nucleus_disagreement"] == pytest.approx(1 / 3)
    assert r["mismatch_nucleus_log_mass"] == pytest.approx((-0.2 - 0.1) / 2)
    ratio = (torch.tensor([-0.5 + 0.8, -2.0 + 2.9]).exp().mean()).item()
    assert r["mismatch_nucleus_ratio_mean"] == pytest.approx(ratio)
    assert r["mismatch_nucleus_uncorrected_ratio_mean"] == pytest.approx(torch.tensor([0.5, 1.0]).exp().mean().item())
    # again with another nucleus: from the engine's values, not from the first renormalization
    renormalize_batch(batch, _nucleus([[-0.1] * 4], [[-0.5] * 4], [[True] * 4]))
    torch.testing.assert_close(batch["rollout_log_probs"], torch.tensor([[-0.5, -1.5, -2.5, 0.0]]))
    assert batch["loss_mask"].tolist() == [[1, 1, 1, 0]] and batch[UNTRUNCATED_MASK].tolist() == [[1, 1, 1, 0]]
    # no valid token: 0 / 0 pairs, finite
    empty = {"rollout_log_probs": torch.zeros(1, 2), "loss_mask": torch.zeros(1, 2)}
    renormalize_batch(empty, _nucleus([[-inf, -1.0]], [[0.0, -0.1]], [[False, True]]))
    assert all(torch.isfinite(v).all() and v[1] == 0 for v in nucleus_report(empty, torch.zeros(1, 2)).values())


def _engine_samples(rows: int, vocab: int, top_p: float, top_k: int, seed: int):
    """Engine logits μ, trainer logits π = μ + noise, and one token per row drawn by the embedded engine's own
    sampler (SGLang's semantics: truncated, renormalized; it reports log μ(y), not renormalized)."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * torch.linspace(0.5, 3.0, rows)[:, None]
    pi = mu + 0.05 * torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    params = {"temperature": 1.0, "top_p": top_p, "top_k": top_k}
    drawn = [sample_next_token(mu[i].float(), params, torch.Generator().manual_seed(seed * 100003 + i))
             for i in range(rows)]
    labels = torch.tensor([tok for tok, _ in drawn])
    lp_rollout = torch.tensor([lp for _, lp in drawn], dtype=torch.float64)
    return mu, pi, labels, lp_rollout


@pytest.mark.parametrize("top_p, top_k", [(0.9, -1), (0.8, 6)])
def test_the_corrected_ratio_has_mean_one_where_the_uncorrected_does_not(top_p, top_k):
    mu, pi, labels, lp_rollout = _engine_samples(3000, 24, top_p, top_k, seed=5)
    trunc = Truncation(top_p=top_p, top_k=top_k)
    n = nucleus_log_probs(pi, labels, trunc)
    torch.testing.assert_close(lp_rollout, torch.log_softmax(mu, -1).gather(-1, labels[:, None])[:, 0].float()
                               .double(), rtol=0, atol=1e-5)  # the engine reports the untruncated log-prob
    inside = n.in_nucleus
    assert 0 < (~inside).sum() < 0.05 * len(labels)  # a few tokens lie outside the trainer's nucleus
    corrected = (n.log_probs - (lp_rollout - n.log_mass))[inside].exp()
    uncorrected = (n.log_probs - lp_rollout)[inside].exp()
    # the exact expectations under the engine's sampler, from the full distributions (an independent reference):
    # E_{μ_trunc}[π_trunc(y)/μ_trunĉ(y) · 1{y ∈ N_π}] = π(N_μ ∩ N_π) / M_μ, and with 1/M_π for the uncorrected ratio
    keep_mu, keep_pi = ref_keep(mu, top_k, top_p), ref_keep(pi, top_k, top_p)
    p_mu, p_pi = torch.softmax(mu, -1), torch.softmax(pi, -1)
    m_mu, m_pi = (p_mu * keep_mu).sum(-1), (p_pi * keep_pi).sum(-1)
    both = (p_pi * keep_mu * keep_pi).sum(-1)
    want_corrected = (both / m_mu).mean()
    want_uncorrected = (both / (m_mu * m_pi)).mean()
    # off 1 by about the mass the trainer's nucleus misses of the engine's (those tokens are masked, not weighted)
    assert abs(want_corrected - 1) < 0.02
    assert want_uncorrected > 1 + 0.5 * (1 - top_p)  # biased up by 1/M ≥ 1/(top_p + max prob)
    n_in = inside.sum()
    for got, want in ((corrected, want_corrected), (uncorrected, want_uncorrected)):
        se = got.std() / n_in.sqrt()
        assert abs(got.sum() / len(labels) - want) < 4 * se + 1e-3, (got.mean(), want)
    assert abs(corrected.mean() - 1) < 0.025 and uncorrected.mean() - 1 > 0.5 * (1 - top_p)


def _batch(seed: int, b: int = 3, s: int = 6, v: int = 16):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, v, generator=g, dtype=torch.float64) * 2
    labels = torch.multinomial(torch.softmax(logits.reshape(-1, v), -1), 1, generator=g).reshape(b, s)
    labels[0, 1] = logits[0, 1].argmin()  # outside the nucleus
    lp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    mask = torch.ones(b, s)
    mask[2, 4:] = 0
    return logits, dict(labels=labels, loss_mask=mask, rollout_log_probs=(lp - 0.01).float(),
                        advantages=torch.randn(b, s, generator=g, dtype=torch.float64), logits=logits)


@pytest.mark.parametrize("preset", ["decoupled_token_is", "pg_is"])
def test_the_hook_trains_under_the_truncation_with_finite_loss_and_gradient(preset):
    trunc = Truncation(top_p=0.8)
    hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset(preset), groups=ParallelGroups(), truncation=trunc,
                                 model_forward=lambda model, batch: batch["logits"])
    logits, batch = _batch(0)
    raw = batch["rollout_log_probs"].clone()
    if hook.needs_old_log_probs:
        hook.compute_old_log_probs(object(), [batch])
        assert torch.isfinite(batch["old_log_probs"]).all()
    train_logits = (logits * 1.05).requires_grad_()  # the policy moved a little
    loss_sum, count, report = hook.loss_func(batch, train_logits)
    loss_sum.backward()
    assert torch.isfinite(loss_sum) and torch.isfinite(train_logits.grad).all()
    # the nucleus whose mass renormalizes the rollout: π_old's (decoupled), the trained policy's (bypass)
    ref = nucleus_log_probs(logits if hook.needs_old_log_probs else train_logits.detach(), batch["labels"], trunc)
    torch.testing.assert_close(batch["rollout_log_probs"], (raw.double() - ref.log_mass).float())
    assert batch["loss_mask"][0, 1] == 0 and not ref.in_nucleus[0, 1]
    torch.testing.assert_close(batch["loss_mask"], batch[UNTRUNCATED_MASK] * ref.in_nucleus)
    assert set(NUCLEUS_KEYS) <= set(report) and all(torch.isfinite(v).all() for v in report.values())
    disagreement = report["mismatch_nucleus_disagreement"]
    assert disagreement[1] == 16 and disagreement[0] == (~ref.in_nucleus & (batch[UNTRUNCATED_MASK] > 0)).sum()
    assert int(count) <= int(batch["loss_mask"].sum())


def test_without_truncation_the_hook_is_unchanged():
    logits, batch = _batch(1)
    batch_b = {k: v.clone() for k, v in batch.items()}
    cfg = RolloutCorrectionConfig.preset("pg_is")
    plain = RolloutCorrectionLoss(cfg, groups=ParallelGroups()).loss_func(batch, logits)
    off = RolloutCorrectionLoss(cfg, groups=ParallelGroups(), truncation=Truncation(top_p=1.0, top_k=0)).loss_func(
        batch_b, logits)
    assert torch.equal(plain[0], off[0]) and set(plain[2]) == set(off[2])
    assert not set(NUCLEUS_KEYS) & set(off[2]) and UNTRUNCATED_ROLLOUT not in batch_b


def test_a_replayed_step_keeps_the_renormalized_rollout_and_mask():
    """Megatron's rerun machine replays a step from copies taken as the micro-batches were first read, before the
    lp_old pass renormalized them: the replay must train the renormalized values, not the engine's."""
    import copy

    from slime_corr.mcore.rollout_steps import RolloutStepIterator

    _, batch0 = _batch(2)
    hook = RolloutCorrectionLoss(RolloutCorrectionConfig.preset("decoupled_token_is"), groups=ParallelGroups(),
                                 truncation=Truncation(top_p=0.8), model_forward=lambda m, b: b["logits"])
    data = RolloutStepIterator([[batch0]], num_microbatches=1)
    saved = []

    class Rerun:
        def __next__(self):
            n = next(data)
            saved.append(copy.copy(n))
            return n

    batch = hook.next_micro_batch(Rerun(), object())
    assert UNTRUNCATED_ROLLOUT in batch and batch["loss_mask"].sum() < batch[UNTRUNCATED_MASK].sum()
    want = hook.loss_func(batch, batch["logits"])
    replayed = hook.next_micro_batch(iter(saved), object())
    for key in ("rollout_log_probs", "loss_mask", "old_log_probs", UNTRUNCATED_ROLLOUT):
        assert replayed[key] is batch[key], key
    got = hook.loss_func(replayed, replayed["logits"])
    assert torch.equal(got[0], want[0]) and int(got[1]) == int(want[1])
