"""Constrained decoding: the grammar a request's answer must follow, as token masks.

A request constrains its answer in one of two ways (shared/protocol.py, `Generate`):

    tool_choice "required" / "function:NAME"   the answer is one tool call (or several,
      with tools_json                            when parallel_tool_calls) in json_tools
                                                 syntax, then end of sequence; wins over
                                                 response_format, as in OpenAI's API
    response_format json_object                any JSON object
    response_format json_schema                a JSON value valid under its schema
    anything else                              no constraint (None)

The tool-call syntax is mlx-lm's `json_tools` one (Qwen 2.5, Hermes), and Sanctum's own
for a model whose template knows no tools:

    <tool_call>
    {"name": "<a tool's name>", "arguments": <JSON valid under its parameters>}
    </tool_call>

with several calls separated by "\\n".  A tokenizer whose mlx-lm tool parser is another
family would parse a forced call in json_tools syntax as text, so it is refused.

The engine is llguidance: the request's grammar is compiled once per distinct grammar
text (a bounded LRU of pristine matchers, deep-copied per request, a copy costing
microseconds), and each step's mask is filled as a bitmask into a preallocated buffer and
unpacked with numpy, never a Python loop over the vocabulary.  The end of sequence is
handled here, not by llguidance (its `validate_tokens` does not count EOS and its rollback
does not undo one): EOS is allowed exactly when the grammar may end, and after it only EOS.

JSON is compiled with at most one space between tokens (`WHITESPACE`): the answer
reads as `json.dumps` writes it, and no token is spent on blanks.  A number a schema
leaves unbounded gets bounds (`bounded_numbers`): an integer has at most 16 digits, as
llama.cpp's schema converter allows, a number's integer part likewise (no exponent
then), and its fraction at most 10 digits (`multipleOf` 1e-10, the finest step
llguidance takes), so a model that keeps writing digits cannot fill its budget with one;
a bound or step the schema sets is kept.

Errors (each a `GrammarRefusal`, a 400 for the client, with the parameter it names):

    invalid_value            response_format, tools_json or tool_choice do not read
    invalid_schema           a schema llguidance finds wrong ($ref to nowhere, a bad value)
    unsupported_schema       a keyword or format llguidance cannot enforce (named)
    tool_choice_unsupported  the seat's tool-call family is not json_tools
    constraint_unsupported   the seat's tokenizer cannot be given to llguidance
    prefix_mismatch          a continued answer's tokens the grammar forbids
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from numpy.typing import NDArray

from shared.protocol import Generate

if TYPE_CHECKING:  # a TypedDict of llguidance's stub only
    from llguidance._lib import JsonCompileOptions

CACHE_SIZE = 64  # compiled grammars kept per seat
# Blanks between JSON tokens: at most one space.  Free whitespace lets a model spend its
# tokens on blanks (the demo model filled 100 tokens with tabs between two keys at 49
# blanks a gap); even a line break and an indent per gap, as llama.cpp allows, let it
# wander through a 96-token budget at temperature 0.8 without closing the object.
WHITESPACE = r"\x20?"
# \uXXXX for any character, as JSON allows (llguidance takes only control characters so
# by default): a model that writes ASCII-only JSON, as json.dumps does, is not cut off.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": WHITESPACE,
                                "json_allow_general_unicode_escapes": True}
# A client's "x-guidance" may set JSON options, never let keywords go unenforced.
JSON_OVERRIDES: JsonCompileOptions = {"lenient": False}
TOOL_FAMILY = "json_tools"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
SCHEMA_PARAM = "response_format.json_schema.schema"
# llguidance's messages for what it cannot enforce, as against what is wrong.
UNSUPPORTED = ("Unimplemented keys", "Unknown format", "not supported", "unsupported")


class GrammarRefusal(Exception):
    """A constraint the seat cannot honour or that is invalid: a 400 for the client."""

    def __init__(self, code: str, message: str, param: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class GrammarError(RuntimeError):
    """The matcher stopped mid-answer (a resource limit of llguidance): the request
    cannot go on under its grammar and must end with an error, never unconstrained."""


# ---------------------------------------------------------------------------
# What a request asks for: pure, from the request's fields to a grammar's text.


@dataclass(frozen=True)
class Plan:
    """A constraint to compile: llguidance grammar text, and what its errors name."""

    grammar: str
    param: str  # the request parameter a compile error is about
    # (param, JSON Schema) to check one by one when the grammar fails, so that the
    # refusal names the tool whose parameters are wrong.
    parts: tuple[tuple[str, str], ...] = ()


INT_BOUND = 10**16 - 1  # 16 digits
NUMBER_BOUND = 1e16
FRACTION_STEP = 1e-10  # 10 fraction digits: llguidance refuses a finer multipleOf


def bounded_numbers(schema: Any) -> Any:
    """`schema` with every integer and number it leaves unbounded bounded (see the
    module docstring); a copy, the schema's own bounds kept.  Pure."""
    if isinstance(schema, list):
        return [bounded_numbers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_numbers(v) for k, v in schema.items()}
    named = out.get("type")  # a schema's type (a `properties` map may name one "type")
    kinds = {k for k in named if isinstance(k, str)} if isinstance(named, list) \
        else {named} if isinstance(named, str) else set()
    if kinds & {"integer", "number"}:
        low, high = (-INT_BOUND, INT_BOUND) if "number" not in kinds \
            else (-NUMBER_BOUND, NUMBER_BOUND)
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = low
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = high
        if "number" in kinds and "multipleOf" not in out:
            out["multipleOf"] = FRACTION_STEP
    return out


