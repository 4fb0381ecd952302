"""Tool calls, log-probabilities and echo as the OpenAI doors render them, read back
by the official openai SDK's own types and stream accumulator; then end to end through
a real proxyd in front of fake seats that send tool calls and log-probabilities, with
X-Sanctum-Ignored and its counter, and a constrained stream continued only from its
exact tokens."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai._models import construct_type
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from proxyd.doors.openai_door import ChatDoor, CompletionDoor
from proxyd.events import Answer, Done, Text
from shared.protocol import TokenLogprob, ToolCall, Usage
from tests.procs import http
from tests.rig import Rig

CALLS = (ToolCall(0, "call_a", "get_weather", '{"city": "Oslo"}'),
         ToolCall(1, "call_b", "clock", "{}"))
LPS = (TokenLogprob("Hé", -0.5, tuple("Hé".encode()), (("Hé", -0.5), ("Ha", -1.5))),
       TokenLogprob("llo", -math.inf, (), (("llo", -math.inf),)))


def answer() -> Answer:
    return Answer("rid1", "brain", 1700000000, served=3, attempts="brain=ok",
                  fingerprint="fp_1")


def done(text: str, calls: tuple[ToolCall, ...] = (), lps: tuple[TokenLogprob, ...] = (),
         finish: str = "stop") -> Done:
    return Done(answer(), text, finish, Usage(5, 2), calls, lps)


def datas(stream: bytes) -> list[dict[str, Any]]:
    """The JSON of every data event of an SSE body, up to [DONE] (which must end it)."""
    events = [e for e in stream.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_a_chat_body_with_tool_calls_and_logprobs_parses_in_the_sdk() -> None:
    """message.tool_calls in OpenAI's shape, content null beside calls alone, the finish
    reason the seat gave, and every token's log-probabilities with their alternatives
    (-inf sent as -9999, OpenAI's floor)."""
    door = ChatDoor(stream=False, include_usage=False, logprobs=True)
    body = ChatCompletion.model_validate_json(door.body(done("", CALLS, LPS, "tool_calls")))
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [(c.id, c.type, c.function.name, json.loads(c.function.arguments))  # type: ignore[union-attr]
            for c in calls] == [("call_a", "function", "get_weather", {"city": "Oslo"}),
                                ("call_b", "function", "clock", {})]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    first, second = choice.logprobs.content
    assert (first.token, first.logprob, bytes(first.bytes or [])) == \
        ("Hé", -0.5, "Hé".encode())
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("Hé", -0.5), ("Ha", -1.5)]
    assert (second.logprob, second.bytes, second.top_logprobs[0].logprob) == \
        (-9999.0, list(b"llo"), -9999.0)
    text = ChatCompletion.model_validate_json(
        ChatDoor(False, False, logprobs=True).body(done("Hi", CALLS[:1], finish="tool_calls")))
    assert text.choices[0].message.content == "Hi"
    assert text.choices[0].logprobs is not None and text.choices[0].logprobs.content == []
    plain = ChatCompletion.model_validate_json(ChatDoor(False, False).body(done("Hi")))
    assert plain.choices[0].logprobs is None and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content == "Hi"


def chat_stream(door: ChatDoor, pieces: list[Text], finish: str) -> bytes:
    a = answer()
    return (door.opening(a) + b"".join(door.text(a, p) for p in pieces)
            + door.closing(a, finish, Usage(5, 2)))


def test_a_chat_stream_of_tool_call_deltas_accumulates_in_the_sdk() -> None:
    """Each chunk is a ChatCompletionChunk; the SDK's own accumulator assembles the text,
    both calls (index, id, name, whole arguments) and the tokens' log-probabilities."""
    pieces = [Text("Hé", logprobs=LPS[:1]), Text("llo", logprobs=LPS[1:]),
              Text("", CALLS[:1]), Text(" ", CALLS[1:])]
    stream = chat_stream(ChatDoor(stream=True, include_usage=True, logprobs=True), pieces,
                         "tool_calls")
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    chunks = [ChatCompletionChunk.model_validate(d) for d in datas(stream)]
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.get_final_completion()
    choice = final.choices[0]
    assert choice.message.content == "Héllo " and choice.finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments)  # type: ignore[union-attr]
            for c in choice.message.tool_calls or []] == [
        ("call_a", "get_weather", '{"city": "Oslo"}'), ("call_b", "clock", "{}")]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [(t.token, t.logprob) for t in choice.logprobs.content] == \
        [("Hé", -0.5), ("llo", -9999.0)]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    indexed = [d.tool_calls[0].index for d in deltas if d.tool_calls]
    assert indexed == [0, 1]
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 7


def test_plain_text_chunks_keep_their_hot_path_shape() -> None:
    """A piece with no calls and no log-probabilities is the prefix-and-suffix chunk it
    always was (one encode), and log-probabilities a request did not ask for are not
    sent."""
    a = answer()
    door = ChatDoor(stream=True, include_usage=False)
    chunk = ChatCompletionChunk.model_validate(json.loads(
        door.text(a, Text("x\n\"y", logprobs=LPS)).removeprefix(b"data: ")))
    assert chunk.choices[0].delta.content == "x\n\"y" and chunk.choices[0].logprobs is None
    assert door.text(a, Text("x")) == door.plain(a, "x")


