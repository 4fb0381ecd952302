"""The OpenAI doors' fields: each one honoured (mapped onto the Generate a rung gets),
accepted, or refused with a 400 naming it; fields unknown to the API found, named and
bounded for X-Sanctum-Ignored.  Pure: the parsers and the field table, no process."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from proxyd.doors.openai_api import (
    ChatRequest,
    CompletionRequest,
    read_chat,
    read_completion,
)
from proxyd.doors.openai_fields import (
    FIELDS,
    MAX_IGNORED_LISTED,
    door_fields,
    ignored_fields,
    ignored_header,
    sanitise,
)
from proxyd.journey import constraint, may_continue
from shared import protocol
from shared.config import ProxyConfig
from shared.errors import BadRequest, SanctumError
from shared.protocol import MAX_LOGIT_BIAS, Generate, SamplingParams

L = ProxyConfig()
HI = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock"}}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
HISTORY = [{"role": "user", "content": "weather in Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]


def chat(**kw: Any) -> bytes:
    return json.dumps({"model": "m", "messages": HI, **kw}).encode()


def completion(**kw: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": "once", **kw}).encode()


def generate_of(body: bytes) -> Generate:
    if b'"messages"' in body:
        return read_chat(body, L).generate("r")
    return read_completion(body, L).generate("r")


# (name, body, what the Generate holds)
GOOD: list[tuple[str, bytes, Callable[[Generate], bool]]] = [
    ("defaults", chat(), lambda g: g.params == SamplingParams(max_tokens=512)
     and g.tools_json is None and g.tool_choice is None and g.response_format is None
     and g.parallel_tool_calls is True),
    ("penalties", chat(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.3),
     lambda g: (g.params.presence_penalty, g.params.frequency_penalty,
                g.params.repetition_penalty) == (-2.0, 2.0, 1.3)),
    ("min_p and top_k", chat(min_p=0.05, top_k=40),
     lambda g: (g.params.min_p, g.params.top_k) == (0.05, 40)),
    ("logit_bias sorted by id", chat(logit_bias={"50256": -100, "7": 2.5, "0": 100}),
     lambda g: g.params.logit_bias == ((0, 100.0), (7, 2.5), (50256, -100.0))),
    ("logprobs alone", chat(logprobs=True), lambda g: g.params.logprobs == 0),
    ("top_logprobs", chat(logprobs=True, top_logprobs=20), lambda g: g.params.logprobs == 20),
    ("logprobs false", chat(logprobs=False), lambda g: g.params.logprobs is None),
    ("tools, auto", chat(tools=[WEATHER], tool_choice="auto"),
     lambda g: json.loads(g.tools_json or "") == [WEATHER] and g.tool_choice == "auto"),
    ("tools without tool_choice", chat(tools=[WEATHER]), lambda g: g.tool_choice is None),
    ("tool_choice none", chat(tools=[WEATHER], tool_choice="none"),
     lambda g: g.tool_choice == "none" and g.tools_json is not None),
    ("tool_choice none without tools", chat(tool_choice="none"),
     lambda g: g.tool_choice == "none"),
    ("tool_choice required", chat(tools=[WEATHER, CLOCK], tool_choice="required"),
     lambda g: g.tool_choice == "required"),
    ("tool_choice named", chat(tools=[WEATHER, CLOCK], tool_choice={
        "type": "function", "function": {"name": "clock"}}),
     lambda g: g.tool_choice == "function:clock"),
    ("parallel_tool_calls false", chat(tools=[WEATHER], parallel_tool_calls=False),
     lambda g: g.parallel_tool_calls is False),
    ("response_format text is free text", chat(response_format={"type": "text"}),
     lambda g: g.response_format is None),
    ("response_format json_object", chat(response_format={"type": "json_object"}),
     lambda g: g.response_format == '{"type":"json_object"}'),
    ("response_format json_schema without a schema: any object, as OpenAI reads it",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "n"}}),
     lambda g: json.loads(g.response_format or "") == {
         "type": "json_schema", "json_schema": {"name": "n"}}),
    ("response_format json_schema", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "count", "schema": SCHEMA,
                                               "strict": True}}),
     lambda g: json.loads(g.response_format or "") == {
         "type": "json_schema", "json_schema": {"name": "count", "schema": SCHEMA,
                                                "strict": True}}),
    ("tool history", chat(messages=HISTORY, tools=[WEATHER]),
     lambda g: g.messages is not None and g.messages[1].content == ""
     and json.loads(g.messages[1].tool_calls_json or "") == [CALL]
     and (g.messages[2].role, g.messages[2].tool_call_id, g.messages[2].content)
     == ("tool", "call_1", "sunny, 21C")),
    ("a tool result in text parts", chat(messages=[*HISTORY[:2], {
        "role": "tool", "tool_call_id": "call_1",
        "content": [{"type": "text", "text": "sun"}, {"type": "text", "text": "ny"}]}]),
     lambda g: g.messages is not None and g.messages[2].content == "sunny"),
    ("empty tool_calls is none", chat(messages=[
        {"role": "assistant", "content": "x", "tool_calls": []}, *HI]),
     lambda g: g.messages is not None and g.messages[0].tool_calls_json is None),
    ("refused fields at their no-op values", chat(
        n=1, store=False, verbosity="medium", modalities=["text"], audio=None,
        reasoning_effort=None, functions=None), lambda g: True),
    ("accepted fields", chat(
        user="u", metadata={"k": "v"}, service_tier="flex", safety_identifier="s",
        prompt_cache_key="k", prompt_cache_retention="24h",
        prompt_cache_options={"ttl": "30m"},
        prediction={"type": "content", "content": "draft"}), lambda g: True),
    ("completion logprobs", completion(logprobs=3), lambda g: g.params.logprobs == 3),
    ("completion logprobs past OpenAI's 5", completion(logprobs=20),
     lambda g: g.params.logprobs == 20),
    ("completion penalties and bias", completion(
        presence_penalty=0.5, frequency_penalty=0.25, logit_bias={"3": -1}),
     lambda g: (g.params.presence_penalty, g.params.frequency_penalty,
                g.params.logit_bias) == (0.5, 0.25, ((3, -1.0),))),
    ("completion no-op values", completion(best_of=1, suffix="", n=1, echo=False),
     lambda g: g.prompt == "once"),
]


@pytest.mark.parametrize(("name", "body", "holds"), GOOD, ids=[c[0] for c in GOOD])
def test_each_field_reaches_the_generate(name: str, body: bytes,
                                         holds: Callable[[Generate], bool]) -> None:
    """A good value of each field becomes the Generate field a rung reads, and the
    Generate is one a seat takes from the wire as it is."""
    gen = generate_of(body)
    assert holds(gen), gen
    assert protocol.read_request(protocol.encode(gen)) == gen


# (name, body, param)
BAD: list[tuple[str, bytes, str]] = [
    ("presence_penalty > 2", chat(presence_penalty=2.5), "presence_penalty"),
    ("frequency_penalty < -2", chat(frequency_penalty=-3), "frequency_penalty"),
    ("repetition_penalty 0", chat(repetition_penalty=0), "repetition_penalty"),
    ("repetition_penalty past 10", chat(repetition_penalty=11), "repetition_penalty"),
    ("min_p > 1", chat(min_p=1.5), "min_p"),
    ("logit_bias key not an id", chat(logit_bias={"hello": 1}), "logit_bias.hello"),
    ("logit_bias negative id", chat(logit_bias={"-1": 1}), "logit_bias.-1"),
    ("logit_bias id past int32", chat(logit_bias={str(2**31): 1}), f"logit_bias.{2**31}"),
    ("logit_bias unsafe key named safely", chat(logit_bias={"a b\n": 1}), "logit_bias.a_b_"),
    ("logit_bias value > 100", chat(logit_bias={"5": 101}), "logit_bias.5"),
    ("logit_bias value a string", chat(logit_bias={"5": "1"}), "logit_bias.5"),
    ("logit_bias key of 5,000 digits", chat(logit_bias={"9" * 5000: 1}),
     "logit_bias." + "9" * 64),
    ("logit_bias value of 400 digits", chat(logit_bias={"5": 10**400}), "logit_bias.5"),
    ("logit_bias value a bool", chat(logit_bias={"5": True}), "logit_bias.5"),
    ("logit_bias one token twice", chat(logit_bias={"5": 1, "05": 2}), "logit_bias.05"),
    ("logit_bias not an object", chat(logit_bias=[1]), "logit_bias"),
    ("logit_bias too many", chat(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}),
     "logit_bias"),
    ("logprobs not a bool", chat(logprobs=3), "logprobs"),
    ("top_logprobs without logprobs", chat(top_logprobs=2), "top_logprobs"),
    ("top_logprobs with logprobs false", chat(logprobs=False, top_logprobs=2), "top_logprobs"),
    ("top_logprobs > 20", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("tools not a list", chat(tools={"type": "function"}), "tools"),
    ("tool of another type", chat(tools=[{"type": "custom", "function": {"name": "f"}}]),
     "tools[0].type"),
    ("tool without function", chat(tools=[{"type": "function"}]), "tools[0].function"),
    ("tool name with a space", chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
     "tools[0].function.name"),
    ("tool name past 64", chat(tools=[{"type": "function", "function": {"name": "a" * 65}}]),
     "tools[0].function.name"),
    ("tool name empty", chat(tools=[{"type": "function", "function": {"name": ""}}]),
     "tools[0].function.name"),
    ("tool parameters not an object", chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": "{}"}}]), "tools[0].function.parameters"),
    ("tool strict not a bool", chat(tools=[{"type": "function", "function": {
        "name": "f", "strict": "yes"}}]), "tools[0].function.strict"),
    ("two tools of one name", chat(tools=[WEATHER, CLOCK, WEATHER]), "tools[2].function.name"),
    ("tool_choice unknown", chat(tools=[WEATHER], tool_choice="any"), "tool_choice"),
    ("tool_choice required without tools", chat(tool_choice="required"), "tool_choice"),
    ("tool_choice named without tools", chat(tool_choice={
        "type": "function", "function": {"name": "f"}}), "tool_choice"),
    ("tool_choice naming no tool", chat(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "clock"}}), "tool_choice"),
    ("tool_choice allowed_tools", chat(tools=[WEATHER], tool_choice={
        "type": "allowed_tools", "allowed_tools": {}}), "tool_choice.type"),
    ("parallel_tool_calls not a bool", chat(parallel_tool_calls="no"), "parallel_tool_calls"),
    ("response_format of unknown type", chat(response_format={"type": "xml"}),
     "response_format.type"),
    ("response_format without type", chat(response_format={}), "response_format.type"),
    ("json_schema without its spec", chat(response_format={"type": "json_schema"}),
     "response_format.json_schema"),
    ("json_schema schema not an object", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": True}}),
     "response_format.json_schema.schema"),
    ("json_schema bad name", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
     "response_format.json_schema.name"),
    ("assistant call without id", chat(messages=[
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": "{}"}}]}, *HI]), "messages[0].tool_calls[0].id"),
    ("assistant call of another type", chat(messages=[
        {"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}, *HI]),
     "messages[0].tool_calls[0].type"),
    ("assistant call arguments not text", chat(messages=[
        {"role": "assistant", "tool_calls": [{**CALL, "function": {
            "name": "f", "arguments": {"city": "Oslo"}}}]}, *HI]),
     "messages[0].tool_calls[0].function.arguments"),
    ("tool_calls on a user message", chat(messages=[
        {"role": "user", "content": "x", "tool_calls": [CALL]}]), "messages[0].tool_calls"),
    ("tool message without tool_call_id", chat(messages=[
        *HISTORY[:2], {"role": "tool", "content": "sunny"}]), "messages[2].tool_call_id"),
    ("tool message without content", chat(messages=[
        *HISTORY[:2], {"role": "tool", "tool_call_id": "call_1"}]), "messages[2].content"),
    ("tool message answering no call", chat(messages=[
        *HISTORY[:2], {"role": "tool", "tool_call_id": "call_9", "content": "x"}]),
     "messages[2].tool_call_id"),
    ("tool message before its call", chat(messages=[
        {"role": "tool", "tool_call_id": "call_1", "content": "x"}, *HISTORY[:2]]),
     "messages[0].tool_call_id"),
    ("tool_call_id on a user message", chat(messages=[
        {"role": "user", "content": "x", "tool_call_id": "call_1"}]),
     "messages[0].tool_call_id"),
    ("the function role", chat(messages=[{"role": "function", "name": "f", "content": "x"}]),
     "messages[0].role"),
    # refused: not implemented
    ("n 2", chat(n=2), "n"),
    ("n true", chat(n=True), "n"),
    ("audio", chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
    ("modalities with audio", chat(modalities=["text", "audio"]), "modalities"),
    ("web_search_options", chat(web_search_options={}), "web_search_options"),
    ("functions", chat(functions=[{"name": "f"}]), "functions"),
    ("function_call", chat(function_call="auto"), "function_call"),
    ("store true", chat(store=True), "store"),
    ("store 0", chat(store=0), "store"),
    ("reasoning_effort", chat(reasoning_effort="low"), "reasoning_effort"),
    ("verbosity low", chat(verbosity="low"), "verbosity"),
    ("moderation", chat(moderation={"model": "m"}), "moderation"),
    ("completion suffix", completion(suffix="end"), "suffix"),
    ("completion best_of 2", completion(best_of=2), "best_of"),
    ("completion n 3", completion(n=3), "n"),
    ("completion logprobs true", completion(logprobs=True), "logprobs"),
    ("completion logprobs past 20", completion(logprobs=21), "logprobs"),
    ("completion echo with logprobs", completion(echo=True, logprobs=1), "echo"),
    ("completion echo not a bool", completion(echo="yes"), "echo"),
    ("completion logit_bias bad key", completion(logit_bias={"x": 1}), "logit_bias.x"),
]


@pytest.mark.parametrize(("name", "body", "param"), BAD, ids=[c[0] for c in BAD])
def test_each_bad_value_is_a_400_naming_its_field(name: str, body: bytes, param: str) -> None:
    """A value the door cannot honour is a 400 in the OpenAI shape whose `param` names
    the field (with its path), never a success without it."""
    with pytest.raises(BadRequest) as refused:
        generate_of(body)
    error = refused.value.body()["error"]
    assert (refused.value.status, error["param"]) == (400, param), error["message"]
    assert error["message"]


def test_the_field_table_is_the_structs() -> None:
    """Every field a door decodes is in the table, with a reason, and every field of
    the table is decoded by its doors: a field cannot be dropped without a word."""
    for door, kind in (("chat", ChatRequest), ("completions", CompletionRequest)):
        assert set(door_fields(door)) == set(kind.__struct_fields__), door  # type: ignore[arg-type]
    assert all(f.reason for f in FIELDS.values())


REFUSED_VALUES: dict[str, Any] = {"n": 2, "best_of": 3, "suffix": "x", "modalities": ["audio"],
                                  "store": True, "verbosity": "high"}


@pytest.mark.parametrize("field", [k for k, f in FIELDS.items() if f.action == "refused"])
def test_every_refused_field_is_refused_unless_it_asks_for_nothing(field: str) -> None:
    """A refused field with a value that asks for something is a 400 naming it; null
    and its listed no-op values pass."""
    spec = FIELDS[field]
    make = completion if spec.doors == "completions" else chat
    with pytest.raises(BadRequest) as refused:
        generate_of(make(**{field: REFUSED_VALUES.get(field, {"x": 1})}))
    assert refused.value.param == field and spec.reason in refused.value.message
    for value in (None, *spec.allowed):
        generate_of(make(**{field: value}))


@pytest.mark.parametrize("field", [k for k, f in FIELDS.items() if f.action == "accepted"])
def test_every_accepted_field_passes_and_is_not_listed_as_ignored(field: str) -> None:
    """A field that needs no action is taken whatever its value, and it is not unknown."""
    spec = FIELDS[field]
    make = completion if spec.doors == "completions" else chat
    done = (read_completion if make is completion else read_chat)(
        make(**{field: {"any": ["value"]}}), L)
    assert done.ignored == ()


def test_unknown_fields_are_named_sorted_and_sanitised() -> None:
    """Fields unknown to the API are listed (sorted, sanitised, each once), at the top
    level and inside the body with their paths; known ones never (an answer's `refusal`
    sent back by the SDK is accepted); the answer is the same."""
    body = chat(ignore_eos=True, chat_template_kwargs={"x": 1}, **{"bad name\n": 1},
                messages=[{"role": "user", "content": "hi", "refusal": None,
                           "frobnicate": 1}],
                stream_options={"include_usage": True, "foo": 1},
                temperature=0.5)
    done = read_chat(body, L)
    assert done.ignored == ("bad_name_", "chat_template_kwargs", "ignore_eos",
                            "messages[0].frobnicate", "stream_options.foo")
    assert done.params == read_chat(chat(temperature=0.5), L).params
    assert read_chat(chat(), L).ignored == ()
    # a field of the other door is unknown to this one
    assert read_completion(completion(tools=[WEATHER], echo=True), L).ignored == ("tools",)
    assert read_chat(chat(echo=True), L).ignored == ("echo",)


def test_the_ignored_header_is_bounded() -> None:
    """At most 16 names of at most 64 header-safe characters, then how many more."""
    names = tuple(sorted(sanitise(f"f{i:02d}" + "x" * 100) for i in range(20)))
    assert all(len(n) == 64 for n in names)
    header = ignored_header(names)
    assert header.split(", ")[-1] == "+4" and len(header.split(", ")) == MAX_IGNORED_LISTED + 1
    assert ignored_header(("a", "b")) == "a, b"
    assert sanitise("é\r\nX-Evil: 1") == "___X-Evil__1" and sanitise("") == "_"
    header.encode("ascii")


@pytest.mark.parametrize(("body", "kind", "names"), [
    (chat(n=2, zzz=1, aaa=2), ChatRequest, ("aaa", "zzz")),
    (b"[1]", ChatRequest, ()),
    (b"{not json", ChatRequest, ()),
    (completion(zzz=1, messages=HI), CompletionRequest, ("messages", "zzz")),
])
def test_the_unknown_fields_of_a_refused_body(body: bytes, kind: type, names: tuple) -> None:
    """A body refused for another reason still has its unknown fields named (its error
    carries the header too); a body that is no object has none."""
    assert ignored_fields(body, kind) == names


def test_a_refused_body_with_unknown_fields_gets_the_right_error() -> None:
    """The lenient decode, not the strict one, says what is wrong with a body that has
    unknown fields: the bad field, not the unknown one."""
    with pytest.raises(BadRequest) as refused:
        read_chat(chat(zzz=1, temperature=9), L)
    assert refused.value.param == "temperature"
    with pytest.raises(SanctumError) as refused:
        read_chat(chat(zzz=1, sanctum={"nope": 1}), L)
    assert refused.value.param == "sanctum.nope"


@pytest.mark.parametrize(("gen", "bound"), [
    (Generate("r", True, SamplingParams()), None),
    (Generate("r", True, SamplingParams(), tools_json="[]", tool_choice="none"), None),
    (Generate("r", True, SamplingParams(), tools_json="[]"), "tools"),
    (Generate("r", True, SamplingParams(), tools_json="[]", tool_choice="required"), "tools"),
    (Generate("r", True, SamplingParams(), response_format='{"type":"json_object"}'),
     "response_format"),
    (Generate("r", True, SamplingParams(), tools_json="[]", tool_choice="none",
              response_format='{"type":"json_object"}'), "response_format"),
    (Generate("r", True, SamplingParams(logprobs=3)), None),
])
def test_which_answers_are_under_a_constraint(gen: Generate, bound: str | None) -> None:
    """Callable tools and a response_format hold an answer to a shape; free text (with
    tools it may not call too) and log-probabilities do not."""
    assert constraint(gen) == bound


FREE = Generate("r", True, SamplingParams(), prefix="t1 ")
SHAPED = msgspec.structs.replace(FREE, response_format='{"type":"json_object"}')
CALLING = msgspec.structs.replace(FREE, tools_json="[]", tool_choice="auto")


@pytest.mark.parametrize(("gen", "hosted", "may"), [
    (FREE, False, True),
    (FREE, True, True),
    (SHAPED, False, False),  # the text alone: the grammar could not start past it
    (msgspec.structs.replace(SHAPED, prefix_ids=(1,)), False, True),
    (msgspec.structs.replace(SHAPED, prefix_ids=(1,)), True, False),
    (SHAPED, True, False),
    (CALLING, False, False),  # the calls the client got are not in its text
    (msgspec.structs.replace(CALLING, prefix_ids=(1,)), False, True),
    (msgspec.structs.replace(CALLING, prefix_ids=(1,)), True, False),
])
def test_which_rungs_may_continue_a_begun_answer(gen: Generate, hosted: bool,
                                                 may: bool) -> None:
    """After the commit, free text goes to any rung; a constrained answer only to a
    local seat given its exact tokens."""
    assert may_continue(gen, hosted) is may


def test_json_object_with_a_schema_is_that_schema() -> None:
    """{"type": "json_object", "schema": ...} (llama.cpp's and LM Studio's clients) is
    the schema's constraint, not any JSON object; without a schema, any object."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    gen = read_chat(chat(response_format={"type": "json_object", "schema": schema}), L) \
        .generate("r")
    assert gen.response_format is not None
    assert json.loads(gen.response_format) == {
        "type": "json_schema", "json_schema": {"name": "json_object", "schema": schema}}
    plain = read_chat(chat(response_format={"type": "json_object"}), L).generate("r")
    assert plain.response_format is not None
    assert json.loads(plain.response_format) == {"type": "json_object"}
