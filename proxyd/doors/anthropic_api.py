"""Anthropic Messages request bodies, decoded and validated into the same `Generate`.

    read_messages(body, limits) -> Messages          messages.generate(request_id) -> Generate
    read_count_tokens(body, limits) -> CountTokens   its messages and tools, to be counted

Bodies are Anthropic's (`POST /v1/messages`, `POST /v1/messages/count_tokens`); what
each top-level field is (honoured, accepted or refused) is `FIELDS` below, and a field
not there is unknown to the API: ignored, listed in X-Sanctum-Ignored and counted, as at
the OpenAI doors (proxyd/doors/openai_fields.py does the finding and the sanitising).  A known
field with a wrong type or value is a 400 naming it (`messages[0].content[2].type`), the
config's input limits (proxyd/limits.py) apply as at chat completions, and tools go
through the chat door's checks (proxyd/doors/openai_tools.py) in OpenAI's shape, which is what
the seats and hosted rungs take.

The mapping onto chat messages (shared.protocol.ChatMessage):

    system (a string or text blocks)     one `system` message first; a `system`-role
                                         message in `messages` is one too
    user / assistant, text blocks        their texts joined by a blank line: clients split
                                         distinct parts into blocks (a reminder and a
                                         prompt), which must not run together
    assistant tool_use {id, name, input} the turn's `tool_calls_json`, OpenAI's list
    user tool_result {tool_use_id,       one `tool` message each (before the turn's text,
      content, is_error}                 where Anthropic requires them), answering a
                                         tool_use of an earlier assistant turn; an error
                                         result's text starts with "Error: " (a chat
                                         template has no other place for is_error)
    thinking / redacted_thinking         dropped: Anthropic drops earlier turns' thinking
                                         from the context too, and the seats never write any
    image, document, any other block     a 400 naming the block's `type`

A final assistant message (a prefill) is refused: `Generate.prefix` is a continuation's
text, which counts in the answer's budget, is replaced when another rung continues the
answer, and reaches an OpenAI-compatible hosted rung as a finished assistant turn, so it
could not keep Anthropic's meaning (the answer goes on from the prefill) on every rung.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, TypeVar

import msgspec

from proxyd import limits as lim
from proxyd.doors import openai_tools as tools
from proxyd.doors.anthropic_door import MessagesDoor
from proxyd.doors.door import DoorRequest, SanctumOptions, decode_body
from proxyd.doors.openai_fields import ABSENT, Refusable, refuse_asked
from proxyd.doors.openai_tools import (
    CallId,
    FunctionSpec,
    JsonSchemaFormat,
    JsonSchemaSpec,
    Name,
    Tool,
)
from shared.config import ProxyConfig
from shared.errors import BadRequest
from shared.protocol import ChatMessage, Generate, SamplingParams

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]  # Anthropic's range
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1)]
BLOCK_JOIN = "\n\n"

# ---------------------------------------------------------------------------
# The bodies


class ResultPart(msgspec.Struct, frozen=True):
    """A block inside a tool_result's content (text only is taken)."""

    type: str
    text: str | None = None
    cache_control: msgspec.Raw = ABSENT  # accepted, as at the top level


class Block(msgspec.Struct, frozen=True):
    """A content block of any type: the fields of the types taken, the rest ignored."""

    type: str
    text: str | None = None
    # tool_use
    id: CallId | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: CallId | None = None
    content: str | list[ResultPart] | dict[str, Any] | None = None
    is_error: bool = False
    cache_control: msgspec.Raw = ABSENT  # accepted, as at the top level
    citations: msgspec.Raw = ABSENT  # accepted: a text's sources, asking for nothing


class Message(msgspec.Struct, frozen=True):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class TextBlock(msgspec.Struct, frozen=True):
    type: Literal["text"]
    text: str
    cache_control: msgspec.Raw = ABSENT  # accepted, as at the top level
    citations: msgspec.Raw = ABSENT


class AnthropicTool(msgspec.Struct, frozen=True):
    """A client tool; a server tool (bash_..., web_search_..., any other type) is a 400."""

    name: Name
    # required of a client tool; optional here so that a server tool, which has none,
    # is refused for its type (`tool_list`), not for a missing schema
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom" or absent
    strict: bool | None = None
    cache_control: msgspec.Raw = ABSENT  # accepted, as at the top level


