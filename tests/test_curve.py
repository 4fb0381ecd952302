"""Seats over CURVE-secured TCP, `sanctum keys`, and private state files.

Pure tables first (endpoints, modes, config rules), then key files on disk, then
real processes: a seatd on the "remote" side (its own config, a seat bound on a
loopback TCP port with CURVE) and a proxyd whose config marks that seat remote.
Only loopback is ever connected to; 192.0.2.10 (TEST-NET-1) is only parsed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

from shared import curve
from shared.config import ConfigError, parse_config, worker_endpoint
from shared.endpoints import EndpointError, is_loopback, needs_keys, parse_endpoint
from shared.private_files import make_private_dir, write_private
from tests.procs import free_port, http, wait_for

MODEL = os.environ.get("SANCTUM_TEST_MODEL", "builtin:demo")


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("LocalHost", True), ("::ffff:127.0.0.1", True),
    ("192.0.2.10", False), ("10.0.0.1", False), ("128.0.0.1", False), ("::2", False),
    ("mac-mini.local", False), ("localhost.evil.example", False), ("0.0.0.0", False),
])
def test_is_loopback(host: str, loopback: bool) -> None:
    """Only 127.0.0.0/8, ::1 and the name localhost are loopback; any other name could
    resolve anywhere, so it is the network."""
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(("text", "host", "port", "keys"), [
    ("tcp://127.0.0.1:5555", "127.0.0.1", 5555, False),
    ("tcp://[::1]:1", "::1", 1, False),
    ("tcp://localhost:65535", "localhost", 65535, False),
    ("tcp://192.0.2.10:5555", "192.0.2.10", 5555, True),
    ("tcp://[2001:db8::1]:80", "2001:db8::1", 80, True),
    ("tcp://studio.local:7000", "studio.local", 7000, True),
])
def test_parse_endpoint(text: str, host: str, port: int, keys: bool) -> None:
    """A tcp endpoint parses into host and port, and says whether it needs keys."""
    got = parse_endpoint(text)
    assert (got.host, got.port) == (host, port)
    assert needs_keys(text) is keys
    assert parse_endpoint(got.url) == got


@pytest.mark.parametrize(("text", "says"), [
    ("127.0.0.1:5555", "expected tcp://"),
    ("ipc://seat-x.sock", "expected tcp://"),
    ("udp://127.0.0.1:5", "expected tcp://"),
    ("tcp://127.0.0.1", "expected tcp://HOST:PORT"),
    ("tcp://127.0.0.1:0", "port from 1 to 65535"),
    ("tcp://127.0.0.1:65536", "port from 1 to 65535"),
    ("tcp://127.0.0.1:http", "port"),
    ("tcp://:5555", "a host"),
    ("tcp://*:5555", "wildcard"),
    ("tcp://0.0.0.0:5555", "wildcard"),
    ("tcp://[::]:5555", "wildcard"),
    ("tcp://::1:5555", "IPv6 in brackets"),
    ("tcp://[nope]:5555", "not an IPv6 address"),
    ("tcp://[::1]5555", "[IPV6]:PORT"),
])
def test_bad_endpoint_says_what_was_expected(text: str, says: str) -> None:
    """A malformed endpoint, or one nobody could connect to, is refused with a reason."""
    with pytest.raises(EndpointError, match=re.escape(says)):
        parse_endpoint(text)


@pytest.mark.parametrize(("mode", "refused"), [
    (0o600, False), (0o400, False), (0o700, False),
    (0o640, True), (0o604, True), (0o644, True), (0o660, True), (0o666, True),
])
def test_secret_mode_problem(mode: int, refused: bool) -> None:
    """A secret key file readable or writable by group or others is refused, naming the
    chmod that fixes it."""
    problem = curve.secret_mode_problem("/k/s.key_secret", stat.S_IFREG | mode)
    assert (problem is not None) is refused
    if problem:
        assert "chmod 600 /k/s.key_secret" in problem and f"{mode:04o}" in problem


BASE = """
[proxy]
{proxy}

[[seat]]
name = "far"
model = "builtin:demo"
{seat}

