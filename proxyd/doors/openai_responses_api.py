"""OpenAI Responses request bodies (POST /v1/responses), decoded into the same
`Generate` as a chat.

    read_responses(body, limits) -> ResponsesCall    call.generate(request_id) -> Generate
                                                     call.door() -> ResponsesDoor

A Responses body is a chat in other words: `instructions` is a system message first;
`input` is a string (one user message) or a list of items: messages (role user,
system, developer or assistant; content a string or input_text / output_text parts),
`function_call` items (an assistant turn's tool calls: consecutive ones, and an
assistant message just before them, are one turn) and `function_call_output` items
(a tool result, which must answer an earlier call).  Tools are flat
({"type": "function", "name", "parameters", ...}), tool_choice names a function as
{"type": "function", "name"}, and `text.format` holds the structured-output
constraint ({"type": "json_schema", "name", "schema", ...}).  They are turned into
the chat door's own Structs (proxyd/doors/openai_tools.py) and checked there, so both doors
refuse the same things; a refusal names the Responses path (`tools[0].parameters`,
`text.format.schema`), not the chat one.  Log-probabilities are asked with include
["message.output_text.logprobs"], and their alternatives with top_logprobs.

Nothing is stored: `store` true and `previous_response_id` are refused (400 naming
them), as are `conversation`, `background` and the other fields of FIELDS below that
ask for something this product does not do; the ones that ask for nothing are
accepted.  A top-level field not in FIELDS is unknown to the API: ignored, and
listed in X-Sanctum-Ignored (`ignored`), as at the chat door.  Any other input item
or content part (an image, a file, a hosted tool's call) is a 400 naming its path.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Literal, NamedTuple

import msgspec

from proxyd import limits as lim
from proxyd.doors import openai_tools as tools
from proxyd.doors.door import DoorRequest, SanctumOptions, decode_body
from proxyd.doors.openai_api import MaxTokens, Temperature, TopLogprobs, TopP
from proxyd.doors.openai_fields import ABSENT, Refusable, refuse_asked, sanitise
from proxyd.doors.openai_responses_door import ResponsesDoor
from proxyd.doors.openai_tools import CallId, Name
from shared.config import ProxyConfig
from shared.errors import BadRequest, SanctumError
from shared.protocol import ChatMessage, Generate, SamplingParams

# ---------------------------------------------------------------------------
# The body


class Part(msgspec.Struct, frozen=True):
    """A content part: input_text (what the client wrote) or output_text (an earlier
    answer sent back); any other type is refused by `_text`."""

    type: str
    text: str | None = None


Role = Literal["user", "system", "developer", "assistant"]


class Item(msgspec.Struct, frozen=True):
    """One input item, of any type: which fields it needs is its type's (`_turns`).
    A message may leave out `type` (OpenAI's "easy" input message)."""

    type: str | None = None
    role: Role | None = None
    content: str | list[Part] | None = None
    call_id: CallId | None = None
    name: Name | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None


class FunctionTool(msgspec.Struct, frozen=True):
    type: str
    name: Name | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceObject(msgspec.Struct, frozen=True):
    type: str
    name: str | None = None


class TextFormat(msgspec.Struct, frozen=True, tag="text", tag_field="type"):
    pass


class JsonObjectFormat(msgspec.Struct, frozen=True, tag="json_object", tag_field="type"):
    pass


class JsonSchemaFormat(msgspec.Struct, frozen=True, tag="json_schema", tag_field="type"):
    name: Name
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, frozen=True):
    format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(DoorRequest, frozen=True):
    """The body, as the SDK's ResponseCreateParams names it (lenient: unknown top-level
    fields are ignored).  Fields kept raw are the accepted and refused ones."""

    nested_named: ClassVar[bool] = True

    @classmethod
    def opaque(cls, path: str, value: dict[str, Any]) -> bool:
        """A reasoning input item (dropped) and a tool OpenAI's servers run (passed
        over and named whole): their fields are their type's."""
        kind = value.get("type")
        return (path.startswith("input[") and kind == "reasoning") or (
            path.startswith("tools[") and kind != "function")

    input: str | list[Item] | None = None
    instructions: str | None = None
    stream: bool = False
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    top_logprobs: TopLogprobs | None = None
    include: list[str] | None = None
    sanctum: SanctumOptions | None = None
    # accepted: they ask for nothing this product must do
    metadata: msgspec.Raw = ABSENT
    user: msgspec.Raw = ABSENT
    safety_identifier: msgspec.Raw = ABSENT
    service_tier: msgspec.Raw = ABSENT
    prompt_cache_key: msgspec.Raw = ABSENT
    prompt_cache_retention: msgspec.Raw = ABSENT
    prompt_cache_options: msgspec.Raw = ABSENT
    stream_options: msgspec.Raw = ABSENT
    # refused unless they ask for nothing
    store: msgspec.Raw = ABSENT
    previous_response_id: msgspec.Raw = ABSENT
    conversation: msgspec.Raw = ABSENT
    background: msgspec.Raw = ABSENT
    background_options: msgspec.Raw = ABSENT
    prompt: msgspec.Raw = ABSENT
    reasoning: msgspec.Raw = ABSENT
    truncation: msgspec.Raw = ABSENT
    max_tool_calls: msgspec.Raw = ABSENT
    context_management: msgspec.Raw = ABSENT
    moderation: msgspec.Raw = ABSENT
    image: msgspec.Raw = ABSENT
    access_programs: msgspec.Raw = ABSENT


