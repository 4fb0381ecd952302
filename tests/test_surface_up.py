"""Tool calls and structured output through `sanctum up`, as the official openai SDK sees
them, on the packaged default config (the demo pair, adaptive speculation).

The demo model never learned a tool syntax: `tool_choice: "required"` makes the seat
constrain its answer to a call of one of the tools, with arguments that match the tool's
schema, so the call always parses and validates.  A `response_format` json_schema answer
always parses and validates, on every seed.  A seed fixes each of them byte for byte
whether the seat speculates or not, and with speculation on the seat really speculates
under the grammar.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.procs import Sanctum, packaged_config, running

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima", "Kyoto"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "The weather forecast of a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time",
                                      "description": "The local time of a city.",
                                      "parameters": {
                                          "type": "object",
                                          "properties": {"city": {"type": "string",
                                                                  "maxLength": 12}},
                                          "required": ["city"],
                                          "additionalProperties": False}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog", "fish"]},
                 "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "pets", "member"],
    "additionalProperties": False,
}
PERSON_FORMAT: Any = {"type": "json_schema",
                      "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def up() -> Iterator[Sanctum]:
    with running(packaged_config) as s:
        yield s


@pytest.fixture(scope="module")
def client(up: Sanctum) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _sanctum(obj: Any) -> dict[str, Any]:
    extra = obj.model_extra or {}
    assert "sanctum" in extra, extra
    return dict(extra["sanctum"])


def _checked_call(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in SCHEMAS, call.function.name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return {"name": call.function.name, "arguments": arguments}


def _first_turn(client: openai.OpenAI, stream: bool, seed: int,
                options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The call the model makes, the assistant message as the SDK parsed it."""
    args: dict[str, Any] = dict(
        model="demo", messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0.7,
        seed=seed, max_tokens=96,
        extra_body={"sanctum": options})
    if not stream:
        r = client.chat.completions.create(**args)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        return choice.message, _sanctum(r)
    with client.chat.completions.stream(**args) as s:  # the SDK's own stream parser
        final = s.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    return choice.message, {}


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip_with_a_required_call(client: openai.OpenAI, stream: bool) -> None:
    message, _ = _first_turn(client, stream, seed=3, options={})
    assert message.tool_calls, message
    calls = [_checked_call(c) for c in message.tool_calls]
    history: list[Any] = [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": message.content,
         "tool_calls": [c.model_dump() for c in message.tool_calls]},
        *[{"role": "tool", "tool_call_id": c.id, "content": "4 degrees, light snow"}
          for c in message.tool_calls],
    ]
    first = client.chat.completions.create(model="demo", messages=history[:1], tools=TOOLS,
                                           tool_choice="none", max_tokens=1, temperature=0)
    second = client.chat.completions.create(model="demo", messages=history, tools=TOOLS,
                                            tool_choice="none", max_tokens=24, seed=3,
                                            temperature=0.7)
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert not choice.message.tool_calls and choice.message.content
    # The second turn's prompt holds the call and its result, as the template rendered them.
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 8, (first.usage,
                                                                        second.usage)
    assert calls and all(c["name"] in SCHEMAS for c in calls)


def test_a_seeded_tool_call_is_the_same_with_and_without_speculation(
        client: openai.OpenAI) -> None:
    """One seeded call, equal across: the default seat sync and streamed, a pinned depth
    (which really speculated), speculation off streamed; so stream equals sync and neither
    depends on speculation."""
    answers = []
    states = set()
    for options, stream in (({}, False), ({}, True), ({"draft_depth": 3}, False),
                            ({"speculation": False}, True)):
        message, sanctum = _first_turn(client, stream, seed=11, options=options)
        answers.append([_checked_call(c) for c in message.tool_calls])
        if sanctum:
            states.add((json.dumps(options), sanctum["speculation"]))
    assert all(a == answers[0] for a in answers), answers
    assert ('{"draft_depth": 3}', "accelerated") in states, states


def _person(client: openai.OpenAI, seed: int, options: dict[str, Any]) -> tuple[str, str]:
    r = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format=PERSON_FORMAT, temperature=0.8, seed=seed, max_tokens=96,
        extra_body={"sanctum": options})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", (seed, choice)
    return choice.message.content or "", _sanctum(r)["speculation"]