class AutoChoice(msgspec.Struct, frozen=True, tag="auto", tag_field="type"):
    disable_parallel_tool_use: bool = False


class AnyChoice(msgspec.Struct, frozen=True, tag="any", tag_field="type"):
    disable_parallel_tool_use: bool = False


class ToolNamed(msgspec.Struct, frozen=True, tag="tool", tag_field="type"):
    name: str
    disable_parallel_tool_use: bool = False


class NoneChoice(msgspec.Struct, frozen=True, tag="none", tag_field="type"):
    pass


ToolChoice = AutoChoice | AnyChoice | ToolNamed | NoneChoice


class OutputFormat(msgspec.Struct, frozen=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, frozen=True):
    # How much effort to spend: accepted, like `thinking` (see FIELDS).
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class _Body(DoorRequest, frozen=True):
    """What the Messages and count_tokens bodies share."""

    nested_named: ClassVar[bool] = True

    @classmethod
    def opaque(cls, path: str, value: dict[str, Any]) -> bool:
        """A content block of a type the door does not read (thinking, image, ...):
        its fields are its type's."""
        return ".content[" in path and value.get("type") not in (
            "text", "tool_use", "tool_result")

    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: msgspec.Raw = ABSENT
    cache_control: msgspec.Raw = ABSENT
    speed: msgspec.Raw = ABSENT
    user_profile_id: msgspec.Raw = ABSENT
    workspace_id: msgspec.Raw = ABSENT
    mcp_servers: msgspec.Raw = ABSENT
    context_management: msgspec.Raw = ABSENT


class MessagesRequest(_Body, frozen=True):
    """POST /v1/messages."""

    max_tokens: MaxTokens | None = None  # required: checked after decoding, to name it
    stream: bool = False
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stop_sequences: list[str] | None = None
    sanctum: SanctumOptions | None = None
    metadata: msgspec.Raw = ABSENT
    service_tier: msgspec.Raw = ABSENT
    inference_geo: msgspec.Raw = ABSENT
    container: msgspec.Raw = ABSENT
    diagnostics: msgspec.Raw = ABSENT
    compaction: msgspec.Raw = ABSENT


class CountTokensRequest(_Body, frozen=True):
    """POST /v1/messages/count_tokens."""


# ---------------------------------------------------------------------------
# The fields


class Field(NamedTuple):
    action: Literal["honoured", "accepted", "refused"]
    reason: str
    doors: Literal["messages", "both"] = "both"  # "both": count_tokens takes it too
    allowed: tuple[Any, ...] = ()  # refused: the values that ask for nothing


_CACHE = ("a hint to Anthropic's prompt cache; the seats' prompt cache matches prefixes "
          "by itself, and the answer is the same")
_THINK = ("the seats' models answer without a thinking trace, which every thinking "
          "setting allows (a budget is what thinking may use), so the answer has no "
          "thinking blocks; Claude clients send it unasked")

