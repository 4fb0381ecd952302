"""The OpenAI Responses door: bodies into the chat's Generate (400s naming the
Responses path), and the ladder's events rendered as a Response object and as the
Responses event sequence, read back by the official openai SDK: its strict pydantic
types, and its client (`responses.create(stream=True)`, the `responses.stream` helper)
over an httpx MockTransport that serves the door's bytes."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx2
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from proxyd.doors.openai_responses_api import FIELDS, ResponsesRequest, read_responses
from proxyd.doors.openai_responses_door import ResponsesDoor
from proxyd.events import Answer, Done, Text
from shared.config import ProxyConfig
from shared.errors import BadRequest, PayloadTooLarge
from shared.protocol import ChatMessage, TokenLogprob, ToolCall, Usage

LIMITS = ProxyConfig()
EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather.",
        "parameters": WEATHER, "strict": True}
CALL = ToolCall(0, "call_a", "get_weather", '{"city": "Oslo"}')
LPS = (TokenLogprob("Hé", -0.5, tuple("Hé".encode()), (("Hé", -0.5), ("Ha", -1.5))),
       TokenLogprob("llo", float("-inf"), (), (("llo", float("-inf")),)))


def body(**kw: Any) -> bytes:
    return json.dumps({"model": "private", "input": "hi", **kw}).encode()


def read(**kw: Any) -> Any:
    return read_responses(body(**kw), LIMITS)


# ---------------------------------------------------------------------------
# Requests


def test_what_codex_sends_is_read_whole() -> None:
    """A Codex CLI turn: instructions, a developer message (its permissions), a
    reasoning item of an earlier answer, a call and its output, reasoning and verbosity
    settings: the reasoning item is dropped (no model here reasons from it), the
    settings ask for nothing a seat must do, every message reaches the seat, and no
    max_output_tokens means no budget short of the context."""
    call = read(instructions="You are Codex.", input=[
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "<permissions instructions>"}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "list the files"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
        {"type": "function_call", "call_id": "call_1", "name": "shell",
         "arguments": '{"command": ["ls"]}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
    ], tools=[{"type": "function", "name": "shell", "description": "Runs a command.",
               "strict": False, "parameters": {"type": "object", "properties": {
                   "command": {"type": "array", "items": {"type": "string"}}}}}],
        tool_choice="auto", parallel_tool_calls=False, store=False, stream=True,
        include=["reasoning.encrypted_content"], prompt_cache_key="k",
        reasoning={"effort": "medium", "summary": "auto"}, text={"verbosity": "low"})
    gen = call.generate("r")
    assert [m.role for m in gen.messages] == ["system", "developer", "user", "assistant",
                                              "tool"]
    assert gen.messages[1].content == "<permissions instructions>"
    assert gen.params.max_tokens == LIMITS.max_completion_tokens
    assert gen.tool_choice == "auto" and not gen.parallel_tool_calls and call.ignored == ()


def test_tools_run_by_openai_are_passed_over_and_named() -> None:
    """Codex CLI offers web_search and a namespace of sub-agent tools to every model:
    nothing here can run them, so the model is offered only the function tools, and the
    others are named in X-Sanctum-Ignored (the answer is still given)."""
    call = read(tools=[
        {"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
        {"type": "namespace", "name": "multi_agent_v1", "tools": [
            {"type": "function", "name": "close_agent", "parameters": {"type": "object"}}]},
        {"type": "web_search", "external_web_access": False},
    ], tool_choice="auto")
    assert [t["function"]["name"] for t in json.loads(call.generate("r").tools_json)] == \
        ["exec_command"]
    assert call.ignored == ("tools[1]_namespace", "tools[2]_web_search")
    with pytest.raises(BadRequest) as err:  # a passed-over tool cannot be forced
        read(tools=[{"type": "web_search"}], tool_choice={"type": "web_search"})
    assert err.value.param == "tool_choice.type"


def test_a_string_input_with_instructions_is_a_system_and_a_user_message() -> None:
    """instructions come first as a system message; the budget and sampling fields
    reach SamplingParams; stream and model are the call's."""
    call = read(instructions="Be brief.", max_output_tokens=40, temperature=0.2,
                top_p=0.9, stream=True)
    gen = call.generate("r1")
    assert gen.messages == (ChatMessage("system", "Be brief."), ChatMessage("user", "hi"))
    p = gen.params
    assert (p.max_tokens, p.temperature, p.top_p) == (40, 0.2, 0.9)
    assert (call.model, call.stream, gen.stream, gen.request_id) == ("private", True,
                                                                    True, "r1")
    assert gen.tools_json is None and gen.response_format is None and gen.tool_choice is None
    default = read().generate("r2").params
    # no max_output_tokens: no bound short of the context, within the proxy's limit
    assert (default.max_tokens, default.temperature, default.top_p) == \
        (ProxyConfig().max_completion_tokens, 1.0, 1.0)