[[route]]
model = "far"
ladder = ["far"]
"""


def config(seat: str = "", proxy: str = "") -> Any:
    return parse_config(BASE.format(seat=seat, proxy=proxy))


@pytest.mark.parametrize(("seat", "proxy", "says"), [
    ('endpoint = "tcp://192.0.2.10:5555"', "", "not a loopback address, so it needs CURVE"),
    ('endpoint = "tcp://studio.local:5555"', "", "needs CURVE keys"),
    ('endpoint = "tcp://192.0.2.10:5555"\nremote = true', "", "needs CURVE keys"),
    ("remote = true", "", "a remote seat needs its tcp:// endpoint"),
    ('curve_cert = "k.key_secret"', "", "CURVE keys are for a tcp:// endpoint"),
    ('endpoint = "tcp://127.0.0.1:5"\ncurve_clients = "c"', "", "needs curve_cert"),
    ('endpoint = "tcp://192.0.2.10:5"\nremote = true\ncurve_cert = "k.key"', "",
     "needs proxy.curve_cert"),
    ('endpoint = "tcp://192.0.2.10:5"\nremote = true\ncurve_cert = "k.key"\n'
     'curve_clients = "c"', 'curve_cert = "p.key_secret"', "listed where seatd runs"),
    ('endpoint = "tcp://*:5555"', "", "wildcard"),
    ('endpoint = "ipc://seat-x.sock"', "", "seat[0] (far).endpoint: expected tcp://"),
])
def test_config_refuses_unsafe_or_unusable_endpoints(seat: str, proxy: str, says: str) -> None:
    """The loader refuses a non-loopback endpoint without keys, and keys or `remote` that
    cannot work, naming the key."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        config(seat, proxy)


@pytest.mark.parametrize(("seat", "proxy", "endpoint", "supervised"), [
    ("", "", None, True),
    ('endpoint = "tcp://127.0.0.1:5555"', "", "tcp://127.0.0.1:5555", True),
    ('endpoint = "tcp://[::1]:5555"\nremote = true', "", "tcp://[::1]:5555", False),
    ('endpoint = "tcp://192.0.2.10:5555"\ncurve_cert = "k.key_secret"\ncurve_clients = "c"',
     "", "tcp://192.0.2.10:5555", True),
    ('endpoint = "tcp://192.0.2.10:5555"\nremote = true\ncurve_cert = "k.key"',
     'curve_cert = "p.key_secret"', "tcp://192.0.2.10:5555", False),
])
def test_config_accepts_loopback_or_keyed_endpoints(seat: str, proxy: str,
                                                    endpoint: str | None,
                                                    supervised: bool) -> None:
    """Loopback TCP needs no keys; any host with keys is allowed.  The seat's endpoint is
    where both ends meet; a remote seat is not this seatd's to run."""
    c = config(seat, proxy)
    got = worker_endpoint(c, "far")
    assert got == endpoint if endpoint else got.startswith("ipc://")
    assert [s.name for s in c.supervised_seats] == (["far"] if supervised else [])
    assert [s.name for s in c.local_seats] == ["far"]


def test_two_seats_on_one_endpoint_are_refused() -> None:
    """Two seats cannot share an endpoint: the second bind would fail, or worse, not."""
    text = BASE.format(seat='endpoint = "tcp://127.0.0.1:5555"', proxy="") + """
[[seat]]
name = "near"
model = "builtin:demo"
endpoint = "tcp://127.0.0.1:5555"
"""
    with pytest.raises(ConfigError, match="is seat far's already"):
        parse_config(text)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_state_dir_is_made_private_and_a_loose_one_tightened(tmp_path: Path) -> None:
    """A new state directory (and its missing parents' leaf) is 0700 whatever the umask;
    one left 0755 by an older run is tightened to 0700."""
    old = os.umask(0)
    try:
        fresh = make_private_dir(tmp_path / "a" / "state")
        assert _mode(fresh) == 0o700
        loose = tmp_path / "loose"
        loose.mkdir(mode=0o755)
        assert _mode(loose) == 0o755
        make_private_dir(loose)
        assert _mode(loose) == 0o700
    finally:
        os.umask(old)


