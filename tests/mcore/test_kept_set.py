"""The replay of the engine's kept sets (`slime_corr.mcore.kept_set.kept_token_log_softmax`) against a float64
full-tensor reference that masks the logits to each token's kept set: log-probs, the per-id log-probs and the
logits' gradient, with uneven set sizes, singletons, tokens without a set, no token at all, every logits dtype and a
temperature; the gradient reaches the kept logits only; a label outside its set, ids outside the vocabulary and
counts that miss the ids are refused by name; TP=2 over gloo gives the same values on both ranks (bitwise) and the
one-process values; `nucleus.replayed_log_probs` of a packed micro-batch equals the padded one's; and the replay's
metric `truncated_logprobs.label_in_nucleus` (no sort) equals the trainer's floor-based nucleus membership, ties
included, chunked and under TP=2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from slime_corr.layout.kept_sets import KEPT_COUNTS_KEY, KEPT_IDS_KEY, KEPT_LOG_PROBS_KEY
from slime_corr.layout.micro_batch import build_micro_batch
from slime_corr.mcore.kept_set import kept_token_log_softmax
from slime_corr.mcore.nucleus import replayed_log_probs
from slime_corr.mcore.truncated_logprobs import label_in_nucleus, truncated_token_log_softmax
from slime_corr.samples import Sample
from tests.mcore.mcore_helpers import checking, spawn_group

pytestmark = pytest.mark.cost(15)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)
V = 40
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp64": 1e-12, "fp32": 2e-6, "bf16": 2e-6, "fp16": 2e-6}  # against float64 of the same rounded logits


def _data(tokens: int = 12, seed: int = 0, dtype: torch.dtype = torch.float64):
    """Logits [tokens, V], and per token a kept set of uneven size (singletons, a whole vocabulary, none) holding
    its label: (logits, labels, counts, ids)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    sizes = [1, 3, 0, 7, 1, V, 2, 0, 5, 1, 11, 4][:tokens] + [3] * max(0, tokens - 12)
    labels, ids = [], []
    for size in sizes:
        chosen = torch.randperm(V, generator=g)[: max(size, 1)]
        labels.append(int(chosen[int(torch.randint(0, chosen.numel(), (1,), generator=g))]))
        ids += chosen.tolist() if size else []
    return logits, torch.tensor(labels), torch.tensor(sizes, dtype=torch.int32), torch.tensor(ids, dtype=torch.int32)


def _reference(logits: torch.Tensor, labels, counts, ids, temperature: float):
    """Per token: log-softmax of z = logits / T over its kept set (a dense −inf mask), 0 where it has none; and per
    kept id its log-prob."""
    z = logits.double() / temperature
    starts = torch.cumsum(counts.long(), 0) - counts.long()
    lp, per_id = [], []
    for t in range(labels.numel()):
        kept = ids[starts[t]: starts[t] + counts[t]].long()
        if kept.numel() == 0:
            lp.append(z[t, 0] * 0)
            continue
        masked = torch.full_like(z[t], -torch.inf).index_put((kept,), z[t, kept])
        row = torch.log_softmax(masked, -1)
        lp.append(row[labels[t]])
        per_id.append(row[kept])
    return torch.stack(lp), torch.cat(per_id) if per_id else z.new_zeros(0)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_a_masked_float64_reference(dtype, temperature):
    logits, labels, counts, ids = _data(dtype=DTYPES[dtype])
    x = logits.clone().requires_grad_()
    out = kept_token_log_softmax(x, labels, counts, ids, temperature=temperature)
    ref_x = logits.double().requires_grad_()
    ref_lp, ref_ids = _reference(ref_x, labels, counts, ids, temperature)
    tol = TOLERANCE[dtype]
    assert out.log_probs.dtype == (torch.float64 if dtype == "fp64" else torch.float32)
    torch.testing.assert_close(out.log_probs.double(), ref_lp.detach(), rtol=tol, atol=tol)
    assert torch.equal(out.has_kept_set, counts > 0) and out.kept_on_rank.all()
    torch.testing.assert_close(out.kept_log_probs.double(), ref_ids.detach(), rtol=tol, atol=tol)
    assert not out.kept_log_probs.requires_grad
    assert out.log_probs[counts == 1].eq(0).all()  # a singleton set: probability 1
    coef = torch.linspace(-1, 2, labels.numel(), dtype=torch.float64)
    (coef * out.log_probs).sum().backward()
    (coef * ref_lp).sum().backward()
    assert x.grad.dtype == x.dtype
    ulp = {"fp64": 1e-12, "fp32": 2e-6, "bf16": 2 ** -7, "fp16": 2 ** -10}[dtype]
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=ulp, atol=ulp * ref_x.grad.abs().max().item())
    # the gradient reaches the kept logits only (the reference's is 0 elsewhere too: checked exactly here)
    kept = torch.zeros_like(x, dtype=torch.bool)
    kept[torch.repeat_interleave(torch.arange(labels.numel()), counts.long()), ids.long()] = True
    assert x.grad[~kept].eq(0).all() and x.grad[counts == 0].eq(0).all()


