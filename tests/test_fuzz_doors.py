"""Fuzzing the HTTP doors of a real proxyd (a process, in front of fake seats).

Generated bodies go over real HTTP to each door (chat and text completions, Anthropic
Messages and its count_tokens, OpenAI Responses): random bytes, random JSON (NaN and
Infinity included), and near-valid requests with fields mutated, dropped, nested
100,000 arrays deep, or set at and one past each input limit; each sent plain,
chunked, gzip-compressed or without a Content-Type.  Every answer is a 4xx in its
door's error shape (Anthropic's at /v1/messages, OpenAI's elsewhere) or a 200 (a valid
request is answered by the fake seat), never a 5xx; afterwards the proxy and the seats
are still up and serve a good request at each door.

FUZZ_EXAMPLES raises the number of inputs per test (the suite's default keeps the
file at a few seconds); FUZZ_REPORT names a JSON file that gets the inputs tried and
the statuses seen, for a longer run outside the suite:

    FUZZ_EXAMPLES=10000 FUZZ_REPORT=fuzz.json pytest tests/test_fuzz_doors.py
"""

from __future__ import annotations

import gzip
import http.client as httpclient
import json
import os
import socket
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.config import ProxyConfig

if TYPE_CHECKING:  # imported where used, so that the atheris run below loads proxyd
    from tests.rig import Rig  # under its instrumentation

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CHAT, COMPLETIONS, MESSAGES, COUNT, RESPONSES = (
    "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/responses")
DOORS = (CHAT, COMPLETIONS, MESSAGES, COUNT, RESPONSES)
L = ProxyConfig()  # the rig's proxy runs with the default limits
SEEN: Counter[str] = Counter()  # "door status" -> count, over the module's tests


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    from tests.rig import Rig

    r = Rig({"brain": "ok", "coder": "ok"}, tokens=3)
    try:
        yield r
    finally:
        r.stop()
        report = os.environ.get("FUZZ_REPORT")
        if report:
            with open(report, "w") as f:
                json.dump({"inputs": sum(SEEN.values()), "statuses": dict(SEEN)}, f, indent=1)


# -- what is sent --------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=4),
    max_leaves=10)


def text(n: int) -> str:
    return "x" * n


def tool(schema_bytes: int = 20) -> dict[str, Any]:
    pad = "d" * max(0, schema_bytes - len(b'{"description":""}'))
    return {"type": "function", "function": {"name": "f", "parameters": {"description": pad}}}