# ---------------------------------------------------------------------------
# What each top-level field is


class Field(NamedTuple):
    action: Literal["honoured", "accepted", "refused"]
    reason: str
    # refused: the values that ask for nothing (null and absent always do)
    allowed: tuple[Any, ...] = ()


_NOTHING_STORED = "nothing is stored here: every response is stateless"
_CACHE = ("a hint to OpenAI's prompt cache; the seats' prompt cache matches prefixes "
          "by itself, and the answer is the same")

FIELDS: dict[str, Field] = {
    "model": Field("honoured", "the route, whose ladder answers"),
    "input": Field("honoured", "the chat: messages, function calls and their outputs"),
    "instructions": Field("honoured", "a system message before the input"),
    "stream": Field("honoured", "server-sent events, the Responses event sequence"),
    "max_output_tokens": Field("honoured", "the answer's budget"),
    "temperature": Field("honoured", "sampling"),
    "top_p": Field("honoured", "sampling"),
    "tools": Field("honoured", "function tools: rendered by the template, calls parsed"),
    "tool_choice": Field("honoured", "required and named: constrained decoding"),
    "parallel_tool_calls": Field("honoured", "false: the first call only"),
    "text": Field("honoured", "text.format: constrained decoding"),
    "top_logprobs": Field("honoured", "the alternatives of each token's log-probability "
                          "(with include message.output_text.logprobs)"),
    "sanctum": Field("honoured", "Sanctum's own per-request overrides"),
    "metadata": Field("accepted", "tags of a stored response; " + _NOTHING_STORED),
    "user": Field("accepted", "an end-user id for OpenAI's abuse monitoring; nothing "
                  "here reads it"),
    "safety_identifier": Field("accepted", "user's successor: nothing reads it"),
    "service_tier": Field("accepted", "OpenAI's processing tiers; there is one here"),
    "prompt_cache_key": Field("accepted", _CACHE),
    "prompt_cache_retention": Field("accepted", _CACHE),
    "prompt_cache_options": Field("accepted", _CACHE),
    "stream_options": Field("accepted", "include_obfuscation: no obfuscation is added "
                            "(the stream does not leave the box's network)"),
    "include": Field("honoured", "message.output_text.logprobs: each token's "
                     "log-probability; the other values name outputs of hosted tools, "
                     "images and reasoning items, which no answer here has"),
    "store": Field("refused", _NOTHING_STORED + " (send store: false)", (False,)),
    "previous_response_id": Field("refused", "responses are not stored, so none can "
                                  "be continued: send the whole input"),
    "conversation": Field("refused", "conversations are not stored: send the whole input"),
    "background": Field("refused", "background responses are not implemented", (False,)),
    "background_options": Field("refused", "background responses are not implemented"),
    "prompt": Field("refused", "stored prompt templates are not implemented"),
    "reasoning": Field("accepted", "an effort and a summary for reasoning models: the "
                       "seats' models are given none, and their answers have no "
                       "reasoning items (Codex sends it for model names it knows)"),
    "truncation": Field("refused", "nothing is truncated (a prompt past the cap is a "
                        "413 with its numbers)", ("disabled",)),
    "max_tool_calls": Field("refused", "a limit on hosted tools' calls, which there are "
                            "none of here"),
    "context_management": Field("refused", "context compaction is not implemented"),
    "moderation": Field("refused", "no moderation runs here"),
    "image": Field("refused", "seats answer in text only"),
    "access_programs": Field("refused", "OpenAI's access programs do not apply here"),
}

