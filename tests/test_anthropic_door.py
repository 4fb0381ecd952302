"""The Anthropic Messages door: bodies to Generate, events to Anthropic's JSON and SSE,
and the official anthropic SDK's own parsers reading what the door renders."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx2
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyd.doors import anthropic_api
from proxyd.doors.anthropic_api import (
    FIELDS,
    CountTokensRequest,
    MessagesRequest,
    read_count_tokens,
    read_messages,
)
from proxyd.doors.anthropic_door import MessagesDoor, error_body, error_type, tool_input
from proxyd.events import Answer, Done, Text
from shared.config import ProxyConfig
from shared.errors import (
    AllRungsFailed,
    BadRequest,
    NoPrivateSeat,
    NotFound,
    PromptTooLong,
    RateLimited,
    SanctumError,
    Unauthorized,
)
from shared.protocol import ChatMessage, ToolCall, Usage

LIMITS = ProxyConfig()
WEATHER = {"name": "weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def body(**kw: Any) -> bytes:
    out: dict[str, Any] = {"model": "brain", "max_tokens": 16,
                           "messages": [{"role": "user", "content": "hi"}]}
    out.update(kw)
    return json.dumps(out).encode()


def turns(*messages: dict[str, Any], **kw: Any) -> bytes:
    return body(messages=list(messages), **kw)


USE = {"role": "assistant", "content": [
    {"type": "text", "text": "Let me look."},
    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}]}


# ---------------------------------------------------------------------------
# Requests


def test_sampling_fields_and_system() -> None:
    """Sampling fields map onto SamplingParams; system (a string or text blocks) is the
    first message; text blocks are joined by a blank line."""
    m = read_messages(body(temperature=0.5, top_p=0.9, top_k=40, stop_sequences=["\n\n"],
                           system=[{"type": "text", "text": "Be brief."},
                                   {"type": "text", "text": "Be kind.",
                                    "cache_control": {"type": "ephemeral"}}]), LIMITS)
    p = m.params
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop) == \
        (0.5, 0.9, 40, 16, ("\n\n",))
    assert m.messages == (ChatMessage("system", "Be brief.\n\nBe kind."),
                          ChatMessage("user", "hi"))
    assert (m.model, m.stream, m.ignored) == ("brain", False, ())
    gen = m.generate("r1")
    assert (gen.request_id, gen.stream, gen.messages, gen.tools_json) == \
        ("r1", False, m.messages, None)
    d = read_messages(body(system="S", stream=True), LIMITS)
    assert d.messages[0] == ChatMessage("system", "S") and d.stream
    assert d.params.temperature == 1.0 and d.params.top_p == 1.0 and d.params.top_k == 0
    assert isinstance(d.door(), MessagesDoor) and d.door().stream


def test_unknown_fields_are_ignored_and_listed() -> None:
    """A field unknown to Anthropic's API (seed is OpenAI's) is listed, sanitised; the
    accepted ones are not."""
    m = read_messages(body(seed=3, **{"we ird": 1}, metadata={"user_id": "u"},
                           thinking={"type": "enabled", "budget_tokens": 2048},
                           service_tier="auto", cache_control={"type": "ephemeral"},
                           output_config={"effort": "high"},
                           context_management={"edits": [
                               {"type": "clear_thinking_20251015", "keep": "all"}]}), LIMITS)
    assert m.ignored == ("seed", "we_ird")
    assert m.params.seed is None


def test_sanctum_overrides() -> None:
    """The `sanctum` key takes the OpenAI doors' per-request overrides."""
    gen = read_messages(body(sanctum={"kv": "q8", "speculation": False, "solo": True}),
                        LIMITS).generate("r")
    assert (gen.kv, gen.speculation, gen.solo) == ("q8", False, True)