def test_json_schema_answers_validate_on_twenty_seeds_and_do_not_depend_on_speculation(
        client: openai.OpenAI) -> None:
    """Twenty seeded answers on the default seat, each validating; on every fifth seed the
    same bytes with speculation off and with a pinned depth that speculates every round,
    under the grammar."""
    states = []
    texts = set()
    for seed in range(20):
        text, state = _person(client, seed, {})
        jsonschema.validate(json.loads(text), PERSON)
        texts.add(text)
        states.append(state)
        if seed % 5 == 0:
            plain, off = _person(client, seed, {"speculation": False})
            assert plain == text, (seed, plain, text)
            assert off == "declined:disabled_by_request"
            pinned, how = _person(client, seed, {"draft_depth": 3})
            assert pinned == text and how == "accelerated", (seed, how)
    assert len(texts) > 10, texts  # the seeds really sample
    assert "accelerated" in states, states  # the default adaptive seat speculated


def test_json_object_mode_answers_parse(client: openai.OpenAI) -> None:
    for seed in range(3):
        r = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Give me a JSON object."}],
            response_format={"type": "json_object"}, temperature=0.7, seed=seed,
            max_tokens=64)
        choice = r.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content or ""), dict)
        else:  # out of tokens mid-object: said so, never passed off as complete
            assert choice.finish_reason == "length"


def test_a_schema_the_grammar_cannot_take_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    body: Any = err.value.body
    assert "response_format" in json.dumps(body), body


def test_log_probabilities_come_from_the_seat_sync_and_streamed(client: openai.OpenAI) -> None:
    args: Any = dict(model="demo", messages=[{"role": "user", "content": "Say hello."}],
                     max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**args)
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    assert r.usage is not None and len(content) == r.usage.completion_tokens
    for item in content:  # greedy: the token taken is the best of its alternatives
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert item.logprob == pytest.approx(tops[0], abs=1e-4) and item.logprob <= 0
    assert "".join(item.token for item in content) == choice.message.content
    streamed = [item for chunk in client.chat.completions.create(**args, stream=True)
                for c in chunk.choices if c.logprobs is not None and c.logprobs.content
                for item in c.logprobs.content]
    assert [(i.token, round(i.logprob, 4)) for i in streamed] == \
        [(i.token, round(i.logprob, 4)) for i in content]


def test_a_logit_bias_of_minus_100_removes_a_token(client: openai.OpenAI) -> None:
    args: Any = dict(model="demo", messages=[{"role": "user", "content": "Count: 1 2 3"}],
                     max_tokens=12, temperature=0, logprobs=True, top_logprobs=1)
    free = client.chat.completions.create(**args)
    assert free.choices[0].logprobs is not None and free.choices[0].logprobs.content
    first = free.choices[0].logprobs.content[0].token
    ids = _token_ids(client, first)
    biased = client.chat.completions.create(**args, logit_bias={str(i): -100 for i in ids})
    assert biased.choices[0].logprobs is not None and biased.choices[0].logprobs.content
    tokens = [i.token for i in biased.choices[0].logprobs.content]
    assert first not in tokens, (first, tokens)


def _token_ids(client: openai.OpenAI, token: str) -> list[int]:
    """The demo tokenizer's ids whose text is `token` (read with the seat's tokenizer)."""
    from shared.builtin import resolve_model
    from shared.prompt import load_tokenizer

    tok = load_tokenizer(resolve_model("builtin:demo"))
    return [i for i in range(len(tok.vocab)) if tok.decode([i]) == token]


