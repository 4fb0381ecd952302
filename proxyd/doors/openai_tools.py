"""Tools and structured output in OpenAI's chat bodies: their shapes and their checks.

    check_tools(tools, limits) -> names           each within the limits, named once
    tool_choice(choice, names) -> str | None      Generate.tool_choice
    response_format(fmt, limits) -> str | None    Generate.response_format (its JSON)
    calls_json(at, calls, limits) -> str          an assistant turn's calls, as JSON

Shapes are OpenAI's: a tool is {"type": "function", "function": {"name", "description"?,
"parameters"?, "strict"?}} with a name of [a-zA-Z0-9_-]{1,64}; tool_choice is "none",
"auto", "required" or {"type": "function", "function": {"name"}} naming one of the
tools ("required" and a named one need tools: there would be nothing to call);
response_format is {"type": "text"} (free text: None), {"type": "json_object"} or
{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}.
Whether a schema is one the seat can constrain to is the seat's to say (a 400 from
it); here only its shape and its size are checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

from proxyd import limits as lim
from shared.config import ProxyConfig
from shared.errors import BadRequest
from shared.protocol import MAX_TOOL_NAME_CHARS

# OpenAI's rule for function and schema names
Name = Annotated[str, msgspec.Meta(pattern=f"^[a-zA-Z0-9_-]{{1,{MAX_TOOL_NAME_CHARS}}}$")]
CallId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class CalledFunction(msgspec.Struct, frozen=True):
    name: Name
    arguments: str  # JSON as the model wrote it, passed on as it is


class MessageToolCall(msgspec.Struct, frozen=True):
    """A call of an assistant turn in the history, as the client sends it back."""

    id: CallId
    function: CalledFunction
    type: Literal["function"] = "function"


class FunctionSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(msgspec.Struct, frozen=True):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(msgspec.Struct, frozen=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class TextFormat(msgspec.Struct, frozen=True, tag="text", tag_field="type"):
    pass


class JsonObjectFormat(msgspec.Struct, frozen=True, tag="json_object", tag_field="type",
                       omit_defaults=True):
    # {"type": "json_object", "schema": {...}}: the form llama.cpp's and LM Studio's
    # clients send; honoured as that schema (`response_format`)
    schema: dict[str, Any] | None = None


class JsonSchemaSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    name: Name
    schema: dict[str, Any] | None = None  # absent: any JSON object, as OpenAI reads it
    description: str | None = None
    strict: bool | None = None


class JsonSchemaFormat(msgspec.Struct, frozen=True, tag="json_schema", tag_field="type"):
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


def to_json(field: str, value: Any) -> str:
    try:
        return msgspec.json.encode(value).decode()
    except RecursionError:  # decodable yet one level too deep to encode
        raise BadRequest(f"{field} is nested too deeply", param=field) from None


def check_tools(tools: Sequence[Tool], limits: ProxyConfig) -> frozenset[str]:
    """Each tool within the limits, each name once; the names."""
    lim.check_tools("tools", len(tools), limits)
    names: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.function
        if function.name in names:
            raise BadRequest(f"two tools are named {function.name!r}",
                             param=f"tools[{i}].function.name")
        names.add(function.name)
        if function.parameters is not None:
            field = f"tools[{i}].function.parameters"
            lim.check_schema(field, lim.encoded_bytes(field, function.parameters), limits)
    return frozenset(names)


def tool_choice(choice: ToolChoice | None, names: frozenset[str]) -> str | None:
    """Generate.tool_choice: "none", "auto", "required" or "function:NAME"."""
    if choice is None or choice in ("none", "auto"):
        return choice
    if isinstance(choice, str):
        if not names:
            raise BadRequest("tool_choice 'required' needs tools", param="tool_choice")
        return choice
    name = choice.function.name
    if name not in names:
        raise BadRequest(f"tool_choice names {name[:64]!r}, which is not one of tools",
                         param="tool_choice")
    return f"function:{name}"


def response_format(fmt: ResponseFormat | None, limits: ProxyConfig) -> str | None:
    """Generate.response_format: the JSON of a constraint, canonical (the Struct's own
    field order, defaults left out); None: free text."""
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, JsonObjectFormat) and fmt.schema is not None:
        fmt = JsonSchemaFormat(JsonSchemaSpec("json_object", fmt.schema))
    if isinstance(fmt, JsonSchemaFormat) and fmt.json_schema.schema is not None:
        field = "response_format.json_schema.schema"
        lim.check_schema(field, lim.encoded_bytes(field, fmt.json_schema.schema), limits)
    return to_json("response_format", fmt)


def calls_json(at: str, calls: Sequence[MessageToolCall], limits: ProxyConfig) -> str:
    """An assistant turn's calls as OpenAI's JSON list (ChatMessage.tool_calls_json),
    each call's arguments held to max_content_chars like a message's text."""
    for j, call in enumerate(calls):
        lim.check_text(f"{at}.tool_calls[{j}].function.arguments",
                       len(call.function.arguments), limits)
    return to_json(f"{at}.tool_calls", [
        {"id": c.id, "type": "function",
         "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in calls])
