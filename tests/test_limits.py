"""Input limits: every check passes at its limit and refuses at limit + 1 with the field
and both numbers; the doors apply them, answer in the OpenAI error shape and count
`input_refused{field}`; the body's limit holds before and while it is read."""

from __future__ import annotations

import gzip
import http.client as httpclient
import json
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from proxyd import limits as lim
from proxyd.doors.openai_api import parse_chat, parse_completion
from shared.clock import ManualClock
from shared.config import ProxyConfig
from shared.errors import BadRequest, PayloadTooLarge
from shared.protocol import MAX_LOGIT_BIAS
from tests.procs import free_port, http
from tests.proxy_thread import ProxyThread

LIMITS = ProxyConfig(max_body_bytes=4096, max_messages=3, max_content_chars=50,
                     max_completion_tokens=100, max_stop=2, max_stop_chars=5, max_tools=2,
                     max_schema_bytes=40)

# (name, check at a value, the limit, error class, param)
CHECKS: list[tuple[str, Callable[[int], None], int, type[Exception], str]] = [
    ("body", lambda n: lim.check_body(n, LIMITS), 4096, PayloadTooLarge, "body"),
    ("messages", lambda n: lim.check_messages("messages", n, LIMITS), 3, BadRequest,
     "messages"),
    ("content", lambda n: lim.check_text("messages[3].content", n, LIMITS), 50,
     PayloadTooLarge, "messages[3].content"),
    ("max_tokens", lambda n: lim.check_max_tokens("max_tokens", n, LIMITS), 100, BadRequest,
     "max_tokens"),
    ("stop count", lambda n: lim.check_stops("stop", ["s"] * n, LIMITS), 2, BadRequest,
     "stop"),
    ("stop chars", lambda n: lim.check_stops("stop", ["a", "b" * n], LIMITS), 5, BadRequest,
     "stop[1]"),
    ("stop string", lambda n: lim.check_stops("stop", ["b" * n], LIMITS, listed=False), 5,
     BadRequest, "stop"),
    ("tools", lambda n: lim.check_tools("tools", n, LIMITS), 2, BadRequest, "tools"),
    ("schema", lambda n: lim.check_schema("tools[0].function.parameters", n, LIMITS), 40,
     BadRequest, "tools[0].function.parameters"),
    ("logit_bias", lambda n: lim.check_logit_bias("logit_bias", n), MAX_LOGIT_BIAS,
     BadRequest, "logit_bias"),
]


@pytest.mark.parametrize(("name", "check", "limit", "error", "param"), CHECKS,
                         ids=[c[0] for c in CHECKS])
def test_each_limit_passes_at_limit_and_refuses_one_past(
        name: str, check: Callable[[int], None], limit: int, error: type[Exception],
        param: str) -> None:
    """At the limit: no error.  One past: the error class, `param` naming the field, and
    `limit` and `actual` in the OpenAI error body; counted under the field sans indexes."""
    check(limit)
    with pytest.raises(error) as refused:
        check(limit + 1)
    body = refused.value.body()["error"]  # type: ignore[attr-defined]
    assert body["param"] == param
    assert (body["limit"], body["actual"]) == (limit, limit + 1)
    assert str(limit) in body["message"] and str(limit + 1) in body["message"]
    assert lim.refused_field(refused.value) == lim.field_name(param)  # type: ignore[arg-type]


@pytest.mark.parametrize(("param", "label"), [
    ("messages[3].content", "messages.content"),
    ("tools[12].function.parameters", "tools.function.parameters"),
    ("stop[2]", "stop"), ("body", "body"),
])
def test_field_name_drops_indexes(param: str, label: str) -> None:
    """A counter label never carries an index, so its variety stays bounded."""
    assert lim.field_name(param) == label


def test_an_empty_stop_is_bad_input_not_a_limit() -> None:
    """An empty stop is a 400 naming it, not counted as a limit refusal."""
    with pytest.raises(BadRequest) as bad:
        lim.check_stops("stop", ["a", ""], LIMITS)
    assert bad.value.param == "stop[1]" and lim.refused_field(bad.value) is None