def test_every_door_answers_on_the_packaged_default(up: Sanctum, client: openai.OpenAI) -> None:
    """The Anthropic and Responses doors on the packaged default (the demo pair, adaptive
    speculation), each with its own SDK, sync and streamed: the same greedy answer at
    both doors and at chat completions, named after the seat that answered."""
    import anthropic

    ask = "def fibonacci(n):"
    chat = client.chat.completions.create(model="demo", temperature=0, max_tokens=12,
                                          messages=[{"role": "user", "content": ask}])
    text = chat.choices[0].message.content
    assert text and chat.model == "demo"
    claude = anthropic.Anthropic(base_url=up.url, api_key="x", max_retries=0, timeout=300)
    # this SDK's create() no longer names temperature: sent as the body's own field
    greedy: Any = {"temperature": 0}
    message = claude.messages.create(model="demo", max_tokens=12, extra_body=greedy,
                                     messages=[{"role": "user", "content": ask}])
    assert message.model == "demo" and message.content[0].type == "text"
    assert message.content[0].text == text and message.stop_reason == "max_tokens"
    with claude.messages.stream(model="demo", max_tokens=12, extra_body=greedy,
                                messages=[{"role": "user", "content": ask}]) as s:
        assert "".join(s.text_stream) == text
    response = client.responses.create(model="demo", input=ask, temperature=0,
                                       max_output_tokens=12)
    assert response.model == "demo" and response.output_text == text
    with client.responses.stream(model="demo", input=ask, temperature=0,
                                 max_output_tokens=12) as r:
        assert "".join(e.delta for e in r if e.type == "response.output_text.delta") == text


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_cut_by_the_budget_is_a_cut_call_at_every_door(
        up: Sanctum, client: openai.OpenAI, choice: str) -> None:
    """A forced call that runs out of max_tokens comes back as each door's own cut call,
    sync and streamed (with no empty content delta), never as its markup in the text:
    chat's `tool_calls` with the
    arguments so far and finish_reason `length`; a `tool_use` block with stop_reason
    `max_tokens` at /v1/messages; a `function_call` item in an `incomplete` response."""
    import anthropic

    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    forced: Any = ("required" if choice == "required"
                   else {"type": "function", "function": {"name": "get_weather"}})
    # 20 tokens: past the call's name, into its arguments
    args: dict[str, Any] = dict(model="demo", messages=ask, tools=TOOLS, tool_choice=forced,
                                temperature=0, max_tokens=20)

    def no_markup(text: str | None) -> None:
        assert not text or ("<tool_call>" not in text and '"arguments"' not in text), text

    r = client.chat.completions.create(**args)
    sync = r.choices[0]
    assert sync.finish_reason == "length" and sync.message.tool_calls, sync
    no_markup(sync.message.content)
    [call] = sync.message.tool_calls
    assert call.function.name in SCHEMAS and call.id.startswith("call_")
    with client.chat.completions.stream(**args) as s:
        # no empty content delta while the call is held back (the SDK fires an event
        # for each one); its final parse refuses a `length` finish, as with OpenAI's
        assert not [e for e in s if e.type == "content.delta" and not e.delta]
        final = s.current_completion_snapshot.choices[0]
    assert final.finish_reason == "length" and final.message.tool_calls
    no_markup(final.message.content)
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]

    claude = anthropic.Anthropic(base_url=up.url, api_key="x", max_retries=0, timeout=300)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    claude_choice: Any = ({"type": "any"} if choice == "required"
                          else {"type": "tool", "name": "get_weather"})
    greedy: Any = {"temperature": 0}
    message = claude.messages.create(model="demo", max_tokens=20, messages=ask,  # type: ignore[arg-type]
                                     tools=tools, tool_choice=claude_choice,  # type: ignore[arg-type]
                                     extra_body=greedy)
    assert message.stop_reason == "max_tokens"
    assert [b.type for b in message.content] == ["tool_use"], message.content
    assert message.content[0].name == call.function.name  # type: ignore[union-attr]
    with claude.messages.stream(model="demo", max_tokens=20, messages=ask,  # type: ignore[arg-type]
                                tools=tools, tool_choice=claude_choice,  # type: ignore[arg-type]
                                extra_body=greedy) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "max_tokens"
    assert [b.type for b in streamed.content] == ["tool_use"], streamed.content

    rtools: Any = [{"type": "function", "name": t["function"]["name"],
                    "parameters": t["function"]["parameters"]} for t in TOOLS]
    rchoice: Any = ("required" if choice == "required"
                    else {"type": "function", "name": "get_weather"})
    response = client.responses.create(model="demo", input=ask, tools=rtools,  # type: ignore[arg-type]
                                       tool_choice=rchoice, temperature=0,
                                       max_output_tokens=20)
    assert response.status == "incomplete"
    assert [o.type for o in response.output] == ["function_call"], response.output
    assert response.output[0].name == call.function.name  # type: ignore[union-attr]
    with client.responses.stream(model="demo", input=ask, tools=rtools,  # type: ignore[arg-type]
                                 tool_choice=rchoice, temperature=0,
                                 max_output_tokens=20) as rs:
        # (the SDK's get_final_response wants response.completed; an incomplete
        # response ends with response.incomplete, as OpenAI's does)
        ends = [e.response for e in rs if e.type == "response.incomplete"]
    [done] = ends
    assert done.status == "incomplete" and [o.type for o in done.output] == ["function_call"]