FIELDS: dict[str, Field] = {
    # -- honoured: they reach the rung as Generate / SamplingParams fields
    "model": Field("honoured", "the route, whose ladder answers"),
    "messages": Field("honoured", "the chat, rendered by the seat's template"),
    "system": Field("honoured", "the first, system message"),
    "max_tokens": Field("honoured", "the answer's budget", "messages"),
    "stream": Field("honoured", "Anthropic's server-sent events", "messages"),
    "temperature": Field("honoured", "sampling", "messages"),
    "top_p": Field("honoured", "sampling", "messages"),
    "top_k": Field("honoured", "sampling", "messages"),
    "stop_sequences": Field("honoured", "stop sequences", "messages"),
    "tools": Field("honoured", "client tools: rendered by the template, calls parsed"),
    "tool_choice": Field("honoured", "any and tool: constrained decoding"),
    "output_config": Field("honoured", "format: constrained decoding; effort: accepted"),
    "sanctum": Field("honoured", "Sanctum's own per-request overrides", "messages"),
    # -- accepted: they ask for nothing this product must do
    "thinking": Field("accepted", _THINK),
    "metadata": Field("accepted", "a user id for Anthropic's abuse detection; nothing "
                      "here reads it", "messages"),
    "service_tier": Field("accepted", "Anthropic's capacity tiers; there is one here, "
                          "and the answer does not depend on it", "messages"),
    "cache_control": Field("accepted", _CACHE),
    "speed": Field("accepted", "there is one speed here, and the answer does not "
                   "depend on it"),
    "inference_geo": Field("accepted", "every answer is made on this box", "messages"),
    "user_profile_id": Field("accepted", "there are no profiles here"),
    "workspace_id": Field("accepted", "there are no workspaces here"),
    "context_management": Field("accepted", "edits Anthropic makes to a long context "
                                "(earlier thinking, old tool results, past a trigger); "
                                "here the messages are taken as sent, and a prompt past "
                                "the cap is a 413 with its numbers, never trimmed; Claude "
                                "Code sends it unasked"),
    # -- refused unless they ask for nothing
    "container": Field("refused", "there is no code-execution container here",
                       "messages"),
    "mcp_servers": Field("refused", "no MCP servers are called from here", "both", ([],)),
    "diagnostics": Field("refused", "no prompt-cache diagnostics are kept here",
                         "messages"),
    "compaction": Field("refused", "the context is not compacted here", "messages"),
}


@functools.cache
def _refusable(kind: type[_Body]) -> Refusable:
    return tuple((name, spec.reason, spec.allowed) for name in kind.__struct_fields__
                 if (spec := FIELDS.get(name)) is not None and spec.action == "refused")


def _refuse_unsupported(req: _Body) -> None:
    """A 400 for a refused field set to a value that asks for something."""
    refuse_asked(req, _refusable(type(req)))


T = TypeVar("T", bound=_Body)


def _decode(body: bytes, kind: type[T]) -> tuple[T, tuple[str, ...]]:
    return decode_body(body, kind)


# ---------------------------------------------------------------------------
# The chat


def _texts(at: str, blocks: Sequence[TextBlock | ResultPart] | str | None) -> str:
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    out = []
    for j, part in enumerate(blocks):
        if part.type != "text":
            raise BadRequest(f"a block of type {part.type[:64]!r} is not supported here; "
                             "only text blocks are", param=f"{at}[{j}].type")
        if part.text is None:
            raise BadRequest("a text block needs its text", param=f"{at}[{j}].text")
        out.append(part.text)
    return BLOCK_JOIN.join(out)