def test_an_unsized_body_is_refused_with_the_limit() -> None:
    """A body found too large while read (chunked) names the limit; actual is unknown."""
    lim.check_body(None, LIMITS)
    body = lim.body_too_large(LIMITS).body()["error"]
    assert (body["param"], body["limit"], body["actual"], body["code"]) == \
        ("body", 4096, None, "payload_too_large")


def test_a_schema_too_deep_to_encode_is_a_400() -> None:
    nested: Any = []
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(BadRequest) as bad:
        lim.encoded_bytes("response_format.json_schema.schema", nested)
    assert bad.value.param == "response_format.json_schema.schema"
    assert lim.encoded_bytes("x", {"type": "object"}) == len(b'{"type":"object"}')


@pytest.mark.parametrize(("body", "depth"), [
    (b'{"model":"m"}', 1),
    (b"42", 0),
    (b'{"a":[1,{"b":[]}],"c":{}}', 4),
    (b'{"a":"[[[[{{{{"}', 1),  # brackets inside a string do not count
    (b'{"a":"quote \\" [[[ \\\\","b":[[]]}', 3),  # escaped quote, escaped backslash
    (b'{"a":"\\\\"}', 1),  # a string ending in a backslash ends there
    (b"[" * 500 + b"]" * 500, 500),
])
def test_json_depth_counts_brackets_outside_strings(body: bytes, depth: int) -> None:
    assert lim.json_depth(body) == depth


def test_a_body_nested_past_the_limit_is_refused_with_numbers() -> None:
    """The same on every Python (a decoder's own limit is Python's recursion limit), at
    every door: each decodes its body through `openai_api.decode_body`."""
    nested = b"[" * (lim.MAX_JSON_DEPTH + 1) + b"]" * (lim.MAX_JSON_DEPTH + 1)
    chat_body = b'{"model":"m","messages":[{"role":"user","content":"x"}],"x":' + nested + b"}"
    for parse in (parse_chat, parse_completion):
        with pytest.raises(lim.OverLimit) as over:
            parse(chat_body, ProxyConfig())
        error = over.value.body()["error"]
        assert (error["param"], error["limit"], error["actual"]) == \
            ("body", lim.MAX_JSON_DEPTH, lim.MAX_JSON_DEPTH + 2)
    at = b"[" * (lim.MAX_JSON_DEPTH - 1) + b"]" * (lim.MAX_JSON_DEPTH - 1)
    lim.check_depth(b'{"x":' + at + b"}")  # at the limit: decoded as before


# -- the doors ---------------------------------------------------------------


def chat(**kw: Any) -> bytes:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(kw)
    return json.dumps(body).encode()


def user(n: int, text: str = "x") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}] * n


def tool(schema_bytes: int, name: str = "f") -> dict[str, Any]:
    """A tool whose parameters encode to `schema_bytes` bytes of compact JSON."""
    pad = "d" * (schema_bytes - len(b'{"description":""}'))
    return {"type": "function", "function": {"name": name, "parameters": {"description": pad}}}


def tools(*sizes: int) -> list[dict[str, Any]]:
    """Tools of these schema sizes, each named apart (a name twice is refused)."""
    return [tool(n, f"f{i}") for i, n in enumerate(sizes)]


def schema(schema_bytes: int) -> dict[str, Any]:
    pad = "d" * (schema_bytes - len(b'{"description":""}'))
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": {"description": pad}}}