def test_a_completion_prompt_of_token_ids_is_the_same_prompt(
        up: Sanctum, client: openai.OpenAI) -> None:
    """`/v1/completions` takes a prompt of token ids (a list, or a list holding one), as
    the OpenAI API does: the greedy answer is the one its text gets; an id outside the
    seat's vocabulary is a 400 naming it."""
    from shared.builtin import resolve_model
    from shared.prompt import load_tokenizer, prompt_ids

    text = "def fibonacci(n):"
    ids = prompt_ids(load_tokenizer(resolve_model("builtin:demo")), None, text, None)
    want = client.completions.create(model="demo", prompt=text, max_tokens=12,
                                     temperature=0)
    for prompt in (ids, [ids]):
        got = client.completions.create(model="demo", prompt=prompt, max_tokens=12,
                                        temperature=0)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage is not None and want.usage is not None
        assert got.usage.prompt_tokens == want.usage.prompt_tokens == len(ids)
        streamed = client.completions.create(model="demo", prompt=prompt, max_tokens=12,
                                             temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == \
            want.choices[0].text
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="demo", prompt=[*ids[:2], 10**9], max_tokens=4)
    assert bad.value.status_code == 400 and "prompt[2]" in str(bad.value.message)


def test_required_with_parallel_calls_never_repeats_a_call(client: openai.OpenAI) -> None:
    """tool_choice "required" with parallel calls allowed (the default), 200 tokens, five
    seeds: the demo model would write the same call until the budget ran out; a call
    made a second time ends the answer instead.  At least four of five end as
    tool_calls, no answer holds a call twice, and no markup reaches any text."""
    ended = []
    for seed in range(5):
        args: dict[str, Any] = dict(
            model="demo", messages=[{"role": "user", "content": "What is the weather?"}],
            tools=TOOLS, tool_choice="required", temperature=0.7, seed=seed, max_tokens=200)
        r = client.chat.completions.create(**args)
        choice = r.choices[0]
        ended.append(choice.finish_reason)
        calls = [(c.function.name, c.function.arguments)
                 for c in choice.message.tool_calls or ()]
        assert calls and len(set(calls)) == len(calls), calls
        text = choice.message.content or ""
        assert "<tool_call>" not in text and '"arguments"' not in text, text
        # streamed, the seeded answer is the same: the same calls, once each
        with client.chat.completions.stream(**args) as s:
            for _ in s:
                pass
            snap = s.current_completion_snapshot.choices[0]
        assert snap.finish_reason == choice.finish_reason
        assert [(c.function.name, c.function.arguments)
                for c in snap.message.tool_calls or ()] == calls
        assert not snap.message.content
    assert ended.count("tool_calls") >= 4, ended
    print(f"\nrequired, parallel calls, 200 tokens, seeds 0-4: {ended}")


CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
        "required": ["city"], "additionalProperties": False}
# (case, max tokens, forced function or None, tools given, JSON schema of the answer)
DOOR_CASES = [("text", 12, None, False, None), ("forced call", 96, "get_weather", True, None),
              ("cut forced call", 20, "get_weather", True, None),
              ("tools beside a schema", 64, None, True, CITY)]


