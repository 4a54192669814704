"""slime's top-p replay keys through slime_corr's slime hook: `rollout_top_p_token_ids` / `rollout_top_p_token_offsets`
(one entry per sample, whole responses, offsets of response_length + 1: slime's meaning) are checked against the
responses (a misfit refused naming the key) and give the kept-set metrics over the trained tokens; the correction
itself is the same with or without them."""

from __future__ import annotations

import pytest
import torch

from slime_corr.integrations.slime import compute_mis_weights_with_cp
from tests.integrations.slime_reference import make_batch, slime_args


def _call(batch, **extra):
    train, rollout, masks, pg, totals, resp = batch
    args = slime_args(use_tis=True)
    return compute_mis_weights_with_cp(args, pg_loss=torch.cat(pg), train_log_probs=list(train),
                                       rollout_log_probs=list(rollout), loss_masks=list(masks), total_lengths=totals,
                                       response_lengths=resp, **extra)


def _kept(resp: list[int], seed: int = 0):
    """Per sample: kept ids and offsets with set sizes 1..4 (token j of sample i has 1 + (i + j) % 4 ids)."""
    ids, offsets = [], []
    for i, r in enumerate(resp):
        sizes = torch.tensor([1 + (i + j) % 4 for j in range(r)])
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]).to(torch.int32))
        ids.append(torch.arange(int(sizes.sum()), dtype=torch.int32))
    return ids, offsets


def test_the_kept_set_metrics_over_the_trained_tokens():
    batch = make_batch(3)
    train, rollout, masks, pg, totals, resp = batch
    ids, offsets = _kept(resp)
    pg_loss, modified, metrics = _call(batch, rollout_top_p_token_ids=ids, rollout_top_p_token_offsets=offsets)
    plain_loss, plain_masks, plain_metrics = _call(batch)
    assert torch.equal(pg_loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(modified, plain_masks,
                                                                                      strict=True))
    sizes = torch.cat([o.diff()[m > 0] for o, m in zip(offsets, masks, strict=True)]).double()
    n_tok = int(torch.cat(pg).numel())
    assert metrics["kept_set_size_mean"].shape == (n_tok,)  # slime's convention: a batch value on every token
    torch.testing.assert_close(metrics["kept_set_size_mean"][0].double(), sizes.mean())
    torch.testing.assert_close(metrics["kept_set_singleton_share"][0].double(), (sizes == 1).double().mean())
    assert "kept_set_size_mean" not in plain_metrics


def test_misfit_kept_sets_are_refused_naming_the_key():
    batch = make_batch(4)
    resp = batch[5]
    ids, offsets = _kept(resp)
    with pytest.raises(ValueError, match=r"rollout_top_p_token_offsets\[1\] has .* offsets .* for a response of"):
        _call(batch, rollout_top_p_token_ids=ids,
              rollout_top_p_token_offsets=[offsets[0], offsets[1][:-1], *offsets[2:]])
    with pytest.raises(ValueError, match="rollout_top_p_token_ids and rollout_top_p_token_offsets come together"):
        _call(batch, rollout_top_p_token_ids=ids)
