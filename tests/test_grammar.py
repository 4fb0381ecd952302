"""seatd/grammar.py: constrained decoding's masks, driven with the demo tokenizer."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.tool_parsers import json_tools, qwen3_coder

from seatd.grammar import GrammarRefusal, Matcher, SeatGrammar, tool_family
from shared.builtin import resolve_model
from shared.protocol import Generate, SamplingParams

DEMO = resolve_model("builtin:demo")
EOS = (0, 2)  # the demo model's eos_token_id, as a seat's tokenizer has it
PAD = 64  # logits wider than the vocabulary, as some models have them

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = json.dumps([
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: {} only
])


@pytest.fixture(scope="module")
def tok() -> TokenizerWrapper:
    t = load_tokenizer(DEMO)
    t.eos_token_ids = EOS
    return t


@pytest.fixture(scope="module")
def seat(tok: TokenizerWrapper) -> SeatGrammar:
    return SeatGrammar(tok, 8192 + PAD)


def gen(**kw: Any) -> Generate:
    return Generate(request_id="r", stream=False, params=SamplingParams(), **kw)


def schema_format(schema: dict[str, Any]) -> str:
    return json.dumps({"type": "json_schema",
                       "json_schema": {"name": "s", "schema": schema, "strict": True}})


def first_forbidden(m: Matcher, ids: Sequence[int]) -> int | None:
    """Drive `m` along `ids`, checking each against mask() first: the index of the
    first forbidden token (the matcher stops before it), or None."""
    for i, t in enumerate(ids):
        if not m.mask()[t].item():
            return i
        m.consume([t])
    return None


def forbidden_char(tok: TokenizerWrapper, m: Matcher, text: str) -> int | None:
    """Where in `text` the grammar first refuses: the span of the refused token."""
    ids = tok.encode(text)
    i = first_forbidden(m, ids)
    if i is None:
        return None
    return len(tok.decode(ids[:i]))


def token_span_holds(tok: TokenizerWrapper, text: str, start: int, pos: int) -> bool:
    """The token that begins at char `start` of text's encoding covers char `pos`."""
    ids = tok.encode(text)
    for i in range(len(ids)):
        if len(tok.decode(ids[:i])) == start:
            return start <= pos < len(tok.decode(ids[: i + 1]))
    return False


@pytest.mark.parametrize("text", [
    '{"a": [1, 2.5, "x"], "b": {"c": null, "d": true}}',
    "{}",
    '{"k": "v \\" \\u00e9", "n": -3e2}',
])
def test_json_object_lets_objects_through(seat: SeatGrammar, tok: TokenizerWrapper,
                                          text: str) -> None:
    """Every token of a JSON object is allowed in turn; then the grammar is finished and
    only EOS is allowed, which it was not before the last token."""
    m = seat.for_request(gen(response_format='{"type": "json_object"}'))
    assert m is not None
    ids = tok.encode(text)
    for i, t in enumerate(ids):
        mask = m.mask()
        assert mask.shape == (8192 + PAD,) and mask.dtype == mx.bool_
        assert mask[t].item(), (i, tok.decode([t]))
        assert not any(mask[e].item() for e in EOS)  # not complete yet
        assert not m.finished
        m.consume([t])
    assert m.finished and m.accepting
    assert np.flatnonzero(np.array(m.mask())).tolist() == sorted(EOS)
    m.consume([2])
    assert m.finished


@pytest.mark.parametrize(("text", "bad"), [
    ("[1, 2]", 0),  # not an object
    ("hello", 0),
    (' {"a": 1}', 0),  # no blank before the value
    ('{"a": 1.}', 8),
    ('{"a" 1}', 5),  # the blank is fine, the missing colon is not
    ('{"a": 1} x', 8),  # nothing after the object but EOS
    ("{'a': 1}", 1),
    ('{  "a": 1}', 2),  # blanks: at most one space
    ('{\n"a": 1}', 1),
    ('{\t"a": 1}', 1),
    ('{"a":  1}', 6),
])
def test_json_object_forbids_the_first_wrong_char(seat: SeatGrammar, tok: TokenizerWrapper,
                                                  text: str, bad: int) -> None:
    """A text that is not one JSON object is refused at the token that holds the char
    where it goes wrong."""
    m = seat.for_request(gen(response_format='{"type": "json_object"}'))
    assert m is not None
    start = forbidden_char(tok, m, text)
    assert start is not None and token_span_holds(tok, text, start, bad), (start, bad)