def test_items_become_chat_turns_with_the_calls_in_one_assistant_turn() -> None:
    """Messages keep their roles and join their text parts; an assistant message and
    the function_call items after it are one assistant turn (OpenAI's chat shape of
    tool_calls); each function_call_output is a tool message answering its call."""
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in "},
                     {"type": "input_text", "text": "Oslo and Lima?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city":"Oslo"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": '{"city":"Lima"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "4 degrees"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "20 degrees"}]},
        {"type": "function_call", "call_id": "c3", "name": "get_weather",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "?"},
    ]
    messages = read(input=items, tools=[TOOL]).generate("r").messages
    assert [(m.role, m.content, m.tool_call_id) for m in messages] == [
        ("developer", "Use tools.", None), ("user", "Weather in Oslo and Lima?", None),
        ("assistant", "Checking.", None), ("tool", "4 degrees", "c1"),
        ("tool", "20 degrees", "c2"), ("assistant", "", None), ("tool", "?", "c3")]
    assert json.loads(messages[2].tool_calls_json or "") == [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
        {"id": "c2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Lima"}'}}]
    assert json.loads(messages[5].tool_calls_json or "")[0]["id"] == "c3"
    assert all(m.tool_calls_json is None for i, m in enumerate(messages) if i not in (2, 5))


@pytest.mark.parametrize(("fields", "tools_json", "choice", "fmt"), [
    ({"tools": [TOOL]},
     [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                        "parameters": WEATHER, "strict": True}}],
     None, None),
    ({"tools": [TOOL], "tool_choice": "required"}, ..., "required", None),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}}, ...,
     "function:get_weather", None),
    ({"tools": [TOOL], "tool_choice": "none"}, ..., "none", None),
    ({"text": {"format": {"type": "text"}}}, None, None, None),
    ({"text": {"format": {"type": "json_object"}}}, None, None, {"type": "json_object"}),
    ({"text": {"format": {"type": "json_schema", "name": "city", "schema": WEATHER,
                          "strict": True}, "verbosity": "medium"}},
     None, None, {"type": "json_schema",
                  "json_schema": {"name": "city", "schema": WEATHER, "strict": True}}),
])
def test_tools_choices_and_formats_reach_the_seat_in_the_chat_shape(
        fields: dict[str, Any], tools_json: Any, choice: str | None, fmt: Any) -> None:
    """Flat Responses tools, tool_choice and text.format become the chat door's
    Generate fields (the JSON the seat's template and grammar read)."""
    gen = read(**fields).generate("r")
    if tools_json is not ...:
        assert (json.loads(gen.tools_json) if gen.tools_json else None) == tools_json
    assert gen.tool_choice == choice
    assert (json.loads(gen.response_format) if gen.response_format else None) == fmt


def test_logprobs_are_asked_by_include_with_top_logprobs_alternatives() -> None:
    """include message.output_text.logprobs asks for each token's log-probability,
    top_logprobs for its alternatives; the other include values ask for nothing."""
    asked = read(include=["message.output_text.logprobs"], top_logprobs=3)
    assert asked.generate("r").params.logprobs == 3 and asked.door().logprobs
    assert read(include=["message.output_text.logprobs"]).generate("r").params.logprobs == 0
    plain = read(include=["reasoning.encrypted_content"])
    assert plain.generate("r").params.logprobs is None and not plain.door().logprobs


def test_parallel_tool_calls_and_sanctum_overrides_reach_the_generate() -> None:
    gen = read(tools=[TOOL], parallel_tool_calls=False,
               sanctum={"kv": "q8", "speculation": False, "draft_depth": 2}).generate("r")
    assert not gen.parallel_tool_calls
    assert (gen.kv, gen.speculation, gen.draft_depth) == ("q8", False, 2)
    assert read().generate("r").parallel_tool_calls


