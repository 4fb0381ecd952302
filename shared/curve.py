"""CURVE on the seat sockets: which keys each end uses, and the sockets' options.

A seat on a tcp:// endpoint may be secured with CURVE (pyzmq's libzmq CURVE;
`sanctum keys` makes the key pairs, in zmq.auth's certificate files: NAME.key
holds the public key, NAME.key_secret both).  The ends:

    worker ROUTER (server)      its seat's secret certificate (seat.curve_cert);
                                a ZAP handler lets in only the listed client keys
    seatd heartbeat DEALER      the seat's own key pair: same machine, same user,
                                so the worker lets its own public key in
    proxyd DEALER, local seat   the seat's own key pair, as seatd
    proxyd DEALER, remote seat  proxy.curve_cert (its own pair) toward the seat's
                                public certificate; the seat's machine lists the
                                proxy's public half in seat.curve_clients

A file holding a secret key must be mode 0600 (or stricter): anything looser is
refused, naming the chmod to run.  No key ever appears in a log line, an error or
a counter: a client is named by the first characters of its public key only.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.auth
import zmq.auth.asyncio

from shared.config import Config, ConfigError, SeatConfig, resolve_path
from shared.endpoints import parse_endpoint

log = structlog.get_logger()

ZAP_DOMAIN = b"sanctum"
# How much of a public key (z85, 40 characters) names a client in a log line.
KEY_TAG = 8


class CurveError(ConfigError):
    """A key file cannot be used; the message names the file and what to do."""


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # z85, 40 bytes
    secret: bytes | None = None


@dataclass(frozen=True)
class ServerKeys:
    own: KeyPair
    allowed: frozenset[bytes]


@dataclass(frozen=True)
class ClientKeys:
    server: bytes  # the worker's public key
    own: KeyPair


def secret_mode_problem(path: str, mode: int) -> str | None:
    """Why a file holding a secret key with this mode must not be used, or None."""
    if mode & 0o077:
        return (f"{path} holds a secret key but is mode {stat.S_IMODE(mode):04o} (readable "
                f"by others): run `chmod 600 {path}`")
    return None


def load_cert(path: str, *, secret: bool) -> KeyPair:
    """A certificate file's keys; `secret`: it must hold the secret half too."""
    p = str(Path(path).expanduser())
    try:
        public, sec = zmq.auth.load_certificate(p)
        mode = os.stat(p).st_mode
    except (OSError, ValueError):
        # The library's own message may quote the file; say only what to fix.
        raise CurveError(f"{p}: not a readable CURVE certificate (`sanctum keys` "
                         "makes them)") from None
    if sec is not None:
        problem = secret_mode_problem(p, mode)
        if problem:
            raise CurveError(problem)
    if secret and sec is None:
        raise CurveError(f"{p} holds only a public key; this end needs the secret "
                         "certificate (NAME.key_secret)")
    return KeyPair(public, sec)


def load_clients(folder: str) -> frozenset[bytes]:
    """The public keys of every NAME.key certificate in `folder`."""
    p = Path(folder).expanduser()
    if not p.is_dir():
        raise CurveError(f"{p}: curve_clients must be a folder of public certificates")
    return frozenset(load_cert(str(f), secret=False).public for f in sorted(p.glob("*.key")))


def server_keys(config: Config, seat: SeatConfig) -> ServerKeys | None:
    """The worker's keys, or None when its seat has no CURVE."""
    if seat.curve_cert is None:
        return None
    own = load_cert(resolve_path(config, seat.curve_cert), secret=True)
    clients = (load_clients(resolve_path(config, seat.curve_clients))
               if seat.curve_clients is not None else frozenset())
    return ServerKeys(own, clients | {own.public})


def client_keys(config: Config, seat: SeatConfig, *, proxy: bool) -> ClientKeys | None:
    """A client's keys toward `seat` (proxyd's when `proxy`, else seatd's)."""
    if seat.curve_cert is None:
        return None
    if proxy and seat.remote:
        assert config.proxy.curve_cert is not None  # the config loader insists
        server = load_cert(resolve_path(config, seat.curve_cert), secret=False)
        return ClientKeys(server.public,
                          load_cert(resolve_path(config, config.proxy.curve_cert), secret=True))
    own = load_cert(resolve_path(config, seat.curve_cert), secret=True)
    return ClientKeys(own.public, own)


def problems(config: Config) -> list[str]:
    """Every key file this machine's daemons would use and cannot (`sanctum check`)."""
    out: list[str] = []
    for seat in config.local_seats:
        try:
            if not seat.remote:
                server_keys(config, seat)
            client_keys(config, seat, proxy=True)
        except CurveError as exc:
            out.append(f"seat {seat.name}: {exc}")
    return out


def _family(sock: zmq.Socket[Any], endpoint: str) -> None:
    if endpoint.startswith("tcp://") and parse_endpoint(endpoint).ipv6:
        sock.setsockopt(zmq.IPV6, 1)


def dial(sock: zmq.Socket[Any], endpoint: str, keys: ClientKeys | None) -> None:
    """Connect a client socket, as a CURVE client when there are keys."""
    _family(sock, endpoint)
    if keys is not None:
        assert keys.own.secret is not None
        sock.curve_serverkey = keys.server
        sock.curve_publickey = keys.own.public
        sock.curve_secretkey = keys.own.secret
    sock.connect(endpoint)


class Gate:
    """The ZAP handler's verdict on a client key: listed or not.  Denials are logged
    with the key's first characters and reported to `denied` (the seat's counter)."""

    def __init__(self, seat: str, allowed: frozenset[bytes], denied: Callable[[], None]) -> None:
        self.seat = seat
        self.allowed = allowed
        self.denied = denied

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        log.warning("curve_denied", seat=self.seat, client_key=key[:KEY_TAG].decode())
        self.denied()
        return False


def bind_seat(ctx: zmq.asyncio.Context, sock: zmq.Socket[Any], endpoint: str,
              keys: ServerKeys | None, seat: str,
              denied: Callable[[], None]) -> zmq.auth.asyncio.AsyncioAuthenticator | None:
    """Bind the worker's socket; with keys, as a CURVE server behind a ZAP handler
    (returned: stop it before the context is terminated)."""
    _family(sock, endpoint)
    auth = None
    if keys is not None:
        assert keys.own.secret is not None
        auth = zmq.auth.asyncio.AsyncioAuthenticator(ctx)
        auth.start()
        gate = Gate(seat, keys.allowed, denied)
        auth.configure_curve_callback(ZAP_DOMAIN.decode(), credentials_provider=gate)
        sock.zap_domain = ZAP_DOMAIN
        sock.curve_secretkey = keys.own.secret
        sock.curve_publickey = keys.own.public
        sock.curve_server = True
    sock.bind(endpoint)
    return auth
