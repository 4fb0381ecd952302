"""The Anthropic Messages door through `sanctum up`, as the official anthropic SDK sees
it: text sync and streamed, a tool round trip, a fallback after a killed seat named
after the seat that answered, a private route with no local seat (a 503 in Anthropic's
shape, nothing sent off the box), an over-cap prompt (a 413 with its numbers), and
count_tokens agreeing with the answer's own input_tokens.

The demo model never learned a tool syntax: tool_choice `any` or `tool` makes the seat
constrain its answer to a call with arguments that match the tool's schema.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import pytest

from tests.doors_rig import DoorsRig, start_doors

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [{"name": "get_weather", "description": "The forecast of a city.",
                     "input_schema": WEATHER}]
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def rig() -> Iterator[DoorsRig]:
    with start_doors() as r:
        yield r


@pytest.fixture(scope="module")
def client(rig: DoorsRig) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=rig.url, api_key="x", max_retries=0, timeout=300)


def _door_errors(rig: DoorsRig) -> dict[str, int]:
    """This door's errors by Anthropic's type, from /counters."""
    return dict(rig.counters()["proxy"]["door_errors"].get("messages", {}))


def _sanctum(message: Any) -> dict[str, Any]:
    extra = message.model_extra or {}
    assert "sanctum" in extra, extra
    return dict(extra["sanctum"])


def test_text_sync_streamed_and_counted(client: anthropic.Anthropic) -> None:
    """A plain answer, whole and streamed, named after the seat that wrote it, with the
    headers; count_tokens gives the same prompt tokens as the answer's usage."""
    args: dict[str, Any] = {"model": "private", "max_tokens": 12, "system": "Be brief.",
                            "messages": [{"role": "user", "content": "Say hello."}]}
    raw = client.messages.with_raw_response.create(**args)
    message = raw.parse()
    assert raw.headers["x-sanctum-seat"] == "brain" == message.model
    assert raw.headers["x-sanctum-attempts"] == "brain=ok"
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in message.content] == ["text"]
    assert 0 < message.usage.output_tokens <= 12 and message.usage.input_tokens > 0
    assert _sanctum(message)["seat"] == "brain"
    counted = client.messages.count_tokens(model="private", system=args["system"],
                                           messages=args["messages"])
    assert counted.input_tokens == (message.usage.input_tokens
                                    + (message.usage.cache_read_input_tokens or 0))

    with client.messages.stream(**args) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
        headers = stream.response.headers
    assert headers["x-sanctum-seat"] == "brain" == final.model
    assert pieces and "".join(pieces) == final.content[0].text  # type: ignore[union-attr]
    # the same prompt, the second time partly from the prompt cache (counted apart)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == \
        counted.input_tokens
    assert 0 < final.usage.output_tokens <= 12


def _call(client: anthropic.Anthropic, stream: bool, choice: dict[str, Any]) -> Any:
    args: dict[str, Any] = {"model": "private", "max_tokens": 96, "messages": ASK,
                            "tools": TOOLS, "tool_choice": choice,
                            "extra_body": {"temperature": 0}}
    if not stream:
        return client.messages.create(**args)
    with client.messages.stream(**args) as s:
        return s.get_final_message()


@pytest.mark.parametrize(("stream", "choice"), [
    (False, {"type": "any", "disable_parallel_tool_use": True}),
    (True, {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}),
])
def test_a_tool_round_trip(client: anthropic.Anthropic, stream: bool,
                           choice: dict[str, Any]) -> None:
    """A forced call arrives as a tool_use block whose input matches the schema; its
    tool_result sent back gets an answer in text."""
    message = _call(client, stream, choice)
    assert message.stop_reason == "tool_use", message
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and all(u.name == "get_weather" and u.id.startswith("toolu_") for u in uses)
    for use in uses:
        jsonschema.validate(use.input, WEATHER)
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                          for b in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                      "content": "4 degrees, light snow"} for u in uses]},
    ]
    answer = client.messages.create(model="private", max_tokens=16, messages=history,
                                    tools=TOOLS, tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]
    first = client.messages.count_tokens(model="private", messages=ASK, tools=TOOLS)
    # The second prompt holds the call and its result, as the template rendered them
    # (its first turn may come from the prompt cache: Anthropic counts that apart).
    prompt = answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)
    assert prompt > first.input_tokens + 8


def test_a_killed_seat_falls_back_and_the_answer_names_the_next(
        rig: DoorsRig, client: anthropic.Anthropic) -> None:
    """brain's worker killed: coder answers, and the message and headers say so."""
    old = rig.kill_seat("brain")
    try:
        raw = client.messages.with_raw_response.create(
            model="private", max_tokens=8, messages=[{"role": "user", "content": "Hi."}])
        message = raw.parse()
        assert message.model == "coder" == raw.headers["x-sanctum-seat"]
        attempts = raw.headers["x-sanctum-attempts"]
        assert attempts.startswith("brain=") and attempts.endswith("; coder=ok"), attempts
        assert _sanctum(message)["attempts"] == attempts
    finally:
        rig.wait_seat_back("brain", old)


