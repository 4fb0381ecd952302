"""Client authentication (proxyd/auth.py) through real HTTP: 401 without a key or with a
wrong one and success with the right one on every route that needs a key, /health
open, keys of the variable and of the file together, route allow-lists (403, and
/v1/models filtered), request rates on the proxy's clock (429 + Retry-After), the
counters of each, and no secret anywhere the proxy speaks or writes.

The proxy runs behind two hosted rungs (tests/hosted_rig.py, fake upstreams on
loopback): `m` -> [primary, backup], `n` -> [backup].  The rig's config template is
swapped for one with the key settings and the second route.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from proxyd.auth import admit_rate, presented
from shared.clock import ManualClock
from tests import hosted_rig
from tests.hosted_rig import KEY as HOSTED_KEY
from tests.hosted_rig import HostedRig, body_of, text_of
from tests.procs import http

ENV = "SANCTUM_TEST_CLIENT_KEYS"
ENV_KEYS = ("ck-env-first-4f1a9c2e7b", "ck-env-second-8d3b6a0f51")
ONLY_N = "ck-file-only-n-2c9e41d7a3"
LIMITED = "ck-file-limited-7a5d03e9b8"
WRONG = "ck-env-first-4f1a9c2e7c"  # one character off the first key
KEY_FILE = f"""# the household's keys
{ONLY_N} name=only-n routes=n   # may use route n only
{LIMITED} name=limited rpm=2
"""
ALL_SECRETS = (*ENV_KEYS, ONLY_N, LIMITED, WRONG, HOSTED_KEY)
CONFIG = """
[proxy]
listen = "127.0.0.1:{port}"
breaker_threshold = 3
breaker_cooldown_s = {cooldown}
api_keys_env = "%s"
api_keys_file = "%s"
{seats}
[[route]]
model = "m"
ladder = ["primary", "backup"]

