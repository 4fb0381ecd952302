"""A hosted rung speaks the OpenAI surface agents use, or is skipped, never answering
without a field it was given.

The upstream is sanctum/bench/fake_openai.py's recording fake, over real HTTP on
loopback in the test's own event loop: it keeps every body it got and answers what
the body asks for (tool calls streamed in pieces or whole, log-probabilities).  The
rung is the real `HostedClient`; the ladder is the real `Journey` over a real `Proxy`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import msgspec
import pytest

from proxyd.events import Done, Event
from proxyd.hosted import HostedClient
from proxyd.hosted_wire import ToolCallAssembler, ToolDelta, request_body
from proxyd.journey import Journey
from proxyd.proxy import Proxy
from proxyd.sse import Malformed
from sanctum.bench.fake_openai import ALTERNATIVES, arguments_for, base_url, listen
from shared.config import Config, ConfigError, RouteConfig, SeatConfig, parse_config
from shared.errors import BadRequest
from shared.protocol import (
    ChatMessage,
    Chunk,
    Failed,
    Final,
    Generate,
    Ok,
    RungFrame,
    SamplingParams,
    TokenLogprob,
    ToolCall,
)

T = TypeVar("T")
Body = dict[str, Any]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time"}},
]
TOOLS_JSON = json.dumps(TOOLS)
HI = (ChatMessage("user", "hi"),)
PLAIN: dict[str, Any] = {"name": "gpt", "kind": "openai", "base_url": "http://127.0.0.1:9/v1"}
VLLM: dict[str, Any] = {**PLAIN, "name": "vllm",
                        "upstream_fields": ("top_k", "min_p", "repetition_penalty")}


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro
    return asyncio.run(main())


def gen(chat: bool = True, stream: bool = True, **kw: Any) -> Generate:
    request = {k: kw.pop(k) for k in ("tools_json", "response_format", "tool_choice",
                                      "parallel_tool_calls", "messages") if k in kw}
    if chat:
        request.setdefault("messages", HI)
    return Generate("r1", stream, SamplingParams(**kw), prompt=None if chat else "hi",
                    **request)


@asynccontextmanager
async def upstream(sync: bool = False) -> AsyncIterator[tuple[str, list[Body]]]:
    """A recording fake: its base URL, and the bodies it received."""
    bodies: list[Body] = []
    server = await listen(bodies, sync)
    try:
        yield base_url(server), bodies
    finally:
        server.close()
        await server.wait_closed()


async def ask(g: Generate, sync: bool = False,
              **seat: Any) -> tuple[list[RungFrame], list[Body]]:
    """One request to a hosted rung in front of a fresh fake: its frames, the bodies."""
    async with upstream(sync) as (url, bodies):
        client = HostedClient(SeatConfig(**{**PLAIN, **seat, "base_url": url}))
        try:
            frames = [f async for f in client.frames(g, 10.0, 10.0)]
        finally:
            await client.close()
    return frames, bodies


def calls_of(frames: list[RungFrame]) -> list[ToolCall]:
    return [c for f in frames if isinstance(f, Chunk) for c in f.tool_calls]


def final(frames: list[RungFrame]) -> Final:
    last = frames[-1]
    assert isinstance(last, Final)
    return last


# ---------------------------------------------------------------------------
# What reaches the upstream

ASSISTANT_CALLS = [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
CONVERSATION = (
    ChatMessage("system", "be brief"),
    ChatMessage("user", "weather in Oslo?", name="ann"),
    ChatMessage("assistant", "", tool_calls_json=json.dumps(ASSISTANT_CALLS)),
    ChatMessage("tool", '{"temp": 3}', tool_call_id="call_1"),
)
SCHEMA = {"type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": {
    "type": "object", "properties": {"temp": {"type": "number"}}, "required": ["temp"]}}}
NEW_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "response_format",
              "presence_penalty", "frequency_penalty", "seed", "logprobs", "top_logprobs",
              "top_k", "min_p", "repetition_penalty", "logit_bias")

# (request, seat, fields the upstream body has, with their values)
FORWARDED: list[tuple[str, Generate, dict[str, Any], Body]] = [
    ("named_tool_choice", gen(tools_json=TOOLS_JSON, tool_choice="function:get_time"), PLAIN,
     {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
    ("required_one_call", gen(tools_json=TOOLS_JSON, tool_choice="required",
                              parallel_tool_calls=False), PLAIN,
     {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}),
    ("tools_none", gen(tools_json=TOOLS_JSON, tool_choice="none"), PLAIN,
     {"tools": TOOLS, "tool_choice": "none"}),
    ("tool_messages", gen(messages=CONVERSATION, tools_json=TOOLS_JSON), PLAIN,
     {"messages": [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": "weather in Oslo?", "name": "ann"},
                   {"role": "assistant", "content": None, "tool_calls": ASSISTANT_CALLS},
                   {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "call_1"}],
      "tools": TOOLS}),
    ("json_schema", gen(response_format=json.dumps(SCHEMA)), PLAIN,
     {"response_format": SCHEMA}),
    ("json_object", gen(response_format='{"type": "json_object"}'), PLAIN,
     {"response_format": {"type": "json_object"}}),
    ("penalties_seed", gen(presence_penalty=0.5, frequency_penalty=-1.25, seed=42,
                           stop=("END",), temperature=0.3, top_p=0.8), PLAIN,
     {"presence_penalty": 0.5, "frequency_penalty": -1.25, "seed": 42, "stop": ["END"],
      "temperature": 0.3, "top_p": 0.8}),
    ("chat_logprobs", gen(logprobs=3), PLAIN, {"logprobs": True, "top_logprobs": 3}),
    ("chat_logprobs_alone", gen(logprobs=0), PLAIN, {"logprobs": True, "top_logprobs": 0}),
    ("completion_logprobs", gen(chat=False, logprobs=2), PLAIN,
     {"logprobs": 2, "prompt": "hi"}),
    ("extras_where_taken", gen(top_k=40, min_p=0.05, repetition_penalty=1.1), VLLM,
     {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1}),
]


@pytest.mark.parametrize(("g", "seat", "want"), [c[1:] for c in FORWARDED],
                         ids=[c[0] for c in FORWARDED])
def test_the_upstream_gets_every_field_it_takes(g: Generate, seat: dict[str, Any],
                                                want: Body) -> None:
    """Tools, tool_choice (a named one as OpenAI's object), parallel_tool_calls, tool
    turns, response_format, penalties, seed and logprobs arrive as OpenAI spells them,
    and the extras where the seat says its upstream takes them; nothing else new."""
    frames, bodies = run(ask(g, **seat))
    assert isinstance(final(frames).outcome, Ok)
    [body] = bodies
    assert {k: body.get(k) for k in want} == want
    assert not set(body) & (set(NEW_FIELDS) - set(want))


def test_neutral_values_send_nothing() -> None:
    """A plain request adds none of the new fields, even to an upstream that takes
    the extras (an older OpenAI-compatible server never sees a field it may refuse)."""
    path, body = request_body(gen(top_k=0, min_p=0.0, repetition_penalty=1.0),
                              SeatConfig(**VLLM))
    assert path == "/chat/completions"
    assert not set(body) & set(NEW_FIELDS)


# ---------------------------------------------------------------------------
# What comes back: tool calls and log-probabilities


def expected_calls(*names: str) -> list[ToolCall]:
    return [ToolCall(i, f"call_fake_{i}", n, arguments_for(n, i)) for i, n in enumerate(names)]


@pytest.mark.parametrize("sync", [False, True], ids=["streamed", "whole"])
@pytest.mark.parametrize(("request_kw", "names"), [
    ({}, ("get_weather", "get_time")),
    ({"parallel_tool_calls": False}, ("get_weather",)),
    ({"tool_choice": "function:get_time"}, ("get_time",)),
])
def test_tool_calls_come_back_whole(sync: bool, request_kw: dict[str, Any],
                                    names: tuple[str, ...]) -> None:
    """Streamed tool-call deltas (id and name first, then the arguments in 3-character
    pieces) and a whole message's tool_calls alike become ToolCall frames with the
    complete arguments, in order, and the answer ends as the upstream said: tool_calls."""
    frames, _ = run(ask(gen(tools_json=TOOLS_JSON, **request_kw), sync=sync))
    calls = calls_of(frames)
    assert calls == expected_calls(*names)
    assert all(json.loads(c.arguments)["text"] == 'h\u00e9llo, "world"\n' for c in calls)
    end = final(frames)
    assert isinstance(end.outcome, Ok) and end.finish_reason == "tool_calls"
    assert "".join(f.text for f in frames if isinstance(f, Chunk)) == ""


@pytest.mark.parametrize("sync", [False, True], ids=["streamed", "whole"])
@pytest.mark.parametrize(("chat", "top"), [(True, 2), (True, 0), (False, 3)])
def test_logprobs_come_back_per_token(sync: bool, chat: bool, top: int) -> None:
    """Each answer token's log-probability and its alternatives ride with its text,
    from chat's `logprobs.content` and from completions' parallel lists."""
    frames, _ = run(ask(gen(chat=chat, logprobs=top, max_tokens=4), sync=sync))
    lps = [lp for f in frames if isinstance(f, Chunk) for lp in f.logprobs]
    text = "".join(f.text for f in frames if isinstance(f, Chunk))
    token, logprob = ALTERNATIVES[0]
    one = TokenLogprob(token, logprob, tuple(token.encode()) if chat else (),
                       tuple(ALTERNATIVES[:top]))
    assert (text, lps) == (token * 4, [one] * 4)


def test_no_logprobs_unless_asked() -> None:
    frames, _ = run(ask(gen(max_tokens=2)))
    assert all(f.logprobs == () and f.tool_calls == () for f in frames if isinstance(f, Chunk))


# ---------------------------------------------------------------------------
# Assembling tool-call deltas (pure)


def delta(index: int, id: str | None = None, name: str | None = None,
          args: str | None = None) -> ToolDelta:
    return msgspec.convert({"index": index, "id": id,
                            "function": {"name": name, "arguments": args}}, ToolDelta)


# (deltas fed one call each, the calls each feed completed, the calls at the finish)
ASSEMBLY: list[tuple[str, list[ToolDelta], list[list[str]], list[str]]] = [
    ("one_call_in_pieces", [delta(0, "a", "f", ""), delta(0, args='{"x"'), delta(0, args=": 1}")],
     [[], [], []], ['a f {"x": 1}']),
    ("next_index_completes", [delta(0, "a", "f", "{}"), delta(1, "b", "g", '{"y"'),
                              delta(1, args=": 2}")],
     [[], ["a f {}"], []], ['b g {"y": 2}']),
    # some upstreams number every call 0: another id is another call
    ("same_index_new_id", [delta(0, "a", "f", "{}"), delta(0, "b", "g", "{}")],
     [[], ["a f {}"]], ["b g {}"]),
    # no id from the upstream: one is made from the request's; no arguments: "{}"
    ("no_id_no_arguments", [delta(0, None, "f")], [[]], ["call_r9_0 f {}"]),
    ("nothing", [], [], []),
]


@pytest.mark.parametrize(("deltas", "per_feed", "at_finish"), [c[1:] for c in ASSEMBLY],
                         ids=[c[0] for c in ASSEMBLY])
def test_a_call_is_passed_on_once_complete(deltas: list[ToolDelta], per_feed: list[list[str]],
                                           at_finish: list[str]) -> None:
    """A call leaves when the next one begins or the choice finishes, never in pieces."""
    asm = ToolCallAssembler("r9")

    def show(calls: list[ToolCall]) -> list[str]:
        return [f"{c.id} {c.name} {c.arguments}" for c in calls]
    assert [show(asm.feed((d,))) for d in deltas] == per_feed
    assert show(asm.finish()) == at_finish
    assert [c.index for c in asm.done] == list(range(len(asm.done)))


@pytest.mark.parametrize("deltas", [
    [delta(0, "a", None, "{}")],  # a call without a function name
    [delta(0, "a", "f", "{"), delta(1, "b", "g", "{}"), delta(0, args="}")],  # went back
], ids=["nameless", "interleaved"])
def test_a_call_that_cannot_be_passed_on_whole_is_a_malformed_stream(
        deltas: list[ToolDelta]) -> None:
    asm = ToolCallAssembler("r")
    with pytest.raises(Malformed):
        for d in deltas:
            asm.feed((d,))
        asm.finish()


# ---------------------------------------------------------------------------
# A rung that cannot honour a field: skipped, the next answers, or a 400


def test_a_rung_asked_for_a_field_it_cannot_honour_sends_nothing() -> None:
    """Asked anyway, the rung ends the attempt unsupported_field, naming the field,
    and the upstream never hears of it."""
    frames, bodies = run(ask(gen(logit_bias=((17, 5.0),))))
    assert bodies == []
    [end] = frames
    assert isinstance(end, Final) and isinstance(end.outcome, Failed)
    assert end.outcome.reason == "unsupported_field"
    assert end.outcome.message.startswith("logit_bias:")


async def journey(g: Generate) -> tuple[Done | BadRequest, list[Body], list[Body]]:
    """One request down the route [gpt (OpenAI's fields only), vllm (takes the
    extras)]: how it ended, and the bodies each upstream got."""
    async with upstream() as (url1, gpt), upstream() as (url2, vllm):
        config = Config(seat=[SeatConfig(**{**PLAIN, "base_url": url1}),
                              SeatConfig(**{**VLLM, "base_url": url2})],
                        route=[RouteConfig(model="m", ladder=["gpt", "vllm"])])
        proxy = Proxy(config)
        await proxy.start()
        events: list[Event] = []
        try:
            async for e in Journey(proxy, config.route[0], g, None, lambda: False).events():
                events.append(e)
        except BadRequest as exc:
            return exc, gpt, vllm
        finally:
            await proxy.stop()
        done = events[-1]
        assert isinstance(done, Done)
        return done, gpt, vllm


# The journey lists the rung it passed over as skipped; until it asks `unsupported`
# itself (proxyd/journey.py), the rung refuses unsent and the header says failed.
PASSED_OVER = ("gpt=skipped:unsupported_field",)


@pytest.mark.parametrize(("field", "value"), [("top_k", 40), ("min_p", 0.1),
                                               ("repetition_penalty", 1.15)])
def test_a_rung_without_the_field_is_passed_over_and_the_next_answers(
        field: str, value: float) -> None:
    """top_k on a route whose first rung's upstream takes no top_k: that upstream is
    never asked, and the next rung, whose upstream takes it, answers with it."""
    shaping: dict[str, Any] = {field: value}
    done, gpt, vllm = run(journey(gen(stream=False, max_tokens=3, **shaping)))
    assert isinstance(done, Done)
    assert done.answer.seat == "vllm" and done.text == "xxx"
    first, second = done.answer.attempts.split("; ")
    assert first in PASSED_OVER and second == "vllm=ok"
    assert gpt == [] and len(vllm) == 1 and vllm[0][field] == value


def test_a_request_every_rung_can_take_goes_to_the_first() -> None:
    done, gpt, vllm = run(journey(gen(stream=False, max_tokens=2, presence_penalty=1.0)))
    assert isinstance(done, Done) and done.answer.seat == "gpt"
    assert (len(gpt), vllm) == (1, [])


def test_no_rung_can_honour_the_field_400() -> None:
    """logit_bias names the local tokenizer's ids: no hosted rung takes it, so the
    request is a 400 unsupported_field naming it, and no upstream hears of it."""
    err, gpt, vllm = run(journey(gen(stream=False, logit_bias=((3, -100.0),))))
    assert isinstance(err, BadRequest)
    assert (err.status, err.code, err.param) == (400, "unsupported_field", "logit_bias")
    assert (gpt, vllm) == ([], [])
    assert err.extra["attempts"].count("unsupported_field") == 2


# ---------------------------------------------------------------------------
# The setting


SEAT_TOML = """
[[seat]]
name = "h"
kind = "{kind}"
{where}
upstream_fields = {fields}
[[route]]
model = "m"
ladder = ["h"]
"""
HOSTED_WHERE = 'base_url = "http://127.0.0.1:9/v1"'


def test_upstream_fields_setting() -> None:
    """Only the three known names, only on a hosted seat; the error names the key."""
    config = parse_config(SEAT_TOML.format(kind="openai", where=HOSTED_WHERE,
                                           fields='["min_p", "top_k"]'))
    assert config.seat[0].upstream_fields == ("min_p", "top_k")
    with pytest.raises(ConfigError, match=r"upstream_fields\[1\]"):
        parse_config(SEAT_TOML.format(kind="openai", where=HOSTED_WHERE,
                                      fields='["top_k", "logit_bias"]'))
    with pytest.raises(ConfigError, match=r"seat\[0\] \(h\)\.upstream_fields"):
        parse_config(SEAT_TOML.format(kind="mlx", where='model = "builtin:demo"',
                                      fields='["top_k"]'))