BIG = "x" * (LIMITS.max_content_chars + 1)


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": None, "instructions": "only a system message"}, "input"),
    ({"model": 3}, "model"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": LIMITS.max_completion_tokens + 1}, "max_output_tokens"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"content": "x"}]}, "input[0].type"),
    ({"input": [{"type": "message", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text"),
    ({"input": [{"type": "input_file", "file_id": "f"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "bad name",
                 "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     "input[0].arguments"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "nope", "output": "x"}]},
     "input[1].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c"}]}, "input[1].output"),
    # a bad function tool is named by its place in the body, passed-over tools counted
    ({"tools": [{"type": "web_search"}, TOOL, TOOL]}, "tools[2].name"),
    ({"tools": [{"type": "web_search"}, {"type": "function"}]}, "tools[1].name"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [TOOL, TOOL]}, "tools[1].name"),
    ({"tools": [{**TOOL, "parameters": {"enum": list(range(LIMITS.max_schema_bytes))}}]},
     "tools[0].parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}},
     "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}},
     "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"enum": list(range(LIMITS.max_schema_bytes))}}}},
     "text.format.schema"),
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"include": [3]}, "include[0]"),
    ({"include": "reasoning.encrypted_content"}, "include"),
    ({"sanctum": {"kv": "fp8"}}, "sanctum.kv"),
])
def test_bad_bodies_are_400s_naming_the_responses_path(fields: dict[str, Any],
                                                       param: str) -> None:
    with pytest.raises(BadRequest) as err:
        read_responses(body(**fields), LIMITS)
    assert err.value.param == param, err.value.message
    assert err.value.status == 400
    assert ".function." not in err.value.message and "response_format" not in err.value.message


@pytest.mark.parametrize(("raw", "param"), [(b"", "body"), (b"[]", "body"),
                                            (b"{not json", "body"),
                                            (b'{"input": "hi"}', "model")])
def test_a_body_that_is_no_request_names_what_is_missing(raw: bytes, param: str) -> None:
    with pytest.raises(BadRequest) as err:
        read_responses(raw, LIMITS)
    assert err.value.param == param


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": BIG}, "input"),
    ({"instructions": BIG}, "instructions"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": BIG}]}]},
     "input[0].content"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": BIG}]},
     "input[0].arguments"),
])
def test_a_text_past_the_limit_is_a_413_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(PayloadTooLarge) as err:
        read_responses(body(**fields), LIMITS)
    assert err.value.param == param and err.value.status == 413


def test_fields_that_ask_for_nothing_are_accepted_and_unknown_ones_listed() -> None:
    """store false, the defaults of refused fields, metadata, include values that name
    outputs no answer here has: accepted.  Fields unknown to the API are ignored and
    listed (sanitised), as at the chat door."""
    call = read(store=False, reasoning={"effort": None}, truncation="disabled",
                background=False, top_logprobs=0, metadata={"a": "b"}, user="u",
                service_tier="auto", prompt_cache_key="k", safety_identifier="s",
                include=["reasoning.encrypted_content", "file_search_call.results"],
                stream_options={"include_obfuscation": False}, previous_response_id=None)
    assert call.ignored == ()
    unknown = read(seed=3, **{"x y": 1, "frobnicate": True})
    assert unknown.ignored == ("frobnicate", "seed", "x_y")


def test_the_fields_table_names_every_field_of_the_body() -> None:
    assert set(FIELDS) == set(ResponsesRequest.__struct_fields__)
    assert all(f.reason for f in FIELDS.values())


# ---------------------------------------------------------------------------
# Rendering


def answer(seat: str = "brain") -> Answer:
    return Answer("rid1", seat, 1700000000, served=7, attempts=f"{seat}=ok",
                  speculation="accelerated", fingerprint="fp_1")


def door(stream: bool, **fields: Any) -> ResponsesDoor:
    door = read(stream=stream, **fields).door()
    assert door.name == "responses" and door.stream is stream
    return door


def events(stream: bytes) -> list[dict[str, Any]]:
    """Every event of the stream, each checked against the SDK's strict types and its
    `event:` line against its type."""
    out = []
    for block in stream.decode().split("\n\n"):
        if not block:
            continue
        head, data = block.split("\n", 1)
        EVENT.validate_json(data.removeprefix("data: "))
        event = json.loads(data.removeprefix("data: "))
        assert head == "event: " + event["type"], block
        out.append(event)
    return out