class _Chat:
    """Builds the ChatMessages of one body, remembering the tool_use ids seen so far."""

    def __init__(self, limits: ProxyConfig) -> None:
        self.limits = limits
        self.calls_made: set[str] = set()
        self.out: list[ChatMessage] = []

    def text(self, at: str, role: str, text: str) -> None:
        if len(text) > self.limits.max_content_chars:
            lim.check_text(at, len(text), self.limits)
        self.out.append(ChatMessage(role, text))

    def message(self, at: str, m: Message) -> None:
        if isinstance(m.content, str):
            self.text(f"{at}.content", m.role, m.content)
            return
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(m.content):
            where = f"{at}.content[{j}]"
            kind = block.type
            if kind == "text":
                if block.text is None:
                    raise BadRequest("a text block needs its text", param=f"{where}.text")
                texts.append(block.text)
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue
            elif kind == "tool_use" and m.role == "assistant":
                calls.append(self._call(where, block))
            elif kind == "tool_result" and m.role == "user":
                if texts:
                    raise BadRequest("tool_result blocks come first in a user message, "
                                     "before its text", param=f"{where}.type")
                self._result(where, block)
            else:
                raise BadRequest(f"a content block of type {kind[:64]!r} is not supported "
                                 f"in a{'n' if m.role == 'assistant' else ''} {m.role} "
                                 "message; text, tool_use (assistant) and tool_result "
                                 "(user) blocks are", param=f"{where}.type")
        text = BLOCK_JOIN.join(texts)
        if calls:
            if len(text) > self.limits.max_content_chars:
                lim.check_text(f"{at}.content", len(text), self.limits)
            self.out.append(ChatMessage("assistant", text, tool_calls_json=tools.to_json(
                f"{at}.content", calls)))
        elif texts or not any(b.type == "tool_result" for b in m.content):
            self.text(f"{at}.content", m.role, text)

    def _call(self, at: str, block: Block) -> dict[str, Any]:
        if not block.id:
            raise BadRequest("a tool_use block needs its id", param=f"{at}.id")
        if block.name is None:
            raise BadRequest("a tool_use block needs its name", param=f"{at}.name")
        if block.input is None:
            raise BadRequest("a tool_use block needs its input (an object)",
                             param=f"{at}.input")
        arguments = tools.to_json(f"{at}.input", block.input)
        lim.check_text(f"{at}.input", len(arguments), self.limits)
        self.calls_made.add(block.id)
        return {"id": block.id, "type": "function",
                "function": {"name": block.name, "arguments": arguments}}

    def _result(self, at: str, block: Block) -> None:
        call_id = block.tool_use_id
        if not call_id:
            raise BadRequest("a tool_result block names the tool_use it answers",
                             param=f"{at}.tool_use_id")
        if call_id not in self.calls_made:
            raise BadRequest(f"tool_use_id {call_id[:64]!r} answers no tool_use block of "
                             "an earlier assistant message", param=f"{at}.tool_use_id")
        if isinstance(block.content, dict):
            raise BadRequest("a tool_result's content is a string or text blocks",
                             param=f"{at}.content")
        text = _texts(f"{at}.content", block.content)
        if block.is_error:
            text = "Error: " + text
        lim.check_text(f"{at}.content", len(text), self.limits)
        self.out.append(ChatMessage("tool", text, tool_call_id=call_id))


def chat_messages(req: _Body, limits: ProxyConfig) -> tuple[ChatMessage, ...]:
    """The body's system prompt and messages as ChatMessages (the docstring's mapping)."""
    lim.check_messages("messages", len(req.messages), limits)
    chat = _Chat(limits)
    if req.system is not None:
        system = req.system if isinstance(req.system, str) else _texts("system", req.system)
        if system:
            chat.text("system", "system", system)
    for i, m in enumerate(req.messages):
        chat.message(f"messages[{i}]", m)
    last = len(req.messages) - 1
    if req.messages[last].role == "assistant":
        raise BadRequest("a final assistant message (a prefill) is not supported: the "
                         "answer is a new assistant turn; end with a user message",
                         param=f"messages[{last}].role")
    return tuple(chat.out)


# ---------------------------------------------------------------------------
# Tools and structured output


def tool_list(req: _Body) -> list[Tool]:
    """The body's tools in OpenAI's shape (what the seats and hosted rungs take)."""
    out = []
    for i, t in enumerate(req.tools or ()):
        if t.type not in (None, "custom"):
            raise BadRequest(f"tools of type {t.type[:64]!r} (Anthropic's server tools) are "
                             "not supported; client tools (name, description, "
                             "input_schema) are", param=f"tools[{i}].type")
        if t.input_schema is None:
            raise BadRequest("a client tool needs its input_schema",
                             param=f"tools[{i}].input_schema")
        out.append(Tool("function", FunctionSpec(t.name, t.description, t.input_schema,
                                                 t.strict)))
    return out


def _tools_param(exc: BadRequest) -> BadRequest:
    """The chat door's check names OpenAI's field (`tools[0].function.parameters`):
    say Anthropic's."""
    if exc.param:
        exc.param = exc.param.replace(".function.parameters", ".input_schema") \
            .replace(".function.name", ".name")
    return exc