def test_a_completion_body_with_logprobs_and_echo_parses_in_the_sdk() -> None:
    """Completions: tokens, token_logprobs, top_logprobs as {token: logprob} and each
    token's text_offset in the choice's text; echo puts the prompt first."""
    door = CompletionDoor(stream=False, include_usage=False, logprobs=True)
    body = Completion.model_validate_json(door.body(done("Héllo", lps=LPS)))
    lp = body.choices[0].logprobs
    assert lp is not None and body.choices[0].text == "Héllo"
    assert (lp.tokens, lp.token_logprobs, lp.text_offset) == \
        (["Hé", "llo"], [-0.5, -9999.0], [0, 2])
    assert lp.top_logprobs == [{"Hé": -0.5, "Ha": -1.5}, {"llo": -9999.0}]
    echoed = Completion.model_validate_json(
        CompletionDoor(False, False, echo="Once ").body(done("upon")))
    assert echoed.choices[0].text == "Once upon" and echoed.choices[0].logprobs is None


def completion_chunk(data: dict[str, Any]) -> Completion:
    """A completions stream chunk as the SDK reads it: built without validation
    (`construct_type`), since its Completion type admits no null finish_reason, which
    OpenAI's own chunks carry before the last; the finish chunk is validated whole."""
    if data["choices"] and data["choices"][0]["finish_reason"] is not None:
        return Completion.model_validate(data)
    chunk = construct_type(type_=Completion, value=data)
    assert isinstance(chunk, Completion)
    return chunk


def test_a_completion_stream_with_echo_and_logprobs() -> None:
    """The echoed prompt is the stream's first chunk; each later chunk carries its own
    tokens' log-probabilities with offsets that run on across chunks."""
    a = answer()
    door = CompletionDoor(stream=True, include_usage=False, logprobs=True)
    stream = door.opening(a) + door.text(a, Text("Hé", logprobs=LPS[:1])) + \
        door.text(a, Text("llo", logprobs=LPS[1:])) + door.closing(a, "length", Usage())
    chunks = [completion_chunk(d) for d in datas(stream)]
    assert "".join(c.choices[0].text for c in chunks) == "Héllo"
    offsets = [c.choices[0].logprobs.text_offset for c in chunks[:2]]  # type: ignore[union-attr]
    assert offsets == [[0], [2]]
    echo = CompletionDoor(stream=True, include_usage=False, echo="Once ")
    first = completion_chunk(datas(echo.opening(a) + echo.text(a, Text("upon"))
                                            + echo.closing(a, "stop", Usage()))[0])
    assert first.choices[0].text == "Once "


# -- through a real proxy --------------------------------------------------------------

TOOLS: list[Any] = [
    {"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "clock"}}]
MSG: list[Any] = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    r = Rig({"brain": "tools", "coder": "ok"}, tokens=3)
    try:
        yield r
    finally:
        r.stop()


def client(rig: Rig) -> openai.OpenAI:
    return openai.OpenAI(base_url=rig.url + "/v1", api_key="x", max_retries=0, timeout=30)


def test_a_tool_round_trip_through_the_proxy(rig: Rig) -> None:
    """The SDK's tool calls, sync and streamed (its own stream helper), with the call's
    arguments, finish_reason tool_calls; the history with the call and its result goes
    back to the seat as ChatMessages."""
    c = client(rig)
    sync = c.chat.completions.create(model="private", messages=MSG, tools=TOOLS,
                                     tool_choice="required")
    choice = sync.choices[0]
    assert choice.finish_reason == "tool_calls" and sync.model == "brain"
    calls = choice.message.tool_calls or []
    assert [(t.function.name, json.loads(t.function.arguments))  # type: ignore[union-attr]
            for t in calls] == [("get_weather", {"n": 1}), ("clock", {"n": 2})]
    with c.chat.completions.stream(model="private", messages=MSG, tools=TOOLS,
                                   tool_choice={"type": "function",
                                                "function": {"name": "clock"}}) as s:
        final = s.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments)  # type: ignore[union-attr]
            for t in streamed.message.tool_calls or []] == [("clock", '{"n": 1}')]
    history = [*MSG, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
    again = c.chat.completions.create(model="private", messages=history, tools=TOOLS,
                                      tool_choice="none")
    assert again.choices[0].finish_reason == "length"
    assert again.choices[0].message.content == "t1 t2 t3 "


def test_logprobs_and_echo_through_the_proxy(rig: Rig) -> None:
    """Chat log-probabilities sync and streamed, a completion's sync, each token's from
    the seat; a completion with echo starts with its prompt, sync and streamed."""
    c = client(rig)
    sync = c.chat.completions.create(model="private", messages=MSG, logprobs=True,
                                     top_logprobs=2)
    content = sync.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [(t.token, t.logprob, len(t.top_logprobs)) for t in content or []] == \
        [("t1 ", -0.25, 2), ("t2 ", -0.5, 2), ("t3 ", -0.75, 2)]
    tokens = [t.token for chunk in c.chat.completions.create(
        model="private", messages=MSG, logprobs=True, stream=True)
        for choice in chunk.choices if choice.logprobs
        for t in choice.logprobs.content or []]
    assert tokens == ["t1 ", "t2 ", "t3 "]
    done = c.completions.create(model="private", prompt="p", logprobs=1)
    assert done.choices[0].logprobs is not None
    assert done.choices[0].logprobs.text_offset == [0, 3, 6]
    echoed = c.completions.create(model="private", prompt="Once ", echo=True)
    assert echoed.choices[0].text == "Once t1 t2 t3 "
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="private", prompt="Once ", echo=True, stream=True) if ch.choices)
    assert streamed == "Once t1 t2 t3 "