@pytest.mark.parametrize(("text", "bad"), [
    ('{"name": "Ada", "age": 36, "role": "admin"}', None),
    ('{"name": "Ada", "age": 3.5, "role": "admin"}', 24),  # integer
    ('{"name": "Ada", "age": "36", "role": "admin"}', 23),
    ('{"name": "Ada", "age": 36, "role": "boss"}', 36),  # enum
    ('{"name": "Ada", "role": "admin"}', 17),  # age is required
    ('{"name": "Ada", "age": 36}', 25),  # role is required
    ('{"name": "Ada", "age": 36, "role": "user", "x": 1}', 41),  # no other keys
    ('{"name": 7, "age": 36, "role": "user"}', 9),
])
def test_json_schema_is_enforced(seat: SeatGrammar, tok: TokenizerWrapper, text: str,
                                 bad: int | None) -> None:
    """Required keys, an enum and integer types: a text that breaks the schema gets a
    forbidden token where it breaks it; one that keeps it ends where EOS is allowed."""
    m = seat.for_request(gen(response_format=schema_format(PERSON)))
    assert m is not None
    start = forbidden_char(tok, m, text)
    if bad is None:
        assert start is None and m.finished
        jsonschema.validate(json.loads(text), PERSON)
    else:
        assert start is not None and token_span_holds(tok, text, start, bad), (start, bad)
        assert not m.finished


def test_eos_only_when_complete(seat: SeatGrammar, tok: TokenizerWrapper) -> None:
    """EOS is allowed exactly at the end of a schema-valid text, and consuming EOS
    early is a ValueError that leaves the state as it was."""
    text = '{"name": "Ada", "age": 36, "role": "user"}'
    ids = tok.encode(text)
    m = seat.for_request(gen(response_format=schema_format(PERSON)))
    assert m is not None
    allowed = []
    for t in ids:
        allowed.append(m.mask()[2].item())
        m.consume([t])
    allowed.append(m.mask()[2].item())
    assert allowed == [False] * len(ids) + [True]
    m2 = seat.for_request(gen(response_format=schema_format(PERSON)))
    assert m2 is not None
    with pytest.raises(ValueError):
        m2.consume([*ids[:-1], 2])
    m2.consume(ids)  # unchanged by the refused call
    assert m2.finished


def test_consume_refuses_forbidden_and_out_of_vocabulary(seat: SeatGrammar,
                                                         tok: TokenizerWrapper) -> None:
    """consume raises ValueError for a forbidden token, a padded id and a token after
    EOS, and keeps its state each time."""
    m = seat.for_request(gen(response_format='{"type": "json_object"}'))
    assert m is not None
    before = np.array(m.mask())
    for bad in ([tok.encode("[")[0]], [8192 + 3], [*tok.encode("{}"), 2, 5]):
        with pytest.raises(ValueError):
            m.consume(bad)
        assert (np.array(m.mask()) == before).all()
    assert not np.array(m.mask())[8192:].any()  # padding is never allowed


@pytest.mark.parametrize("cut", [0, 3, 7])
def test_masks_along(seat: SeatGrammar, tok: TokenizerWrapper, cut: int) -> None:
    """masks_along: n is the index of the first forbidden token, the rows are the masks
    step by step, and the state is unchanged afterwards."""
    good = tok.encode('{"name": "Ada", "age": 36, "role": "user"}')
    m = seat.for_request(gen(response_format=schema_format(PERSON)))
    assert m is not None
    m.consume(good[:cut])
    before = np.array(m.mask())
    wrong = 1  # <|im_start|>: a special token, never in the grammar
    draft = [*good[cut : cut + 5], wrong, *good[cut + 5 : cut + 7]]
    masks, n = m.masks_along(draft)
    assert n == 5 and masks.shape == (6, 8192 + PAD)
    assert (np.array(m.mask()) == before).all()
    step = seat.for_request(gen(response_format=schema_format(PERSON)))
    assert step is not None
    step.consume(good[:cut])
    for i in range(n + 1):
        assert (np.array(masks[i]) == np.array(step.mask())).all(), i
        if i < n:
            step.consume([draft[i]])
    m.consume(good[cut:])  # the state went back to where it was
    assert m.finished