def test_tool_round_trip_history() -> None:
    """tool_use blocks become the assistant turn's OpenAI-shaped calls; tool_result
    blocks become tool messages answering them, before the turn's text; an error result
    says so; the tools reach the seat in OpenAI's shape."""
    m = read_messages(turns(
        {"role": "user", "content": "Weather in Oslo?"}, USE,
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "12 C"}]},
            {"type": "text", "text": "And tomorrow?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2",
                                      "content": "no data", "is_error": True}]},
        tools=[WEATHER], tool_choice={"type": "auto"}), LIMITS)
    user, assistant, result, text, again, failed = m.messages
    assert user == ChatMessage("user", "Weather in Oslo?")
    assert assistant.role == "assistant" and assistant.content == "Let me look."
    assert json.loads(assistant.tool_calls_json or "") == [
        {"id": "toolu_1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]
    assert result == ChatMessage("tool", "12 C", tool_call_id="toolu_1")
    assert text == ChatMessage("user", "And tomorrow?")
    assert again.content == "" and again.tool_calls_json is not None
    assert failed == ChatMessage("tool", "Error: no data", tool_call_id="toolu_2")
    assert json.loads(m.tools_json or "") == [
        {"type": "function", "function": {"name": "weather",
                                          "description": "the weather in a city",
                                          "parameters": WEATHER["input_schema"]}}]
    assert m.tool_choice == "auto" and m.parallel_tool_calls


@pytest.mark.parametrize(("choice", "expected", "parallel"), [
    ({"type": "auto"}, "auto", True),
    ({"type": "any"}, "required", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "tool", "name": "weather"}, "function:weather", True),
    ({"type": "none"}, "none", True),
])
def test_tool_choice(choice: dict[str, Any], expected: str, parallel: bool) -> None:
    """Anthropic's tool_choice onto the seat's: any forces a call, tool a named one."""
    gen = read_messages(body(tools=[WEATHER], tool_choice=choice), LIMITS).generate("r")
    assert (gen.tool_choice, gen.parallel_tool_calls) == (expected, parallel)


def test_output_format_is_structured_output() -> None:
    """output_config.format's JSON schema reaches the seat as a response_format."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    gen = read_messages(body(output_config={"format": {"type": "json_schema",
                                                       "schema": schema}}),
                        LIMITS).generate("r")
    assert json.loads(gen.response_format or "") == {
        "type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def test_count_tokens_body() -> None:
    """count_tokens takes the prompt's fields: system, messages and tools; fields of the
    Messages body alone (max_tokens) are unknown to it."""
    c = read_count_tokens(json.dumps({
        "model": "brain", "system": "S", "max_tokens": 5, "tools": [WEATHER],
        "messages": [{"role": "user", "content": "hi"}]}).encode(), LIMITS)
    assert c.model == "brain" and c.ignored == ("max_tokens",)
    assert c.messages == (ChatMessage("system", "S"), ChatMessage("user", "hi"))
    m = read_messages(body(system="S", tools=[WEATHER]), LIMITS)
    assert c.tools_json == m.tools_json and c.messages == m.messages


def image(at: str = "user") -> dict[str, Any]:
    return {"role": at, "content": [{"type": "text", "text": "see"}, {
        "type": "image", "source": {"type": "base64", "media_type": "image/png",
                                    "data": "AA=="}}]}


@pytest.mark.parametrize(("raw", "param"), [
    (b"", "body"),
    (b"[]", "body"),
    (b"{nope", "body"),
    (json.dumps({"model": "brain", "messages": [{"role": "user", "content": "x"}]}).encode(),
     "max_tokens"),
    (body(max_tokens=0), "max_tokens"),
    (body(max_tokens=LIMITS.max_completion_tokens + 1), "max_tokens"),
    (json.dumps({"max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}).encode(),
     "model"),
    (body(messages=[]), "messages"),
    (body(temperature=1.5), "temperature"),
    (body(top_p=0), "top_p"),
    (body(top_k=-1), "top_k"),
    (body(stop_sequences=["a", ""]), "stop_sequences[1]"),
    (body(stop_sequences="stop"), "stop_sequences"),
    (body(system=[{"type": "image"}]), "system[0].type"),
    (turns({"role": "tool", "content": "x"}), "messages[0].role"),
    (turns(image()), "messages[0].content[1].type"),
    (turns({"role": "user", "content": [{"type": "document", "source": {}}]}),
     "messages[0].content[0].type"),
    (turns({"role": "user", "content": [{"type": "text"}]}), "messages[0].content[0].text"),
    (turns({"role": "user", "content": "q"}, {"role": "assistant", "content": "The "}),
     "messages[1].role"),
    (turns({"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "weather",
                                         "input": {}}]}), "messages[0].content[0].type"),
    (turns({"role": "user", "content": "q"}, USE,
           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9",
                                         "content": "x"}]}),
     "messages[2].content[0].tool_use_id"),
    (turns({"role": "user", "content": "q"}, USE,
           {"role": "user", "content": [{"type": "text", "text": "t"},
                                        {"type": "tool_result", "tool_use_id": "toolu_1"}]}),
     "messages[2].content[1].type"),
    (turns({"role": "user", "content": "q"}, USE,
           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                         "content": [image()["content"][1]]}]}),
     "messages[2].content[0].content[0].type"),
    (turns({"role": "user", "content": "q"},
           {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "w"}]},
           {"role": "user", "content": "q"}), "messages[1].content[0].input"),
    (body(tools=[{**WEATHER, "name": "bad name"}]), "tools[0].name"),
    (body(tools=[WEATHER, WEATHER]), "tools[1].name"),
    (body(tools=[{"type": "web_search_20250305", "name": "web_search",
                  "input_schema": {}}]), "tools[0].type"),
    # a server tool has no input_schema: refused for its type all the same
    (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (body(tools=[{"name": "x"}]), "tools[0].input_schema"),
    (body(tool_choice={"type": "any"}), "tool_choice"),
    (body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name"),
    (body(tool_choice={"type": "sometimes"}), "tool_choice.type"),
    (body(container="c1"), "container"),
    (body(mcp_servers=[{"type": "url", "url": "https://example.invalid"}]), "mcp_servers"),
    (body(output_config={"format": {"type": "json_schema"}}), "output_config.format.schema"),
    (body(sanctum={"bogus": 1}), "sanctum.bogus"),
    (turns({"role": "user", "content": "q"}, USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t" * 257}]}),
     "messages[2].content[0].tool_use_id"),
])
def test_bad_requests(raw: bytes, param: str) -> None:
    """Each malformed body is a 400 naming its field, by Anthropic's names."""
    with pytest.raises(BadRequest) as err:
        read_messages(raw, LIMITS)
    assert err.value.status == 400 and err.value.param == param, err.value.message


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(["type", "text", "id", "name", "input", "content",
                                       "tool_use_id", "is_error", "role", "x"]),
                      inner, max_size=4), max_leaves=20)