def _as_object(schema: dict[str, Any] | bool) -> dict[str, Any]:
    """A boolean schema as the object schema that means the same; numbers bounded."""
    if isinstance(schema, bool):  # true: any value; false: none
        return {} if schema else {"not": {}}
    out: dict[str, Any] = bounded_numbers(schema)
    return out


def json_grammar(schema: dict[str, Any] | bool) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(
        _as_object(schema), defaults=JSON_OPTIONS, overrides=JSON_OVERRIDES
    )


def _read_json(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise GrammarRefusal("invalid_value", f"{param} is not valid JSON: {e}", param) from e


def format_schema(text: str | None) -> dict[str, Any] | bool | None:
    """The JSON Schema a response_format (its JSON text) asks for, None for free text."""
    if text is None:
        return None
    fmt = _read_json(text, "response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise GrammarRefusal(
            "invalid_value",
            f"response_format.type must be text, json_object or json_schema, not {kind!r}",
            "response_format.type",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise GrammarRefusal(
            "invalid_value", "response_format.json_schema must be an object",
            "response_format.json_schema",
        )
    schema = spec.get("schema", {"type": "object"})  # absent: OpenAI takes any object
    if not isinstance(schema, dict | bool):
        raise GrammarRefusal(
            "invalid_schema", "response_format.json_schema.schema must be a JSON Schema object",
            SCHEMA_PARAM,
        )
    return schema


def _lark_text(text: str) -> str:
    """A Lark string literal of `text` (Lark reads JSON's escapes)."""
    return json.dumps(text)


def _tools(tools_json: str | None) -> list[tuple[str, dict[str, Any] | bool]]:
    """(name, parameters schema) of each function tool, in order."""
    if tools_json is None:
        raise GrammarRefusal("invalid_value", "tool_choice requires tools", "tool_choice")
    tools = _read_json(tools_json, "tools")
    if not isinstance(tools, list):
        raise GrammarRefusal("invalid_value", "tools must be a list", "tools")
    out: list[tuple[str, dict[str, Any] | bool]] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(fn, dict) or not isinstance(name, str) or not TOOL_NAME.match(name):
            raise GrammarRefusal(
                "invalid_value",
                f"tools[{i}] must be a function with a name of 1-64 letters, digits, _ or -",
                f"tools[{i}].function.name",
            )
        # Omitted parameters: a function that takes none (OpenAI's rule).
        params = fn.get("parameters", {"type": "object", "properties": {},
                                        "additionalProperties": False})
        if not isinstance(params, dict | bool):
            raise GrammarRefusal(
                "invalid_schema", f"tools[{i}].function.parameters must be a JSON Schema object",
                f"tools[{i}].function.parameters",
            )
        out.append((name, params))
    return out


def _with_options(schema: dict[str, Any] | bool, param: str) -> dict[str, Any] | bool:
    """A schema carrying our JSON options, for a %json inside a Lark grammar."""
    schema = _as_object(schema)
    own = schema.get("x-guidance")
    if own is not None and not isinstance(own, dict):
        raise GrammarRefusal("invalid_schema", f"{param}: x-guidance must be an object", param)
    guidance = {**(own or {}), **JSON_OPTIONS, **JSON_OVERRIDES}
    return {**schema, "x-guidance": guidance}


def tool_call_plan(
    tools_json: str | None, choice: str, parallel: bool, family: str | None,
    start: str = TOOL_CALL_START, end: str = TOOL_CALL_END,
    or_json: dict[str, Any] | bool | None = None,
) -> Plan:
    """The grammar of a forced tool call: `choice` is "required" or "function:NAME".

    `start`/`end` are the tags as grammar items: a literal's text, or `<[id]>` where the
    tag is one special token of the tokenizer.  `or_json`: the answer may instead be one
    JSON value of this schema (tools beside a response_format, tool_choice auto)."""
    if family not in (None, TOOL_FAMILY):
        raise GrammarRefusal(
            "tool_choice_unsupported",
            f"this seat's model writes tool calls in the {family} syntax; a forced tool call "
            "is only enforced in json_tools syntax",
            "tool_choice",
        )
    indexed = list(enumerate(_tools(tools_json)))
    if choice.startswith("function:"):
        wanted = choice[len("function:"):]
        indexed = [(i, t) for i, t in indexed if t[0] == wanted]
        if not indexed:
            raise GrammarRefusal(
                "invalid_value", f"tool_choice names {wanted!r}, which is not among the tools",
                "tool_choice",
            )
    elif choice != "required":
        raise GrammarRefusal("invalid_value", f"tool_choice {choice!r} is not known",
                             "tool_choice")
    if not indexed:
        raise GrammarRefusal("invalid_value", "tool_choice requires tools", "tool_choice")
    rules = []
    parts = []
    for i, (name, params) in indexed:
        head = _lark_text('\n{"name": ' + json.dumps(name) + ', "arguments": ')
        body = json.dumps(_with_options(params, f"tools[{i}].function.parameters"),
                          separators=(",", ":"))
        rules.append(f"call{i}: {start} {head} %json {body} {_lark_text('}' + chr(10))} {end}")
        parts.append((f"tools[{i}].function.parameters", json.dumps(params)))
    calls = " | ".join(f"call{i}" for i, _ in indexed)
    top = f'calls: call ({_lark_text(chr(10))} call)*' if parallel else "calls: call"
    if or_json is None:
        head_rule = "start: calls"
    else:  # tools the model may call, else the answer response_format asks for
        fmt = json.dumps(_with_options(or_json, SCHEMA_PARAM), separators=(",", ":"))
        head_rule = f"start: calls | %json {fmt}"
        parts.append((SCHEMA_PARAM, json.dumps(or_json)))
    lark = "\n".join([head_rule, top, f"call: {calls}", *rules])
    return Plan(llguidance.LLMatcher.grammar_from_lark(lark), "tools", tuple(parts))


def request_plan(
    request: Generate, family: str | None, start: str = TOOL_CALL_START,
    end: str = TOOL_CALL_END,
) -> Plan | None:
    """The request's constraint: a forced tool call wins over response_format; tools the
    model may call beside a response_format give calls or that JSON."""
    choice = request.tool_choice
    if choice is not None and choice not in ("none", "auto"):
        return tool_call_plan(
            request.tools_json, choice, request.parallel_tool_calls, family, start, end
        )
    schema = format_schema(request.response_format)
    if schema is not None and request.tools_json and choice != "none":
        # Tools the model may call beside a response_format: either calls or that JSON,
        # never text that is neither (and never the tools silently out of reach).
        return tool_call_plan(request.tools_json, "required", request.parallel_tool_calls,
                              family, start, end, or_json=schema)
    if schema is None:
        return None
    return Plan(json_grammar(schema), SCHEMA_PARAM)


def tool_family(tokenizer: Any) -> str | None:
    """The mlx-lm tool-parser family of a TokenizerWrapper (json_tools, qwen3_coder, ...),
    None when mlx-lm found none."""
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None:
        return None
    return str(getattr(parser, "__module__", "unknown")).rsplit(".", 1)[-1]


def refusal_of(message: str, param: str) -> GrammarRefusal:
    """llguidance's compile error -> what the client is told."""
    code = "unsupported_schema" if any(u in message for u in UNSUPPORTED) else "invalid_schema"
    lead = "the schema uses what this seat cannot enforce" if code == "unsupported_schema" \
        else "the schema is not valid"
    return GrammarRefusal(code, f"{param}: {lead}: {message}", param)


# ---------------------------------------------------------------------------
# A request's state: masks and steps.


class Matcher:
    """One request's grammar state; used only on the seat's MLX thread."""

    def __init__(self, ll: llguidance.LLMatcher, vocab: int, width: int,
                 eos: Sequence[int]) -> None:
        self._ll = ll
        self._vocab = min(vocab, width)  # ids the grammar can allow
        self._width = width
        self._eos = frozenset(eos)
        self._eos_ids = np.array(sorted(e for e in self._eos if e < width), dtype=np.intp)
        self._bits = np.zeros(((vocab + 31) // 32,), dtype=np.int32)
        self._ended = False  # EOS consumed
        self.tokens_masked = 0
        self.mask_seconds = 0.0

    @property
    def finished(self) -> bool:
        """The grammar is complete: only EOS may follow."""
        return self._ended or self._ll.is_stopped()

    @property
    def accepting(self) -> bool:
        """EOS is allowed now."""
        return self._ended or self._ll.is_accepting()

    def _eos_only(self) -> NDArray[np.bool_]:
        row = np.zeros((self._width,), dtype=np.bool_)
        row[self._eos_ids] = True
        return row

    def _row(self) -> NDArray[np.bool_]:
        t0 = time.perf_counter()
        if self._ended:
            row = self._eos_only()
        else:
            ll = self._ll
            ll.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            if ll.is_error():
                raise GrammarError(ll.get_error())
            # Bit t of the little-endian words is token t.
            bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little",
                                 count=self._vocab).view(np.bool_)
            row = np.zeros((self._width,), dtype=np.bool_)
            row[: self._vocab] = bits
            row[self._eos_ids] = ll.is_accepting()
        self.tokens_masked += 1
        self.mask_seconds += time.perf_counter() - t0
        return row

    def mask(self) -> mx.array:
        """(width,) bool: True = allowed now (EOS exactly when the grammar may end)."""
        return mx.array(self._row())

    def masks_along(self, tokens: Sequence[int]) -> tuple[mx.array, int]:
        """The masks now and after each of `tokens` in turn while the grammar allows them:
        ((n + 1, width) bool, n), n the number of leading tokens allowed.  The state is
        the same afterwards.  After an allowed EOS the row allows only EOS."""
        rows = [self._row()]
        n = 0
        consumed = 0
        try:
            for t in tokens:
                if not (0 <= t < self._width and rows[-1][t]):
                    break
                n += 1
                if t in self._eos:
                    rows.append(self._eos_only())
                    break
                if not self._ll.consume_token(t):
                    raise GrammarError(self._ll.get_error())
                consumed += 1
                rows.append(self._row())
        finally:
            if consumed:
                self._ll.rollback(consumed)
        return mx.array(np.stack(rows)), n

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance by `tokens`; a token the grammar forbids raises ValueError and leaves
        the state as it was (a bug upstream: every sampled token was masked)."""
        tokens = list(tokens)
        cut = next((i for i, t in enumerate(tokens) if t in self._eos), len(tokens))
        body = tokens[:cut]
        if self._ended and tokens:
            raise ValueError(f"token {tokens[0]} after the end of sequence")
        # An id past the vocabulary would put llguidance in its error state for good.
        known = next((i for i, t in enumerate(body) if not 0 <= t < self._vocab), len(body))
        ok = self._ll.validate_tokens(body[:known]) if known else 0
        if ok < len(body):
            raise ValueError(f"token {body[ok]} at {ok} is forbidden by the grammar")
        if cut < len(tokens) - 1:
            raise ValueError(f"token {tokens[cut + 1]} after the end of sequence")
        if body and not self._ll.consume_tokens(body):
            raise GrammarError(self._ll.get_error())
        if cut < len(tokens):
            if not self._ll.is_accepting():
                if body:
                    self._ll.rollback(len(body))
                raise ValueError(f"end of sequence at {cut} before the grammar is complete")
            self._ended = True


# ---------------------------------------------------------------------------
# A seat's grammars.


class SeatGrammar:
    """Built once per seat from its tokenizer (the llguidance tokenizer is costly)."""

    def __init__(self, tokenizer: Any, width: int, cache_size: int = CACHE_SIZE) -> None:
        self._width = width
        self._eos = tuple(sorted(tokenizer.eos_token_ids))
        self._cache: OrderedDict[str, llguidance.LLMatcher | GrammarRefusal] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # for_request may be called off the MLX thread
        self.family = tool_family(tokenizer)
        self.unsupported: str | None = None
        self._ll_tok: llguidance.LLTokenizer | None = None
        try:
            self._ll_tok = llguidance.hf.from_tokenizer(
                tokenizer._tokenizer, eos_token=list(self._eos)
            )
        except (ValueError, TypeError, RuntimeError) as e:  # a slow (non-Rust) tokenizer
            self.unsupported = str(e)
        self._start = self._tag(tokenizer, TOOL_CALL_START)
        self._end = self._tag(tokenizer, TOOL_CALL_END)

    def _tag(self, tokenizer: Any, text: str) -> str:
        """A tool-call tag as a grammar item: the special token it is, or its text."""
        if self._ll_tok is None:
            return _lark_text(text)
        ids = tokenizer._tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self._ll_tok.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return _lark_text(text)

    @property
    def vocab(self) -> int:
        return self._ll_tok.vocab_size if self._ll_tok is not None else 0

    def compiled(self) -> int:
        """How many grammars the cache holds."""
        return len(self._cache)

    def for_request(self, request: Generate, prefix_ids: Sequence[int] = ()) -> Matcher | None:
        """The request's matcher, after `prefix_ids`; None when it has no constraint."""
        plan = request_plan(request, self.family, self._start, self._end)
        if plan is None:
            return None
        if self._ll_tok is None:
            raise GrammarRefusal(
                "constraint_unsupported",
                f"this seat's tokenizer cannot be constrained: {self.unsupported}",
                plan.param,
            )
        matcher = Matcher(self._template(plan).deep_copy(), self._ll_tok.vocab_size,
                          self._width, self._eos)
        if prefix_ids:
            try:
                matcher.consume(prefix_ids)
            except ValueError as e:
                raise GrammarRefusal(
                    "prefix_mismatch", f"the answer so far does not follow the grammar: {e}",
                    "prefix",
                ) from e
        return matcher

    def _template(self, plan: Plan) -> llguidance.LLMatcher:
        """A pristine compiled matcher for the plan's grammar (cached), or its refusal."""
        with self._lock:
            hit = self._cache.get(plan.grammar)
            if hit is not None:
                self._cache.move_to_end(plan.grammar)
        if hit is None:
            hit = self._compile(plan)
            with self._lock:
                self._cache[plan.grammar] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, GrammarRefusal):
            raise GrammarRefusal(hit.code, hit.message, hit.param)
        return hit

    def _compile(self, plan: Plan) -> llguidance.LLMatcher | GrammarRefusal:
        tok = self._ll_tok
        assert tok is not None
        ll = llguidance.LLMatcher(tok, plan.grammar, log_level=0)  # never raises
        if ll.is_error():
            return self._blame(plan, [ll.get_error()])
        return ll

    def _blame(self, plan: Plan, messages: Iterable[str]) -> GrammarRefusal:
        """The refusal for a grammar that failed: the tool whose schema fails, if any."""
        tok = self._ll_tok
        for param, schema in plan.parts:
            bad, why = llguidance.LLMatcher.validate_grammar_with_warnings(
                json_grammar(json.loads(schema)), tok
            )
            if bad:
                return refusal_of("; ".join(why), param)
        return refusal_of("; ".join(messages), plan.param)
