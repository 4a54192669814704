"""Weight-sync calls that could never succeed against a real SGLang server fail at once with the reason
(SGLANG_ON_CPU.md): an `in_place` pause (SGLang refuses /flush_cache under it), a weights folder that does not exist
(SGLang takes the path for a Hub name). Neither reaches the server: the URL below has none."""

from __future__ import annotations

import asyncio

import pytest
import torch

from slime_corr.rollout.client import SGLangClient
from slime_corr.rollout.weight_sync import DistributedWeightSync

NO_SERVER = "http://127.0.0.1:9"  # discard port: nothing listens


def test_disk_sync_refuses_in_place_pause(tmp_path):
    async def go():
        async with SGLangClient(NO_SERVER) as c:
            await c.sync_weights_from_disk(str(tmp_path), "v1", pause_mode="in_place")

    with pytest.raises(ValueError, match=r"pause_mode 'in_place'.*flush"):
        asyncio.run(go())


def test_distributed_sync_refuses_in_place_pause():
    async def go():
        async with SGLangClient(NO_SERVER) as c:
            await DistributedWeightSync(c).sync([("w", torch.zeros(2))], "v1", pause_mode="in_place")

    with pytest.raises(ValueError, match=r"pause_mode 'in_place'"):
        asyncio.run(go())


def test_update_from_a_missing_folder_names_it(tmp_path):
    missing = tmp_path / "step-7"

    async def go():
        async with SGLangClient(NO_SERVER) as c:
            await c.update_weights_from_disk(str(missing), weight_version="v1")

    with pytest.raises(FileNotFoundError, match=r"step-7.*not a folder"):
        asyncio.run(go())