def test_a_body_is_a_response_the_sdk_validates() -> None:
    """id, model (the answering seat), a completed message whose text the SDK's
    output_text gives, the usage in the Responses shape, the sanctum object."""
    raw = door(False, tools=[TOOL]).body(Done(answer(), "Hello!", "stop", Usage(9, 3, 4)))
    r = Response.model_validate_json(raw)
    assert (r.id, r.object, r.status, r.model, r.output_text) == (
        "resp_rid1", "response", "completed", "brain", "Hello!")
    assert r.created_at == 1700000000 and r.incomplete_details is None and r.error is None
    assert r.output[0].type == "message" and r.output[0].id == "msg_rid1"
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens,
            r.usage.input_tokens_details.cached_tokens,
            r.usage.output_tokens_details.reasoning_tokens) == (9, 3, 12, 4, 0)
    assert [t.name for t in r.tools] == ["get_weather"]  # type: ignore[union-attr]
    extra = r.model_extra or {}
    assert extra["sanctum"]["seat"] == "brain" and extra["sanctum"]["served"] == 7
    assert extra["system_fingerprint"] == "fp_1"


def test_a_body_with_calls_and_one_cut_by_its_budget() -> None:
    """Calls alone: function_call items only; a length finish: status incomplete with
    reason max_output_tokens, its message incomplete too; no text and no calls: one
    empty message."""
    calls = (CALL, ToolCall(1, "call_b", "get_weather", '{"city": "Lima"}'))
    r = Response.model_validate_json(
        door(False).body(Done(answer(), "", "tool_calls", Usage(1, 2), calls)))
    assert r.status == "completed" and r.output_text == ""
    assert [(o.type, o.id, o.call_id, o.name, o.arguments, o.status)  # type: ignore[union-attr]
            for o in r.output] == [
        ("function_call", "fc_rid1_0", "call_a", "get_weather", '{"city": "Oslo"}',
         "completed"),
        ("function_call", "fc_rid1_1", "call_b", "get_weather", '{"city": "Lima"}',
         "completed")]
    cut = Response.model_validate_json(door(False).body(Done(answer(), "Hel", "length",
                                                             Usage(1, 2))))
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and cut.output_text == "Hel"
    empty = Response.model_validate_json(door(False).body(Done(answer(), "", "stop",
                                                               Usage(1, 0))))
    assert [o.type for o in empty.output] == ["message"] and empty.output_text == ""


def sdk(stream: bytes) -> openai.OpenAI:
    """The official client, served `stream` by a MockTransport (no socket)."""
    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                               content=stream)
    return openai.OpenAI(api_key="x", base_url="http://sanctum.test/v1", max_retries=0,
                         http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def rendered(d: ResponsesDoor, pieces: list[Text], finish: str | None,
             a: Answer | None = None) -> bytes:
    a = a or answer()
    return (d.opening(a) + b"".join(d.text(a, p) for p in pieces)
            + d.closing(a, finish, Usage(5, 3)))


def test_the_sdk_stream_helper_assembles_the_text_and_the_final_response() -> None:
    """created, in_progress, the message item, a delta per Text event, its done events,
    completed with the whole response: sequence numbers count from 0 without a gap,
    and the SDK's helper gives the text and the final response."""
    d = door(True)
    raw = rendered(d, [Text("Hel"), Text("lo, "), Text("wörld \"\n")], "stop")
    evs = events(raw)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 3,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    with sdk(raw).responses.stream(model="private", input="hi") as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert deltas == ["Hel", "lo, ", "wörld \"\n"]
    assert final.output_text == "Hello, wörld \"\n" and final.status == "completed"
    assert final.id == "resp_rid1" and final.model == "brain"
    assert final.usage is not None and final.usage.total_tokens == 8
    assert (final.model_extra or {})["sanctum"]["attempts"] == "brain=ok"


def test_streamed_tool_calls_are_function_call_items_the_sdk_assembles() -> None:
    """Text, then each completed call as a function_call item (added, arguments delta
    and done, done), the message closed before it; the final response holds both."""
    d = door(True, tools=[TOOL])
    later = ToolCall(1, "call_b", "get_weather", '{"city": "Lima"}')
    raw = rendered(d, [Text("Let me check."), Text("", (CALL,)), Text("", (later,))],
                   "tool_calls")
    kinds = [e["type"] for e in events(raw)]
    assert kinds[kinds.index("response.output_item.done") + 1:] == [
        *["response.output_item.added", "response.function_call_arguments.delta",
          "response.function_call_arguments.done", "response.output_item.done"] * 2,
        "response.completed"]
    with sdk(raw).responses.stream(model="private", input="hi") as s:
        arguments = [e.delta for e in s if e.type == "response.function_call_arguments.delta"]
        final = s.get_final_response()
    assert arguments == ['{"city": "Oslo"}', '{"city": "Lima"}']
    assert final.output_text == "Let me check."
    calls = [o for o in final.output if o.type == "function_call"]
    assert [(c.call_id, c.name, c.arguments) for c in calls] == [  # type: ignore[union-attr]
        ("call_a", "get_weather", '{"city": "Oslo"}'), ("call_b", "get_weather",
                                                         '{"city": "Lima"}')]
    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]


