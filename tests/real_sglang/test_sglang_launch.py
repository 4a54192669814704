"""The launcher against a real SGLang server whose port is taken between the probe and the bind (it binds tens of
seconds after the probe, once its imports are done; CI18 lost a module's servers to it): the server is stopped and
started again on another port. The fault is real: a listening socket holds the port the first probe returns, and
the real server fails to bind it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from sglang_helpers import ServerSpec

from slime_corr.engines import sglang_server
from slime_corr.rollout.weight_group import free_port

pytestmark = pytest.mark.cost(60)  # CI seconds, roughly: the costliest modules run first (tests/conftest.py)


def test_a_port_taken_before_the_bind_starts_the_server_again_elsewhere(launch, tiny_opt, monkeypatch):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()  # held, not served: an HTTP request to it waits, as to a busy process's port
    taken = holder.getsockname()[1]
    ports = iter([taken])
    monkeypatch.setattr(sglang_server, "free_port", lambda: next(ports, None) or free_port())
    try:
        (server,) = launch(ServerSpec(tiny_opt["v0"], name="taken"))
    finally:
        holder.close()
    assert server.url != f"http://127.0.0.1:{taken}"
    first = Path(server.log_path).with_name(f"taken-{taken}.log")
    assert sglang_server.BIND_FAILED in first.read_text(errors="replace")  # the real server's own words
    assert server.proc.poll() is None
