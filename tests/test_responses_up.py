"""POST /v1/responses through `sanctum up` (tests/doors_rig.py), as the official openai
SDK's `client.responses` sees it: text sync and streamed (the SDK's stream helper
assembling it), a tool round trip under the grammar, a json_schema text.format, an
off-box rung given the chat the Responses body spells, a fallback after a killed seat
named by the seat that answered, a private route with its local seat down (503 in
OpenAI's error shape, nothing sent off the box) and a prompt over the cap (413 with
its numbers)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.doors_rig import DoorsRig, start_doors
from tests.procs import http

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "parameters": WEATHER,
                     "description": "The weather forecast of a city.", "strict": True}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "member": {"type": "boolean"}},
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def rig() -> Iterator[DoorsRig]:
    with start_doors() as r:
        yield r


@pytest.fixture(scope="module")
def client(rig: DoorsRig) -> openai.OpenAI:
    return openai.OpenAI(base_url=rig.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _sanctum(obj: Any) -> dict[str, Any]:
    return dict((obj.model_extra or {})["sanctum"])


def test_text_sync_and_streamed_are_the_same_answer(client: openai.OpenAI) -> None:
    """A greedy answer, whole and streamed: the SDK's helper assembles the same text and
    gives the final response; both name the answering seat, as the headers do."""
    args: dict[str, Any] = dict(model="private", input="Say hello.", temperature=0,
                                max_output_tokens=64)
    raw = client.responses.with_raw_response.create(**args)
    sync = raw.parse()
    assert sync.status == "completed" and sync.output_text, sync
    assert sync.model == raw.headers["X-Sanctum-Seat"] == "brain"
    assert _sanctum(sync)["seat"] == "brain" and raw.headers["X-Sanctum-Attempts"] == "brain=ok"
    assert sync.usage is not None and sync.usage.output_tokens > 0
    with client.responses.stream(**args) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == final.output_text == sync.output_text
    assert final.model == "brain" and final.status == "completed"
    assert final.usage is not None and final.usage.output_tokens == sync.usage.output_tokens
    assert _sanctum(final)["seat"] == "brain"


FIRST_TURN: dict[str, Any] = dict(model="private", input="What is the weather in Oslo?",
                                  tools=TOOLS, parallel_tool_calls=False, temperature=0,
                                  max_output_tokens=96)


def _called(output: list[Any]) -> list[Any]:
    calls = [o for o in output if o.type == "function_call"]
    for call in calls:
        assert call.name == "get_weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    return calls


def test_a_tool_round_trip(client: openai.OpenAI) -> None:
    """A forced call (tool_choice required) is a function_call item whose arguments
    validate; sent back with its output, it gets an answer in text, whose prompt held
    the call and its result."""
    r = client.responses.create(**FIRST_TURN, tool_choice="required")
    assert r.status == "completed", r
    calls = _called(r.output)
    assert len(calls) == 1, r.output
    history: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"},
                          *[o.to_dict() for o in r.output],
                          {"type": "function_call_output", "call_id": calls[0].call_id,
                           "output": "4 degrees, light snow"}]
    second = client.responses.create(model="private", input=history, tools=TOOLS,
                                     tool_choice="none", temperature=0, max_output_tokens=8)
    assert second.output_text and not _called(second.output)
    assert r.usage is not None and second.usage is not None
    assert second.usage.input_tokens > r.usage.input_tokens + 8, (r.usage, second.usage)


def test_a_named_function_streamed_is_a_call_the_sdk_helper_assembles(
        client: openai.OpenAI) -> None:
    with client.responses.stream(
            **FIRST_TURN, tool_choice={"type": "function", "name": "get_weather"}) as s:
        deltas = [e.delta for e in s if e.type == "response.function_call_arguments.delta"]
        r = s.get_final_response()
    assert r.status == "completed", r
    (call,) = _called(r.output)
    assert deltas == [call.arguments]


def test_a_json_schema_text_format_gives_json_that_validates(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="private", input="Describe a person as JSON.", temperature=0.9,
        max_output_tokens=96,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), PERSON)


def test_an_offbox_rung_gets_the_chat_the_responses_body_spells(
        client: openai.OpenAI, rig: DoorsRig) -> None:
    """On the route that allows it, the hosted rung answers: named as the seat, its
    upstream given instructions as the system message, sync and streamed."""
    before = len(rig.upstream.requests)
    r = client.responses.create(model="open", input="hi", instructions="Be brief.",
                                max_output_tokens=20)
    assert r.model == "cloud" and r.output_text.strip() == "the cloud answers"
    sent = rig.upstream.requests[before]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "hi"}]
    assert sent["max_tokens"] == 20
    with client.responses.stream(model="open", input="hi") as s:
        assert s.get_final_response().output_text.strip() == "the cloud answers"


def test_a_private_route_with_its_local_seat_down_is_a_503_sending_nothing_off_box(
        client: openai.OpenAI, rig: DoorsRig) -> None:
    """sealed: its local seat never started (the proxy calls it loading within its
    spawn grace, down after), its off-box rung is denied: a 503 in OpenAI's shape, sync
    and streamed, and the upstream saw nothing."""
    before = len(rig.upstream.requests)
    with pytest.raises(openai.InternalServerError) as err:
        client.responses.create(model="sealed", input="hi")
    assert err.value.status_code == 503
    assert isinstance(err.value.body, dict)
    assert err.value.body["code"] in ("no_private_seat", "loading")
    status, _, body = http("POST", rig.url + "/v1/responses",
                           {"model": "sealed", "input": "hi", "stream": True})
    error = json.loads(body)["error"]
    assert status == 503 and error["type"] == "server_error"
    assert error["code"] in ("no_private_seat", "loading")
    assert len(rig.upstream.requests) == before


def test_a_prompt_over_the_cap_is_a_413_with_its_numbers(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        client.responses.create(model="private", input="hello " * 2000)
    assert err.value.status_code == 413
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded"
    assert body["prompt_tokens"] > body["cap"] > 0


def test_a_killed_seat_falls_back_named_by_the_seat_that_answered(
        client: openai.OpenAI, rig: DoorsRig) -> None:
    old = rig.kill_seat("brain")
    try:
        raw = client.responses.with_raw_response.create(
            model="private", input="Say hello.", temperature=0, max_output_tokens=16)
        r = raw.parse()
        assert r.model == raw.headers["X-Sanctum-Seat"] == "coder" == _sanctum(r)["seat"]
        attempts = raw.headers["X-Sanctum-Attempts"]
        assert attempts.startswith("brain=failed") and attempts.endswith("coder=ok"), attempts
        assert r.output_text
    finally:
        rig.wait_seat_back("brain", old)


def test_a_stream_no_rung_can_finish_ends_failed_and_the_sdk_raises(
        rig: DoorsRig, client: openai.OpenAI) -> None:
    """The only rung cuts its stream after a word: the door ends the stream with
    response.failed and an error event, never response.completed, and the SDK's stream
    helper raises instead of returning a short response as complete; the door counts a
    midstream error."""
    def midstream() -> int:
        return int(rig.counters()["proxy"]["door_errors"].get("responses", {})
                   .get("midstream", 0))

    before = midstream()
    rig.upstream.set_script(["cut:1"])
    types: list[str] = []
    try:
        with pytest.raises(openai.APIError) as err:
            with client.responses.stream(model="open", input="hello",
                                         max_output_tokens=8) as s:
                types.extend(event.type for event in s)
    finally:
        rig.upstream.set_script(["ok"])
    assert "response.output_text.delta" in types and "response.completed" not in types
    assert types[-1] == "response.failed", types
    body = err.value.body
    assert isinstance(body, dict) and body.get("seat") == "cloud", body
    assert midstream() == before + 1
