"""Addresses: which of this host's addresses another process is told, so that it can reach it from its own host.

An address handed to another process must be one that process can reach: 127.0.0.1 is every host's own loopback,
so an engine on another host told "127.0.0.1" connects to itself. This host's address toward a peer is the source
address the kernel picks for a packet to it: `route_source` asks with a UDP socket's `connect()` (no packet is sent)
and reads it back with `getsockname()`. Used for:

- the weight-update group's master address (`master_address`): the trainer's address on the interface that routes
  to the engines, else `MASTER_ADDR`, unless `--update-weight-master-address` names one;
- gloo's network interface (`pin_gloo_interface`): gloo binds the address this host's name resolves to, and a
  name that resolves to loopback (Debian's 127.0.1.1, a container's /etc/hosts) makes it hand 127.0.0.1 to the
  ranks of other nodes; a multi-node torchrun world gets the interface that routes to `MASTER_ADDR` instead,
  unless `GLOO_SOCKET_IFNAME` is set.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Sequence
from urllib.parse import urlsplit

from slime_corr.ports import LOOPBACK

GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"  # gloo's own variable: the interface(s) its connections bind
_SIOCGIFCONF = 0x8912  # Linux: every IPv4 address of this host with its interface
_IFREQ_BYTES = 40  # sizeof(struct ifreq) on 64-bit Linux: 16 bytes of name, then a sockaddr


def url_host(url: str) -> str:
    """The host part of `url` ("http://10.0.0.2:30000" -> "10.0.0.2"); raises ValueError without one."""
    host = urlsplit(url if "//" in url else f"//{url}").hostname
    if not host:
        raise ValueError(f"{url!r} names no host")
    return host


def is_loopback(address: str) -> bool:
    """`address` is a loopback address (127.0.0.0/8, ::1); False for a name."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def route_source(host: str) -> str | None:
    """This host's address on the interface that routes to `host` (a name or an address), or None when `host` does
    not resolve or no route leads to it. Sends nothing."""
    try:
        family, _, _, _, peer = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(peer)
            return str(s.getsockname()[0])
    except OSError:
        return None


def is_this_host(host: str) -> bool | None:
    """True when `host` names this machine (loopback, or an address one of its interfaces holds), False when it
    resolves to another machine, None when it does not resolve."""
    try:
        family, _, _, _, where = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except OSError:
        return None
    if is_loopback(str(where[0])):
        return True
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((where[0], 0))
        except OSError:
            return False
    return True


def master_address(worker_urls: Sequence[str], master_addr: str | None = None) -> str:
    """Where the engines of `worker_urls` join the weight-update group: this host's address on the interface that
    routes to them (the first one not on loopback when they differ: an engine on this host reaches any of this
    host's addresses), else `master_addr` (default: $MASTER_ADDR), else 127.0.0.1."""
    sources = [route_source(url_host(url)) for url in worker_urls]
    found = [s for s in sources if s]
    beyond_loopback = [s for s in found if not is_loopback(s)]
    if beyond_loopback:
        return beyond_loopback[0]
    if found:
        return found[0]
    return master_addr or os.environ.get("MASTER_ADDR") or LOOPBACK


def interface_of(address: str) -> str | None:
    """The name of this host's interface that holds the IPv4 `address` (Linux), or None."""
    try:
        wanted = socket.inet_aton(address)
    except OSError:
        return None
    count = 64
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        while True:
            buffer = array.array("B", bytes(count * _IFREQ_BYTES))
            request = struct.pack("iL", len(buffer), buffer.buffer_info()[0])
            used = struct.unpack("iL", fcntl.ioctl(s.fileno(), _SIOCGIFCONF, request))[0]
            if used < len(buffer):
                break
            count *= 2
        data = buffer.tobytes()[:used]
        for offset in range(0, used, _IFREQ_BYTES):
            if data[offset + 20:offset + 24] == wanted:  # the sockaddr_in's address, after family and port
                return data[offset:offset + 16].split(b"\0", 1)[0].decode()
    return None


def pin_gloo_interface(master_addr: str | None = None) -> str | None:
    """Make gloo bind the interface that routes to `master_addr` (default: $MASTER_ADDR) when that is not loopback
    and `GLOO_SOCKET_IFNAME` is not set (module doc); returns the interface it set, else None. Call it before the
    first gloo group."""
    host = master_addr or os.environ.get("MASTER_ADDR")
    if not host or os.environ.get(GLOO_INTERFACE):
        return None
    source = route_source(host)
    if source is None or is_loopback(source):
        return None
    interface = interface_of(source)
    if interface is not None:
        os.environ[GLOO_INTERFACE] = interface
    return interface


__all__ = ["GLOO_INTERFACE", "interface_of", "is_loopback", "is_this_host", "master_address", "pin_gloo_interface",
           "route_source", "url_host"]