def checked_tools(req: _Body, limits: ProxyConfig) -> tuple[str | None, str | None, bool]:
    """(Generate.tools_json, Generate.tool_choice, parallel_tool_calls)."""
    listed = tool_list(req)
    try:
        names = tools.check_tools(listed, limits)
    except BadRequest as exc:
        raise _tools_param(exc) from None
    choice = req.tool_choice
    parallel = not (choice is not None and not isinstance(choice, NoneChoice)
                    and choice.disable_parallel_tool_use)
    picked: str | None
    if choice is None:
        picked = None
    elif isinstance(choice, NoneChoice):
        picked = "none"
    elif isinstance(choice, AutoChoice):
        picked = "auto"
    elif not names:
        raise BadRequest(f"tool_choice {'any' if isinstance(choice, AnyChoice) else 'tool'}"
                         " needs tools", param="tool_choice")
    elif isinstance(choice, AnyChoice):
        picked = "required"
    else:
        if choice.name not in names:
            raise BadRequest(f"tool_choice names {choice.name[:64]!r}, which is not one "
                             "of tools", param="tool_choice.name")
        picked = f"function:{choice.name}"
    return (tools.to_json("tools", listed) if listed else None), picked, parallel


def response_format(req: _Body, limits: ProxyConfig) -> str | None:
    """output_config.format as the chat door's response_format JSON; None: free text."""
    if req.output_config is None or req.output_config.format is None:
        return None
    field = "output_config.format.schema"
    schema = req.output_config.format.schema
    lim.check_schema(field, lim.encoded_bytes(field, schema), limits)
    return tools.to_json("output_config.format",
                         JsonSchemaFormat(JsonSchemaSpec("output", schema)))


# ---------------------------------------------------------------------------
# The doors' bodies, decoded


def sampling_params(req: MessagesRequest, limits: ProxyConfig) -> SamplingParams:
    if req.max_tokens is None:
        raise BadRequest("max_tokens is required", param="max_tokens")
    lim.check_max_tokens("max_tokens", req.max_tokens, limits)
    stops = tuple(req.stop_sequences or ())
    lim.check_stops("stop_sequences", stops, limits)
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        max_tokens=req.max_tokens,
        stop=stops,
    )


def overrides(options: SanctumOptions | None) -> dict[str, Any]:
    """The body's `sanctum` overrides as Generate fields, as at the OpenAI doors."""
    return {} if options is None else options.generate_fields()


class Messages(msgspec.Struct, frozen=True):
    """A Messages body, decoded and checked: what the door and its rungs need."""

    req: MessagesRequest
    messages: tuple[ChatMessage, ...]
    params: SamplingParams
    tools_json: str | None
    tool_choice: str | None
    parallel_tool_calls: bool
    response_format: str | None
    ignored: tuple[str, ...]  # unknown top-level fields, sanitised and sorted

    @property
    def model(self) -> str:
        return self.req.model

    @property
    def stream(self) -> bool:
        return self.req.stream

    def generate(self, request_id: str) -> Generate:
        return Generate(request_id, self.req.stream, self.params, messages=self.messages,
                        tools_json=self.tools_json, response_format=self.response_format,
                        tool_choice=self.tool_choice,
                        parallel_tool_calls=self.parallel_tool_calls,
                        **overrides(self.req.sanctum))

    def door(self) -> MessagesDoor:
        return MessagesDoor(self.req.stream)


class CountTokens(msgspec.Struct, frozen=True):
    """A count_tokens body: the prompt a Messages body with the same fields would have."""

    req: CountTokensRequest
    messages: tuple[ChatMessage, ...]
    tools_json: str | None
    ignored: tuple[str, ...]

    @property
    def model(self) -> str:
        return self.req.model


def read_messages(body: bytes, limits: ProxyConfig) -> Messages:
    """The Messages body as typed values, or a 400/413 naming the field."""
    req, ignored = _decode(body, MessagesRequest)
    _refuse_unsupported(req)
    params = sampling_params(req, limits)
    messages = chat_messages(req, limits)
    tools_json, choice, parallel = checked_tools(req, limits)
    return Messages(req, messages, params, tools_json, choice, parallel,
                    response_format(req, limits), ignored)


def read_count_tokens(body: bytes, limits: ProxyConfig) -> CountTokens:
    """The count_tokens body as typed values, or a 400/413 naming the field."""
    req, ignored = _decode(body, CountTokensRequest)
    _refuse_unsupported(req)
    messages = chat_messages(req, limits)
    tools_json, _choice, _parallel = checked_tools(req, limits)
    response_format(req, limits)
    return CountTokens(req, messages, tools_json, ignored)