LOGPROBS = "message.output_text.logprobs"  # the one `include` value that asks for more

MAX_ITEM_TEXT = 64  # of a refused value, quoted in its error


@functools.cache
def _refusable() -> Refusable:
    return tuple((name, f.reason, f.allowed) for name, f in FIELDS.items()
                 if f.action == "refused")


def refuse_unsupported(req: ResponsesRequest) -> None:
    """A 400 naming a refused field set to a value that asks for something."""
    refuse_asked(req, _refusable())


def logprobs_asked(req: ResponsesRequest) -> int | None:
    """SamplingParams.logprobs: the alternatives per token (top_logprobs) when include
    names message.output_text.logprobs; None without it.  The other `include` values
    name outputs that no answer here has (hosted tools' results, images, reasoning
    items): they ask for nothing."""
    if LOGPROBS in (req.include or ()):
        return req.top_logprobs or 0
    if req.top_logprobs:
        raise BadRequest(f"top_logprobs needs include {LOGPROBS!r}", param="top_logprobs")
    return None


def _decode(body: bytes) -> tuple[ResponsesRequest, tuple[str, ...]]:
    return decode_body(body, ResponsesRequest)


@contextmanager
def _renamed(chat: str, ours: str) -> Iterator[None]:
    """A refusal of the chat door's checks, naming the Responses path instead."""
    try:
        yield
    except SanctumError as exc:
        if exc.param:
            exc.param = exc.param.replace(chat, ours)
        exc.message = exc.message.replace(chat, ours)
        exc.args = (exc.message,)
        raise


_TOOL_AT = re.compile(r"tools\[(\d+)\]")


@contextmanager
def _reindexed(positions: list[int]) -> Iterator[None]:
    """A refusal of the chat door's tool checks, naming the tool by its place in the
    body (the tools passed over are not in the list checked)."""
    try:
        yield
    except SanctumError as exc:
        def at(m: re.Match[str]) -> str:
            k = int(m.group(1))
            return f"tools[{positions[k] if k < len(positions) else k}]"

        if exc.param:
            exc.param = _TOOL_AT.sub(at, exc.param)
        exc.message = _TOOL_AT.sub(at, exc.message)
        exc.args = (exc.message,)
        raise


# ---------------------------------------------------------------------------
# Input items -> chat turns

_TEXT_PARTS = {"user": ("input_text",), "system": ("input_text",),
               "developer": ("input_text",), "assistant": ("output_text", "input_text")}


def _text(at: str, content: str | list[Part] | None, kinds: tuple[str, ...],
          limits: ProxyConfig) -> str:
    """A content string, or its text parts joined; within max_content_chars."""
    if content is None:
        raise BadRequest("a message needs its content", param=at)
    if isinstance(content, str):
        text = content
    else:
        texts = []
        for j, part in enumerate(content):
            if part.type not in kinds:
                raise BadRequest(f"content part of type {part.type[:MAX_ITEM_TEXT]!r} is "
                                 f"not supported here; only {' and '.join(kinds)} parts "
                                 "are", param=f"{at}[{j}].type")
            if part.text is None:
                raise BadRequest("a text part needs its text", param=f"{at}[{j}].text")
            texts.append(part.text)
        text = "".join(texts)
    if len(text) > limits.max_content_chars:
        lim.check_text(at, len(text), limits)
    return text