USER = {"role": "user", "content": "hi"}
# Set as a field's value, it is sent as arrays nested this deep.
DEEP = "\x00deep"
DEPTH = 100_000
# Values at and one past each limit, and the edges of each field's range.
EDGES: dict[str, list[Any]] = {
    "model": ["private", "open", "optin", "", "nope", 7, None],
    "stream": [True, False, "yes", 1],
    "stream_options": [{"include_usage": True}, {"include_usage": 1}, []],
    "temperature": [0, 2, 2.0000001, -0.0, -1, 1e308, "1"],
    "top_p": [0, 1e-300, 1, 1.0000001],
    "top_k": [0, -1, 2**63 - 1, 2**63, 2**64],
    "max_tokens": [0, 1, L.max_completion_tokens, L.max_completion_tokens + 1, -1, 2**63,
                   10**40, 1.5],
    "max_completion_tokens": [1, L.max_completion_tokens, L.max_completion_tokens + 1],
    "seed": [-(2**63), -(2**63) - 1, 2**63 - 1, 2**63, 2**64, 10**40],
    "n": [0, 1, 2, 10**30],
    "logprobs": [True, False, 0, 5],
    "stop": [[], [""], "", ["s"] * L.max_stop, ["s"] * (L.max_stop + 1),
             [text(L.max_stop_chars)], [text(L.max_stop_chars + 1)],
             text(L.max_stop_chars + 1), [1]],
    "messages": [[], [USER] * L.max_messages, [USER] * (L.max_messages + 1),
                 [{"role": "user", "content": text(L.max_content_chars)}],
                 [{"role": "user", "content": text(L.max_content_chars + 1)}],
                 [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                 [{"role": "user", "content": [{"type": "text"}]}],
                 [{"role": "wizard", "content": "x"}], [{"content": "x"}], [None], {}],
    "prompt": ["", "p", text(L.max_content_chars), text(L.max_content_chars + 1), [],
               ["a", "b"], ["a"], [1]],
    "tools": [[], [tool()] * L.max_tools, [tool()] * (L.max_tools + 1),
              [tool(L.max_schema_bytes)], [tool(L.max_schema_bytes + 1)], [1], "t",
              [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]],
    "response_format": [{"type": "json_object"},
                        {"type": "json_schema", "json_schema": {"schema": {
                            "description": text(L.max_schema_bytes)}}}, "json"],
    "sanctum": [{"kv": "q8"}, {"kv": "q9"}, {"draft_depth": 17}, {"solo": True},
                {"bogus": 1}, []],
    # the Anthropic door's own
    "system": ["be brief", [{"type": "text", "text": "x"}], [{"type": "image"}], 3,
               text(L.max_content_chars + 1)],
    "stop_sequences": [[], ["s"] * L.max_stop, ["s"] * (L.max_stop + 1), "s"],
    "thinking": [{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}, 1],
    # the Responses door's own
    "input": ["hi", "", [], [{"role": "user", "content": "hi"}],
              [{"type": "function_call_output", "call_id": "c", "output": "x"}],
              [{"role": "user", "content": [{"type": "input_image"}]}],
              text(L.max_content_chars + 1)],
    "instructions": ["be brief", "", text(L.max_content_chars + 1), 1],
    "max_output_tokens": [0, 1, L.max_completion_tokens + 1, -1],
    "text": [{"format": {"type": "json_object"}}, {"format": {"type": "text"}},
             {"format": {"type": "json_schema", "name": "x", "schema": DEEP}}, "t"],
    "store": [True, False, None],
    "previous_response_id": ["resp_1", None],
}
FIELDS = sorted(EDGES)


@st.composite
def near_valid(draw: st.DrawFn, door: str) -> bytes:
    """A good request with one to four fields set to an edge value, a random JSON value,
    or dropped; sometimes an unknown field added; messages mutated inside."""
    body: dict[str, Any] = dict(GOOD[door])
    if "messages" in body:
        body["messages"] = [dict(USER)]
    for _ in range(draw(st.integers(1, 4))):
        field = draw(st.sampled_from(FIELDS))
        # deep: only fields of any JSON (unknown ones, a tool's parameters) can take it
        how = draw(st.sampled_from(["edge", "edge", "random", "drop", "deep"]))
        if how == "deep":
            body[field] = DEEP
        elif how == "edge":
            body[field] = draw(st.sampled_from(EDGES[field]))
        elif how == "random":
            body[field] = draw(JSON)
        else:
            body.pop(field, None)
    if draw(st.booleans()) and isinstance(body.get("messages"), list) and body["messages"]:
        i = draw(st.integers(0, len(body["messages"]) - 1))
        key = draw(st.sampled_from(["role", "content", "name"]))
        msg = body["messages"][i]
        if isinstance(msg, dict):
            body["messages"][i] = {**msg, key: draw(JSON)}
    if draw(st.booleans()):  # an unknown field, skipped by the decoder (even if deep)
        body[draw(st.text(max_size=8))] = draw(JSON | st.just(DEEP))
    nested = b"[" * DEPTH + b"]" * DEPTH
    return json.dumps(body).encode().replace(json.dumps(DEEP).encode(), nested)


def bodies(door: str) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=512),
        JSON.map(lambda v: json.dumps(v).encode()),
        st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6).map(
            lambda v: json.dumps(v).encode()),
        near_valid(door),
    )


