"""OpenAI request bodies, decoded and validated into typed Structs.

Unknown fields are ignored, as OpenAI clients send many; a known field with a
wrong type or an out-of-range value is a 400 that names the field (msgspec's path
`$.messages[0].role` becomes `param` "messages[0].role"; a body that is not one JSON
object is `param` "body").  The config's input limits (proxyd/limits.py) are applied
here, after decoding: the body's own size was bounded before it was read.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from proxyd import limits as lim
from shared.config import ProxyConfig
from shared.errors import BadRequest
from shared.protocol import ChatMessage, SamplingParams

DEFAULT_MAX_TOKENS = 512

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1)]
# 64-bit signed, as OpenAI documents seed: a larger integer could not even be sent
# to the seat (msgpack carries 64 bits).
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
TopK = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class TextPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None


class Message(msgspec.Struct, frozen=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class SanctumOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-request overrides of the seat's settings, under the body's `sanctum` key."""

    kv: Literal["fp16", "q8"] | None = None
    speculation: bool | None = None
    # false: neither reuse nor leave a cached prompt prefix on the seat
    prompt_cache: bool | None = None
    # pins the draft length of this request (0 = plain), for measuring speculation
    draft_depth: Annotated[int, msgspec.Meta(ge=0, le=16)] | None = None
    # true: decode as a row of its own, never in a forward with other requests, so a
    # seeded answer's bytes cannot depend on its neighbours (it costs batching's gain)
    solo: bool | None = None


class _Common(msgspec.Struct, frozen=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    n: int = 1
    logprobs: bool | int | None = None
    sanctum: SanctumOptions | None = None


class ChatRequest(_Common, frozen=True):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)] = []
    # Rendered by the model's chat template (and so counted against the cap).
    tools: list[dict[str, Any]] | None = None
    # Not acted on yet; decoded only so that its schema is held to max_schema_bytes.
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common, frozen=True):
    prompt: str | list[str] = ""


T = TypeVar("T")

_AT = re.compile(r" - at `\$\.?([^`]*)`$")
# A field named in the message itself: one that is missing, or unknown where unknown
# fields are refused (`sanctum`).
_NAMED = re.compile(r"^Object (?:missing required|contains unknown) field `([^`]*)`")


def validation_param(message: str) -> str:
    """The field a msgspec ValidationError names, as `param`: "messages[0].role" for
    "... - at `$.messages[0].role`", "model" for a missing top-level `model`, "body"
    for the body itself (not an object)."""
    at = _AT.search(message)
    path = at.group(1) if at else ""
    named = _NAMED.match(message)
    if named:
        path = f"{path}.{named.group(1)}" if path else named.group(1)
    return path or "body"


def _decode(body: bytes, kind: type[T]) -> T:
    if not body:
        raise BadRequest("the request body is empty; expected a JSON object", param="body")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        raise BadRequest(f"invalid request: {text}", param=validation_param(text)) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}", param="body") from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply", param="body") from None


def sampling_params(req: _Common, limits: ProxyConfig) -> SamplingParams:
    if req.n != 1:
        raise BadRequest("only n=1 is supported", param="n")
    if req.logprobs:
        raise BadRequest("logprobs are not supported", param="logprobs")
    stops: tuple[str, ...]
    if req.stop is None:
        stops = ()
    elif isinstance(req.stop, str):
        stops = (req.stop,)
    else:
        stops = tuple(req.stop)
    lim.check_stops("stop", stops, limits, listed=not isinstance(req.stop, str))
    for field in ("max_tokens", "max_completion_tokens"):
        asked = getattr(req, field)
        if asked is not None:
            lim.check_max_tokens(field, asked, limits)
    max_tokens = req.max_completion_tokens or req.max_tokens or DEFAULT_MAX_TOKENS
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        max_tokens=max_tokens,
        stop=stops,
        seed=req.seed,
    )


def _content(field: str, message: Message) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        if part.type != "text":
            raise BadRequest(f"content part of type {part.type!r} is not supported; "
                             "only text parts are", param=f"{field}[{j}].type")
        if part.text is None:
            raise BadRequest("a text content part needs its text",
                             param=f"{field}[{j}].text")
        texts.append(part.text)
    return "".join(texts)


def overrides(req: _Common) -> dict[str, Any]:
    """The request's `sanctum` overrides as Generate fields (KV lane, speculation,
    prompt cache, draft depth, a row of its own)."""
    if req.sanctum is None:
        return {}
    return {"kv": req.sanctum.kv, "speculation": req.sanctum.speculation,
            "prompt_cache": req.sanctum.prompt_cache, "draft_depth": req.sanctum.draft_depth,
            "solo": req.sanctum.solo}


def tools_json(req: ChatRequest) -> str | None:
    if not req.tools:
        return None
    try:
        return json.dumps(req.tools, ensure_ascii=False)
    except RecursionError:  # decodable by msgspec yet one level too deep to encode
        raise BadRequest("tools is nested too deeply", param="tools") from None


def _schemas(req: ChatRequest, limits: ProxyConfig) -> None:
    """Each tool's parameters, and a response_format schema, within max_schema_bytes."""
    tools = req.tools or []
    lim.check_tools("tools", len(tools), limits)
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if isinstance(function, dict) and "parameters" in function:
            field = f"tools[{i}].function.parameters"
            lim.check_schema(field, lim.encoded_bytes(field, function["parameters"]), limits)
    fmt = req.response_format
    spec = fmt.get("json_schema") if fmt is not None else None
    if isinstance(spec, dict) and "schema" in spec:
        field = "response_format.json_schema.schema"
        lim.check_schema(field, lim.encoded_bytes(field, spec["schema"]), limits)


def parse_chat(body: bytes, limits: ProxyConfig
               ) -> tuple[ChatRequest, tuple[ChatMessage, ...], SamplingParams]:
    """The chat body as typed values, or a 400/413 naming the field."""
    req = _decode(body, ChatRequest)
    if not req.messages:
        raise BadRequest("messages must hold at least one message", param="messages")
    lim.check_messages("messages", len(req.messages), limits)
    messages = []
    for i, m in enumerate(req.messages):
        field = f"messages[{i}].content"
        text = _content(field, m)
        lim.check_text(field, len(text), limits)
        messages.append(ChatMessage(m.role, text, m.name))
    _schemas(req, limits)
    return req, tuple(messages), sampling_params(req, limits)


def parse_completion(body: bytes, limits: ProxyConfig
                     ) -> tuple[CompletionRequest, str, SamplingParams]:
    """The completion body as typed values, or a 400/413 naming the field."""
    req = _decode(body, CompletionRequest)
    prompt = req.prompt
    field = "prompt"
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise BadRequest("only one prompt per request is supported", param="prompt")
        prompt, field = prompt[0], "prompt[0]"
    if not prompt:
        raise BadRequest("prompt must not be empty", param=field)
    lim.check_text(field, len(prompt), limits)
    return req, prompt, sampling_params(req, limits)