def test_state_files_are_written_0600_whatever_the_umask(tmp_path: Path) -> None:
    """A state file is 0600 from its first byte, also when it replaces a looser file or
    a stale temporary one; seatd's own writers (counters, restart totals, exit
    reasons) all go through it."""
    from seatd import ledger
    from seatd.counters import SeatCounters
    from shared import exitcodes

    old = os.umask(0)
    try:
        target = tmp_path / "f.json"
        target.write_text("{}")
        target.chmod(0o666)
        (tmp_path / "f.json.tmp").write_text("stale")
        (tmp_path / "f.json.tmp").chmod(0o666)
        write_private(target, '{"a": 1}')
        assert (_mode(target), target.read_text()) == (0o600, '{"a": 1}')
        assert not (tmp_path / "f.json.tmp").exists()

        counters = SeatCounters("s", tmp_path / "counters-s.json")
        counters.inc("served")
        counters.persist()
        ledger.save(tmp_path / "totals-s.json", ledger.Totals(2, 1))
        reason = tmp_path / "exit-s.reason"
        os.environ[exitcodes.REASON_ENV] = str(reason)
        try:
            exitcodes.record_reason("config_error: x")
        finally:
            del os.environ[exitcodes.REASON_ENV]
        written = sorted(tmp_path.iterdir())
        assert [p.name for p in written] == ["counters-s.json", "exit-s.reason", "f.json",
                                             "totals-s.json"]
        assert {p.name: _mode(p) for p in written} == dict.fromkeys(
            (p.name for p in written), 0o600)
        assert json.loads((tmp_path / "counters-s.json").read_text())["served"] == 1
        assert ledger.load(tmp_path / "totals-s.json") == ledger.Totals(2, 1)
    finally:
        os.umask(old)


# -- key files and `sanctum keys` ---------------------------------------------------


def make_keys(folder: Path, name: str, capsys: pytest.CaptureFixture[str]) -> str:
    """`sanctum keys FOLDER --name NAME`, in this process; its printed text."""
    from sanctum.cli import main

    assert main(["keys", str(folder), "--name", name]) == 0
    return capsys.readouterr().out