def post(rig: Rig, door: str, body: bytes, how: str) -> tuple[int, str, bytes]:
    """POST `body` to `door`, `how`: plain, chunked, gzip (Content-Encoding) or bare
    (no Content-Type); the status, Content-Type and whole body of the answer."""
    headers = {"Content-Type": "application/json"}
    data: bytes | Iterator[bytes] = body
    chunked = False
    if how == "gzip":
        data = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    elif how == "bare":
        headers = {}
    elif how == "chunked":
        data = iter([body[: len(body) // 2], body[len(body) // 2:]])
        chunked = True
    conn = httpclient.HTTPConnection("127.0.0.1", rig.port, timeout=60)
    try:
        conn.request("POST", door, body=data, headers=headers, encode_chunked=chunked)
        r = conn.getresponse()
        return r.status, r.headers.get("Content-Type", ""), r.read()
    finally:
        conn.close()


def assert_clean(door: str, status: int, content_type: str, answer: bytes) -> None:
    """A 200 answer (JSON, or a stream ending as its API ends one) or a 4xx in the door's
    error shape."""
    assert status < 500, answer[:500]
    if status == 200:
        if content_type.startswith("text/event-stream"):
            assert any(end in answer for end in STREAM_END[door]), answer[-300:]
        else:
            reply = json.loads(answer)
            assert {CHAT: "choices", COMPLETIONS: "choices", MESSAGES: "content",
                    COUNT: "input_tokens", RESPONSES: "output"}[door] in reply, answer[:300]
        return
    assert 400 <= status < 500 and content_type.startswith("application/json"), answer[:300]
    reply = json.loads(answer)
    error = reply["error"]
    assert isinstance(error["message"], str) and error["message"]
    if door in (MESSAGES, COUNT):  # Anthropic's shape
        assert reply["type"] == "error" and isinstance(error["type"], str), answer[:300]
    else:
        assert isinstance(error["type"], str) and "code" in error and "param" in error


HOW = st.sampled_from(["plain", "plain", "chunked", "gzip", "bare"])
# A good request at each door, and how each door's stream ends when it is complete.
GOOD: dict[str, dict[str, Any]] = {
    CHAT: {"model": "private", "messages": [USER]},
    COMPLETIONS: {"model": "private", "prompt": "hello"},
    MESSAGES: {"model": "private", "max_tokens": 16, "messages": [USER]},
    COUNT: {"model": "private", "messages": [USER]},
    RESPONSES: {"model": "private", "input": "hello"},
}
# (a Responses stream cut by its budget ends with response.incomplete: the fake seat's
# answers always run to their length)
STREAM_END = {CHAT: (b"\ndata: [DONE]\n",), COMPLETIONS: (b"\ndata: [DONE]\n",),
              MESSAGES: (b"event: message_stop\n",),
              RESPONSES: (b"event: response.completed\n", b"event: response.incomplete\n")}


@pytest.mark.parametrize("door", DOORS)
@FUZZ
@given(data=st.data(), how=HOW)
def test_every_fuzzed_body_gets_a_clean_answer(rig: Rig, door: str, data: st.DataObject,
                                               how: str) -> None:
    """Random bytes, random JSON and mutated requests: never a 5xx, always the shape."""
    body = data.draw(bodies(door))
    status, content_type, answer = post(rig, door, body, how)
    SEEN[f"{door} {status}"] += 1
    assert_clean(door, status, content_type, answer)


HEADER_BYTES = st.binary(min_size=1, max_size=64).filter(lambda b: b"\r\n\r\n" not in b)


@FUZZ
@given(door=st.sampled_from(DOORS), junk=HEADER_BYTES, length=st.integers(-5, 10**30))
def test_broken_http_framing_never_takes_the_proxy_down(rig: Rig, door: str, junk: bytes,
                                                        length: int) -> None:
    """A header of random bytes, or a Content-Length that lies or is absurd: the proxy
    answers with a 4xx or closes that connection, and nothing else is disturbed (the
    next test proves it serves)."""
    request = (f"POST {door} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n".encode()
               + b"X-Junk: " + junk + b"\r\n\r\n" + b'{"model":"private"}')
    with socket.create_connection(("127.0.0.1", rig.port), timeout=30) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    SEEN[f"framing {answer[9:12].decode(errors='replace') or 'closed'}"] += 1
    if answer:
        status = int(answer[9:12])
        assert 400 <= status < 500, answer[:300]


def test_after_the_fuzz_the_proxy_and_seats_serve(rig: Rig) -> None:
    """Runs last in this file: the proxy and both seats are the processes that started,
    and a good request at each door is answered by a seat."""
    assert rig.proxy.poll() is None
    assert all(p.poll() is None for p in rig.fakes.values())
    for door in (CHAT, COMPLETIONS, MESSAGES, RESPONSES):
        status, _, answer = post(rig, door, json.dumps(GOOD[door]).encode(), "plain")
        assert status == 200, answer[:300]
        reply = json.loads(answer)
        assert reply["model"] == "brain", answer[:300]
    counters = rig.counters()["proxy"]
    assert counters["bad_requests"] > 0
    # each door counted its own requests and refusals
    for name in ("chat", "completions", "messages", "responses"):
        assert counters["door_requests"][name] > 0
        assert sum(counters["door_errors"][name].values()) > 0


# -- a longer, coverage-guided run of the doors' parsers (atheris) ------------------


def parse_one(data: bytes) -> None:
    """One input to every door's parser: it parses, or it is refused with a 4xx in the
    OpenAI shape; anything else raised is a crash."""
    from proxyd.doors.anthropic_api import read_count_tokens, read_messages
    from proxyd.doors.openai_api import parse_chat, parse_completion, tools_json
    from proxyd.doors.openai_responses_api import read_responses
    from shared.errors import ClientError

    for limits in (L, SMALL):
        try:
            req, _, _ = parse_chat(data, limits)
            tools_json(req)
        except ClientError as exc:
            assert 400 <= exc.status < 500 and exc.body()["error"]["message"]
        for read in (parse_completion, read_messages, read_count_tokens, read_responses):
            try:
                read(data, limits)
            except ClientError as exc:
                assert 400 <= exc.status < 500 and exc.body()["error"]["message"]


# Limits small enough for random inputs to cross them.
SMALL = ProxyConfig(max_messages=2, max_content_chars=8, max_completion_tokens=8,
                    max_stop=2, max_stop_chars=4, max_tools=1, max_schema_bytes=16)


if __name__ == "__main__":
    # python -m tests.test_fuzz_doors -runs=1000000 CORPUS_DIR  (needs atheris, which is
    # not in the lock: install it beside the project's packages to run this)
    import sys

    import atheris

    with atheris.instrument_imports(include=["proxyd"]):
        import proxyd.doors.anthropic_api
        import proxyd.doors.openai_api
        import proxyd.doors.openai_responses_api  # noqa: F401
    atheris.Setup(sys.argv, parse_one)
    atheris.Fuzz()
