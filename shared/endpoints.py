"""Seat endpoints: which ones a config may name, and which need CURVE keys.

Pure: nothing here opens a socket or resolves a name.  A seat without an
`endpoint` is reached over an ipc socket in the state directory (0700, only the
service user can open it).  `tcp://HOST:PORT` is for a seat on another machine
(or one that must be reached over TCP on this one): loopback TCP may go without
keys, any other host only with CURVE (shared/curve.py), since anyone on the
network could otherwise talk to the worker.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

# Hosts that only this machine can reach.  A name other than localhost could
# resolve anywhere, so it counts as the network.
LOOPBACK_NAMES = frozenset({"localhost"})
# Addresses a worker could bind but nobody can connect to: the same string is
# used by both ends, so a wildcard cannot work (name the interface's address).
WILDCARDS = frozenset({"*", "0.0.0.0", "::"})


class EndpointError(ValueError):
    """The endpoint cannot be used; the message says what was expected."""


@dataclass(frozen=True)
class Endpoint:
    host: str  # as written, without brackets
    port: int

    @property
    def ipv6(self) -> bool:
        return ":" in self.host

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if self.ipv6 else self.host
        return f"tcp://{host}:{self.port}"


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 (also IPv4-mapped) and `localhost`; nothing else."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def parse_endpoint(text: str) -> Endpoint:
    """`tcp://HOST:PORT` (HOST an address or a name, IPv6 in brackets)."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme != "tcp":
        raise EndpointError(f"expected tcp://HOST:PORT, got {text!r}")
    if rest.startswith("["):
        host, bracket, tail = rest[1:].partition("]")
        if not bracket or not tail.startswith(":"):
            raise EndpointError(f"expected tcp://[IPV6]:PORT, got {text!r}")
        port = tail[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise EndpointError(f"{host!r} is not an IPv6 address (in {text!r})") from None
    else:
        host, colon, port = rest.rpartition(":")
        if not colon or ":" in host:
            raise EndpointError(f"expected tcp://HOST:PORT (IPv6 in brackets), got {text!r}")
    if not host or any(c in host for c in "/ ;@"):
        raise EndpointError(f"expected a host in {text!r}")
    if host.lower() in WILDCARDS:
        raise EndpointError(f"{text!r}: a wildcard address cannot be connected to; name the "
                            "address the worker binds (the same string serves both ends)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointError(f"expected a port from 1 to 65535 in {text!r}")
    return Endpoint(host, int(port))


def needs_keys(text: str) -> bool:
    """Whether an endpoint may only be used with CURVE keys (not loopback)."""
    return not parse_endpoint(text).loopback