def test_masks_along_through_eos(seat: SeatGrammar, tok: TokenizerWrapper) -> None:
    """An EOS in a draft is allowed where the grammar may end; after it only EOS."""
    ids = tok.encode('{"a": 1}')
    m = seat.for_request(gen(response_format='{"type": "json_object"}'))
    assert m is not None
    masks, n = m.masks_along([*ids, 2, 5])
    assert n == len(ids) + 1 and masks.shape[0] == n + 1
    assert np.flatnonzero(np.array(masks[-1])).tolist() == sorted(EOS)
    masks, n = m.masks_along([*ids[:-1], 2])  # EOS before the object is closed
    assert n == len(ids) - 1
    assert not m.finished


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


@pytest.mark.parametrize(("choice", "parallel", "text", "ok"), [
    ("required", True, call("get_weather", '{"city": "Paris"}'), True),
    ("required", True, call("get_weather", '{"city": "Paris", "days": 3}'), True),
    ("required", True, call("get_time", "{}"), True),
    ("required", True, call("get_weather", '{"city": "Oslo"}') + "\n" + call("get_time", "{}"),
     True),
    ("required", False, call("get_weather", '{"city": "Oslo"}') + "\n" + call("get_time", "{}"),
     False),
    ("required", True, call("get_weather", '{"days": 3}'), False),  # city is required
    ("required", True, call("get_weather", '{"city": 3}'), False),
    ("required", True, call("get_time", '{"x": 1}'), False),  # takes no parameters
    ("required", True, call("send_mail", "{}"), False),  # not a tool
    ("required", True, 'Sure! {"city": "Paris"}', False),
    ("function:get_time", True, call("get_time", "{}"), True),
    ("function:get_time", True, call("get_weather", '{"city": "Paris"}'), False),
])
def test_forced_tool_call(seat: SeatGrammar, tok: TokenizerWrapper, choice: str,
                          parallel: bool, text: str, ok: bool) -> None:
    """tool_choice required or named: the answer is <tool_call> syntax with a tool's name
    (the named one) and arguments valid under its parameters; one call unless parallel."""
    m = seat.for_request(gen(tools_json=TOOLS, tool_choice=choice, parallel_tool_calls=parallel,
                             response_format='{"type": "json_object"}'))
    assert m is not None
    bad = first_forbidden(m, tok.encode(text))
    assert (bad is None and m.accepting) == ok, bad
    if ok:
        for body in text.split("<tool_call>\n")[1:]:
            payload = json.loads(body.split("\n</tool_call>")[0])
            assert list(payload) == ["name", "arguments"]
            if payload["name"] == "get_weather":
                jsonschema.validate(payload["arguments"], WEATHER)


def test_one_call_then_only_eos(seat: SeatGrammar, tok: TokenizerWrapper) -> None:
    """parallel_tool_calls False: after one call the grammar is finished; True: a newline
    may start another."""
    text = call("get_time", "{}")
    single = seat.for_request(gen(tools_json=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False))
    several = seat.for_request(gen(tools_json=TOOLS, tool_choice="required"))
    assert single is not None and several is not None
    single.consume(tok.encode(text))
    several.consume(tok.encode(text))
    assert single.finished
    assert np.flatnonzero(np.array(single.mask())).tolist() == sorted(EOS)
    assert several.accepting and not several.finished
    assert several.mask()[tok.encode("\n")[0]].item()


