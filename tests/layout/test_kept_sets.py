"""The engine's kept sets in the sequence layout (`slime_corr.layout.kept_sets`): on a Sample (ragged, slime's names,
segments with and without them, the checks naming the field), in padded and packed micro-batches (the counts in the
labels' alignment, the ids in row-major order), in every CP rank's zig-zag / THD slice (each rank keeps exactly the
ids of its positions), and slime's per-sample batch keys turned into the same key pair."""

from __future__ import annotations

import pytest
import torch

from slime_corr.layout.context_parallel import slice_micro_batch_for_cp
from slime_corr.layout.kept_sets import (
    KEPT_COUNTS_KEY,
    KEPT_IDS_KEY,
    KEPT_LOG_PROBS_KEY,
    SLIME_IDS_KEY,
    SLIME_LOG_PROBS_KEY,
    SLIME_OFFSETS_KEY,
    from_slime_samples,
)
from slime_corr.layout.micro_batch import (
    build_micro_batch,
    cp_pad_multiple,
    empty_micro_batch,
    mask_not_trained,
)
from slime_corr.samples import Sample, SampleStatus, SampleValidationError

V = 50


def _sample(prompt: list[int], tokens: list[int], sizes: list[int], index: int = 0, seed: int = 0) -> Sample:
    """A finished sample whose token i has a kept set of sizes[i] ids (its token among them), the support log-probs
    of each id (`-id / 100`, recognisable)."""
    g = torch.Generator().manual_seed(seed + index)
    sets = []
    for tok, size in zip(tokens, sizes, strict=True):
        others = [v for v in torch.randperm(V, generator=g).tolist() if v != tok][: size - 1]
        sets.append([*others, tok] if size else [])
    s = Sample(prompt_tokens=prompt, index=index)
    s.append_segment(tokens, [-0.5] * len(tokens), "v0", kept_ids=sets, kept_log_probs=[[-v / 100 for v in k]
                                                                                        for k in sets])
    s.status = SampleStatus.COMPLETED
    return s


def _samples() -> list[Sample]:
    return [_sample([1, 2, 3], [4, 5, 6, 7], [1, 3, 2, 5], 0), _sample([8], [9, 10], [4, 1], 1),
            _sample([11, 12], [13, 14, 15, 16, 17], [2, 2, 6, 1, 3], 2)]


def _sets_at(batch: dict, positions: list[tuple[int, int]]) -> list[list[int]]:
    """The kept ids of each (row, col) of a whole micro-batch, read by walking the counts in row-major order."""
    counts = batch[KEPT_COUNTS_KEY]
    flat = counts.reshape(-1).tolist()
    starts = [sum(flat[:i]) for i in range(len(flat))]
    ids = batch[KEPT_IDS_KEY].tolist()
    width = counts.shape[-1]
    return [ids[starts[r * width + c]: starts[r * width + c] + flat[r * width + c]] for r, c in positions]


def test_sample_fields_are_ragged_with_slimes_meaning():
    s = _sample([1, 2], [3, 4, 5], [2, 1, 3])
    assert s.rollout_top_p_token_offsets.tolist() == [0, 2, 3, 6] and s.rollout_top_p_token_ids.dtype == torch.int32
    for i, tok in enumerate(s.response_tokens):
        o = s.rollout_top_p_token_offsets
        assert tok in s.rollout_top_p_token_ids[o[i]:o[i + 1]].tolist()
    s.append_segment([20, 21], [0.0, 0.0], None, trained=False)  # a tool's tokens: no kept sets
    assert s.rollout_top_p_token_offsets.tolist() == [0, 2, 3, 6, 6, 6]
    assert s.rollout_top_p_log_probs.numel() == 6
    s.append_segment([7], [-1.0], "v1", kept_ids=[[7, 9]])  # a later segment without support log-probs: NaN
    assert s.rollout_top_p_token_offsets.tolist()[-1] == 8 and s.rollout_top_p_log_probs[-2:].isnan().all()


@pytest.mark.parametrize(("change", "field"), [
    (lambda s: setattr(s, "rollout_top_p_token_offsets", torch.tensor([0, 2, 3], dtype=torch.int32)),
     "rollout_top_p_token_offsets: 3 offsets for 3 response tokens"),
    (lambda s: setattr(s, "rollout_top_p_token_offsets", torch.tensor([0, 3, 2, 6], dtype=torch.int32)),
     "rollout_top_p_token_offsets: must rise"),
    (lambda s: setattr(s, "rollout_top_p_token_ids", s.rollout_top_p_token_ids.long()),
     "rollout_top_p_token_ids: expected a 1-D int32"),
    (lambda s: setattr(s, "response_tokens", [3, 4, 49]), "rollout_top_p_token_ids: response token 2 "),
    (lambda s: setattr(s, "rollout_top_p_log_probs", torch.zeros(5)), "rollout_top_p_log_probs: expected float32"),
    (lambda s: setattr(s, "rollout_top_p_token_offsets", None), "give both or neither"),
])
def test_bad_kept_sets_on_a_sample_are_refused_by_name(change, field):
    s = _sample([1, 2], [3, 4, 5], [2, 1, 3])
    change(s)
    with pytest.raises(SampleValidationError, match=field):
        s.validate()