def _blocks_chat(client: openai.OpenAI, stream: bool, tokens: int, forced: str | None,
                 tools: bool, schema: Any) -> list[tuple[str, str]]:
    args: dict[str, Any] = dict(model="demo", messages=[{"role": "user", "content": ASK}],
                                temperature=0, max_tokens=tokens)
    if tools:
        args["tools"] = TOOLS
    if forced:
        args["tool_choice"] = {"type": "function", "function": {"name": forced}}
    if schema is not None:
        args["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "c", "schema": schema}}
    if not stream:
        m = client.chat.completions.create(**args).choices[0].message
        return ([("text", m.content)] if m.content else []) + \
            [("call", c.function.name) for c in m.tool_calls or ()]
    out: list[tuple[str, str]] = []
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            if choice.delta.content:
                if out and out[-1][0] == "text":
                    out[-1] = ("text", out[-1][1] + choice.delta.content)
                else:
                    out.append(("text", choice.delta.content))
            out += [("call", c.function.name) for c in choice.delta.tool_calls or ()
                    if c.function and c.function.name]
    return out


def _blocks_messages(up: Sanctum, stream: bool, tokens: int, forced: str | None, tools: bool,
                     schema: Any) -> list[tuple[str, str]]:
    import anthropic

    claude = anthropic.Anthropic(base_url=up.url, api_key="x", max_retries=0, timeout=300)
    args: dict[str, Any] = dict(model="demo", max_tokens=tokens,
                                messages=[{"role": "user", "content": ASK}],
                                extra_body={"temperature": 0})
    if tools:
        args["tools"] = [{"name": t["function"]["name"],
                          "input_schema": t["function"]["parameters"],
                          "description": t["function"]["description"]} for t in TOOLS]
    if forced:
        args["tool_choice"] = {"type": "tool", "name": forced}
    if schema is not None:
        args["extra_body"] = {**args["extra_body"],
                              "output_config": {"format": {"type": "json_schema",
                                                           "schema": schema}}}
    if stream:
        with claude.messages.stream(**args) as s:
            message = s.get_final_message()
    else:
        message = claude.messages.create(**args)
    return [("text", b.text) if b.type == "text" else ("call", b.name)  # type: ignore[union-attr]
            for b in message.content]


def _blocks_responses(client: openai.OpenAI, stream: bool, tokens: int, forced: str | None,
                      tools: bool, schema: Any) -> list[tuple[str, str]]:
    args: dict[str, Any] = dict(model="demo", input=ASK, temperature=0, max_output_tokens=tokens)
    if tools:
        args["tools"] = [{"type": "function", "name": t["function"]["name"],
                          "parameters": t["function"]["parameters"]} for t in TOOLS]
    if forced:
        args["tool_choice"] = {"type": "function", "name": forced}
    if schema is not None:
        args["text"] = {"format": {"type": "json_schema", "name": "c", "schema": schema}}
    if stream:
        items = [e.item for e in client.responses.create(stream=True, **args)
                 if e.type == "response.output_item.done"]
    else:
        items = list(client.responses.create(**args).output)
    out: list[tuple[str, str]] = []
    for item in items:
        if item.type == "function_call":
            out.append(("call", item.name))  # type: ignore[union-attr]
        else:
            text = "".join(p.text for p in item.content)  # type: ignore[union-attr]
            if text:
                out.append(("text", text))
    return out


ASK = "What is the weather in Oslo?"


@pytest.mark.parametrize(("case", "tokens", "forced", "tools", "schema"), DOOR_CASES,
                         ids=[c[0] for c in DOOR_CASES])
def test_the_three_doors_give_the_same_blocks_in_the_same_order(
        up: Sanctum, client: openai.OpenAI, case: str, tokens: int, forced: str | None,
        tools: bool, schema: Any) -> None:
    """The same greedy request at chat completions, /v1/messages and /v1/responses, sync
    and streamed: the same text and calls, in the same order, at every door."""
    got = {}
    for stream in (False, True):
        got[("chat", stream)] = _blocks_chat(client, stream, tokens, forced, tools, schema)
        got[("messages", stream)] = _blocks_messages(up, stream, tokens, forced, tools,
                                                     schema)
        got[("responses", stream)] = _blocks_responses(client, stream, tokens, forced, tools,
                                                       schema)
    want = got[("chat", False)]
    assert want, case
    for where, blocks in got.items():
        assert blocks == want, (case, where, blocks, want)
    for _, text in (b for b in want if b[0] == "text"):
        assert "<tool_call>" not in text


def test_every_door_names_an_unknown_key_inside_the_body(up: Sanctum,
                                                         client: openai.OpenAI) -> None:
    """Through each SDK: a key no API knows, inside the body, is answered (not refused)
    and named with its path in X-Sanctum-Ignored."""
    import anthropic

    for stream in (False, True):
        chat = client.chat.completions.with_raw_response.create(
            model="demo", max_tokens=2, stream=stream,
            messages=[{"role": "user", "content": "hi", "frobnicate": 1}])  # type: ignore[misc]
        assert chat.headers["x-sanctum-ignored"] == "messages[0].frobnicate", stream
    claude = anthropic.Anthropic(base_url=up.url, api_key="x", max_retries=0, timeout=300)
    for stream in (False, True):
        message = claude.messages.with_raw_response.create(
            model="demo", max_tokens=2, stream=stream,
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "zz": 1}]}])  # type: ignore[typeddict-unknown-key]
        assert message.headers["x-sanctum-ignored"] == "messages[0].content[0].zz", stream
        response = client.responses.with_raw_response.create(
            model="demo", max_output_tokens=2, stream=stream,
            input=[{"role": "user", "content": "hi", "zz": 1}])  # type: ignore[typeddict-unknown-key]
        assert response.headers["x-sanctum-ignored"] == "input[0].zz", stream