@pytest.mark.parametrize("kw", [
    {},
    {"response_format": '{"type": "text"}'},
    {"tools_json": TOOLS},
    {"tools_json": TOOLS, "tool_choice": "auto"},
    {"tools_json": TOOLS, "tool_choice": "none"},
])
def test_no_constraint(seat: SeatGrammar, kw: dict[str, Any]) -> None:
    """Free text, response_format text and tool_choice none/auto: no matcher."""
    assert seat.for_request(gen(**kw)) is None


@pytest.mark.parametrize(("kw", "code", "param"), [
    ({"response_format": schema_format({"$ref": "#/nowhere"})}, "invalid_schema",
     "response_format.json_schema.schema"),
    ({"response_format": schema_format({"type": "strnig"})}, "invalid_schema",
     "response_format.json_schema.schema"),
    ({"response_format": schema_format({"type": "object", "if": {}})}, "unsupported_schema",
     "response_format.json_schema.schema"),
    ({"response_format": '{"type": "json_schema", "json_schema": {"schema": []}}'},
     "invalid_schema", "response_format.json_schema.schema"),
    ({"response_format": '{"type": "yaml"}'}, "invalid_value", "response_format.type"),
    ({"response_format": "{"}, "invalid_value", "response_format"),
    ({"tools_json": TOOLS, "tool_choice": "function:send_mail"}, "invalid_value",
     "tool_choice"),
    ({"tool_choice": "required"}, "invalid_value", "tool_choice"),
    ({"tools_json": json.dumps([{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}]),
      "tool_choice": "required"}, "invalid_schema", "tools[0].function.parameters"),
    ({"tools_json": json.dumps([{"type": "function", "function": {"name": "a b"}}]),
      "tool_choice": "required"}, "invalid_value", "tools[0].function.name"),
    # x-guidance that is no object: the client's schema, never a failure of the seat
    ({"tools_json": json.dumps([
        {"type": "function", "function": {"name": "a"}},
        {"type": "function", "function": {"name": "b", "parameters": {"x-guidance": 5}}}]),
      "tool_choice": "required"}, "invalid_schema", "tools[1].function.parameters"),
    # a named tool's refusal names its own place in the list
    ({"tools_json": json.dumps([
        {"type": "function", "function": {"name": "a"}},
        {"type": "function", "function": {"name": "b", "parameters": {"x-guidance": [1]}}}]),
      "tool_choice": "function:b"}, "invalid_schema", "tools[1].function.parameters"),
])
def test_refusals(seat: SeatGrammar, kw: dict[str, Any], code: str, param: str) -> None:
    """A bad schema, an unsupported keyword, an unknown tool: a GrammarRefusal with
    the right code and param; asking again gives the same refusal (cached)."""
    for _ in range(2):
        with pytest.raises(GrammarRefusal) as e:
            seat.for_request(gen(**kw))
        assert (e.value.code, e.value.param) == (code, param), e.value.message


def test_other_tool_family_refused(tok: TokenizerWrapper) -> None:
    """A tokenizer whose mlx-lm tool parser is not json_tools cannot be forced into a
    call (its parser would not read one); json_tools and none can."""
    other = TokenizerWrapper(tok._tokenizer, eos_token_ids=EOS,
                             tool_parser=qwen3_coder.parse_tool_call,
                             tool_call_start=qwen3_coder.tool_call_start,
                             tool_call_end=qwen3_coder.tool_call_end)
    assert tool_family(other) == "qwen3_coder"
    grammar = SeatGrammar(other, 8192)
    with pytest.raises(GrammarRefusal) as e:
        grammar.for_request(gen(tools_json=TOOLS, tool_choice="required"))
    assert (e.value.code, e.value.param) == ("tool_choice_unsupported", "tool_choice")
    assert grammar.for_request(gen(response_format='{"type": "json_object"}')) is not None
    same = TokenizerWrapper(tok._tokenizer, eos_token_ids=EOS,
                            tool_parser=json_tools.parse_tool_call,
                            tool_call_start=json_tools.tool_call_start,
                            tool_call_end=json_tools.tool_call_end)
    assert tool_family(same) == "json_tools" and tool_family(tok) is None
    assert SeatGrammar(same, 8192).for_request(gen(tools_json=TOOLS,
                                                   tool_choice="required")) is not None


