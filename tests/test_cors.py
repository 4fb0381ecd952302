"""CORS for the origins the config lists, through real HTTP to a real proxyd (in front
of a fake hosted upstream): a listed origin's preflight is answered without a key, its
requests still need one and name the origin in their answer; an unlisted origin gets no
CORS header at all.  Without cors_origins, nothing changes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from proxyd import cors
from shared.config import ConfigError, parse_config
from tests.hosted_rig import MSG, HostedRig
from tests.procs import http

PAGE = "http://notes.lan:3000"
CLIENT_KEY = "sk-client-0123456789abcdef"
KEYS_ENV = "SANCTUM_TEST_CLIENT_KEYS"


def test_only_listed_origins_are_allowed() -> None:
    assert cors.allowed(PAGE, [PAGE]) and cors.allowed("http://x", ["*"])
    assert not cors.allowed("http://evil.lan", [PAGE]) and not cors.allowed(None, ["*"])
    assert not cors.allowed("", [PAGE])


def test_a_preflight_echoes_plain_asked_headers_only() -> None:
    h = cors.preflight(PAGE, "authorization, content-type, x-stainless-os")
    assert h["Access-Control-Allow-Headers"] == "authorization, content-type, x-stainless-os"
    assert h["Access-Control-Allow-Origin"] == PAGE and h["Vary"] == "Origin"
    assert h["Access-Control-Max-Age"] == str(cors.MAX_AGE_S)
    odd = cors.preflight(PAGE, "content-type\r\nx-evil: 1")
    assert odd["Access-Control-Allow-Headers"] == cors.HEADERS


@pytest.mark.parametrize("origin", ["http://notes.lan:3000/path", "notes.lan", "ftp://x"])
def test_an_origin_that_is_not_one_is_a_config_error(origin: str) -> None:
    with pytest.raises(ConfigError, match=r"proxy.cors_origins\[0\]"):
        parse_config(f'[proxy]\ncors_origins = ["{origin}"]\n[[seat]]\nname = "h"\n'
                     'kind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n'
                     '[[route]]\nmodel = "m"\nladder = ["h"]\n')


@pytest.fixture(params=[True, False], ids=["keys", "no-keys"])
def rig(request: pytest.FixtureRequest) -> Iterator[tuple[HostedRig, bool]]:
    keys = bool(request.param)
    extra = f'cors_origins = ["{PAGE}"]' + (f'\napi_keys_env = "{KEYS_ENV}"' if keys else "")
    r = HostedRig(primary=["ok"], backup=["ok"], proxy_extra=extra,
                  env={KEYS_ENV: CLIENT_KEY})
    yield r, keys
    r.stop()


def post(rig: HostedRig, origin: str | None, key: str | None
         ) -> tuple[int, dict[str, str], bytes]:
    headers = {}
    if origin:
        headers["Origin"] = origin
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return http("POST", rig.url + "/v1/chat/completions",
                {"model": "m", "messages": MSG}, headers=headers)


def preflight(rig: HostedRig, origin: str) -> tuple[int, dict[str, str], bytes]:
    return http("OPTIONS", rig.url + "/v1/chat/completions", None, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def cors_headers(headers: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower().startswith("access-control-")}


def test_a_listed_origin_is_answered_and_an_unlisted_one_is_not(
        rig: tuple[HostedRig, bool]) -> None:
    r, keys = rig
    key = CLIENT_KEY if keys else None
    status, headers, _ = preflight(r, PAGE)  # never with a key: browsers send none
    assert status == 204
    assert cors_headers(headers) == {
        "Access-Control-Allow-Origin": PAGE, "Access-Control-Allow-Methods": cors.METHODS,
        "Access-Control-Allow-Headers": "authorization, content-type",
        "Access-Control-Max-Age": str(cors.MAX_AGE_S)}
    status, headers, body = post(r, PAGE, key)
    assert status == 200, body
    assert headers["Access-Control-Allow-Origin"] == PAGE and headers["Vary"] == "Origin"
    assert "X-Sanctum-Seat" in headers["Access-Control-Expose-Headers"]
    if keys:  # the page still needs its key; its error names the origin so it can read it
        status, headers, _ = post(r, PAGE, None)
        assert status == 401 and headers["Access-Control-Allow-Origin"] == PAGE
    status, headers, _ = preflight(r, "http://evil.lan")
    assert status != 204 and not cors_headers(headers)
    status, headers, _ = post(r, "http://evil.lan", key)
    assert status == 200 and not cors_headers(headers)
    status, headers, _ = post(r, None, key)
    assert status == 200 and not cors_headers(headers)


def test_no_cors_origins_means_no_cors_header() -> None:
    r = HostedRig(primary=["ok"], backup=["ok"])
    try:
        status, headers, _ = preflight(r, PAGE)
        assert status == 405 and not cors_headers(headers)
        status, headers, _ = post(r, PAGE, None)
        assert status == 200 and not cors_headers(headers)
    finally:
        r.stop()


@pytest.mark.parametrize(("origins", "warned"), [('["*"]', True), (f'["{PAGE}"]', False)])
def test_check_warns_of_any_origin_beside_keys(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str],
                                               origins: str, warned: bool) -> None:
    from sanctum.cli import main

    monkeypatch.setenv(KEYS_ENV, CLIENT_KEY)
    config = tmp_path / "c.toml"
    config.write_text(f'[proxy]\ncors_origins = {origins}\napi_keys_env = "{KEYS_ENV}"\n'
                      '[[seat]]\nname = "h"\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n'
                      '[[route]]\nmodel = "m"\nladder = ["h"]\n')
    main(["check", "--config", str(config)])
    out = capsys.readouterr().out
    assert ('cors_origins has "*" and client keys are set' in out) is warned, out