def test_no_token_and_no_kept_set():
    logits, labels, counts, ids = _data()
    x = logits[:0].clone().requires_grad_()
    out = kept_token_log_softmax(x, labels[:0], counts[:0], ids[:0])
    assert out.log_probs.shape == (0,) and out.kept_log_probs.shape == (0,)
    out.log_probs.sum().backward()
    assert x.grad.shape == (0, V)
    none = torch.zeros(3, dtype=torch.int32)  # tokens without any kept set: 0 and no gradient
    y = logits[:3].clone().requires_grad_()
    out = kept_token_log_softmax(y, labels[:3], none, torch.zeros(0, dtype=torch.int32))
    assert out.log_probs.eq(0).all() and not out.has_kept_set.any()
    out.log_probs.sum().backward()
    assert y.grad.eq(0).all()


def test_shapes_follow_the_labels():
    logits, labels, counts, ids = _data(tokens=12)
    flat = kept_token_log_softmax(logits, labels, counts, ids)
    shaped = kept_token_log_softmax(logits.reshape(3, 4, V), labels.reshape(3, 4), counts.reshape(3, 4), ids)
    assert torch.equal(shaped.log_probs, flat.log_probs.reshape(3, 4))


def test_bad_kept_sets_are_refused_by_name():
    logits, labels, counts, ids = _data()
    wrong = labels.clone()
    starts = torch.cumsum(counts.long(), 0) - counts.long()
    t = 3  # a set of 7: put a label outside it
    inside = set(ids[starts[t]: starts[t] + counts[t]].tolist())
    wrong[t] = next(v for v in range(V) if v not in inside)
    with pytest.raises(ValueError, match=r"rollout_kept_token_ids: token 3 .* not exactly once in its kept set"):
        kept_token_log_softmax(logits, wrong, counts, ids)
    with pytest.raises(ValueError, match=r"rollout_kept_token_ids: ids in \[.*\] outside the vocabulary \[0, 40\)"):
        kept_token_log_softmax(logits, labels, counts, torch.where(ids == ids[0], V, ids))
    with pytest.raises(ValueError, match="rollout_kept_token_ids: .* the counts add up to"):
        kept_token_log_softmax(logits, labels, counts, ids[:-1])
    with pytest.raises(ValueError, match="one count per label"):
        kept_token_log_softmax(logits, labels, counts[:-1], ids)


NUCLEUS_SETTINGS = [(0, 1.0, 1.0), (5, 1.0, 1.0), (0, 0.9, 1.0), (0, 0.5, 0.7), (8, 0.8, 1.3), (1, 0.3, 1.0),
                    (0, 0.05, 1.0), (3, 0.6, 1.0)]


def _nucleus_data(seed: int = 3):
    """Rows from flat to peaked, with exact ties (a duplicated block of logits), labels drawn across the ranks."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 9, V, generator=g, dtype=torch.float64) * torch.linspace(0.3, 6, 6)[:, None, None]
    logits[0, :, 10:20] = logits[0, :, 0:10]  # ties at every rank
    order = logits.argsort(-1, descending=True)
    labels = order.gather(-1, torch.randint(0, 12, (6, 9, 1), generator=g))[..., 0]
    return logits, labels


@pytest.mark.parametrize("top_k, top_p, t", NUCLEUS_SETTINGS)
def test_label_in_nucleus_is_the_floor_based_membership(top_k, top_p, t):
    """The replay's metric (the sampled token outside the trainer's own nucleus) without a sort equals the
    membership the trainer's nucleus path computes by its floor."""
    logits, labels = _nucleus_data()
    for chunk in (7, 4096):
        got = label_in_nucleus(logits, labels, top_k=top_k, top_p=top_p, temperature=t, chunk_size=chunk)
        want = truncated_token_log_softmax(logits, labels, top_k=top_k, top_p=top_p, temperature=t).in_kept
        assert torch.equal(got, torch.ones_like(got) if want is None else want), (top_k, top_p, t, chunk)
    if top_p < 1.0 or top_k > 0:
        assert not got.all() and got.any()