FIELD_NAMES = [*sorted(FIELDS), "seed", "x"]


@settings(max_examples=300, deadline=None, database=None)
@given(field=st.sampled_from(FIELD_NAMES), value=JSON, count=st.booleans())
def test_any_field_value_is_an_answer_or_a_4xx(field: str, value: Any, count: bool) -> None:
    """Any JSON value in any field (a message's blocks among them) is read or refused
    with a 4xx naming a field, never an unexpected exception."""
    raw = body(**{field: value})
    msgs = turns({"role": "user", "content": "q"}, USE, {"role": "user", "content": value})
    for b in (raw, msgs):
        try:
            (read_count_tokens if count else read_messages)(b, LIMITS)
        except SanctumError as exc:
            assert 400 <= exc.status < 500 and exc.param, exc


def test_refused_fields_accept_what_asks_for_nothing() -> None:
    """A refused field set to null (or an empty MCP server list) asks for nothing."""
    read_messages(body(container=None, mcp_servers=[], diagnostics=None), LIMITS)


def test_limits_apply() -> None:
    """The config's input limits hold at this door as at chat completions: a text past
    max_content_chars is a 413 naming it, too many messages a 400."""
    small = ProxyConfig(max_content_chars=10, max_messages=2)
    with pytest.raises(SanctumError) as err:
        read_messages(body(system="x" * 11), small)
    assert (err.value.status, err.value.param) == (413, "system")
    with pytest.raises(SanctumError) as err:
        read_messages(turns({"role": "user", "content": "q"}, USE, {
            "role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                         "content": "y" * 17}]}), ProxyConfig(
            max_content_chars=16))
    assert (err.value.status, err.value.param) == (413, "messages[2].content[0].content")
    with pytest.raises(SanctumError) as err:
        read_messages(turns(*[{"role": "user", "content": "q"}] * 3), small)
    assert (err.value.status, err.value.param) == (400, "messages")


def test_field_table_matches_the_bodies() -> None:
    """Every field of the bodies is in the table and every table entry is a field of the
    body its doors name."""
    messages = set(MessagesRequest.__struct_fields__)
    count = set(CountTokensRequest.__struct_fields__)
    assert set(FIELDS) == messages
    assert {n for n, f in FIELDS.items() if f.doors == "both"} == count
    for name, spec in FIELDS.items():
        assert spec.reason, name
    assert anthropic_api.FIELDS["thinking"].action == "accepted"


# ---------------------------------------------------------------------------
# Rendering


def answer(seat: str = "brain", **kw: Any) -> Answer:
    return Answer("r1", seat, 1700000000, served=7, attempts=f"{seat}=ok", **kw)


CALL = ToolCall(0, "call_abc", "weather", '{"city": "Oslo"}')


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for chunk in raw.decode().split("\n\n"):
        if chunk:
            name, data = chunk.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


USAGE = Usage(9, 4, 2)


def streamed(pieces: list[Text], finish: str = "stop", usage: Usage = USAGE,
             a: Answer | None = None, tail: Callable[[MessagesDoor, Answer], bytes]
             | None = None) -> bytes:
    a = a or answer()
    door = MessagesDoor(True)
    out = door.opening(a) + b"".join(door.text(a, p) for p in pieces)
    if tail is not None:
        return out + tail(door, a)
    return out + door.closing(a, finish, usage)


def test_stream_event_sequence() -> None:
    """message_start, ping, a text block, a tool_use block per call, message_delta with
    stop_reason, usage and sanctum, message_stop: in Anthropic's order and indexes."""
    raw = streamed([Text("Hel"), Text("lo"), Text("", (CALL,)), Text(" bye")])
    seq = events(raw)
    assert [n for n, _ in seq] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in seq)
    start = seq[0][1]["message"]
    assert (start["id"], start["model"], start["content"], start["usage"]["input_tokens"]) \
        == ("msg_r1", "brain", [], 0)
    assert [d.get("index") for n, d in seq if n.startswith("content")] == \
        [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert seq[6][1]["content_block"] == {"type": "tool_use", "id": "toolu_abc",
                                          "name": "weather", "input": {}}
    assert json.loads(seq[7][1]["delta"]["partial_json"]) == {"city": "Oslo"}
    delta = seq[12][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    # the prompt's 9 tokens, 2 of them read from the cache
    assert delta["usage"] == {"input_tokens": 7, "output_tokens": 4,
                              "cache_read_input_tokens": 2}
    assert delta["sanctum"]["seat"] == "brain" and delta["sanctum"]["served"] == 7


@pytest.mark.parametrize(("finish", "calls", "reason"), [
    ("stop", (), "end_turn"), (None, (), "end_turn"), ("length", (), "max_tokens"),
    ("tool_calls", (CALL,), "tool_use"), ("stop", (CALL,), "tool_use"),
    ("content_filter", (), "refusal"), ("length", (CALL,), "max_tokens"),
])
def test_stop_reasons(finish: str | None, calls: tuple[ToolCall, ...], reason: str) -> None:
    """finish_reason onto stop_reason, alike in the body and the stream."""
    done = Done(answer(), "t", finish, Usage(1, 1), calls)
    assert json.loads(MessagesDoor(False).body(done))["stop_reason"] == reason
    seq = events(streamed([Text("t", calls)], finish or ""))
    if finish is None:
        seq = events(streamed([Text("t", calls)]))
    assert seq[-2][1]["delta"]["stop_reason"] == reason


def test_body() -> None:
    """The non-stream Message: the answering seat as model, text then tool_use blocks
    with parsed input, usage, and the sanctum object."""
    a = answer("coder", upstream_model="")
    done = Done(a, "Checking.", "tool_calls", Usage(11, 5, 3), (CALL,))
    out = json.loads(MessagesDoor(False).body(done))
    assert out == {
        "id": "msg_r1", "type": "message", "role": "assistant", "model": "coder",
        "content": [{"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_abc", "name": "weather",
                     "input": {"city": "Oslo"}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 8, "output_tokens": 5, "cache_read_input_tokens": 3},
        "sanctum": a.sanctum()}


@pytest.mark.parametrize(("arguments", "expected"), [
    ('{"a": 1}', {"a": 1}), ("", {}), ("  ", {}), ("[1]", {"arguments": [1]}),
    ("{broken", {"arguments": "{broken"}),
])
def test_tool_input(arguments: str, expected: dict[str, Any]) -> None:
    """A call's arguments as Anthropic's input object, never lost."""
    assert tool_input(arguments) == expected


@pytest.mark.parametrize(("exc", "status", "kind"), [
    (BadRequest("bad", param="top_k"), 400, "invalid_request_error"),
    (Unauthorized("who"), 401, "authentication_error"),
    (NotFound("none", param="model"), 404, "not_found_error"),
    (PromptTooLong("long", prompt_tokens=2000, cap=1536, seat="brain"), 413,
     "request_too_large"),
    (RateLimited("slow"), 429, "rate_limit_error"),
    (SanctumError("oops"), 500, "api_error"),
    (NoPrivateSeat("down", attempts="brain=failed:worker_lost"), 503, "overloaded_error"),
    (AllRungsFailed("all"), 503, "overloaded_error"),
])
def test_error_body(exc: SanctumError, status: int, kind: str) -> None:
    """Refusals in Anthropic's shape, typed by status, with our code and extras."""
    out = error_body(exc)
    assert exc.status == status and out["type"] == "error"
    error = out["error"]
    assert (error["type"], error["code"]) == (kind, exc.code)
    if status == 413:  # Anthropic's words first, for clients that read them
        assert error["message"] == "prompt is too long: 2000 tokens > 1536 maximum (long)"
    else:
        assert error["message"] == exc.message
    for key, value in exc.extra.items():
        assert error[key] == value
    assert error_type(422) == "invalid_request_error" and error_type(502) == "api_error"


# ---------------------------------------------------------------------------
# The official SDK reading what the door renders


def client(status: int, content: bytes, headers: dict[str, str] | None = None,
           seen: list[httpx2.Request] | None = None) -> anthropic.Anthropic:
    def handle(request: httpx2.Request) -> httpx2.Response:
        if seen is not None:
            seen.append(request)
        return httpx2.Response(status, content=content, headers={
            "content-type": "text/event-stream" if content.startswith(b"event:")
            else "application/json", **(headers or {})})
    return anthropic.Anthropic(api_key="k", base_url="http://sanctum.test", max_retries=0,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(handle)))


ASK: dict[str, Any] = {"model": "brain", "max_tokens": 16,
                       "messages": [{"role": "user", "content": "hi"}]}


def test_sdk_stream_text_and_tool() -> None:
    """The SDK's accumulator assembles the text, the tool_use input, the stop reason
    and the usage (input_tokens from message_delta) from the door's stream, and passes
    the continued stream's trailer by."""
    a = answer(segments=[{"seat": "brain", "tokens": 1, "served": 7, "outcome": "failed"},
                         {"seat": "coder", "tokens": 2, "served": 3, "outcome": "ok"}])
    raw = streamed([Text("Hel"), Text("lo"), Text("", (CALL,))], "tool_calls",
                   tail=lambda d, ans: d.closing(ans, "tool_calls", Usage(9, 4, 2))
                   + d.trailer(ans), a=a)
    seen: list[httpx2.Request] = []
    with client(200, raw, seen=seen).messages.stream(**ASK) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert json.loads(seen[0].content)["stream"] is True
    assert texts == ["Hel", "lo"]
    assert final.id == "msg_r1" and final.model == "brain"
    assert [b.type for b in final.content] == ["text", "tool_use"]
    text, tool = final.content
    assert text.type == "text" and text.text == "Hello"
    assert tool.type == "tool_use" and (tool.id, tool.name, tool.input) == \
        ("toolu_abc", "weather", {"city": "Oslo"})
    assert final.stop_reason == "tool_use" and final.stop_sequence is None
    assert (final.usage.input_tokens, final.usage.output_tokens,
            final.usage.cache_read_input_tokens) == (7, 4, 2)


def test_sdk_raw_stream_events() -> None:
    """create(stream=True) yields the door's events, typed, the ping skipped."""
    raw = streamed([Text("ok")])
    with client(200, raw).messages.create(**ASK, stream=True) as stream:
        kinds = [e.type for e in stream]
    assert kinds == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]


def test_sdk_abort_raises() -> None:
    """A stream no rung could finish ends with the door's error event: the SDK raises
    it (with our code), never returns a short message as complete."""
    raw = streamed([Text("Hal")], tail=lambda d, a: d.error_event(
        "the seat failed mid-answer", "all_rungs_failed", {"seat": "brain",
                                                           "attempts": "brain=failed"}))
    got: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as err:
        with client(200, raw).messages.stream(**ASK) as stream:
            got.extend(stream.text_stream)
    assert got == ["Hal"]
    body = err.value.body
    assert isinstance(body, dict)
    assert body["error"]["type"] == "api_error"
    assert body["error"]["code"] == "all_rungs_failed" and body["error"]["seat"] == "brain"


def test_sdk_body() -> None:
    """create() parses the non-stream body into a Message (text and tool_use)."""
    done = Done(answer("coder"), "Sure.", "tool_calls", Usage(5, 3), (CALL,))
    message = client(200, MessagesDoor(False).body(done)).messages.create(**ASK)
    assert message.model == "coder" and message.stop_reason == "tool_use"
    assert message.content[0].type == "text" and message.content[0].text == "Sure."
    assert message.content[1].type == "tool_use" and message.content[1].input == \
        {"city": "Oslo"}
    assert (message.usage.input_tokens, message.usage.output_tokens) == (5, 3)


@pytest.mark.parametrize(("exc", "kind"), [
    (BadRequest("bad", param="top_k"), anthropic.BadRequestError),
    (Unauthorized("who"), anthropic.AuthenticationError),
    (NotFound("none", param="model"), anthropic.NotFoundError),
    (PromptTooLong("long", prompt_tokens=2000, cap=1536), anthropic.ContentTooLargeError),
    (RateLimited("slow"), anthropic.RateLimitError),
    (NoPrivateSeat("down"), anthropic.ServiceUnavailableError),
])
def test_sdk_errors(exc: SanctumError, kind: type[Exception]) -> None:
    """The SDK raises the exception of each status from the door's error body, and
    reads its type and message."""
    raw = msgspec.json.encode(error_body(exc))
    with pytest.raises(kind) as err:
        client(exc.status, raw).messages.create(**ASK)
    assert isinstance(err.value, anthropic.APIStatusError)
    assert err.value.type == error_type(exc.status)
    assert err.value.api_message == error_body(exc)["error"]["message"]
    assert exc.message in str(err.value.api_message)


def test_a_stop_string_is_stop_sequence_named_alike_in_body_and_stream() -> None:
    """A local seat's final frame names the stop string that ended the answer: the
    body and the stream say stop_reason `stop_sequence` and which one; without one,
    end_turn as before."""
    a = answer(stop_sequence="\n\n")
    out = json.loads(MessagesDoor(False).body(Done(a, "t", "stop", Usage(3, 1))))
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", "\n\n")
    delta = events(streamed([Text("t")], "stop", a=a))[-2][1]["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": "\n\n"}
    # the budget ran out first: max_tokens, and no stop sequence claimed
    out = json.loads(MessagesDoor(False).body(Done(a, "t", "length", Usage(3, 1))))
    assert (out["stop_reason"], out["stop_sequence"]) == ("max_tokens", None)


def test_message_start_carries_the_prompts_tokens_the_seat_told() -> None:
    a = answer(prompt_tokens=9, cached_tokens=2)
    start = events(streamed([Text("t")], a=a))[0][1]["message"]
    assert start["usage"] == {"input_tokens": 7, "output_tokens": 0,
                              "cache_read_input_tokens": 2}


def test_a_body_has_the_streams_blocks_in_the_streams_order() -> None:
    """Text, a call, more text: the body's content blocks are the stream's, in order."""
    seq = events(streamed([Text("Let me check. "), Text("", (CALL,)), Text("Done.")],
                          "tool_calls"))
    starts = [d["content_block"]["type"] for n, d in seq if n == "content_block_start"]
    done = Done(answer(), "Let me check. Done.", "tool_calls", Usage(5, 3), (CALL,),
                parts=("Let me check. ", CALL, "Done."))
    content = json.loads(MessagesDoor(False).body(done))["content"]
    assert [b["type"] for b in content] == starts == ["text", "tool_use", "text"]
    assert [b.get("text") for b in content] == ["Let me check. ", None, "Done."]


def test_unknown_keys_inside_the_body_are_named_with_their_paths() -> None:
    """A block's unknown key is named with its path; cache_control anywhere is accepted;
    a block of a type the door does not read keeps its fields to itself."""
    from proxyd.doors.anthropic_api import read_messages
    from shared.config import ProxyConfig

    m = read_messages(json.dumps({
        "model": "m", "max_tokens": 5,
        "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "zz": 1,
                                                   "cache_control": {"type": "ephemeral"}}]},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "t",
                                                        "signature": "x"},
                                                       {"type": "text", "text": "ok"}]},
                     {"role": "user", "content": "go"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "yy": 2}]}).encode(),
        ProxyConfig())
    assert m.ignored == ("messages[0].content[0].zz", "tools[0].yy")
