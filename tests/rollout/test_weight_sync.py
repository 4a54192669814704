"""Weight sync over a process group (gloo on CPU) against the embedded engines: bitwise what the disk path gives.

Two engines behind one client: fp32 (its weights must equal the trainer's exactly) and bf16 (the trainer's cast
to bf16, exactly as loading the same checkpoint from disk casts it).
"""

from __future__ import annotations

import asyncio
import errno
import socket
import threading

import pytest
import torch
import torch.distributed as dist

from slime_corr import ports
from slime_corr.engines.embedded.engine import start_local_engine
from slime_corr.engines.embedded.model import load_tiny_lm, save_checkpoint, teacher_forced_logprobs
from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.control import ControlError
from slime_corr.rollout.weight_calls import WeightCalls
from slime_corr.rollout.weight_group import (
    FLATTENED_BUCKET,
    WeightUpdateGroup,
    bucket_layout,
    make_buckets,
)
from slime_corr.rollout.weight_sync import DistributedWeightSync

PROMPT = [72, 101, 108, 108, 111, 32]


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    with start_local_engine(tiny_ckpt, dtype=torch.float32, group_timeout=60) as fp32, \
            start_local_engine(tiny_ckpt, dtype=torch.bfloat16, group_timeout=60) as bf16:
        yield fp32, bf16


@pytest.fixture
def trainer(tiny_ckpt_v1):
    """fp32 trainer weights that are in no checkpoint: v1 plus noise."""
    model = load_tiny_lm(tiny_ckpt_v1)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
    return model


def weights(handle) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in handle.engine.model.named_weights()}


@pytest.mark.parametrize("load_format", [FLATTENED_BUCKET, None], ids=["flattened", "per-tensor"])
def test_distributed_sync_equals_the_disk_path_bitwise(engines, trainer, tiny_ckpt, tmp_path, load_format):
    fp32, bf16 = engines
    urls = [fp32.url, bf16.url]

    async def go():
        async with SGLangClient(urls) as c:
            await c.sync_weights_from_disk(save_checkpoint(trainer, str(tmp_path / "trainer")), "disk")
            by_disk = [weights(h) for h in engines]
            await c.sync_weights_from_disk(tiny_ckpt, "v0")
            before = [weights(h) for h in engines]
            sync = DistributedWeightSync(c, bucket_bytes=32 * 1024, load_format=load_format, timeout=60)
            try:
                report = await sync.sync(trainer.state_dict().items(), "dist")
                return by_disk, before, [weights(h) for h in engines], report, await c.weight_versions()
            finally:
                sync.close()

    by_disk, before, by_group, report, versions = asyncio.run(go())
    assert report.buckets > 2 and sorted(report.workers) == sorted(urls) and versions == dict.fromkeys(urls, "dist")
    state = trainer.state_dict()
    for disk, group, old, dtype in zip(by_disk, by_group, before, (torch.float32, torch.bfloat16), strict=True):
        assert disk.keys() == group.keys() == state.keys()
        for k in state:
            assert group[k].dtype == dtype and torch.equal(group[k], disk[k]), k  # bitwise the disk path
            assert torch.equal(group[k], state[k].to(dtype)), k  # = the trainer's weights (cast like disk)
        assert any(not torch.equal(group[k], old[k]) for k in state)  # and they really changed


def test_engine_generates_with_the_weights_it_received(engines, trainer):
    fp32, _ = engines

    async def go():
        async with SGLangClient(fp32.url) as c:
            sync = DistributedWeightSync(c, bucket_bytes=1 << 20, timeout=60)
            try:
                await sync.sync(trainer.state_dict().items(), "gen")
            finally:
                sync.close()
            return await c.generate(PROMPT, {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0.8})

    res = asyncio.run(go())
    ref = teacher_forced_logprobs(trainer, PROMPT, res.output_ids, temperature=0.8)
    torch.testing.assert_close(torch.tensor(res.log_probs), ref, atol=1e-4, rtol=0)
    assert res.weight_version == "gen"


