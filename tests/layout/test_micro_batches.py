"""Micro-batch contract, GRPO advantages, CP zig-zag, DP balance, TP broadcast (gloo, 2 processes)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_corr.layout.context_parallel import slice_micro_batch_for_cp, thd_local_offsets, zigzag_slice
from slime_corr.layout.groups import (
    balance_across_dp,
    grpo_advantages,
    micro_batch_iterator,
    pack_by_tokens,
    split_for_dp,
)
from slime_corr.layout.micro_batch import (
    BATCH_KEYS,
    broadcast_micro_batch,
    build_micro_batch,
    cp_pad_multiple,
    empty_micro_batch,
)
from slime_corr.ports import agent_store_environment, host_store
from slime_corr.samples import Sample


def _s(prompt, resp, mask=None, reward=None, group=0, index=0):
    lps = [-0.1 * (i + 1) for i in range(len(resp))]
    return Sample(prompt_tokens=prompt, response_tokens=resp, rollout_log_probs=lps, loss_mask=mask,
                  reward=reward, group_id=group, index=index)


def test_micro_batch_alignment_and_padding():
    a = _s([1, 2, 3], [4, 5], mask=[1, 0])
    b = _s([6], [7, 8, 9])
    mb = build_micro_batch([a, b], [2.0, -1.0], pad_to_multiple=4, pad_token_id=0)
    assert set(BATCH_KEYS) <= set(mb) and mb["tokens"].shape == (2, 8)
    assert mb["tokens"].dtype == torch.int64 and mb["labels"].dtype == torch.int64
    for k in ("loss_mask", "rollout_log_probs", "advantages"):
        assert mb[k].dtype == torch.float32
    assert mb["tokens"][0].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert mb["labels"][0].tolist() == [2, 3, 4, 5, 0, 0, 0, 0]
    # position t predicts labels[t] = tokens[t+1]: response token 4 is predicted at t=2
    assert mb["loss_mask"][0].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    assert mb["rollout_log_probs"][0].tolist() == pytest.approx([0, 0, -0.1, 0, 0, 0, 0, 0])
    assert mb["advantages"][0].tolist() == [0, 0, 2.0, 0, 0, 0, 0, 0]
    assert mb["loss_mask"][1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert mb["rollout_log_probs"][1, :3].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert mb["labels"][1, :3].tolist() == [7, 8, 9]
    assert mb["position_ids"][1].tolist() == list(range(8))
    # an independent check: every trained position's label is a response token with its own log-prob
    for row, s in enumerate([a, b]):
        pos = mb["loss_mask"][row].nonzero().flatten().tolist()
        trained = [i for i, m in enumerate(s.loss_mask) if m]
        assert [int(mb["labels"][row, t]) for t in pos] == [s.response_tokens[i] for i in trained]


def test_packed_batch():
    a, b = _s([1, 2], [3]), _s([4], [5, 6])
    mb = build_micro_batch([a, b], packed=True, pad_to_multiple=4)
    assert mb["tokens"].tolist() == [[1, 2, 3, 0, 4, 5, 6, 0]]  # each sample padded to a multiple of 4
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert mb["labels"].tolist() == [[2, 3, 0, 0, 5, 6, 0, 0]]  # never across a sample boundary
    assert mb["loss_mask"].tolist() == [[0, 1, 0, 0, 1, 1, 0, 0]]
    assert mb["cu_seqlens"].tolist() == [0, 3, 6] and mb["cu_seqlens"].dtype == torch.int32
    assert mb["cu_seqlens_padded"].tolist() == [0, 4, 8] and mb["cu_seqlens_padded"].dtype == torch.int32
    plain = build_micro_batch([a, b], packed=True)
    assert plain["tokens"].tolist() == [[1, 2, 3, 4, 5, 6]] and plain["cu_seqlens_padded"].tolist() == [0, 3, 6]


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6), cp=st.integers(2, 4))
def test_thd_partition_follows_megatron_per_sample_chunks(lengths, cp):
    """Each CP rank holds, sample after sample, chunks r and 2·CP−1−r of the sample's padded span (Transformer
    Engine's thd_get_partitioned_indices); the ranks together hold every position once; sample i starts at
    cu_seqlens_padded[i] / CP locally. The per-sample comparison with Megatron's own zig-zag slicing is in
    tests/mcore/test_mcore_units.py."""
    samples = [_s([7] * n, [8], index=i) for i, n in enumerate(lengths)]
    mb = build_micro_batch(samples, [1.0] * len(samples), packed=True, pad_to_multiple=cp_pad_multiple(cp))
    cu = mb["cu_seqlens_padded"].tolist()
    assert all((b - a) % (2 * cp) == 0 and b - a >= n + 1
               for a, b, n in zip(cu, cu[1:], lengths, strict=False))
    positions = torch.arange(cu[-1]).unsqueeze(0)
    held = []
    for r in range(cp):
        local = slice_micro_batch_for_cp({**mb, "positions": positions}, r, cp, keys=("positions",))
        idx = local["positions"][0].tolist()
        want = []
        for a, b in zip(cu, cu[1:], strict=False):
            c = (b - a) // (2 * cp)
            want += list(range(a + r * c, a + (r + 1) * c)) + list(range(a + (2 * cp - 1 - r) * c, a + (2 * cp - r) * c))
        assert idx == want
        assert thd_local_offsets(mb["cu_seqlens_padded"], cp).tolist() == [x // cp for x in cu]
        assert local["cu_seqlens"] is mb["cu_seqlens"]  # the metadata describe the full row
        held += idx
    assert sorted(held) == list(range(cu[-1]))


def test_thd_partition_rejects_unpadded_samples():
    mb = build_micro_batch([_s([1, 2], [3]), _s([4], [5, 6])], packed=True)
    with pytest.raises(ValueError, match=r"padded length must be a multiple of 2\*cp_size=4.*pad_to_multiple"):
        slice_micro_batch_for_cp(mb, 0, 2)


def test_empty_micro_batch_trains_nothing():
    mb = empty_micro_batch(cp_size=2, pad_token_id=5)
    assert mb["tokens"].shape == (1, 4) and mb["loss_mask"].sum() == 0 and mb["cu_seqlens_padded"].tolist() == [0, 4]
    assert slice_micro_batch_for_cp(mb, 1, 2)["tokens"].shape == (1, 2)


def test_grpo_advantages_against_numpy_reference():
    import numpy as np

    rewards = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5], [3.0]]
    samples = [_s([1], [2], reward=r, group=g) for g, rs in enumerate(rewards) for r in rs]
    adv = grpo_advantages(samples, eps=1e-6)
    ref = []
    for rs in rewards:
        r = np.array(rs)
        std = r.std(ddof=1) if len(r) > 1 else 0.0
        ref += list((r - r.mean()) / (std + 1e-6))
    assert adv == pytest.approx(ref)
    assert grpo_advantages(samples, normalize_std=False)[:4] == pytest.approx([0.5, -0.5, -0.5, 0.5])
    with pytest.raises(ValueError, match="reward"):
        grpo_advantages([_s([1], [2])])


@settings(max_examples=30, deadline=None)
@given(cp=st.integers(1, 4), chunk=st.integers(1, 3), b=st.integers(1, 2), dim=st.sampled_from([0, 1, 2]))
def test_zigzag_slices_partition_the_sequence(cp, chunk, b, dim):
    n = 2 * cp * chunk
    shape = [b, 3, 2]
    shape[dim] = n
    x = torch.arange(torch.Size(shape).numel()).reshape(shape)
    parts = [zigzag_slice(x, r, cp, dim=dim) for r in range(cp)]
    # reference: rank r owns chunks r and 2cp-1-r
    chunks = x.split(chunk, dim=dim)
    for r, p in enumerate(parts):
        assert torch.equal(p, torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=dim))
    # together they cover every position exactly once
    idx = torch.cat([zigzag_slice(torch.arange(n), r, cp, dim=0) for r in range(cp)])
    assert sorted(idx.tolist()) == list(range(n))
    if cp > 1:
        with pytest.raises(ValueError):
            zigzag_slice(torch.zeros(1, n + 1), 0, cp)


def test_cp_iterator_keeps_positions():
    samples = [_s([1, 2, 3], [4, 5, 6, 7]), _s([8], [9])]
    full = next(micro_batch_iterator(samples, 2, [1.0, 2.0], cp_size=2, cp_rank=0))
    other = next(micro_batch_iterator(samples, 2, [1.0, 2.0], cp_size=2, cp_rank=1))
    assert full["tokens"].shape == (2, 4) and other["tokens"].shape == (2, 4)
    assert full["position_ids"][0].tolist() == [0, 1, 6, 7] and other["position_ids"][0].tolist() == [2, 3, 4, 5]
    assert full["loss_mask"].sum() + other["loss_mask"].sum() == 5


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 500), min_size=1, max_size=40), dp=st.integers(1, 5))
def test_dp_balance_assigns_each_sample_once(lengths, dp):
    n = len(lengths) - len(lengths) % dp
    lengths = lengths[:n]
    if not lengths:
        return
    parts = balance_across_dp(lengths, dp)
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(n))
    assert len({len(p) for p in parts}) == 1
    loads = [sum(lengths[i] for i in p) for p in parts]
    # greedy longest-first bound: spread no larger than the longest item
    assert max(loads) - min(loads) <= max(lengths)
    free = balance_across_dp(lengths, dp, equal_count=False)
    assert sorted(i for p in free for i in p) == list(range(n))


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), max_size=40), budget=st.integers(1, 400))
def test_token_packing_keeps_items_whole_within_the_budget_first_fit(sizes, budget):
    bins = pack_by_tokens(sizes, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))  # every item once, whole
    loads = [sum(sizes[i] for i in b) for b in bins]
    for b, load in zip(bins, loads, strict=True):
        assert b == sorted(b) and (load <= budget or len(b) == 1)  # over the budget: an item alone
    assert [b[0] for b in bins] == sorted(b[0] for b in bins)
    # first fit: no two micro-batches could have been one (so at most twice the fewest possible)
    assert all(loads[i] + loads[j] > budget for i in range(len(bins)) for j in range(i + 1, len(bins)))


def test_token_packing_fills_the_fullest_fit_first():
    assert pack_by_tokens([5, 7, 3, 5], 10) == [[0, 3], [1, 2]]  # first fit decreasing: 7+3, 5+5
    assert pack_by_tokens([12, 3], 10) == [[0], [1]]  # an item over the budget on its own
    assert pack_by_tokens([], 10) == []
    with pytest.raises(ValueError, match="budget=0"):
        pack_by_tokens([1], 0)


def test_split_for_dp_balances_tokens():
    samples = [_s([1] * n, [2]) for n in (50, 40, 30, 20, 10, 5, 5, 4)]
    shares = [split_for_dp(samples, r, 2) for r in range(2)]
    tokens = [sum(s.total_length for s in sh) for sh in shares]
    assert abs(tokens[0] - tokens[1]) <= 10 and sum(len(s) for s in shares) == 8


def _tp_batch(src: int) -> dict:
    """A different micro-batch per TP group (told apart by its source rank)."""
    return build_micro_batch([_s([1, 2 + src], [3, 4]), _s([5], [6 + src])], [1.0, -1.0 - src], packed=src == 1)


def _bcast_worker(rank: int, world: int, store_env: dict[str, str], q) -> None:
    os.environ.update(store_env)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # two TP groups, {0} and {1, 2}; the source of each is its first GLOBAL rank (1 for the second group)
        groups = [dist.new_group([0]), dist.new_group([1, 2])]
        src, group = (0, groups[0]) if rank == 0 else (1, groups[1])
        out = broadcast_micro_batch(_tp_batch(src) if rank == src else None, src=src, group=group)
        q.put((rank, {k: v.tolist() for k, v in out.items()}, {k: str(v.dtype) for k, v in out.items()}))
        q.put((rank, _dp_materialize(rank), None))
    finally:
        dist.destroy_process_group()


def _dp_materialize(rank: int) -> tuple[list[int], int]:
    """Three DP ranks with a token budget: rank r's 3 groups (all of one length) fill r + 1 micro-batches; after
    `materialize` over the DP group every rank runs 3 (the most any has), its own extra ones empty."""
    import asyncio

    from slime_corr.rollout.buffer import SampleBuffer
    from slime_corr.rollout.data_iterator import BufferMicroBatchIterator, background_event_loop

    n = (5, 9, 14)[rank]  # 3 groups of 2 samples of 1 + n tokens: 12, 20 or 30 per group -> 3, 2, 1 per micro-batch
    groups = [[_s([1], [2] * n, reward=float(i), group=g, index=2 * g + i) for i in range(2)] for g in range(3)]
    dp = dist.new_group([0, 1, 2])
    with background_event_loop() as loop:
        buffer = SampleBuffer(maxsize=6)

        async def put_all():
            for g in groups:
                await buffer.put_group(g)

        asyncio.run_coroutine_threadsafe(put_all(), loop).result(timeout=10)
        it = BufferMicroBatchIterator(buffer, loop, 6, 6, group_size=2, max_tokens_per_micro_batch=40, timeout=10)
        batches = it.materialize(dp_group=dp)
    return it.batch_sizes, len(batches)


def test_tp_broadcast_with_gloo():
    store = host_store(world_size=3)  # the ranks' store, hosted here as torchrun's agent hosts it
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_bcast_worker, args=(r, 3, agent_store_environment(store), q)) for r in range(3)]
    for p in procs:
        p.start()
    results, materialized = {}, {}
    for rank, v, d in (q.get(timeout=120) for _ in range(2 * len(procs))):
        if d is None:
            materialized[rank] = v
        else:
            results[rank] = (v, d)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rank, src in ((0, 0), (1, 1), (2, 1)):  # rank 2 passed None and got its group's batch (packed too)
        expect = _tp_batch(src)
        vals, dtypes = results[rank]
        assert vals == {k: v.tolist() for k, v in expect.items()}
        assert dtypes == {k: str(v.dtype) for k, v in expect.items()}
    assert results[2][0] != results[0][0]
    # token budget: every DP rank keeps 3 micro-batches, the most real ones any rank has
    assert materialized == {0: ([6, 0, 0], 3), 1: ([4, 2, 0], 3), 2: ([2, 2, 2], 3)}
