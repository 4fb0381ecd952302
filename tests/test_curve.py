"""Seats over CURVE-secured TCP, `sanctum keys`, and private state files.

Pure tables first (endpoints, modes, config rules), then key files on disk, then
real processes: a seatd on the "remote" side (its own config, a seat bound on a
loopback TCP port with CURVE) and a proxyd whose config marks that seat remote.
Only loopback is ever connected to; 192.0.2.10 (TEST-NET-1) is only parsed.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest

from shared import curve
from shared.config import ConfigError, parse_config, worker_endpoint
from shared.endpoints import EndpointError, is_loopback, needs_keys, parse_endpoint
from shared.private_files import make_private_dir, write_private

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
    ("ipc:///tmp/x.sock", "expected tcp://"),
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
    ('endpoint = "ipc:///tmp/x"', "", "seat[0] (far).endpoint: expected tcp://"),
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