def test_the_group_port_is_bound_before_the_engines_are_told_it(engines, trainer, monkeypatch):
    """A port picked free and bound later can be taken in between (EADDRINUSE). The trainer's store binds port 0
    first: when the engines are told the port, another process binding it fails, and no port is picked at all."""
    fp32, _ = engines
    told: list[tuple[int, str]] = []
    tell = WeightCalls.init_weights_update_group

    async def init_group(self, master_address, master_port, *args, **kwargs):
        with socket.socket() as other:  # another process trying to take the port now
            try:
                other.bind((master_address, master_port))
                told.append((master_port, "free"))
            except OSError as e:
                told.append((master_port, errno.errorcode.get(e.errno, str(e.errno))))
        return await tell(self, master_address, master_port, *args, **kwargs)

    def no_port(*args):
        raise AssertionError("the weight sync picked a port to bind later")

    monkeypatch.setattr(WeightCalls, "init_weights_update_group", init_group)
    monkeypatch.setattr(ports, "free_port", no_port)

    async def go():
        async with SGLangClient(fp32.url) as c:
            sync = DistributedWeightSync(c, timeout=60)
            try:
                await sync.sync(trainer.state_dict().items(), "held")
            finally:
                sync.close()
            return await c.weight_versions()

    assert asyncio.run(go()) == {fp32.url: "held"}
    assert len(told) == 1 and told[0][1] == "EADDRINUSE", told


def test_a_refused_bucket_is_an_error_and_the_next_sync_works(engines, trainer, tiny_ckpt):
    """An unknown weight: both engines take part in the broadcast, refuse it, keep their weights; the caller
    gets the engines' reasons; the client is not left paused; a later sync rebuilds the group and succeeds."""
    urls = [h.url for h in engines]

    async def go():
        async with SGLangClient(urls) as c:
            await c.sync_weights_from_disk(tiny_ckpt, "v0")
            before = [weights(h) for h in engines]
            sync = DistributedWeightSync(c, timeout=60)
            try:
                bad = [*trainer.state_dict().items(), ("head.bogus", torch.zeros(3))]
                with pytest.raises(ControlError, match="head.bogus") as ei:
                    await sync.sync(bad, "bad")
                after_bad = [weights(h) for h in engines], c.paused, [h.engine.paused for h in engines]
                await sync.sync(trainer.state_dict().items(), "good")
                return before, after_bad, ei.value, await c.weight_versions()
            finally:
                sync.close()

    before, (after_bad, client_paused, paused), err, versions = asyncio.run(go())
    assert sorted(err.failures) == sorted(urls)  # each engine's own refusal
    assert all(torch.equal(a[k], b[k]) for a, b in zip(after_bad, before, strict=True) for k in a)
    assert not client_paused and paused == [False, False] and versions == dict.fromkeys(urls, "good")


def test_jobs_one_after_another_each_build_their_own_group_on_the_same_engines(engines, trainer):
    """An engine outlives the jobs that sync to it (`--sglang-url`) and, like SGLang, refuses a group name it
    holds: a job that left (`disconnect`) leaves the engines without its group, and one that did not (a crash:
    only its own side closed) does not stop the next job, whose group has a name of its own."""
    urls = [h.url for h in engines]
    held = [h.engine.control.groups for h in engines]
    earlier = [set(g) for g in held]  # the groups this module's earlier tests left (they only close their side)

    def new_groups() -> list[list[str]]:
        return [sorted(set(g) - e) for g, e in zip(held, earlier, strict=True)]

    async def go():
        async with SGLangClient(urls) as c:
            first = DistributedWeightSync(c, timeout=60)
            await first.sync(trainer.state_dict().items(), "job-1")
            during = new_groups()
            await first.disconnect()
            left = new_groups()
            crashed = DistributedWeightSync(c, timeout=60)
            await crashed.sync(trainer.state_dict().items(), "job-2")
            crashed.close()  # no disconnect: its group stays on the engines
            last = DistributedWeightSync(c, timeout=60)
            try:
                await last.sync(trainer.state_dict().items(), "job-3")
                return during, left, new_groups(), first.name, crashed.name, last.name, await c.weight_versions()
            finally:
                await last.disconnect()

    during, left, after, first_name, crashed_name, last_name, versions = asyncio.run(go())
    assert during == [[first_name]] * 2 and left == [[], []]
    assert crashed_name != last_name and after == [sorted([crashed_name, last_name])] * 2
    assert versions == dict.fromkeys(urls, "job-3")
    for g in held:  # the crashed job's group, left behind
        g.pop(crashed_name).close()