def _tp_worker(rank: int) -> None:
    for dtype in (torch.float64, torch.float32):
        checking(f"kept sets, {dtype}")
        logits, labels, counts, ids = _data(tokens=30, seed=2, dtype=dtype)
        shard = logits[:, rank * V // 2:(rank + 1) * V // 2].clone().requires_grad_()
        out = kept_token_log_softmax(shard, labels, counts, ids, tp_group=dist.group.WORLD, temperature=0.9)
        coef = torch.linspace(-1, 1, labels.numel(), dtype=out.log_probs.dtype)
        (coef * out.log_probs).sum().backward()
        whole = logits.clone().requires_grad_()
        one = kept_token_log_softmax(whole, labels, counts, ids, temperature=0.9)
        (coef * one.log_probs).sum().backward()
        tol = 1e-13 if dtype == torch.float64 else 2e-6
        torch.testing.assert_close(out.log_probs, one.log_probs, rtol=tol, atol=tol)
        torch.testing.assert_close(shard.grad, whole.grad[:, rank * V // 2:(rank + 1) * V // 2], rtol=tol, atol=tol)
        on = out.kept_on_rank  # this rank's kept ids: the one-process values; the others' −inf
        assert torch.equal(on, (ids >= rank * V // 2) & (ids < (rank + 1) * V // 2))
        torch.testing.assert_close(out.kept_log_probs[on], one.kept_log_probs[on], rtol=tol, atol=tol)
        assert out.kept_log_probs[~on].eq(-torch.inf).all()
        both = [torch.empty_like(out.log_probs) for _ in range(2)]
        dist.all_gather(both, out.log_probs.detach())
        assert torch.equal(both[0], both[1]), "log-probs differ across TP ranks"
    logits, labels = _nucleus_data(seed=4)
    for top_k, top_p, t in NUCLEUS_SETTINGS:
        checking(f"label_in_nucleus top_k={top_k} top_p={top_p} t={t}")
        shard = logits[..., rank * V // 2:(rank + 1) * V // 2]
        got = label_in_nucleus(shard, labels, top_k=top_k, top_p=top_p, temperature=t, chunk_size=7,
                               tp_group=dist.group.WORLD)
        assert torch.equal(got, label_in_nucleus(logits, labels, top_k=top_k, top_p=top_p, temperature=t))


def test_tp2_is_the_same_on_both_ranks_and_equals_one_process():
    spawn_group(_tp_worker, 2)


def _samples() -> list[Sample]:
    """Two samples with kept sets (one response empty) and one without any: prompts of different lengths."""
    out = []
    g = torch.Generator().manual_seed(5)
    for index, (prompt, response) in enumerate([(3, 5), (2, 0), (4, 3)]):
        s = Sample(prompt_tokens=torch.randint(0, V, (prompt,), generator=g).tolist(), index=index)
        tokens = torch.randint(0, V, (response,), generator=g).tolist()
        sets = [sorted({t, *torch.randint(0, V, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()})
                for t in tokens]
        lps = [torch.log_softmax(torch.randn(len(k), generator=g), 0).tolist() for k in sets]
        s.append_segment(tokens, [-1.0] * response, "v0", kept_ids=sets, kept_log_probs=lps)
        out.append(s)
    return out


def test_a_packed_micro_batch_replays_as_the_padded_one():
    samples = _samples()
    padded = build_micro_batch(samples, pad_to_multiple=4)
    packed = build_micro_batch(samples, packed=True, pad_to_multiple=4)
    assert torch.equal(padded[KEPT_IDS_KEY], packed[KEPT_IDS_KEY])
    assert torch.equal(padded[KEPT_LOG_PROBS_KEY], packed[KEPT_LOG_PROBS_KEY])
    g = torch.Generator().manual_seed(7)
    per_sample = [torch.randn(s.total_length, V, generator=g, dtype=torch.float64) for s in samples]
    width = padded["labels"].shape[1]
    pad_logits = torch.stack([torch.cat([x, torch.randn(width - x.shape[0], V, dtype=torch.float64)])
                              for x in per_sample]).requires_grad_()
    starts = packed["cu_seqlens_padded"].tolist()
    pack_rows = torch.randn(starts[-1], V, dtype=torch.float64)
    for s, x, a in zip(samples, per_sample, starts, strict=False):
        pack_rows[a: a + s.total_length] = x
    pack_logits = pack_rows[None].clone().requires_grad_()
    a = replayed_log_probs(pad_logits, padded, temperature=0.8)
    b = replayed_log_probs(pack_logits, packed, temperature=0.8)
    for i, (s, start) in enumerate(zip(samples, starts, strict=False)):
        n = s.total_length
        assert torch.equal(a.nucleus.log_probs[i, :n], b.nucleus.log_probs[0, start:start + n])
        assert torch.equal(a.abs_diff_sum[i, :n], b.abs_diff_sum[0, start:start + n])
    trained = padded["loss_mask"] > 0
    assert torch.equal(padded[KEPT_COUNTS_KEY] > 0, trained)  # every trained token has its set, nothing else
    (a.nucleus.log_probs * padded["loss_mask"]).sum().backward()
    (b.nucleus.log_probs * packed["loss_mask"]).sum().backward()
    for i, (s, start) in enumerate(zip(samples, starts, strict=False)):
        assert torch.equal(pad_logits.grad[i, :s.total_length], pack_logits.grad[0, start:start + s.total_length])
    assert a.compared.sum() == sum(s.rollout_top_p_token_ids.numel() for s in samples)