def test_a_private_route_with_no_local_seat_is_a_503_and_stays_on_the_box(
        rig: DoorsRig, client: anthropic.Anthropic) -> None:
    """sealed: its local seat never started, its off-box rung is denied; the SDK raises
    the 503 in Anthropic's error shape and the upstream saw nothing; the door counts
    them by that type."""
    before = _door_errors(rig).get("overloaded_error", 0)
    seen = len(rig.upstream.requests)
    for stream in (False, True):
        with pytest.raises(anthropic.ServiceUnavailableError) as err:
            client.messages.create(model="sealed", max_tokens=8, messages=ASK,
                                   stream=stream)  # type: ignore[call-overload]
        body = err.value.body
        assert isinstance(body, dict) and body["type"] == "error", body
        assert err.value.type == "overloaded_error" and err.value.api_message
        assert body["error"]["code"] in ("no_private_seat", "loading"), body
    assert len(rig.upstream.requests) == seen
    assert _door_errors(rig).get("overloaded_error", 0) == before + 2


def test_an_over_cap_prompt_is_a_413_with_its_numbers(rig: DoorsRig,
                                                      client: anthropic.Anthropic) -> None:
    """A prompt past the seats' cap (1536 less the margin): a 413 with prompt_tokens and
    cap, before any rung is asked; count_tokens gives the same count."""
    before = _door_errors(rig).get("request_too_large", 0)
    long = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(anthropic.ContentTooLargeError) as err:
        client.messages.create(model="private", max_tokens=8, messages=long)
    body = err.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "request_too_large", body
    error = body["error"]
    assert error["prompt_tokens"] > error["cap"] and error["cap"] <= 1536, error
    counted = client.messages.count_tokens(model="private", messages=long)
    assert counted.input_tokens == error["prompt_tokens"]
    assert _door_errors(rig).get("request_too_large", 0) == before + 1


def test_an_offbox_rung_answers_through_this_door(rig: DoorsRig,
                                                  client: anthropic.Anthropic) -> None:
    """open: the hosted rung gets the chat in OpenAI's shape, and its answer comes back
    as an Anthropic message named after the rung."""
    seen = len(rig.upstream.requests)
    message = client.messages.create(model="open", max_tokens=8, system="Be brief.",
                                     messages=ASK)
    assert message.model == "cloud" and message.stop_reason == "end_turn"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text.strip() == "the cloud answers"  # type: ignore[union-attr]
    assert message.usage.input_tokens == 7  # the upstream's own count
    sent = rig.upstream.requests[seen]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, ASK[0]]


def test_a_stream_no_rung_can_finish_ends_with_an_error_the_sdk_raises(
        rig: DoorsRig, client: anthropic.Anthropic) -> None:
    """The only rung cuts its stream after a word: the door ends the stream with its
    error event, and the SDK raises instead of returning a short message as complete."""
    before = _door_errors(rig).get("midstream", 0)
    rig.upstream.set_script(["cut:1"])
    got: list[str] = []
    try:
        with pytest.raises(anthropic.APIStatusError) as err:
            with client.messages.stream(model="open", max_tokens=8, messages=ASK) as s:
                got.extend(s.text_stream)
    finally:
        rig.upstream.set_script(["ok"])
    assert "".join(got) == "the "
    body = err.value.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert body["error"]["type"] == "api_error" and body["error"]["seat"] == "cloud", body
    assert _door_errors(rig).get("midstream", 0) == before + 1


def test_a_stop_sequence_is_named_and_message_start_counts_the_prompt(
        client: anthropic.Anthropic) -> None:
    """A greedy answer cut by a stop string it reaches: stop_reason `stop_sequence` with
    the string, sync and streamed; the stream's message_start already carries the
    prompt's input_tokens, the same as the final usage."""
    greedy: Any = {"temperature": 0}
    args: dict[str, Any] = {"model": "private", "messages": ASK, "extra_body": greedy}
    whole = client.messages.create(max_tokens=24, **args)
    text = whole.content[0].text  # type: ignore[union-attr]
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]  # a string the answer reaches after its first words
    cut = client.messages.create(max_tokens=24, stop_sequences=[stop], **args)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert text.startswith(cut.content[0].text) and stop not in cut.content[0].text  # type: ignore[union-attr]
    with client.messages.stream(max_tokens=24, stop_sequences=[stop], **args) as s:
        starts = [e.message.usage for e in s if e.type == "message_start"]
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    [start] = starts
    assert start.input_tokens > 0
    assert start.input_tokens + (start.cache_read_input_tokens or 0) == \
        final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