def test_a_stream_cut_by_its_budget_ends_incomplete() -> None:
    """response.incomplete, as OpenAI ends one: the raw stream gives it with the reason;
    the SDK's helper has no completed response to give (as with OpenAI itself)."""
    raw = rendered(door(True), [Text("Hel")], "length")
    last = events(raw)[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["output"][0]["status"] == "incomplete"
    got = list(sdk(raw).responses.create(model="private", input="hi", stream=True))
    assert got[-1].type == "response.incomplete"
    with sdk(raw).responses.stream(model="private", input="hi") as s, \
            pytest.raises(RuntimeError, match=r"response\.completed"):
        s.get_final_response()


def test_an_empty_stream_answer_is_one_empty_message() -> None:
    with sdk(rendered(door(True), [], "stop")).responses.stream(model="m", input="hi") as s:
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["message"] and final.output_text == ""


def test_a_broken_stream_makes_the_sdk_raise_never_a_complete_response() -> None:
    """After text, the ladder's abort renders response.failed (status failed, the
    output so far, its message incomplete) and an `error` event with the facts: the
    SDK raises APIError on it, from the raw stream and from the helper alike."""
    a = answer()
    d = door(True)
    raw = (d.opening(a) + d.text(a, Text("Half an ans"))
           + d.error_event("seat brain failed mid-answer", "worker_lost",
                           {"seat": "brain", "attempts": "brain=failed:worker_lost",
                            "segments": [{"seat": "brain", "chars": 11}]}))
    evs = events(raw)
    failed, error = evs[-2:]
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed" and failed["response"]["id"] == "resp_rid1"
    assert failed["response"]["error"] == {"code": "server_error",
                                           "message": "seat brain failed mid-answer"}
    assert failed["response"]["output"][0]["status"] == "incomplete"
    assert failed["response"]["output"][0]["content"][0]["text"] == "Half an ans"
    assert (error["type"], error["code"], error["message"]) == (
        "error", "worker_lost", "seat brain failed mid-answer")
    assert error["error"]["seat"] == "brain" and error["error"]["type"] == "server_error"
    seen: list[str] = []
    with pytest.raises(openai.APIError, match="failed mid-answer") as err:
        for event in sdk(raw).responses.create(model="private", input="hi", stream=True):
            seen.append(event.type)
    assert seen[-1] == "response.failed"
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "worker_lost"
    finals: list[Any] = []
    with pytest.raises(openai.APIError), \
            sdk(raw).responses.stream(model="private", input="hi") as s:
        finals.append(s.get_final_response())
    assert finals == []


def test_a_continued_stream_names_every_segment_in_the_final_response() -> None:
    """A second rung finishing the answer: its text follows without a seam, the final
    response names it as the model and lists both segments; no trailer follows (the
    SDK would read one as an event)."""
    a = answer()
    d = door(True)
    head = d.opening(a) + d.text(a, Text("Once upon "))
    a.seat, a.served, a.attempts = "coder", 2, "brain=failed:worker_lost; coder=ok"
    a.segments = [{"seat": "brain", "served": 7, "chars": 10},
                  {"seat": "coder", "served": 2, "chars": 6}]
    tail = d.text(a, Text("a time")) + d.closing(a, "stop", Usage(4, 5))
    assert d.trailer(a) == b""
    with sdk(head + tail).responses.stream(model="private", input="hi") as s:
        final = s.get_final_response()
    assert final.output_text == "Once upon a time" and final.model == "coder"
    assert [seg["seat"] for seg in (final.model_extra or {})["sanctum"]["segments"]] == \
        ["brain", "coder"]


def test_a_text_delta_is_the_json_a_fresh_encode_would_give() -> None:
    """The hot path splices the text into a prebuilt event: the same JSON, for text
    that JSON must escape."""
    d = door(True)
    a = answer()
    d.opening(a)
    for text in ["plain", "quote \" and \\", "\x00\x1f line\nbreak", "é😀", "</script>"]:
        event = events(d.text(a, Text(text)))[-1]  # (the first opens the message)
        assert event["type"] == "response.output_text.delta"
        assert event["delta"] == text and event["item_id"] == "msg_rid1"


@pytest.mark.parametrize("make", [
    lambda: door(True).error_event("stopped", "proxy_shutdown", {"seat": "brain"}),
])
def test_an_error_before_any_text_still_names_the_response(make: Callable[[], bytes]) -> None:
    """A door whose opening never ran still renders a valid terminal pair."""
    kinds = [e["type"] for e in events(make())]
    assert kinds == ["response.failed", "error"]


def test_logprobs_ride_on_the_deltas_and_the_text_part_when_asked() -> None:
    """Each delta carries its tokens' log-probabilities (-inf as -9999, OpenAI's floor),
    the done events and the final text part all of them; a body's text part too; a
    door that was not asked sends none."""
    d = door(True, include=["message.output_text.logprobs"], top_logprobs=2)
    raw = rendered(d, [Text("Hé", logprobs=LPS[:1]), Text("llo", logprobs=LPS[1:])], "stop")
    deltas = [e for e in events(raw) if e["type"] == "response.output_text.delta"]
    assert [[(t["token"], t["logprob"]) for t in e["logprobs"]] for e in deltas] == \
        [[("Hé", -0.5)], [("llo", -9999.0)]]
    assert [(t["token"], t["logprob"]) for t in deltas[0]["logprobs"][0]["top_logprobs"]] \
        == [("Hé", -0.5), ("Ha", -1.5)]
    with sdk(raw).responses.stream(model="m", input="hi") as s:
        final = s.get_final_response()
    part = final.output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs is not None
    assert [(t.token, t.logprob, bytes(t.bytes)) for t in part.logprobs] == [
        ("Hé", -0.5, "Hé".encode()), ("llo", -9999.0, b"llo")]
    assert final.top_logprobs == 2
    body = Response.model_validate_json(
        door(False, include=["message.output_text.logprobs"]).body(
            Done(answer(), "Héllo", "stop", Usage(1, 2), (), LPS)))
    lps = body.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert lps is not None and [t.token for t in lps] == ["Hé", "llo"]
    unasked = rendered(door(True), [Text("Hé", logprobs=LPS[:1])], "stop")
    assert all(not e.get("logprobs") for e in events(unasked))
    plain = Response.model_validate_json(door(False).body(
        Done(answer(), "Héllo", "stop", Usage(1, 2), (), LPS)))
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]


