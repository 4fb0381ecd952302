"""OpenAI request bodies, decoded and validated into typed Structs.

Unknown fields are ignored, as OpenAI clients send many; a known field with a
wrong type or an out-of-range value is a 400 that names the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from shared.errors import BadRequest
from shared.protocol import ChatMessage, SamplingParams

DEFAULT_MAX_TOKENS = 512
MAX_STOPS = 4

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=0)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1)]


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
    seed: int | None = None
    n: int = 1
    logprobs: bool | int | None = None
    sanctum: SanctumOptions | None = None


class ChatRequest(_Common, frozen=True):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)] = []
    # Rendered by the model's chat template (and so counted against the cap).
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(_Common, frozen=True):
    prompt: str | list[str] = ""


T = TypeVar("T")


def _decode(body: bytes, kind: type[T]) -> T:
    if not body:
        raise BadRequest("the request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rsplit("at `$.", 1)[-1].rstrip("`") if "at `$." in text else None
        raise BadRequest(f"invalid request: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


def sampling_params(req: _Common) -> SamplingParams:
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
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"at most {MAX_STOPS} stop sequences", param="stop")
    if any(not s for s in stops):
        raise BadRequest("a stop sequence must not be empty", param="stop")
    max_tokens = req.max_completion_tokens or req.max_tokens or DEFAULT_MAX_TOKENS
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        max_tokens=max_tokens,
        stop=stops,
        seed=req.seed,
    )


def _content(message: Message) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise BadRequest(f"content part of type {part.type!r} is not supported",
                             param="messages")
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
    return json.dumps(req.tools, ensure_ascii=False) if req.tools else None


def parse_chat(body: bytes) -> tuple[ChatRequest, tuple[ChatMessage, ...], SamplingParams]:
    req = _decode(body, ChatRequest)
    if not req.messages:
        raise BadRequest("messages must hold at least one message", param="messages")
    messages = tuple(ChatMessage(m.role, _content(m), m.name) for m in req.messages)
    return req, messages, sampling_params(req)


def parse_completion(body: bytes) -> tuple[CompletionRequest, str, SamplingParams]:
    req = _decode(body, CompletionRequest)
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise BadRequest("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise BadRequest("prompt must not be empty", param="prompt")
    return req, prompt, sampling_params(req)
