"""Helpers of the real-SGLang tests: the trainer's teacher-forced log-probs of sampled sequences, and a request held
in flight for certain (SGLang's own throttle and the stream's first token)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slime_corr.rollout import protocol


def teacher_forced(version_dir: str, sequences: list[tuple[list[int], list[int]]],
                   per_sequence: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> list[torch.Tensor]:
    """`per_sequence(logits, response)` for each (prompt, response), `logits` [len(response), V] the trainer's
    (Megatron GPTModel, fp32, teacher-forced) at the response's positions, in a one-rank gloo group in this
    process."""
    from tests.mcore.mcore_helpers import run_in_process

    result: list[torch.Tensor] = []

    def fn(rank: int, world: int) -> None:
        from slime_corr.mcore.model import TinyGPTArgs, build_tiny_gpt
        from tests.mcore.mcore_helpers import init_layout

        init_layout(1, 1)
        model = build_tiny_gpt(TinyGPTArgs(vocab_size=256), ddp=False).eval()
        model.load_state_dict(torch.load(Path(version_dir) / "megatron.pt", weights_only=True), strict=False)
        for prompt, response in sequences:
            ids = torch.tensor([prompt + response])
            with torch.no_grad():
                logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], attention_mask=None)
                result.append(per_sequence(logits[0, len(prompt) - 1:-1], response))

    run_in_process(fn)
    return result


def megatron_logprobs(version_dir: str, sequences: list[tuple[list[int], list[int]]], temperature: float) -> list:
    """Teacher-forced log-probs of each (prompt, response) under the trainer's model and its log-prob path
    (`vocab_parallel_log_probs`)."""
    from slime_corr.mcore.logprobs import vocab_parallel_log_probs

    return teacher_forced(version_dir, sequences, lambda logits, response: vocab_parallel_log_probs(
        logits[None], torch.tensor([response]), temperature=temperature)[0])


# The modules that share real SGLang servers (conftest.shared_servers), by group: one pytest worker runs a group's
# modules one after the other (tests/conftest.py's scheduling), the group's servers start once for them and stop
# after its last module.
SERVER_GROUPS = {
    "sglang-fp32": ("test_sglang_endpoints.py", "test_sglang_nucleus.py", "test_sglang_kept_sets.py"),
    "sglang-bf16": ("test_sglang_trainer.py", "test_sglang_partial_rollout.py"),
}


def server_group(path: str) -> str | None:
    """The SERVER_GROUPS group of the test module at `path` (a node id or a file path), or None."""
    name = Path(path.split("::", 1)[0]).name
    return next((group for group, modules in SERVER_GROUPS.items() if name in modules), None)


@dataclass(frozen=True)
class ServerSpec:
    model_path: str
    dtype: str = "float32"
    extra_args: tuple[str, ...] = ()
    name: str = "sglang"


@contextlib.contextmanager
def slowed_down(url: str, forward_sleep: float) -> Iterator[None]:
    """SGLang's own throttle (`POST /slow_down {"forward_sleep_time": s}`): every forward the server runs sleeps
    `s` first, so a request for n tokens stays in flight at least n * s on any machine, fast or loaded. A test that
    must act while a request runs takes this instead of guessing the server's speed. Off again on exit."""
    _post_json(url, "/slow_down", {"forward_sleep_time": forward_sleep})
    try:
        yield
    finally:
        _post_json(url, "/slow_down", {"forward_sleep_time": None})


def restore(url: str, model_path: str, version: str) -> None:
    """Put a shared server back as it started: no throttle, and `model_path`'s weights under `version` unless it
    already serves that version (every weight update names its version: SGLang's `weight_version`)."""
    from slime_corr.rollout.client import SGLangClient

    _post_json(url, "/slow_down", {"forward_sleep_time": None})

    async def go() -> None:
        async with SGLangClient(url) as client:
            if (await client.weight_versions())[url] != version:
                await client.sync_weights_from_disk(model_path, version)

    asyncio.run(go())


def group_processes(pgid: int) -> dict[int, tuple[str, float]]:
    """{pid: (command line, CPU seconds used: user + system)} of the live processes of process group `pgid` (Linux
    /proc): an SGLang server leads its own group (its HTTP process, scheduler and detokenizer)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:  # after ")": state ppid pgrp ... utime (index 11) stime (12)
                    command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                    found[int(entry)] = (command, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return found


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds the live processes of process group `pgid` have used (`group_processes`)."""
    return sum(cpu for _, cpu in group_processes(pgid).values())


def _post_json(url: str, path: str, body: dict) -> None:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - a loopback test server
        assert resp.status == 200, (path, resp.status)


@contextlib.contextmanager
def tokens_streamed() -> Iterator[Callable[[int], Awaitable[None]]]:
    """An observer of the client's streams (it wraps `StreamAccumulator.feed`, changing nothing): yields
    `wait(n)`, which returns once `n` requests have each received at least one token from the server, i.e. are
    running there (their prefill is done), as the server itself reports by streaming."""
    started: set[int] = set()
    feed = protocol.StreamAccumulator.feed

    def observed(acc: protocol.StreamAccumulator, obj: Any) -> None:
        feed(acc, obj)
        if acc.out.output_ids:
            started.add(id(acc))

    async def wait(n: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout  # bounded: a server that never streams fails the test
        while len(started) < n:
            assert time.monotonic() < deadline, f"{len(started)} of {n} requests streamed a token in {timeout} s"
            await asyncio.sleep(0.01)

    protocol.StreamAccumulator.feed = observed
    try:
        yield wait
    finally:
        protocol.StreamAccumulator.feed = feed