[[route]]
model = "n"
ladder = ["backup"]
"""
MSG = [{"role": "user", "content": "hello"}]
# Every route that needs a key: (method, path, body).
GUARDED = [
    ("POST", "/v1/chat/completions", {"model": "m", "messages": MSG}),
    ("POST", "/v1/completions", {"model": "m", "prompt": "hello"}),
    ("GET", "/v1/models", None),
    ("GET", "/counters", None),
    ("GET", "/metrics", None),
]

MakeRig = Callable[..., HostedRig]


@pytest.fixture
def make_rig(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[MakeRig]:
    keys = tmp_path / "keys"
    keys.write_text(KEY_FILE)
    keys.chmod(0o600)
    monkeypatch.setattr(hosted_rig, "CONFIG", CONFIG % (ENV, keys))
    monkeypatch.setenv(ENV, ",".join(ENV_KEYS))
    rigs: list[HostedRig] = []

    def make(**kw: Any) -> HostedRig:
        rig = HostedRig(**kw)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.stop()


def call(rig: HostedRig, method: str, path: str, body: Any = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    return http(method, rig.url + path, body=body, headers=headers, timeout=30)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def counters(rig: HostedRig) -> dict[str, Any]:
    code, _, raw = call(rig, "GET", "/counters", headers=bearer(ENV_KEYS[0]))
    assert code == 200
    return dict(json.loads(raw)["proxy"])


def error_of(raw: bytes) -> dict[str, Any]:
    """The OpenAI error object of a body, checked for its shape."""
    error = body_of(raw)["error"]
    assert {"message", "type", "code", "param"} <= set(error)
    return dict(error)


def sdk(rig: HostedRig, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=rig.url + "/v1", api_key=key, max_retries=0, timeout=30)


# -- pure parts -------------------------------------------------------------------------


@pytest.mark.parametrize(("headers", "key"), [
    ({}, None),
    ({"Authorization": "Bearer k1"}, "k1"),
    ({"Authorization": "bearer   k1  "}, "k1"),
    ({"Authorization": "Bearer "}, None),
    ({"Authorization": "Basic azE6"}, None),
    ({"x-api-key": "k2"}, "k2"),
    ({"x-api-key": "  "}, None),
    ({"Authorization": "Bearer k1", "x-api-key": "k2"}, "k1"),
    ({"Authorization": "Basic azE6", "x-api-key": "k2"}, "k2"),
])
def test_the_presented_key(headers: dict[str, str], key: str | None) -> None:
    """A Bearer token, else x-api-key; another scheme or an empty value is no key."""
    assert presented(headers) == key


@pytest.mark.parametrize(("window", "now", "rpm", "after", "wait"), [
    ((), 0.0, 1, (0.0,), None),
    ((0.0,), 1.0, 1, (0.0,), 59),
    ((0.0,), 59.5, 1, (0.0,), 1),
    ((0.0,), 60.0, 1, (60.0,), None),  # a request 60 s old has left the window
    ((0.0, 10.0), 30.0, 3, (0.0, 10.0, 30.0), None),
    ((0.0, 10.0, 30.0), 30.0, 3, (0.0, 10.0, 30.0), 30),
    ((0.0, 10.0, 30.0), 65.0, 3, (10.0, 30.0, 65.0), None),
    ((0.0, 10.0, 30.0), 69.2, 2, (10.0, 30.0), 1),  # the 10 s one leaves at 70 s
    # more than rpm in the window (its rate was lower): two must leave, the 20 s one last
    ((10.0, 20.0, 30.0), 40.0, 2, (10.0, 20.0, 30.0), 40),
])
def test_admit_rate(window: tuple[float, ...], now: float, rpm: int,
                    after: tuple[float, ...], wait: int | None) -> None:
    """At most `rpm` requests in any 60 s; a refused request does not join the window,
    and the wait is the whole seconds until enough requests have left it."""
    assert admit_rate(window, now, rpm) == (after, wait)


# -- through HTTP -----------------------------------------------------------------------


def test_every_guarded_route_needs_a_key(make_rig: MakeRig) -> None:
    """Each route answers 401 in the OpenAI error shape without a key and with a wrong
    one (as Bearer or as x-api-key), and 200 with a right one sent either way; each
    refusal is counted by its reason."""
    rig = make_rig(clock=ManualClock())
    for method, path, body in GUARDED:
        code, headers, raw = call(rig, method, path, body)
        assert (code, error_of(raw)["code"]) == (401, "missing_api_key"), path
        assert headers["WWW-Authenticate"].startswith("Bearer"), path
        for wrong in (bearer(WRONG), {"x-api-key": WRONG}):
            code, _, raw = call(rig, method, path, body, wrong)
            error = error_of(raw)
            assert (code, error["type"], error["code"]) == \
                (401, "invalid_request_error", "invalid_api_key"), path
        for right in (bearer(ENV_KEYS[0]), {"x-api-key": ENV_KEYS[1]}):
            code, _, raw = call(rig, method, path, body, right)
            assert code == 200, (path, raw)
    assert counters(rig)["auth_failures"] == {"missing_key": 5, "unknown_key": 10}


def test_the_openai_sdk_with_the_right_and_a_wrong_key(make_rig: MakeRig) -> None:
    """The official client is answered with the right key on chat, completions and
    models, and gets AuthenticationError (401, invalid_api_key) with a wrong one."""
    rig = make_rig(clock=ManualClock())
    good = sdk(rig, ENV_KEYS[1])
    chat = good.chat.completions.create(model="m", messages=MSG)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == "primary says hi "
    assert good.completions.create(model="m", prompt="hello").choices[0].text \
        == "primary says hi "
    assert [m.id for m in good.models.list()] == ["m", "n"]
    bad = sdk(rig, WRONG)
    calls: list[Callable[[], object]] = [
        lambda: bad.chat.completions.create(model="m", messages=MSG),  # type: ignore[arg-type]
        lambda: bad.completions.create(model="m", prompt="hello"),
        lambda: bad.models.list(),
    ]
    for attempt in calls:
        with pytest.raises(openai.AuthenticationError) as err:
            attempt()
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    assert len(rig.primary.requests) == 2  # the refused requests never reached a rung


def test_health_is_open(make_rig: MakeRig) -> None:
    """/health and /health/live answer without a key, and a wrong key changes nothing."""
    rig = make_rig(clock=ManualClock())
    for path in ("/health", "/health/live"):
        for headers in (None, bearer(WRONG)):
            assert call(rig, "GET", path, headers=headers)[0] == 200
    assert counters(rig)["auth_failures"] == {}


def test_keys_of_the_variable_and_the_file_work_together(make_rig: MakeRig) -> None:
    """Both keys of the variable and both keys of the file are accepted side by side."""
    rig = make_rig(clock=ManualClock())
    for key in (*ENV_KEYS, ONLY_N, LIMITED):
        code, _, raw = call(rig, "POST", "/v1/chat/completions",
                            {"model": "n", "messages": MSG}, bearer(key))
        assert (code, text_of(raw)) == (200, "backup answers here "), key


def test_a_route_allow_list(make_rig: MakeRig) -> None:
    """A key with routes=n is refused 403 (permission_error, route_not_allowed, param
    model) on route m through both doors, never reaching a rung, is served on n, and
    sees only n in /v1/models; a key without a list sees both."""
    rig = make_rig(clock=ManualClock())
    for path, body in [("/v1/chat/completions", {"model": "m", "messages": MSG}),
                       ("/v1/completions", {"model": "m", "prompt": "hi", "stream": True})]:
        code, _, raw = call(rig, "POST", path, body, bearer(ONLY_N))
        error = error_of(raw)
        assert (code, error["type"], error["code"], error["param"]) == \
            (403, "permission_error", "route_not_allowed", "model")
        assert "'only-n'" in error["message"] and "use: n" in error["message"]
    assert rig.tries() == (0, 0)
    code, _, raw = call(rig, "POST", "/v1/chat/completions", {"model": "n", "messages": MSG},
                        {"x-api-key": ONLY_N})
    assert (code, text_of(raw)) == (200, "backup answers here ")
    listed = {key: [m.id for m in sdk(rig, key).models.list()] for key in (ONLY_N, ENV_KEYS[0])}
    assert listed == {ONLY_N: ["n"], ENV_KEYS[0]: ["m", "n"]}
    assert counters(rig)["auth_failures"] == {"route_not_allowed": 2}


def test_a_request_rate_on_the_proxy_clock(make_rig: MakeRig) -> None:
    """A key with rpm=2 is served twice, then refused 429 with Retry-After until its
    first requests are 60 s old on the proxy's clock, then served again; refusals do
    not fill its window, other keys are not limited, and it is counted by the key's
    name."""
    clock = ManualClock()
    rig = make_rig(clock=clock)

    def ask(key: str = LIMITED) -> tuple[int, dict[str, str], bytes]:
        return call(rig, "POST", "/v1/chat/completions", {"model": "n", "messages": MSG},
                    bearer(key))

    assert [ask()[0], ask()[0]] == [200, 200]
    code, headers, raw = ask()
    error = error_of(raw)
    assert (code, headers["Retry-After"], error["type"], error["code"]) == \
        (429, "60", "rate_limit_error", "rate_limited")
    assert "'limited'" in error["message"] and LIMITED not in error["message"]
    assert ask(ENV_KEYS[0])[0] == 200
    clock.advance(59)
    code, headers, _ = ask()
    assert (code, headers["Retry-After"]) == (429, "1")
    clock.advance(1)
    assert [ask()[0], ask()[0], ask()[0]] == [200, 200, 429]
    c = counters(rig)
    assert c["rate_limited"] == {"limited": 3}
    assert c["auth_failures"] == {}
    assert rig.tries() == (0, 5)


def test_a_key_file_others_may_read_stops_the_proxy(tmp_path: Path) -> None:
    """proxyd refuses to start on a group-readable key file: exit 2, with the mode to
    set, and no key in what it prints."""
    keys = tmp_path / "keys"
    keys.write_text(KEY_FILE)
    keys.chmod(0o640)
    config = tmp_path / "c.toml"
    config.write_text('[proxy]\nlisten = "127.0.0.1:1"\napi_keys_file = "keys"\n'
                      '[[seat]]\nname = "n"\nkind = "openai"\nbase_url = "http://127.0.0.1:1/v1"\n'
                      'upstream_model = "x"\noffbox = true\n'
                      '[[route]]\nmodel = "n"\nladder = ["n"]\noffbox = "allow"\n')
    run = subprocess.run([sys.executable, "-m", "sanctum.cli", "proxyd", "--config", str(config)],
                         env=dict(os.environ, SANCTUM_STATE_DIR=str(tmp_path / "s")),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"(mode 0640); make it the owner's alone: chmod 600 {keys}" in run.stderr
    for secret in ALL_SECRETS:
        assert secret not in run.stdout + run.stderr


def test_no_secret_leaks(make_rig: MakeRig) -> None:
    """A real proxyd process with client keys and a hosted key, asked in ways that fail
    (no key, a wrong key, a route not allowed, an upstream that echoes its key back,
    a prompt over every cap) and that succeed: no client key, presented or configured,
    and no hosted key is in any response, /counters, /metrics, the proxy's log or
    `sanctum check` output, and no client key reaches an upstream."""
    rig = make_rig(primary=["status:401:echo_key"], backup_cap=2000)
    spoken: list[str] = []

    def ask(method: str, path: str, body: Any = None,
            headers: dict[str, str] | None = None) -> int:
        code, got_headers, raw = call(rig, method, path, body, headers)
        spoken.append(json.dumps(got_headers) + raw.decode(errors="replace"))
        return code

    chat = "/v1/chat/completions"
    long = {"model": "n", "messages": [{"role": "user", "content": "word " * 4000}]}
    outcomes = [
        ask("POST", chat, {"model": "m", "messages": MSG}),
        ask("POST", chat, {"model": "m", "messages": MSG}, bearer(WRONG)),
        ask("GET", "/metrics", None, {"x-api-key": WRONG}),
        ask("POST", chat, {"model": "m", "messages": MSG}, bearer(ONLY_N)),
        ask("POST", chat, {"model": "m", "messages": MSG}, bearer(ENV_KEYS[0])),
        ask("POST", chat, long, bearer(ENV_KEYS[1])),
        ask("POST", chat, {"model": "nope", "messages": MSG}, bearer(LIMITED)),
        ask("GET", "/v1/models", None, bearer(ENV_KEYS[0])),
        ask("GET", "/counters", None, bearer(ENV_KEYS[0])),
        ask("GET", "/metrics", None, bearer(ENV_KEYS[0])),
    ]
    assert outcomes == [401, 401, 401, 403, 200, 413, 404, 200, 200, 200]
    assert rig.primary.headers[0]["Authorization"] == f"Bearer {HOSTED_KEY}"  # it was sent
    metrics = spoken[-1]
    assert 'sanctum_proxy_auth_failures_total{reason="unknown_key"} 2.0' in metrics
    assert 'sanctum_proxy_auth_failures_total{reason="route_not_allowed"} 1.0' in metrics
    check = subprocess.run([str(Path(sys.executable).parent / "sanctum"), "check",
                            "--config", str(rig.config)], env=rig.env,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    upstream_saw = json.dumps(rig.primary.headers + rig.backup.headers
                              + rig.primary.requests + rig.backup.requests)
    logs = rig.logs()
    assert "auth_refused" in logs and "[redacted]" in logs
    for secret in ALL_SECRETS:
        for place, text in [("responses", "\n".join(spoken)), ("log", logs),
                            ("check", check.stdout + check.stderr)]:
            assert secret not in text, (secret, place)
        if secret != HOSTED_KEY:
            assert secret not in upstream_saw


def test_sanctum_counters_sends_a_key_of_the_file(make_rig: MakeRig) -> None:
    """`sanctum counters` reads the proxy's counters with the first key of the file when
    the variable is unset (without a key /counters is a 401 and it would fall back to
    seatd, which this rig does not run)."""
    rig = make_rig(clock=ManualClock())
    env = {k: v for k, v in os.environ.items() if k != ENV}
    done = subprocess.run([sys.executable, "-m", "sanctum.cli", "counters", "--json",
                           "--config", str(rig.config)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    proxy = json.loads(done.stdout)["proxy"]
    assert proxy["auth_failures"] == {} and proxy["requests"] == 0
    assert not any(secret in done.stdout + done.stderr for secret in ALL_SECRETS)


CHECK_CONFIG = """
[proxy]
listen = "{listen}"
{keys}