def test_a_body_has_the_streams_items_in_the_streams_order() -> None:
    """Text, a call, more text: the body's output items are the stream's, in its order
    (a message, the call, a second message), not all text first."""
    pieces = [Text("Let me check. "), Text("", (CALL,)), Text("Done.")]
    streamed = [e["item"] for e in events(rendered(door(True), pieces, "tool_calls"))
                if e["type"] == "response.output_item.done"]
    done = Done(answer(), "Let me check. Done.", "tool_calls", Usage(5, 3), (CALL,),
                parts=("Let me check. ", CALL, "Done."))
    body = json.loads(door(False).body(done))["output"]
    kinds = [(i["type"], i.get("name") or "".join(p["text"] for p in i["content"]))
             for i in body]
    assert kinds == [("message", "Let me check. "), ("function_call", "get_weather"),
                     ("message", "Done.")]
    assert [(i["type"], i.get("name") or "".join(p["text"] for p in i["content"]))
            for i in streamed] == kinds


def test_unknown_keys_inside_the_body_are_named_with_their_paths() -> None:
    """An input item's or a function tool's unknown key is named with its path; a
    reasoning item (dropped) and a tool OpenAI runs (named whole) are not walked."""
    call = read(input=[{"role": "user", "content": "hi", "zz": 1},
                       {"type": "reasoning", "id": "rs_1", "summary": [],
                        "encrypted_content": "x"}],
                tools=[{"type": "function", "name": "f", "parameters": {"type": "object"},
                        "yy": 2}, {"type": "web_search", "external_web_access": True}])
    assert call.ignored == ("input[0].zz", "tools[0].yy", "tools[1]_web_search")