class _Turns:
    """The chat being built: an assistant turn stays open for the calls after it."""

    def __init__(self, limits: ProxyConfig) -> None:
        self.limits = limits
        self.out: list[ChatMessage] = []
        self.calls: list[dict[str, Any]] = []  # of the open assistant turn
        self.open = False  # the last turn is an assistant's that calls may join
        self.called: set[str] = set()

    def close(self) -> None:
        if self.calls:
            last = self.out[-1]
            self.out[-1] = ChatMessage(last.role, last.content, last.name,
                                       tools.to_json("input", self.calls))
            self.calls = []
        self.open = False

    def message(self, at: str, item: Item) -> None:
        if item.role is None:
            raise BadRequest("a message item needs its role", param=f"{at}.role")
        text = _text(f"{at}.content", item.content, _TEXT_PARTS[item.role], self.limits)
        self.close()
        self.out.append(ChatMessage(item.role, text))
        self.open = item.role == "assistant"

    def call(self, at: str, item: Item) -> None:
        for field in ("call_id", "name", "arguments"):
            if getattr(item, field) is None:
                raise BadRequest(f"a function_call item needs its {field}",
                                 param=f"{at}.{field}")
        assert item.call_id is not None and item.arguments is not None
        lim.check_text(f"{at}.arguments", len(item.arguments), self.limits)
        if not self.open:
            self.out.append(ChatMessage("assistant", ""))
            self.open = True
        self.calls.append({"id": item.call_id, "type": "function",
                           "function": {"name": item.name, "arguments": item.arguments}})
        self.called.add(item.call_id)

    def result(self, at: str, item: Item) -> None:
        if item.call_id is None:
            raise BadRequest("a function_call_output item names the call it answers",
                             param=f"{at}.call_id")
        if item.call_id not in self.called:
            raise BadRequest(f"call_id {item.call_id[:MAX_ITEM_TEXT]!r} answers no "
                             "function_call item before it", param=f"{at}.call_id")
        output = _text(f"{at}.output", item.output, ("input_text", "output_text"),
                       self.limits)
        self.close()
        self.out.append(ChatMessage("tool", output, tool_call_id=item.call_id))


def _messages(req: ResponsesRequest, limits: ProxyConfig) -> tuple[ChatMessage, ...]:
    turns = _Turns(limits)
    if req.instructions:
        lim.check_text("instructions", len(req.instructions), limits)
        turns.out.append(ChatMessage("system", req.instructions))
    if isinstance(req.input, str):
        if not req.input:
            raise BadRequest("input must not be empty", param="input")
        lim.check_text("input", len(req.input), limits)
        turns.out.append(ChatMessage("user", req.input))
    elif req.input:
        lim.check_messages("input", len(req.input), limits)
        for i, item in enumerate(req.input):
            kind = item.type or ("message" if item.role is not None else None)
            if kind == "message":
                turns.message(f"input[{i}]", item)
            elif kind == "function_call":
                turns.call(f"input[{i}]", item)
            elif kind == "function_call_output":
                turns.result(f"input[{i}]", item)
            elif kind == "reasoning":
                # a reasoning model's earlier thoughts (an OpenAI answer's output sent
                # back): dropped, as OpenAI drops them for a model that does not reason
                continue
            elif kind is None:
                raise BadRequest("an input item needs its type (or a message its role)",
                                 param=f"input[{i}].type")
            else:
                raise BadRequest(f"input item of type {kind[:MAX_ITEM_TEXT]!r} is not "
                                 "supported; only message, function_call and "
                                 "function_call_output items are",
                                 param=f"input[{i}].type")
        turns.close()
    if not any(m.role != "system" for m in turns.out):
        raise BadRequest("input must hold at least one message", param="input")
    return tuple(turns.out)


# ---------------------------------------------------------------------------
# Tools and structured output, as the chat door's Structs


def _tools(req: ResponsesRequest) -> tuple[list[tools.Tool], tuple[str, ...]]:
    """The function tools in the chat door's shape, and the others passed over, named
    `tools[i]:TYPE` for X-Sanctum-Ignored.  Every other type (web_search, file_search,
    namespace, local_shell, custom, ...) is a tool OpenAI's servers run or a grouping
    of them: nothing here can run one, so the model is not offered it, and a client
    that offers them to any model (Codex CLI sends web_search and a namespace with
    every turn) still gets its answer, told what was left out."""
    out = []
    skipped = []
    for i, tool in enumerate(req.tools or ()):
        if tool.type != "function":
            skipped.append(sanitise(f"tools[{i}]:{tool.type[:MAX_ITEM_TEXT]}"))
            continue
        if tool.name is None:
            raise BadRequest("a function tool needs its name", param=f"tools[{i}].name")
        out.append(tools.Tool("function", tools.FunctionSpec(
            tool.name, tool.description, tool.parameters, tool.strict)))
    return out, tuple(skipped)