def ignored_counts(rig: Rig) -> dict[str, int]:
    counts: dict[str, int] = rig.counters()["proxy"]["ignored_fields"]
    return counts


def test_unknown_fields_are_named_on_answers_and_errors_and_counted(rig: Rig) -> None:
    """X-Sanctum-Ignored lists the unknown fields on a sync answer, a stream, a 400 and
    a 404 alike; each is counted in ignored_fields{field}, in /counters and /metrics; a
    body without any gets no header."""
    before = ignored_counts(rig)
    url = rig.url + "/v1/chat/completions"
    body = {"model": "private", "messages": MSG, "ignore_eos": True, "min_tokens": 2}
    for extra, status in (({}, 200), ({"stream": True}, 200), ({"temperature": 9}, 400),
                          ({"model": "nope"}, 404)):
        got, headers, _ = http("POST", url, body={**body, **extra})
        assert got == status and headers["X-Sanctum-Ignored"] == "ignore_eos, min_tokens"
    got, headers, _ = http("POST", url, body={"model": "private", "messages": MSG})
    assert got == 200 and "X-Sanctum-Ignored" not in headers
    got, headers, _ = http("POST", rig.url + "/v1/completions",
                           body={"model": "private", "prompt": "p", "messages": MSG})
    assert got == 200 and headers["X-Sanctum-Ignored"] == "messages"
    after = ignored_counts(rig)
    for name, n in (("ignore_eos", 4), ("min_tokens", 4), ("messages", 1)):
        assert after[name] == before.get(name, 0) + n
    metrics = http("GET", rig.url + "/metrics")[2].decode()
    assert f'sanctum_proxy_ignored_fields_total{{field="ignore_eos"}} {after["ignore_eos"]}' \
        in metrics


def stream(rig: Rig, model: str, **body: Any) -> tuple[list[str], dict[str, Any]]:
    """The SSE events of a streamed chat, and the JSON of the last one."""
    code, _, raw = http("POST", rig.url + "/v1/chat/completions",
                        body={"model": model, "messages": MSG, "stream": True, **body})
    events = [e for e in raw.decode().split("\n\n") if e]
    last = [e for e in events if "data: {" in e][-1]
    assert code == 200
    return events, json.loads(last.split("data: ", 1)[1])


CONSTRAINTS: list[dict[str, Any]] = [{"response_format": {"type": "json_object"}},
                                     {"tools": TOOLS, "tool_choice": "auto"}]


def test_a_constrained_stream_is_continued_only_from_its_exact_tokens() -> None:
    """A seat that dies mid-stream under a response_format or callable tools: the next
    local seat, given the answer's exact tokens, finishes it; the hosted rung, which
    could not be held to the constraint from a prefill, is passed over
    (`skipped:constrained`) and the stream ends with the terminal error, no [DONE]."""
    r = Rig({"brain": "crash_midstream", "coder": "ok"})
    try:
        for constraint in CONSTRAINTS:
            events, last = stream(r, "private", **constraint)
            assert "data: [DONE]" in events and events[-1].startswith("event: sanctum")
            assert last["sanctum"]["attempts"] == "brain=failed:worker_lost; coder=ok"
            r.start_fake("brain", "crash_midstream")
        asked = r.events("coder", "generate")
        assert [g["prefix"] for g in asked] == ["t1 t2 t3 "] * 2
        # (once: a third failure of brain opens its circuit; the tools case is the same
        # rule, `may_continue`'s table)
        r.start_fake("coder", "crash_midstream")
        events, last = stream(r, "open", **CONSTRAINTS[0])
        assert events[-1].startswith("event: error")
        error = last["error"]
        assert error["code"] == "midstream_failure" and error["seat"] == "brain"
        assert "under its response_format" in error["message"]
        assert error["attempts"] == ("brain=failed:worker_lost; "
                                     "coder=failed:worker_lost; hosted=skipped:constrained")
        assert r.upstream.requests == []
        assert r.counters()["proxy"]["midstream_aborts"] == 1
    finally:
        r.stop()