def tool_turns(result: str = "r", args: str = "{}") -> list[dict[str, Any]]:
    """A question, the assistant's call (its arguments `args`), the tool's `result`."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
    return [*user(1), {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": result}]


def bias(n: int) -> dict[str, int]:
    return {str(i): 1 for i in range(n)}


# (name, body at the limit, body one past, param); chat unless it says prompt
DOOR_CASES: list[tuple[str, bytes, bytes, str]] = [
    ("messages", chat(messages=user(3)), chat(messages=user(4)), "messages"),
    ("content", chat(messages=user(2, "y" * 50)),
     chat(messages=[*user(1), {"role": "user", "content": "y" * 51}]), "messages[1].content"),
    ("content parts", chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "y" * 25}, {"type": "text", "text": "y" * 25}]}]),
     chat(messages=[{"role": "user", "content": [
         {"type": "text", "text": "y" * 25}, {"type": "text", "text": "y" * 26}]}]),
     "messages[0].content"),
    ("max_tokens", chat(max_tokens=100), chat(max_tokens=101), "max_tokens"),
    ("max_completion_tokens", chat(max_completion_tokens=100),
     chat(max_completion_tokens=101), "max_completion_tokens"),
    ("stop count", chat(stop=["a", "b"]), chat(stop=["a", "b", "c"]), "stop"),
    ("stop chars", chat(stop=["a", "12345"]), chat(stop=["a", "123456"]), "stop[1]"),
    ("stop string", chat(stop="12345"), chat(stop="123456"), "stop"),
    ("tools", chat(tools=tools(20, 20)), chat(tools=tools(20, 20, 20)), "tools"),
    ("tool schema", chat(tools=tools(20, 40)), chat(tools=tools(20, 41)),
     "tools[1].function.parameters"),
    ("response schema", chat(response_format=schema(40)), chat(response_format=schema(41)),
     "response_format.json_schema.schema"),
    ("tool result", chat(messages=tool_turns("y" * 50)), chat(messages=tool_turns("y" * 51)),
     "messages[2].content"),
    ("tool call arguments", chat(messages=tool_turns(args="a" * 50)),
     chat(messages=tool_turns(args="a" * 51)), "messages[1].tool_calls[0].function.arguments"),
    ("logit_bias", chat(logit_bias=bias(MAX_LOGIT_BIAS)), chat(logit_bias=bias(MAX_LOGIT_BIAS + 1)),
     "logit_bias"),
    ("prompt", b'{"model":"m","prompt":"' + b"p" * 50 + b'"}',
     b'{"model":"m","prompt":"' + b"p" * 51 + b'"}', "prompt"),
    ("prompt list", b'{"model":"m","prompt":["' + b"p" * 50 + b'"]}',
     b'{"model":"m","prompt":["' + b"p" * 51 + b'"]}', "prompt[0]"),
    ("completion max_tokens", b'{"model":"m","prompt":"p","max_tokens":100}',
     b'{"model":"m","prompt":"p","max_tokens":101}', "max_tokens"),
]


def parse(body: bytes) -> object:
    return (parse_chat if b'"messages"' in body else parse_completion)(body, LIMITS)


@pytest.mark.parametrize(("name", "at", "over", "param"), DOOR_CASES,
                         ids=[c[0] for c in DOOR_CASES])
def test_the_doors_apply_each_limit(name: str, at: bytes, over: bytes, param: str) -> None:
    """The chat and completion parsers take a body at each limit and refuse one past
    it, naming the field (with its index) and the limit."""
    parse(at)
    with pytest.raises((BadRequest, PayloadTooLarge)) as refused:
        parse(over)
    body = refused.value.body()["error"]
    assert body["param"] == param
    assert body["actual"] == body["limit"] + 1


# -- over HTTP ---------------------------------------------------------------

HTTP_CONFIG = """
[proxy]
listen = "127.0.0.1:{port}"
load_wait_s = 0
max_body_bytes = 4096
max_messages = 3
max_content_chars = 50

[[seat]]
name = "brain"
model = "unused"