def test_special_token_tags(tok: TokenizerWrapper) -> None:
    """A tag that is one special token of the tokenizer is that token in the grammar."""
    from seatd.grammar import tool_call_plan

    seat = SeatGrammar(tok, 8192)
    assert seat._tag(tok, "<|im_start|>") == "<[1]>"
    assert seat._tag(tok, "<tool_call>") == '"<tool_call>"'
    # <|im_start|> as the opening tag (the seat's EOS ids cannot be tags: llguidance
    # ends the answer there)
    plan = tool_call_plan(TOOLS, "required", True, None, start="<[1]>",
                          end='"</tool_call>"')
    import llguidance

    ll = llguidance.LLMatcher(seat._ll_tok, plan.grammar)  # type: ignore[arg-type]
    m = Matcher(ll, 8192, 8192, EOS)
    ids = [1, *tok.encode('\n{"name": "get_time", "arguments": {}}\n</tool_call>')]
    assert first_forbidden(m, ids) is None and m.accepting


def test_prefix_ids(seat: SeatGrammar, tok: TokenizerWrapper) -> None:
    """A continued answer's tokens are consumed first; tokens the grammar forbids are a
    prefix_mismatch refusal."""
    text = '{"name": "Ada", "age": 36, "role": "user"}'
    ids = tok.encode(text)
    m = seat.for_request(gen(response_format=schema_format(PERSON)), prefix_ids=ids[:6])
    assert m is not None
    assert first_forbidden(m, ids[6:]) is None and m.finished
    with pytest.raises(GrammarRefusal) as e:
        seat.for_request(gen(response_format=schema_format(PERSON)),
                         prefix_ids=tok.encode("Sure: {"))
    assert (e.value.code, e.value.param) == ("prefix_mismatch", "prefix")


def test_compiled_grammars_cached(tok: TokenizerWrapper) -> None:
    """One compiled grammar per distinct grammar text, at most cache_size of them; each
    request gets its own state."""
    seat = SeatGrammar(tok, 8192, cache_size=2)
    a = seat.for_request(gen(response_format=schema_format(PERSON)))
    b = seat.for_request(gen(response_format=schema_format(PERSON)))
    assert a is not None and b is not None and seat.compiled() == 1
    a.consume(tok.encode('{"name"'))
    assert b.mask()[tok.encode("{")[0]].item()  # b is still at the start
    seat.for_request(gen(response_format='{"type": "json_object"}'))
    seat.for_request(gen(response_format=schema_format(WEATHER)))
    assert seat.compiled() == 2


def test_cost_counters(seat: SeatGrammar, tok: TokenizerWrapper) -> None:
    """tokens_masked counts the masks computed and mask_seconds their time."""
    m = seat.for_request(gen(response_format='{"type": "json_object"}'))
    assert m is not None
    m.mask()
    m.masks_along(tok.encode('{"a"'))
    assert m.tokens_masked == 1 + 1 + len(tok.encode('{"a"')) and m.mask_seconds > 0


