"""The HTTP pieces the client and its control plane share: reading a response's body, and a cancel that holds."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp

CANCEL_REPEAT_S = 0.05  # seconds between the cancels of a request that has not ended yet


async def cancel_for_certain(coro: Any) -> Any:
    """Await `coro` in a task of its own; when the caller is cancelled, cancel that task again every
    CANCEL_REPEAT_S until it has ended, then raise CancelledError. aiohttp (3.14.5, Python 3.11) can lose a cancel
    that lands at a certain point of a request, which then ran on to its read timeout: a rollout's early stop waited
    the 120 s of a held request (5 times in ~330 under load). The request's own timeouts bound the repeats."""
    task = asyncio.ensure_future(coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):  # a cancel of ours again: keep waiting for the task
                await asyncio.wait({task}, timeout=CANCEL_REPEAT_S)
        if not task.cancelled():
            task.exception()  # retrieved: its error is not the caller's any more
        raise


async def read_body(resp: aiohttp.ClientResponse) -> Any:
    """The response's JSON, or its text when it is not JSON (SGLang's flush answers plain text)."""
    raw = await resp.read()
    try:
        return json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw.decode("utf-8", errors="replace")