[[route]]
model = "m"
ladder = ["brain"]
"""


@pytest.fixture(scope="module")
def proxy() -> Iterator[str]:
    """proxyd (in this process) with small limits and no seat: every request here is
    refused before the ladder, or finds its seat down."""
    tmp = Path(tempfile.mkdtemp(prefix="lim-", dir="/tmp"))
    port = free_port()
    (tmp / "c.toml").write_text(HTTP_CONFIG.format(port=port))
    (tmp / "s").mkdir()
    p = ProxyThread(tmp / "c.toml", {"SANCTUM_STATE_DIR": str(tmp / "s")}, tmp / "log",
                    ManualClock())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        p.stop()
        assert p.poll() == 0
        shutil.rmtree(tmp, ignore_errors=True)


def raw_post(url: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def error_of(body: bytes) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(body)["error"]
    assert {"message", "type", "code", "param"} <= error.keys()
    return error


def refused_counts(url: str) -> dict[str, int]:
    counts: dict[str, int] = json.loads(http("GET", url + "/counters")[2])["proxy"][
        "input_refused"]
    return counts


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_declared_body_past_the_limit_is_413_before_it_is_read(proxy: str,
                                                                  path: str) -> None:
    """Content-Length one past max_body_bytes: 413 naming `body` with both numbers,
    counted; at the limit the body is read and parsed (here: a 400 for its content)."""
    before = refused_counts(proxy).get("body", 0)
    status, body = raw_post(proxy, path, b" " * 4097, {"Content-Type": "application/json"})
    error = error_of(body)
    assert (status, error["param"], error["limit"], error["actual"]) == (413, "body", 4096, 4097)
    assert refused_counts(proxy)["body"] == before + 1
    status, body = raw_post(proxy, path, b" " * 4096, {"Content-Type": "application/json"})
    assert status == 400 and error_of(body)["param"] == "body"


def expect_continue(url: str, length: int) -> bytes:
    """Send only the headers of a POST that declares `length` bytes and asks
    `Expect: 100-continue`; what the proxy says before any body is sent."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {length}\r\n"
                     "Expect: 100-continue\r\n\r\n".encode())
        answer = sock.recv(65536)
        if answer.startswith(b"HTTP/1.1 413"):
            while b"}}" not in answer:  # the JSON body may come in a later segment
                answer += sock.recv(65536)
        return answer


def test_expect_continue_past_the_limit_gets_the_413_instead_of_the_100(proxy: str) -> None:
    """A client that asks before sending (curl, over 1 MiB) is told 413 with the numbers
    and never sends the body; at the limit it is told to go on."""
    answer = expect_continue(proxy, 4097)
    assert answer.startswith(b"HTTP/1.1 413")
    error = error_of(answer.split(b"\r\n\r\n", 1)[1])
    assert (error["param"], error["limit"], error["actual"]) == ("body", 4096, 4097)
    assert expect_continue(proxy, 4096).startswith(b"HTTP/1.1 100 Continue")


def test_a_chunked_body_past_the_limit_is_413_naming_body(proxy: str) -> None:
    """Without Content-Length, aiohttp's own refusal comes back in the OpenAI shape."""
    host, port = proxy.removeprefix("http://").split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=iter([b"x" * 3000, b"x" * 3000]),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
        r = conn.getresponse()
        status, body = r.status, r.read()
    finally:
        conn.close()
    error = error_of(body)
    assert (status, error["param"], error["limit"], error["code"]) == \
        (413, "body", 4096, "payload_too_large")