def _tool_choice(req: ResponsesRequest) -> tools.ToolChoice | None:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function":
        raise BadRequest(f"tool_choice of type {choice.type[:MAX_ITEM_TEXT]!r} is not "
                         "supported; send none, auto, required or a function",
                         param="tool_choice.type")
    if choice.name is None:
        raise BadRequest("tool_choice names its function", param="tool_choice.name")
    return tools.NamedToolChoice("function", tools.NamedFunction(choice.name))


def _format(text: TextConfig | None) -> tools.ResponseFormat | None:
    if text is None:
        return None
    fmt = text.format
    if isinstance(fmt, JsonSchemaFormat):
        return tools.JsonSchemaFormat(tools.JsonSchemaSpec(fmt.name, fmt.schema,
                                                           fmt.description, fmt.strict))
    if isinstance(fmt, JsonObjectFormat):
        return tools.JsonObjectFormat()
    return None


# ---------------------------------------------------------------------------
# The call


class ResponsesCall(msgspec.Struct, frozen=True):
    """A Responses body, decoded and checked: what the door and its rungs need."""

    req: ResponsesRequest
    messages: tuple[ChatMessage, ...]
    params: SamplingParams
    tools_json: str | None
    tool_choice: str | None
    response_format: str | None
    ignored: tuple[str, ...]  # unknown top-level fields, sanitised and sorted

    @property
    def model(self) -> str:
        return self.req.model

    @property
    def stream(self) -> bool:
        return self.req.stream

    def generate(self, request_id: str) -> Generate:
        req = self.req
        return Generate(request_id, req.stream, self.params, messages=self.messages,
                        tools_json=self.tools_json, response_format=self.response_format,
                        tool_choice=self.tool_choice,
                        parallel_tool_calls=req.parallel_tool_calls is not False,
                        **_overrides(req.sanctum))

    def door(self) -> ResponsesDoor:
        return ResponsesDoor(self.req.stream, echo(self),
                             logprobs=self.params.logprobs is not None)


def _overrides(opts: SanctumOptions | None) -> dict[str, Any]:
    """The `sanctum` overrides as Generate fields (as at the chat door)."""
    return {} if opts is None else opts.generate_fields()


def echo(call: ResponsesCall) -> dict[str, Any]:
    """The request's settings as a Response object repeats them."""
    req = call.req
    fmt: dict[str, Any] = {"type": "text"}
    if req.text is not None and req.text.format is not None:
        fmt = msgspec.to_builtins(req.text.format)
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": call.params.temperature,
        "top_p": call.params.top_p,
        "top_logprobs": call.params.logprobs,
        "tool_choice": msgspec.to_builtins(req.tool_choice) if req.tool_choice else "auto",
        "tools": [{"type": "function", "name": t.name, "description": t.description,
                   "parameters": t.parameters, "strict": t.strict}
                  for t in req.tools or ()],
        "text": {"format": fmt, "verbosity": "medium"},
        "store": False,
        "truncation": "disabled",
        "previous_response_id": None,
        "reasoning": None,
        "metadata": {},
    }


def read_responses(body: bytes, limits: ProxyConfig) -> ResponsesCall:
    """The Responses body as typed values, or a 400/413 naming the field."""
    req, ignored = _decode(body)
    refuse_unsupported(req)
    messages = _messages(req, limits)
    lim.check_tools("tools", len(req.tools or ()), limits)  # the passed-over ones too
    chat_tools, skipped = _tools(req)
    positions = [i for i, t in enumerate(req.tools or ()) if t.type == "function"]
    with _renamed(".function.", "."), _reindexed(positions):
        names = tools.check_tools(chat_tools, limits)
    choice = tools.tool_choice(_tool_choice(req), names)
    with _renamed("response_format.json_schema.", "text.format."):
        fmt = tools.response_format(_format(req.text), limits)
    if req.max_output_tokens is not None:
        lim.check_max_tokens("max_output_tokens", req.max_output_tokens, limits)
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        # absent: no bound short of the model's context (OpenAI's reading, and what
        # Codex counts on), within the proxy's own limit
        max_tokens=req.max_output_tokens or limits.max_completion_tokens,
        logprobs=logprobs_asked(req))
    tools_json = tools.to_json("tools", chat_tools) if chat_tools else None
    ignored = tuple(sorted({*ignored, *skipped}))
    return ResponsesCall(req, messages, params, tools_json, choice, fmt, ignored)