def _chat_text(client: openai.OpenAI, stream: bool, args: dict[str, Any]) -> str:
    """A chat answer's text, whole or joined from its stream."""
    if stream:
        return "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(stream=True, **args)
                       if c.choices)
    return client.chat.completions.create(**args).choices[0].message.content or ""


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_with_a_schema_answers_under_that_schema(client: openai.OpenAI,
                                                             stream: bool) -> None:
    """`response_format: {"type": "json_object", "schema": ...}` (llama.cpp's and LM
    Studio's clients): the answer parses and validates under the schema, sync and
    streamed."""
    args: dict[str, Any] = dict(
        model="demo", messages=[{"role": "user", "content": "A person, please."}],
        temperature=0.7, seed=4, max_tokens=160,
        response_format={"type": "json_object", "schema": PERSON})
    text = _chat_text(client, stream, args)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_numbers_the_schema_leaves_unbounded_stop_at_their_bounds(
        up: Sanctum, client: openai.OpenAI, stream: bool) -> None:
    """A model pushed to write digits for ever (logit_bias on the demo's "1", "11" and "."
    tokens) under a schema whose integer and number have no bound: the answer still
    parses, its integer has 16 digits at most and its number's fraction 10."""
    import anthropic

    from shared.builtin import resolve_model
    from shared.prompt import load_tokenizer

    tok = load_tokenizer(resolve_model("builtin:demo"))
    push = {str(i): 100 for t in ("1", "11", ".") for i in tok.encode(t, add_special_tokens=False)}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}},
              "required": ["n", "x"], "additionalProperties": False}
    args: dict[str, Any] = dict(
        model="demo", messages=[{"role": "user", "content": "Two numbers."}], temperature=0,
        max_tokens=60, logit_bias=push,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    text = _chat_text(client, stream, args)
    answer = json.loads(text)
    assert 10**15 <= abs(answer["n"]) < 10**16, text  # pushed to the bound, and held there
    fraction = text.split('"x":')[1].split("}")[0].strip().partition(".")[2]
    assert "." in text.split('"x":')[1] and 1 <= len(fraction) <= 10, text  # pushed, held
    # the same grammar behind the Responses door's text.format and a forced tool call at
    # /v1/messages (neither takes logit_bias, so only the bounds' presence is checked:
    # each answer parses, its numbers within them)
    rargs: dict[str, Any] = dict(
        model="demo", input="Two numbers.", temperature=0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    if stream:
        rtext = "".join(e.delta for e in client.responses.create(stream=True, **rargs)
                        if e.type == "response.output_text.delta")
    else:
        rtext = client.responses.create(**rargs).output_text
    claude = anthropic.Anthropic(base_url=up.url, api_key="x", max_retries=0, timeout=300)
    margs: dict[str, Any] = dict(
        model="demo", max_tokens=120, messages=[{"role": "user", "content": "Two numbers."}],
        tools=[{"name": "put", "input_schema": schema}],
        tool_choice={"type": "tool", "name": "put"}, extra_body={"temperature": 0})
    if stream:
        with claude.messages.stream(**margs) as s:
            message = s.get_final_message()
    else:
        message = claude.messages.create(**margs)
    inputs: list[Any] = [b.input for b in message.content if b.type == "tool_use"]
    for got in (json.loads(rtext), *inputs):
        assert abs(got["n"]) < 10**16 and abs(got["x"]) <= 1e16, got
        assert round(got["x"], 10) == got["x"], got
    assert inputs, message.content


@pytest.mark.parametrize("stream", [False, True])
def test_no_door_sends_a_call_twice(up: Sanctum, client: openai.OpenAI, stream: bool) -> None:
    """The repeated-call rule at /v1/messages (tool_choice any, parallel calls allowed) and
    /v1/responses (required): seeded answers whose calls are each made once."""
    import anthropic

    claude = anthropic.Anthropic(base_url=up.url, api_key="x", max_retries=0, timeout=300)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
              "description": t["function"]["description"]} for t in TOOLS]
    rtools: Any = [{"type": "function", "name": t["function"]["name"],
                    "parameters": t["function"]["parameters"]} for t in TOOLS]
    ask = [{"role": "user", "content": "What is the weather?"}]
    for seed in range(2):
        margs: dict[str, Any] = dict(model="demo", max_tokens=200, messages=ask, tools=tools,
                                     tool_choice={"type": "any"},
                                     extra_body={"temperature": 0.7, "seed": seed})
        if stream:
            with claude.messages.stream(**margs) as s:
                message = s.get_final_message()
        else:
            message = claude.messages.create(**margs)
        calls = [(b.name, json.dumps(b.input, sort_keys=True)) for b in message.content  # type: ignore[union-attr]
                 if b.type == "tool_use"]
        assert calls and len(set(calls)) == len(calls), calls
        rargs: dict[str, Any] = dict(model="demo", input=ask, tools=rtools,
                                     tool_choice="required", temperature=0.7,
                                     max_output_tokens=200, extra_body={"seed": seed})
        if stream:
            items = [e.item for e in client.responses.create(stream=True, **rargs)
                     if e.type == "response.output_item.done"]
        else:
            items = list(client.responses.create(**rargs).output)
        rcalls = [(i.name, i.arguments) for i in items if i.type == "function_call"]  # type: ignore[union-attr]
        assert rcalls and len(set(rcalls)) == len(rcalls), rcalls