@pytest.mark.parametrize("packed", [False, True])
def test_micro_batch_carries_counts_in_label_alignment_and_ids_in_row_major_order(packed):
    samples = _samples()
    batch = build_micro_batch(samples, packed=packed, pad_to_multiple=4)
    counts = batch[KEPT_COUNTS_KEY]
    assert counts.dtype == torch.int32 and counts.shape == batch["labels"].shape
    assert batch[KEPT_IDS_KEY].dtype == torch.int32 and batch[KEPT_LOG_PROBS_KEY].dtype == torch.float32
    assert int(counts.sum()) == batch[KEPT_IDS_KEY].numel() == sum(s.rollout_top_p_token_ids.numel() for s in samples)
    starts = batch["cu_seqlens_padded"].tolist() if packed else None
    for i, s in enumerate(samples):
        row, first = (0, starts[i] + len(s.prompt_tokens) - 1) if packed else (i, len(s.prompt_tokens) - 1)
        positions = [(row, first + j) for j in range(s.response_length)]
        o = s.rollout_top_p_token_offsets.tolist()
        assert _sets_at(batch, positions) == [s.rollout_top_p_token_ids[o[j]:o[j + 1]].tolist()
                                              for j in range(s.response_length)]
        assert [int(batch["labels"][r, c]) for r, c in positions] == s.response_tokens
    assert torch.equal(counts > 0, batch["loss_mask"] > 0)
    # the engine's log-probs travel with the ids
    assert torch.equal(batch[KEPT_LOG_PROBS_KEY], -batch[KEPT_IDS_KEY].float() / 100)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("cp", [2, 3])
def test_each_cp_rank_keeps_the_kept_ids_of_its_positions(packed, cp):
    samples = _samples()
    whole = build_micro_batch(samples, packed=packed, pad_to_multiple=cp_pad_multiple(cp))
    width = whole[KEPT_COUNTS_KEY].shape[-1]
    flat_positions = torch.arange(whole[KEPT_COUNTS_KEY].numel()).reshape(whole[KEPT_COUNTS_KEY].shape)
    seen = []
    for rank in range(cp):
        local = slice_micro_batch_for_cp({**whole, "where": flat_positions}, rank, cp,
                                         keys=("labels", KEPT_COUNTS_KEY, "where"))
        where = local["where"].reshape(-1).tolist()
        expected = [i for sets in _sets_at(whole, [(p // width, p % width) for p in where]) for i in sets]
        assert local[KEPT_IDS_KEY].tolist() == expected
        assert local[KEPT_LOG_PROBS_KEY].tolist() == pytest.approx([-i / 100 for i in expected])
        assert int(local[KEPT_COUNTS_KEY].sum()) == local[KEPT_IDS_KEY].numel()
        seen += expected
    assert sorted(seen) == sorted(whole[KEPT_IDS_KEY].tolist())


def test_a_trained_token_without_a_kept_set_is_refused():
    a, b = _samples()[:2]
    bare = Sample(prompt_tokens=[1], response_tokens=[2, 3], rollout_log_probs=[-1.0, -1.0], index=7,
                  status=SampleStatus.COMPLETED)
    with pytest.raises(ValueError, match="rollout_top_p_token_offsets: sample 7's response token 0 is trained but"):
        build_micro_batch([a, bare])
    bare.status = SampleStatus.FAILED  # not trained: fine, masked out
    bare.failure_reason = "test"
    batch = mask_not_trained(build_micro_batch([a, b, bare]), [a, b, bare])
    assert batch[KEPT_COUNTS_KEY][2].eq(0).all()
    empty = empty_micro_batch(2)  # no sample with kept sets: no keys, unless asked for
    assert KEPT_IDS_KEY not in empty


def test_an_empty_micro_batch_can_carry_the_keys():
    from slime_corr.layout.micro_batch import padding_sample

    batch = build_micro_batch([padding_sample()], kept_sets=True)
    assert batch[KEPT_COUNTS_KEY].eq(0).all() and batch[KEPT_IDS_KEY].numel() == 0


@pytest.mark.parametrize("packed", [False, True])
def test_slimes_per_sample_keys_become_the_same_key_pair(packed):
    samples = _samples()
    ours = build_micro_batch(samples, packed=packed, pad_to_multiple=2)
    theirs = {k: v for k, v in ours.items() if k not in (KEPT_COUNTS_KEY, KEPT_IDS_KEY, KEPT_LOG_PROBS_KEY)}
    theirs[SLIME_IDS_KEY] = [s.rollout_top_p_token_ids.tolist() for s in samples]  # lists or tensors: both taken
    theirs[SLIME_OFFSETS_KEY] = [s.rollout_top_p_token_offsets for s in samples]
    theirs[SLIME_LOG_PROBS_KEY] = [s.rollout_top_p_log_probs for s in samples]
    theirs["total_lengths"] = [s.total_length for s in samples]
    theirs["response_lengths"] = [s.response_length for s in samples]
    converted = from_slime_samples(theirs)
    assert SLIME_IDS_KEY not in converted
    for key in (KEPT_COUNTS_KEY, KEPT_IDS_KEY, KEPT_LOG_PROBS_KEY):
        assert torch.equal(converted[key], ours[key]), key
    bad = dict(theirs, **{SLIME_OFFSETS_KEY: [o[:-1] for o in theirs[SLIME_OFFSETS_KEY]]})
    with pytest.raises(ValueError, match=r"rollout_top_p_token_offsets\[0\]: 4 offsets for a response of 4 tokens"):
        from_slime_samples(bad)
    with pytest.raises(ValueError, match="response_lengths: missing"):
        from_slime_samples({k: v for k, v in theirs.items() if k != "response_lengths"})
