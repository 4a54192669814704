"""Shared by the tests that act on a request while the embedded engine generates it."""

from __future__ import annotations

import asyncio

from slime_corr.engines.embedded.engine import LocalEngine
from slime_corr.rollout.client import SGLangClient


async def wait_tokens(engine: LocalEngine, client: SGLangClient, n: int) -> None:
    """Until a request `client` has in flight is running on `engine` with `n` tokens (bounded: ~6 s). Only those: a
    request of the test's previous step can still be listed by the engine, finished, while its handler ends (a
    test that acted on it paused before its own request was sent, and waited for a request its client held back)."""
    for _ in range(3000):
        mine = set(client.gate.inflight)
        if any(len(r.output_ids) >= n for rid, r in list(engine.active.items()) if rid in mine and r.finish is None):
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"no request of the client reached {n} tokens on the engine")