def test_engine_refusals_name_the_problem(engines):
    fp32, _ = engines

    async def go():
        async with SGLangClient(fp32.url) as c:
            errors = []
            weights = c.weights
            for call in (lambda: weights.init_weights_update_group("127.0.0.1", ports.free_port(), 1, 2,
                                                                   backend="nccl"),
                         lambda: weights.end_weight_update(),
                         lambda: weights.update_weights_from_distributed(["w"], ["float32"], [[1]], group_name="none")):
                with pytest.raises(ControlError) as ei:
                    await call()
                errors.append(str(ei.value))
            await weights.begin_weight_update()
            with pytest.raises(ControlError) as ei:
                await weights.begin_weight_update()
            errors.append(str(ei.value))
            await weights.end_weight_update()
            return errors

    nccl, end, no_group, twice = asyncio.run(go())
    assert "'nccl' needs CUDA" in nccl and "use backend='gloo'" in nccl
    assert "no weight-update session is open" in end
    assert "Group none not in" in no_group and "init_weights_update_group" in no_group
    assert "already open" in twice


def test_buckets_are_bounded_and_aligned():
    named = [("a", torch.zeros(10, dtype=torch.bfloat16)), ("b", torch.zeros(3)), ("c", torch.zeros(100)),
             ("d", torch.zeros(1, dtype=torch.uint8)), ("e", torch.zeros(2, dtype=torch.float64))]
    buckets = make_buckets(named, bucket_bytes=64)
    assert [b.names for b in buckets] == [["b", "a"], ["c"], ["e", "d"]]  # larger elements first in a bucket
    assert [b.nbytes for b in buckets] == [32, 400, 17]
    for b in buckets:
        bucket_layout([t.dtype for t in b.tensors], b.shapes)  # aligned: does not raise
    with pytest.raises(ValueError, match="misaligned"):
        bucket_layout([torch.bfloat16, torch.float32], [[1], [1]])
    with pytest.raises(ValueError, match="bucket_bytes"):
        make_buckets(named, 0)


def test_group_layout_matches_torchs_own_custom_group():
    """Our member joins a group built the way SGLang's ``init_custom_process_group`` builds it (torch's
    rendezvous + ``_new_process_group_helper``): the store keys agree, the broadcast arrives."""
    from torch.distributed import distributed_c10d as c10d

    store, got, errors = ports.host_store(world_size=2), {}, []
    port = store.port

    def sglang_side() -> None:
        try:
            store, rank, world = next(c10d.rendezvous(f"tcp://127.0.0.1:{port}", 1, 2))
            store = dist.PrefixStore("g", store)
            pg, _ = c10d._new_process_group_helper(2, 1, [], "gloo", store, group_name="g",
                                                   timeout=c10d.default_pg_timeout)
            t = torch.zeros(4)
            c10d._world.pg_group_ranks[pg] = {0: 0, 1: 1}
            dist.broadcast(t, src=0, group=pg)
            got["t"] = t
            dist.destroy_process_group(pg)
        except Exception as e:  # noqa: BLE001 - reported in the main thread
            errors.append(e)

    try:
        th = threading.Thread(target=sglang_side)
        th.start()
        ours = WeightUpdateGroup("127.0.0.1", port, 0, 2, "g", "gloo", timeout=30, store=store)
        ours.broadcast(torch.arange(4.0))
        th.join(30)
        ours.close()
    except TypeError as e:  # a torch whose private helper changed its signature
        pytest.skip(f"torch's _new_process_group_helper changed: {e}")
    if errors and isinstance(errors[0], TypeError):
        pytest.skip(f"torch's _new_process_group_helper changed: {errors[0]}")
    assert not errors, errors
    assert torch.equal(got["t"], torch.arange(4.0))