[[seat]]
name = "up"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"

[[route]]
model = "m"
ladder = ["up"]

[[route]]
model = "n"
ladder = ["up"]
"""


@pytest.mark.parametrize(("listen", "keys", "mode", "code", "says"), [
    ("0.0.0.0:8800", "", None, 0, "warning: proxy.listen 0.0.0.0:8800 is reachable"),
    ("127.0.0.1:8800", "", None, 0, None),
    ("0.0.0.0:8800", "file", 0o600, 0, None),
    ("127.0.0.1:8800", "file", 0o644, 1, "error: client keys: "),
], ids=["open-no-keys", "loopback-no-keys", "open-with-keys", "loose-key-file"])
def test_sanctum_check_looks_at_the_keys(tmp_path: Path, listen: str, keys: str,
                                         mode: int | None, code: int, says: str | None) -> None:
    """`sanctum check` fails on a key file proxyd would refuse (naming the chmod, never
    the key) and warns when the port reaches the network with no key set."""
    setting = ""
    if keys:
        path = tmp_path / "keys"
        path.write_text(KEY_FILE)
        assert mode is not None
        path.chmod(mode)
        setting = f'api_keys_file = "{path}"'
    config = tmp_path / "sanctum.toml"
    config.write_text(CHECK_CONFIG.format(listen=listen, keys=setting))
    done = subprocess.run([sys.executable, "-m", "sanctum.cli", "check", "--config",
                           str(config)], capture_output=True, text=True, timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode == code, out
    if says is None:
        assert "warning: proxy.listen" not in out and "client keys" not in out
    else:
        assert says in out
    if mode == 0o644:
        assert "chmod 600" in out
    assert not any(secret in out for secret in ALL_SECRETS)


def test_a_refusal_at_the_anthropic_door_is_in_its_shape_and_counted_there(
        make_rig: MakeRig) -> None:
    """No key at /v1/messages: a 401 in Anthropic's error shape with its request id,
    counted as one of that door's requests and as its authentication_error; the right
    key, sent as x-api-key as the anthropic SDK sends it, passes."""
    rig = make_rig(clock=ManualClock())
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    code, headers, raw = call(rig, "POST", "/v1/messages", body)
    reply = json.loads(raw)
    assert code == 401 and reply["type"] == "error", reply
    assert reply["error"]["type"] == "authentication_error"
    assert reply["request_id"] == headers["X-Request-Id"]
    c = counters(rig)
    assert c["door_requests"] == {"messages": 1}
    assert c["door_errors"] == {"messages": {"authentication_error": 1}}
    code, _, raw = call(rig, "POST", "/v1/messages", body, {"x-api-key": ENV_KEYS[1]})
    assert code == 200, raw
    assert counters(rig)["door_requests"] == {"messages": 2}