def test_sanctum_keys_writes_a_pair_and_never_prints_the_secret(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`sanctum keys` writes NAME.key (public) and NAME.key_secret (0600) that zmq.auth
    loads, prints the config keys for both machines but not the secret key, and refuses
    to replace an existing pair."""
    from sanctum.cli import main

    out = make_keys(tmp_path / "k", "far", capsys)
    public, secret = tmp_path / "k" / "far.key", tmp_path / "k" / "far.key_secret"
    assert (_mode(secret), _mode(tmp_path / "k")) == (0o600, 0o700)
    pub, sec = zmq.auth.load_certificate(str(secret))
    assert sec is not None and zmq.auth.load_certificate(str(public)) == (pub, None)
    assert sec.decode() not in out
    for needed in ("endpoint = ", "remote = true", f'curve_cert = "{secret}"',
                   f'curve_cert = "{public}"', "curve_clients = ", "[proxy]"):
        assert needed in out
    assert [p.name for p in (tmp_path / "k").iterdir()] in (["far.key", "far.key_secret"],
                                                             ["far.key_secret", "far.key"])
    assert main(["keys", str(tmp_path / "k"), "--name", "far"]) == 1
    assert "exists already" in capsys.readouterr().err
    assert zmq.auth.load_certificate(str(secret)) == (pub, sec)  # not replaced


def test_key_files_refused_with_what_to_do(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A secret certificate readable by others, a public one where a secret is needed, and
    a file that is no certificate are refused with a message naming the file and the
    fix, and never the key."""
    make_keys(tmp_path, "s", capsys)
    secret = tmp_path / "s.key_secret"
    sec = zmq.auth.load_certificate(str(secret))[1]
    assert sec is not None
    assert curve.load_cert(str(secret), secret=True).secret == sec
    secret.chmod(0o644)
    with pytest.raises(curve.CurveError, match=re.escape(f"chmod 600 {secret}")) as err:
        curve.load_cert(str(secret), secret=False)
    assert sec.decode() not in str(err.value)
    with pytest.raises(curve.CurveError, match="holds only a public key"):
        curve.load_cert(str(tmp_path / "s.key"), secret=True)
    (tmp_path / "junk.key").write_text("not a certificate\n")
    for bad in ("junk.key", "missing.key"):
        with pytest.raises(curve.CurveError, match="not a readable CURVE certificate"):
            curve.load_cert(str(tmp_path / bad), secret=False)


CHECK_SEAT = """
[[seat]]
name = "far"
model = "{model}"
max_prompt_tokens = 1536
{extra}

[[route]]
model = "far"
ladder = ["far"]
"""


def check(config_text: str, tmp_path: Path,
          capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from sanctum.cli import main

    path = tmp_path / "c.toml"
    path.write_text(config_text)
    code = main(["check", "--config", str(path)])
    got = capsys.readouterr()
    return code, got.out + got.err


def test_check_refuses_a_network_endpoint_without_keys(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`sanctum check` refuses a seat on tcp://192.0.2.10:5555 without CURVE keys (only
    parsed, never connected) and accepts loopback TCP without them."""
    code, out = check(CHECK_SEAT.format(model=MODEL, extra='endpoint = "tcp://192.0.2.10:5555"'),
                      tmp_path, capsys)
    assert code == 2 and "not a loopback address, so it needs CURVE keys" in out
    assert "sanctum keys" in out
    code, out = check(CHECK_SEAT.format(model=MODEL, extra='endpoint = "tcp://127.0.0.1:5555"'),
                      tmp_path, capsys)
    assert (code, out.splitlines()[-1]) == (0, "config ok")


def test_check_refuses_a_loose_secret_and_never_prints_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With keys, `sanctum check` passes; a secret certificate made readable by others
    (or a missing clients folder) is an error that names the chmod, and no key is
    printed either way."""
    make_keys(tmp_path, "far", capsys)
    (tmp_path / "clients").mkdir()
    extra = (f'endpoint = "tcp://192.0.2.10:5555"\ncurve_cert = "{tmp_path}/far.key_secret"\n'
             f'curve_clients = "{tmp_path}/clients"')
    text = CHECK_SEAT.format(model=MODEL, extra=extra)
    pub, sec = zmq.auth.load_certificate(str(tmp_path / "far.key_secret"))
    assert sec is not None
    code, out = check(text, tmp_path, capsys)
    assert (code, out.splitlines()[-1]) == (0, "config ok")
    (tmp_path / "far.key_secret").chmod(0o640)
    code, out = check(text, tmp_path, capsys)
    assert code == 1 and f"run `chmod 600 {tmp_path}/far.key_secret`" in out
    (tmp_path / "far.key_secret").chmod(0o600)
    (tmp_path / "clients").rmdir()
    code, out = check(text, tmp_path, capsys)
    assert code == 1 and "curve_clients must be a folder" in out
    for key in (pub, sec):
        assert key.decode() not in out


# -- the CURVE handshake, in this process ---------------------------------------------

AUTH_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH
ANY_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def handshake(client: zmq.Socket[bytes], monitor: zmq.Socket[bytes],
              timeout_s: float = 20.0) -> int:
    """The first handshake event of `client`: success or one of the failures."""
    from zmq.utils.monitor import recv_monitor_message

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if monitor.poll(100):
            event = int(recv_monitor_message(monitor)["event"])
            if event & (ANY_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED):
                return event
    raise AssertionError("no handshake event")


def dial_test_client(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str,
                     keys: curve.ClientKeys | None
                     ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket()
    curve.dial(sock, endpoint, keys)
    return sock, monitor


@pytest.mark.parametrize("who", ["right", "wrong_key", "no_curve", "wrong_server_key"])
def test_only_a_listed_client_key_gets_through(who: str) -> None:
    """A worker socket bound by `curve.bind_seat` answers a client with a listed key; a
    client with another key pair is denied by the ZAP handler (counted), and one without
    CURVE, or expecting another server key, fails its handshake: none of them gets
    anything, and the server never sees their message."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    server_pair = curve.KeyPair(*zmq.curve_keypair())
    client_pair = curve.KeyPair(*zmq.curve_keypair())
    keys = {"right": curve.ClientKeys(server_pair.public, client_pair),
            "wrong_key": curve.ClientKeys(server_pair.public, curve.KeyPair(*zmq.curve_keypair())),
            "no_curve": None,
            "wrong_server_key": curve.ClientKeys(zmq.curve_keypair()[0], client_pair)}[who]
    denied: list[int] = []

    async def serve(client_ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[int, list[bytes]]:
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        server = ctx.socket(zmq.ROUTER)
        server.setsockopt(zmq.LINGER, 0)
        gate = curve.bind_seat(ctx, server, endpoint,
                               curve.ServerKeys(server_pair, frozenset({client_pair.public})),
                               "t", lambda: denied.append(1))
        client, monitor = dial_test_client(client_ctx, endpoint, keys)
        got: list[bytes] = []
        try:
            client.send(b"ping")
            event = await asyncio.to_thread(handshake, client, monitor)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                ident, msg = await asyncio.wait_for(server.recv_multipart(), 20)
                await server.send_multipart([ident, b"pong:" + msg])
                got.append(await asyncio.to_thread(client.recv))
            else:
                # The handshake failed for good: nothing was delivered either way.
                assert not await server.poll(200) and not client.poll(0)
            return event, got
        finally:
            client.disable_monitor()
            monitor.close(0)
            client.close(0)
            server.close(0)
            assert gate is not None
            gate.stop()
            ctx.term()

    client_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        event, got = asyncio.run(serve(client_ctx))
    finally:
        client_ctx.term()
    if who == "right":
        assert (event, got, denied) == (zmq.EVENT_HANDSHAKE_SUCCEEDED, [b"pong:ping"], [])
    else:
        assert event & ANY_FAILED and got == []
        assert denied == ([1] if who == "wrong_key" else [])
        assert (event == AUTH_FAILED) is (who == "wrong_key")


# -- real processes: a seat on a second "machine" ------------------------------------

REMOTE_SIDE = """
[proxy]
listen = "127.0.0.1:{unused}"

[seatd]
heartbeat_s = 0.5
drain_s = 5.0

[[seat]]
name = "far"
model = "{model}"
max_prompt_tokens = 1536
endpoint = "{endpoint}"
curve_cert = "{keys}/far.key_secret"
curve_clients = "{keys}/clients"

[[route]]
model = "far"
ladder = ["far"]
"""

PROXY_SIDE = """
[proxy]
listen = "127.0.0.1:{port}"
heartbeat_s = 0.5
curve_cert = "{keys}/proxy.key_secret"

[seatd]
heartbeat_s = 0.5

[[seat]]
name = "far"
model = "{model}"
max_prompt_tokens = 1536
remote = true
endpoint = "{endpoint}"
curve_cert = "{keys}/far.key"

[[route]]
model = "far"
ladder = ["far"]
"""




def seat_states(s: Any) -> dict[str, str]:
    """`sanctum status` of one instance: its seatd's seats and their states."""
    from sanctum.cli import _control
    from shared import protocol
    from shared.config import load_config

    os.environ["SANCTUM_STATE_DIR"] = str(s.state)
    try:
        reply = _control(load_config(s.config), protocol.StatusQuery())
    finally:
        del os.environ["SANCTUM_STATE_DIR"]
    return {row.name: row.state for row in reply.seats}


@pytest.mark.slow
def test_remote_seat_over_curve_serves_and_refuses_other_keys(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The seat's machine runs `sanctum seatd` with its own config (the seat bound on
    tcp://127.0.0.1:PORT with CURVE); the proxy's machine runs `sanctum up` whose config
    marks that seat remote, so its seatd runs nothing and proxyd reaches the seat with
    its own key pair: a real Generate is answered by the seat.  A client with a key pair
    the seat does not list is denied (the worker counts and logs it), one without CURVE
    fails its handshake; neither gets a reply, and the proxy still gets answers.  No
    secret key is in any log; the state directory is 0700 and the counters 0600; every
    process is proven stopped."""
    from shared import protocol
    from tests.procs import Sanctum

    keys = Path(tempfile.mkdtemp(prefix="crv-", dir="/tmp"))
    make_keys(keys, "far", capsys)
    make_keys(keys, "proxy", capsys)
    (keys / "clients").mkdir()
    shutil.copy(keys / "proxy.key", keys / "clients" / "proxy.key")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    fmt = {"model": MODEL, "endpoint": endpoint, "keys": str(keys)}
    far = Sanctum(REMOTE_SIDE.format(unused=free_port(), **fmt), command="seatd")
    near: Sanctum | None = None
    try:
        port = free_port()
        near = Sanctum(PROXY_SIDE.format(port=port, **fmt), port=port, command="up")
        near.wait_ready(("far",))
        assert (far.state.stat().st_mode & 0o777) == 0o700

        body = {"model": "far", "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 8, "seed": 7}
        status, headers, raw = http("POST", near.url + "/v1/chat/completions", body)
        assert status == 200, raw
        first = json.loads(raw)
        assert headers["X-Sanctum-Seat"] == "far" and first["choices"][0]["message"]["content"]

        # The proxy's machine runs no worker: its seatd leaves the remote seat alone.  The
        # seat's own seatd hears its worker over CURVE (with the seat's own key pair).
        assert seat_states(near) == {}
        assert wait_for("seatd hears its worker", lambda: seat_states(far) == {
            "far": "READY"}, 30, far.logs)

        ping = protocol.encode(protocol.Ping(sent_at=0.0))
        server = curve.load_cert(str(keys / "far.key"), secret=False).public
        stranger = curve.ClientKeys(server, curve.KeyPair(*zmq.curve_keypair()))
        proxy_pair = curve.load_cert(str(keys / "proxy.key_secret"), secret=True)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            for who, client_keys, expect in (("stranger", stranger, AUTH_FAILED),
                                             ("plain", None, ANY_FAILED)):
                sock, monitor = dial_test_client(ctx, endpoint, client_keys)
                sock.send(ping)
                event = handshake(sock, monitor)
                assert event & expect, (who, event)
                assert not sock.poll(300), who  # a failed handshake delivers nothing
                sock.disable_monitor()
                monitor.close(0)
                sock.close(0)
            # The same harness with a listed key pair gets its pong.
            sock, monitor = dial_test_client(ctx, endpoint,
                                             curve.ClientKeys(server, proxy_pair))
            sock.send(ping)
            assert handshake(sock, monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
            assert sock.poll(20000)
            pong = protocol.reply_decoder.decode(sock.recv())
            assert isinstance(pong, protocol.Pong) and pong.ready
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
        finally:
            ctx.term()

        def denied() -> int:
            got = json.loads(http("GET", near.url + "/counters")[2])
            return int(got["seats"]["far"]["curve_denied"])

        assert wait_for("the denial counted", denied, 10, far.logs) == 1
        assert "curve_denied" in far.logs()
        status, headers, raw = http("POST", near.url + "/v1/chat/completions", body)
        assert (status, json.loads(raw)["choices"]) == (200, first["choices"])

        secrets = [zmq.auth.load_certificate(str(keys / f"{n}.key_secret"))[1]
                   for n in ("far", "proxy")]
        logs = far.logs() + near.logs()
        for secret in secrets:
            assert secret is not None and secret.decode() not in logs
        assert near.stop() == 0
        near = None
        far_state = far.state
        counters = far_state / "counters-far.json"
        assert far.proc.poll() is None
        far.remember_tree()
        far.proc.send_signal(signal.SIGTERM)
        assert far.proc.wait(60) == 0
        assert (counters.stat().st_mode & 0o777) == 0o600
        assert json.loads(counters.read_text())["curve_denied"] == 1
    finally:
        if near is not None:
            near.kill_everything()
        if far.proc.poll() is None:
            far.kill_everything()
        else:
            far.stop()
        shutil.rmtree(keys, ignore_errors=True)