def test_a_compressed_body_is_held_to_the_limit_once_inflated(proxy: str) -> None:
    """A small gzip body that inflates past the limit is refused as it is read."""
    small = gzip.compress(chat(messages=user(1, "z" * 8000)))
    assert len(small) < 4096
    status, body = raw_post(proxy, "/v1/chat/completions", small,
                            {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 413 and error_of(body)["param"] == "body"


def test_limits_over_http_name_the_field_and_are_counted(proxy: str) -> None:
    """A field past its limit: the OpenAI shape, its param and numbers, and
    input_refused{field} counted without the index."""
    before = refused_counts(proxy)
    status, _, body = http("POST", proxy + "/v1/chat/completions",
                           raw=chat(messages=[*user(1), {"role": "user", "content": "y" * 51}]))
    error = error_of(body)
    assert (status, error["param"], error["limit"], error["actual"]) == \
        (413, "messages[1].content", 50, 51)
    status, _, body = http("POST", proxy + "/v1/chat/completions", raw=chat(messages=user(4)))
    assert (status, error_of(body)["param"]) == (400, "messages")
    after = refused_counts(proxy)
    assert after.get("messages.content", 0) == before.get("messages.content", 0) + 1
    assert after.get("messages", 0) == before.get("messages", 0) + 1


# Bad input of every class the doors meet, and what each gets: (body, status, param).
NESTED = b"[" * 100_000 + b"]" * 100_000
BAD_INPUT: list[tuple[str, bytes, int, str | None]] = [
    ("empty body", b"", 400, "body"),
    ("not JSON", b"{nope", 400, "body"),
    ("invalid UTF-8", b'{"model":"m","messages":[{"role":"user","content":"\xff"}]}', 400,
     "body"),
    ("lone surrogate", b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}',
     400, "body"),
    ("array body", b"[1]", 400, "body"),
    ("number body", b"42", 400, "body"),
    ("deeply nested body", NESTED[:2000] + NESTED[-2000:], 400, "body"),
    ("deeply nested field", b'{"model":"m","x":' + NESTED[:2000] + NESTED[-2000:] + b"}",
     400, "body"),
    ("NaN", b'{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":NaN}',
     400, "body"),
    ("Infinity literal", chat(temperature=float("inf")), 400, "body"),
    ("1e999 (infinite)", b'{"model":"m","messages":[{"role":"user","content":"x"}],'
     b'"temperature":1e999}', 400, "temperature"),
    ("huge max_tokens", b'{"model":"m","messages":[{"role":"user","content":"x"}],'
     b'"max_tokens":' + b"9" * 400 + b"}", 400, "max_tokens"),
    ("huge seed", chat(seed=2**64), 400, "seed"),
    ("huge top_k", chat(top_k=2**64), 400, "top_k"),
    ("negative max_tokens", chat(max_tokens=-1), 400, "max_tokens"),
    ("temperature out of range", chat(temperature=2.5), 400, "temperature"),
    ("n > 1", chat(n=2), 400, "n"),
    ("empty messages", chat(messages=[]), 400, "messages"),
    ("image part", chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}]}]),
     400, "messages[0].content[1].type"),
    ("text part without text", chat(messages=[{"role": "user", "content": [
        {"type": "text"}]}]), 400, "messages[0].content[0].text"),
    ("unknown role", chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages[0].role"),
    ("missing model", json.dumps({"messages": user(1)}).encode(), 400, "model"),
    ("missing role", chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    ("wrong type", chat(stream="yes"), 400, "stream"),
    ("unknown route", chat(model="nope"), 404, "model"),
]


@pytest.mark.parametrize(("name", "body", "status", "param"), BAD_INPUT,
                         ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_a_clean_4xx_naming_the_field(proxy: str, name: str, body: bytes,
                                                   status: int, param: str | None) -> None:
    """Each class of bad input gets its 4xx in the OpenAI shape, naming the field."""
    got, _, answer = http("POST", proxy + "/v1/chat/completions", raw=body)
    assert (got, error_of(answer)["param"]) == (status, param)


def test_the_door_takes_content_parts_and_no_content_type(proxy: str) -> None:
    """Text parts are one text, and a body without Content-Type is still read as JSON:
    both reach the ladder (whose seat is down here: 503, not a refusal)."""
    parts = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}])
    assert http("POST", proxy + "/v1/chat/completions", raw=parts)[0] == 503
    status, body = raw_post(proxy, "/v1/chat/completions", chat(), {})
    assert status == 503 and error_of(body)["code"] != "invalid_request"


def test_a_get_on_a_door_is_405_in_the_openai_shape(proxy: str) -> None:
    status, _, body = http("GET", proxy + "/v1/chat/completions")
    assert status == 405 and error_of(body)["code"] == "method_not_allowed"
    status, _, body = http("POST", proxy + "/v1/nothing", raw=chat())
    assert status == 404 and error_of(body)["type"] == "invalid_request_error"