def test_an_over_cap_prompt_is_context_length_exceeded_at_every_door(
        up: Sanctum, client: openai.OpenAI) -> None:
    """Over the cap: a 413 whose code is `context_length_exceeded` (what OpenAI clients
    look for to trim the history) with its numbers, through each SDK."""
    import anthropic

    long = "word " * 4000
    for call in (
            lambda: client.chat.completions.create(
                model="demo", max_tokens=2, messages=[{"role": "user", "content": long}]),
            lambda: client.completions.create(model="demo", max_tokens=2, prompt=long),
            lambda: client.responses.create(model="demo", max_output_tokens=2, input=long)):
        with pytest.raises(openai.APIStatusError) as err:
            call()
        assert err.value.status_code == 413
        body: Any = err.value.body
        assert body["code"] == "context_length_exceeded" and body["prompt_tokens"] > body["cap"]
    claude = anthropic.Anthropic(base_url=up.url, api_key="x", max_retries=0, timeout=300)
    with pytest.raises(anthropic.APIStatusError) as aerr:
        claude.messages.create(model="demo", max_tokens=2,
                               messages=[{"role": "user", "content": long}])
    assert aerr.value.status_code == 413
    error: Any = aerr.value.body
    assert error["error"]["code"] == "context_length_exceeded"
    assert error["error"]["message"].startswith("prompt is too long")