SMALL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["list", "dict", "set"]},
    },
    "required": ["name", "count", "kind"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_greedy_decode_under_schema() -> None:
    """The real demo model, greedy-decoded with the mask applied, writes JSON that
    parses and validates under the schema (unconstrained, it writes Python)."""
    from mlx_lm.models.cache import make_prompt_cache

    from seatd.model_load import load_for_compute

    loaded = load_for_compute(DEMO, None)
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt = tokenizer.apply_chat_template(  # type: ignore[no-untyped-call]
        [{"role": "user", "content": "Describe a Python container as JSON."}],
        add_generation_prompt=True,
    )
    free: list[int] = []
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    for _ in range(12):
        free.append(int(mx.argmax(logits)))
        logits = model(mx.array([free[-1:]]), cache=cache)[0, -1]
    assert not tokenizer.decode(free).lstrip().startswith("{")  # the mask is what does it
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    seat = SeatGrammar(tokenizer, logits.shape[-1])
    m = seat.for_request(gen(response_format=schema_format(SMALL)))
    assert m is not None
    out: list[int] = []
    for _ in range(60):
        masked = mx.where(m.mask(), logits, -mx.inf)
        t = int(mx.argmax(masked))
        if t in tokenizer.eos_token_ids:
            break
        m.consume([t])
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    text = tokenizer.decode(out)
    assert m.finished, text
    jsonschema.validate(json.loads(text), SMALL)


@pytest.mark.parametrize(("text", "ok"), [
    ('{"k": [1, 2]}', True),  # the JSON response_format asks for
    (call("get_time", "{}"), True),  # or a call of one of the tools
    (call("get_weather", '{"city": "Oslo"}') + "\n" + call("get_time", "{}"), True),
    ("Sure, here it is", False),  # never text that is neither
    ('[1, 2]', False),
])
def test_tools_beside_a_response_format(seat: SeatGrammar, tok: TokenizerWrapper, text: str,
                                        ok: bool) -> None:
    """tool_choice auto with a response_format: the answer is calls or that JSON, so the
    tools stay in reach and the format holds."""
    m = seat.for_request(gen(tools_json=TOOLS, response_format='{"type": "json_object"}'))
    assert m is not None
    bad = first_forbidden(m, tok.encode(text))
    assert (bad is None and m.accepting) == ok, bad


@pytest.mark.parametrize(("schema", "want"), [
    ({"type": "integer"}, {"type": "integer", "minimum": -(10**16 - 1),
                           "maximum": 10**16 - 1}),
    ({"type": "integer", "minimum": 1}, {"type": "integer", "minimum": 1,
                                         "maximum": 10**16 - 1}),
    ({"type": ["number", "null"], "exclusiveMaximum": 5},
     {"type": ["number", "null"], "exclusiveMaximum": 5, "minimum": -1e16,
      "multipleOf": 1e-10}),
    ({"type": "number", "multipleOf": 0.5}, {"type": "number", "multipleOf": 0.5,
                                            "minimum": -1e16, "maximum": 1e16}),
    ({"type": "object", "properties": {"type": {"type": "integer", "maximum": 7}}},
     {"type": "object", "properties": {"type": {"type": "integer", "maximum": 7,
                                                "minimum": -(10**16 - 1)}}}),
    ({"anyOf": [{"type": "string"}, {"type": "number"}]},
     {"anyOf": [{"type": "string"}, {"type": "number", "minimum": -1e16, "maximum": 1e16,
                                     "multipleOf": 1e-10}]}),
])
def test_unbounded_numbers_get_bounds_the_schema_did_not_set(schema: Any, want: Any) -> None:
    from seatd.grammar import bounded_numbers

    assert bounded_numbers(schema) == want


# (property schema, the value's head, digits after it that pass, digits that are refused,
#  the last digit allowed as a position in the value)
DIGIT_BOUNDS = [
    ({"type": "integer"}, "", "1" * 16, "1" * 17, 16),
    ({"type": "number"}, "0.5", "1" * 9, "1" * 12, len("0.") + 10),
    ({"type": "number", "minimum": 0.25, "maximum": 0.75}, "0.5", "1" * 9, "1" * 12,
     len("0.") + 10),
]


@pytest.mark.parametrize("prop, head, passes, refused, last", DIGIT_BOUNDS)
def test_a_number_a_schema_leaves_unbounded_has_bounded_digits(
        seat: SeatGrammar, tok: TokenizerWrapper, prop: dict[str, Any], head: str, passes: str,
        refused: str, last: int) -> None:
    """A model that keeps writing digits cannot fill its budget with one number: an
    integer has at most 16 digits, a number's fraction at most 10, with or without the
    schema's own range."""
    schema = {"type": "object", "properties": {"p": prop}, "required": ["p"],
              "additionalProperties": False}
    m = seat.for_request(gen(response_format=schema_format(schema)))
    assert m is not None
    assert forbidden_char(tok, m, '{"p": ' + head + passes + "}") is None
    m = seat.for_request(gen(response_format=schema_format(schema)))
    assert m is not None
    at = forbidden_char(tok, m, '{"p": ' + head + refused + "}")
    assert at is not None and at <= len('{"p": ') + last
