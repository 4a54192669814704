"""Another host on this machine, for the tests of what the job hands across hosts: a network namespace the test
creates (`ip netns add`, as root), joined to this one by a veth pair with an address at each end.

Inside it, 127.0.0.1 is its own loopback and this namespace's addresses other than the pair's are out of reach (and
the other way round): an address handed over on the assumption of one host (127.0.0.1, a hostname that resolves to
it) fails for real, with no need to record what was handed over. Processes run there with `OtherHost.command`
(`ip netns exec NAME ...`: only the network differs; files, PIDs and users are this machine's).

Creating one needs root (CAP_NET_ADMIN) and iproute2: without them the tests skip with the reason, and fail under
CI (CI=true), which must run them. Each namespace is named `slc-PID-N` after the test process; one whose process is
gone (a killed run) is removed by the next test that makes one.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

_made = itertools.count()
_NAME = re.compile(r"^slc-(\d+)-\d+")
_STEP_TIMEOUT = 30  # seconds per `ip` command


@dataclass(frozen=True)
class OtherHost:
    """A namespace standing for another host: its `address`, this namespace's address toward it (`here`), and its
    end of the pair (`interface`: what GLOO_SOCKET_IFNAME names there)."""

    name: str
    address: str
    here: str
    interface: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run on this host (`ip netns exec`: the process keeps its PID's parent, files and environment)."""
        return ["ip", "netns", "exec", self.name, *argv]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_STEP_TIMEOUT)


def unavailable() -> str | None:
    """Why no namespace can be made here, or None."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "creating a network namespace needs root"
    return None


def require() -> None:
    """Skip (fail under CI) when no namespace can be made here."""
    reason = unavailable()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason} (CI must run the tests across hosts: run them as root)")
    pytest.skip(reason)


def _remove_stale() -> None:
    """Namespaces of test processes that are gone (killed before their teardown)."""
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _NAME.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _ip("netns", "del", name)


def _free_subnet() -> str:
    """A 10.x.y.0/30 prefix no interface here uses ("10.x.y."), picked at random (two test processes rarely draw
    the same, and a used one is skipped)."""
    used = _ip("-4", "-o", "addr").stdout
    for _ in range(100):
        prefix = f"10.{random.randrange(200, 250)}.{random.randrange(256)}."
        if prefix not in used:
            return prefix
    raise RuntimeError("no free 10.200-249.x.0/30 subnet for a test namespace")


@contextlib.contextmanager
def other_host() -> Iterator[OtherHost]:
    """A fresh namespace with its loopback up and a veth pair to this one (10.x.y.1 here, 10.x.y.2 there); removed
    on exit (stop the processes started in it first)."""
    require()
    _remove_stale()
    n = next(_made)
    name = f"slc-{os.getpid()}-{n}"
    here_end, there_end = f"sl{os.getpid()}{n}a", f"sl{os.getpid()}{n}b"
    prefix = _free_subnet()
    here, there = f"{prefix}1", f"{prefix}2"
    steps = [("netns", "add", name), ("-n", name, "link", "set", "lo", "up"),
             ("link", "add", here_end, "type", "veth", "peer", "name", there_end),
             ("link", "set", there_end, "netns", name),
             ("addr", "add", f"{here}/30", "dev", here_end), ("link", "set", here_end, "up"),
             ("-n", name, "addr", "add", f"{there}/30", "dev", there_end), ("-n", name, "link", "set", there_end, "up")]
    try:
        for step in steps:
            done = _ip(*step)
            if done.returncode:
                raise RuntimeError(f"`ip {' '.join(step)}` failed: {done.stderr.strip()}")
        yield OtherHost(name, there, here, there_end)
    finally:
        _ip("link", "del", here_end)  # its peer goes with it
        _ip("netns", "del", name)


__all__ = ["OtherHost", "other_host", "require", "unavailable"]
