"""OpenAI request bodies, decoded and validated into typed Structs.

    read_chat(body, limits) -> Chat                 chat.generate(request_id) -> Generate
    read_completion(body, limits) -> Completion     and its unknown fields, `ignored`

What each top-level field is (honoured, accepted or refused) is proxyd/doors/openai_fields.py's
table; the bodies derive from `proxyd.doors.door.DoorRequest` and are read as every
door's are (`decode_body`: unknown top-level fields ignored and named, a wrong field a
400 that names it).  Fields that need no decoding (accepted ones, and refused ones
unless present) stay raw JSON.  The config's input limits (proxyd/limits.py) are
applied here, after decoding: the body's own size was bounded before it was read.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec

from proxyd import limits as lim
from proxyd.doors import openai_tools as tools
from proxyd.doors.door import DoorRequest, SanctumOptions, decode_body
from proxyd.doors.openai_door import ChatDoor, CompletionDoor
from proxyd.doors.openai_fields import ABSENT, refuse_unsupported, sanitise
from proxyd.doors.openai_tools import CallId, MessageToolCall, ResponseFormat, Tool, ToolChoice
from shared.config import ProxyConfig
from shared.errors import BadRequest
from shared.protocol import (
    MAX_REPETITION_PENALTY,
    MAX_TOKEN_ID,
    MAX_TOP_LOGPROBS,
    ChatMessage,
    Generate,
    SamplingParams,
)

DEFAULT_MAX_TOKENS = 512

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1)]
# 64-bit signed, as OpenAI documents seed: a larger integer could not even be sent
# to the seat (msgpack carries 64 bits).
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
TopK = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_REPETITION_PENALTY)]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]
BIAS_LIMIT = 100.0  # OpenAI's range of a logit_bias value: -100..100

# ---------------------------------------------------------------------------
# The bodies


class TextPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None


class Message(msgspec.Struct, frozen=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: CallId | None = None  # a tool result: the call it answers
    # accepted: what the openai SDK sends back of an answer it got (a refusal's text,
    # citations), asking for nothing here
    refusal: msgspec.Raw = ABSENT
    annotations: msgspec.Raw = ABSENT


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class _Common(DoorRequest, frozen=True):
    nested_named: ClassVar[bool] = True  # messages[0].frobnicate is named too
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    # token id (as a string) -> bias; checked here to name the key (`_logit_bias`)
    logit_bias: dict[str, Any] | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    sanctum: SanctumOptions | None = None
    n: msgspec.Raw = ABSENT
    user: msgspec.Raw = ABSENT


class ChatRequest(_Common, frozen=True):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=list)
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    # Rendered by the model's chat template (and so counted against the cap).
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    safety_identifier: msgspec.Raw = ABSENT
    metadata: msgspec.Raw = ABSENT
    service_tier: msgspec.Raw = ABSENT
    prompt_cache_key: msgspec.Raw = ABSENT
    prompt_cache_retention: msgspec.Raw = ABSENT
    prompt_cache_options: msgspec.Raw = ABSENT
    prediction: msgspec.Raw = ABSENT
    audio: msgspec.Raw = ABSENT
    modalities: msgspec.Raw = ABSENT
    web_search_options: msgspec.Raw = ABSENT
    functions: msgspec.Raw = ABSENT
    function_call: msgspec.Raw = ABSENT
    store: msgspec.Raw = ABSENT
    reasoning_effort: msgspec.Raw = ABSENT
    verbosity: msgspec.Raw = ABSENT
    moderation: msgspec.Raw = ABSENT


class CompletionRequest(_Common, frozen=True):
    # text, [text], token ids, or [token ids] (`_prompt`)
    prompt: str | list[Any] = ""
    # OpenAI's completions take 0..5; the seats give up to MAX_TOP_LOGPROBS
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: msgspec.Raw = ABSENT
    best_of: msgspec.Raw = ABSENT


# ---------------------------------------------------------------------------
# Field checks

def _logit_bias(bias: dict[str, Any] | None) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    lim.check_logit_bias("logit_bias", len(bias))
    out: dict[int, float] = {}
    for key, value in bias.items():
        field = f"logit_bias.{sanitise(key)}"
        # At most 10 digits: MAX_TOKEN_ID has 10, and int() refuses 4,300 or more.
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 10 else -1
        if not 0 <= token <= MAX_TOKEN_ID:
            raise BadRequest(f"logit_bias keys are token ids (0..{MAX_TOKEN_ID}) as "
                             f"strings; {key[:40]!r} is not one", param=field)
        if token in out:
            raise BadRequest(f"logit_bias names token {token} twice", param=field)
        # Compared, never converted: a 400-digit integer is no float (NaN fails too).
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not -BIAS_LIMIT <= value <= BIAS_LIMIT):
            raise BadRequest(f"a logit_bias value is a number from -{BIAS_LIMIT:g} to "
                             f"{BIAS_LIMIT:g}; got {str(value)[:40]}", param=field)
        out[token] = float(value)
    return tuple(sorted(out.items()))


def sampling_params(req: _Common, limits: ProxyConfig,
                    logprobs: int | None = None) -> SamplingParams:
    refuse_unsupported(req)
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
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias),
        min_p=req.min_p or 0.0,
        logprobs=logprobs,
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


def _messages(req: ChatRequest, limits: ProxyConfig) -> tuple[ChatMessage, ...]:
    """The chat as ChatMessages; the turns with tool calls or results by `_tool_turn`."""
    if not req.messages:
        raise BadRequest("messages must hold at least one message", param="messages")
    lim.check_messages("messages", len(req.messages), limits)
    calls_made: set[str] = set()
    limit = limits.max_content_chars
    out = []
    for i, m in enumerate(req.messages):
        # field names are built only for an error: this loop is on every request's path
        text = m.content if type(m.content) is str else _content(f"messages[{i}].content", m)
        if len(text) > limit:
            lim.check_text(f"messages[{i}].content", len(text), limits)
        if m.tool_calls or m.tool_call_id is not None or m.role == "tool":
            out.append(_tool_turn(f"messages[{i}]", m, text, calls_made, limits))
        else:
            out.append(ChatMessage(m.role, text, m.name))
    return tuple(out)


def _tool_turn(at: str, m: Message, text: str, calls_made: set[str],
               limits: ProxyConfig) -> ChatMessage:
    """An assistant turn's tool calls as their JSON list (OpenAI's shape), or a tool
    result with the call it answers, which an earlier assistant turn made."""
    calls_json = None
    if m.tool_calls:
        if m.role != "assistant":
            raise BadRequest("only an assistant message carries tool_calls",
                             param=f"{at}.tool_calls")
        calls_json = tools.calls_json(at, m.tool_calls, limits)
        calls_made.update(call.id for call in m.tool_calls)
    if m.role == "tool":
        if m.tool_call_id is None:
            raise BadRequest("a tool message names the call it answers",
                             param=f"{at}.tool_call_id")
        if m.content is None:
            raise BadRequest("a tool message needs its content", param=f"{at}.content")
        if m.tool_call_id not in calls_made:
            raise BadRequest(f"tool_call_id {m.tool_call_id[:64]!r} answers no tool "
                             "call of an earlier assistant message",
                             param=f"{at}.tool_call_id")
    elif m.tool_call_id is not None:
        raise BadRequest("only a tool message carries tool_call_id",
                         param=f"{at}.tool_call_id")
    return ChatMessage(m.role, text, m.name, calls_json, m.tool_call_id)


def tools_json(req: ChatRequest) -> str | None:
    return tools.to_json("tools", req.tools) if req.tools else None


def overrides(req: _Common) -> dict[str, Any]:
    """The request's `sanctum` overrides as Generate fields (KV lane, speculation,
    prompt cache, draft depth, a row of its own)."""
    return {} if req.sanctum is None else req.sanctum.generate_fields()


def _include_usage(req: _Common) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


# ---------------------------------------------------------------------------
# The doors' bodies, decoded


class Chat(msgspec.Struct, frozen=True):
    """A chat body, decoded and checked: what the door and its rungs need."""

    req: ChatRequest
    messages: tuple[ChatMessage, ...]
    params: SamplingParams
    tools_json: str | None
    tool_choice: str | None
    response_format: str | None
    ignored: tuple[str, ...]  # unknown top-level fields, sanitised and sorted

    @property
    def model(self) -> str:
        return self.req.model

    def door(self) -> ChatDoor:
        return ChatDoor(self.req.stream, _include_usage(self.req),
                        logprobs=self.params.logprobs is not None)

    def generate(self, request_id: str) -> Generate:
        req = self.req
        return Generate(request_id, req.stream, self.params, messages=self.messages,
                        tools_json=self.tools_json, response_format=self.response_format,
                        tool_choice=self.tool_choice,
                        parallel_tool_calls=req.parallel_tool_calls is not False,
                        **overrides(req))


class Completion(msgspec.Struct, frozen=True):
    req: CompletionRequest
    prompt: str
    params: SamplingParams
    ignored: tuple[str, ...]
    prompt_ids: tuple[int, ...] | None = None  # a prompt given as token ids

    @property
    def model(self) -> str:
        return self.req.model

    def door(self) -> CompletionDoor:
        return CompletionDoor(self.req.stream, _include_usage(self.req),
                              logprobs=self.params.logprobs is not None,
                              echo=self.prompt if self.req.echo else "")

    def generate(self, request_id: str) -> Generate:
        return Generate(request_id, self.req.stream, self.params, prompt=self.prompt,
                        prompt_ids=self.prompt_ids, **overrides(self.req))


def read_chat(body: bytes, limits: ProxyConfig) -> Chat:
    """The chat body as typed values, or a 400/413 naming the field."""
    req, ignored = decode_body(body, ChatRequest)
    messages = _messages(req, limits)
    names = tools.check_tools(req.tools or (), limits)
    choice = tools.tool_choice(req.tool_choice, names)
    fmt = tools.response_format(req.response_format, limits)
    if req.top_logprobs is not None and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, limits, logprobs)
    return Chat(req, messages, params, tools_json(req), choice, fmt, ignored)


def read_completion(body: bytes, limits: ProxyConfig) -> Completion:
    """The completion body as typed values, or a 400/413 naming the field."""
    req, ignored = decode_body(body, CompletionRequest)
    prompt, ids = _prompt(req.prompt, limits)
    if req.echo and req.logprobs is not None:
        raise BadRequest("echo with logprobs would need the prompt's log-probabilities, "
                         "which the seats do not compute", param="echo")
    if req.echo and ids is not None:
        raise BadRequest("echo needs a prompt of text, not of token ids", param="echo")
    return Completion(req, prompt, sampling_params(req, limits, req.logprobs), ignored, ids)


def _prompt(prompt: str | list[Any], limits: ProxyConfig) -> tuple[str, tuple[int, ...] | None]:
    """A completion's one prompt: (its text, None), or ("", its token ids) for a list of
    ids or a list holding one (each checked here against the protocol's range; the seat
    checks its own vocabulary)."""
    field = "prompt"
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        if len(prompt) != 1:
            raise BadRequest("only one prompt per request is supported", param="prompt")
        prompt, field = prompt[0], "prompt[0]"
        if not prompt or not all(isinstance(t, int) for t in prompt):
            raise BadRequest("a prompt in a list of lists is token ids", param=field)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
        lim.check_text(field, len(prompt), limits)
        for i, token in enumerate(prompt):
            if isinstance(token, bool) or not isinstance(token, int) \
                    or not 0 <= token <= MAX_TOKEN_ID:
                raise BadRequest(f"a prompt of token ids holds integers from 0 to "
                                 f"{MAX_TOKEN_ID}; got {str(token)[:40]}",
                                 param=f"{field}[{i}]")
        return "", tuple(prompt)
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise BadRequest("only one prompt per request is supported", param="prompt")
        prompt, field = prompt[0], "prompt[0]"
    if not isinstance(prompt, str):
        raise BadRequest("a prompt is a string, a list of one string, or token ids",
                         param=field)
    if not prompt:
        raise BadRequest("prompt must not be empty", param=field)
    lim.check_text(field, len(prompt), limits)
    return prompt, None


def parse_chat(body: bytes, limits: ProxyConfig
               ) -> tuple[ChatRequest, tuple[ChatMessage, ...], SamplingParams]:
    """`read_chat`, as (request, messages, sampling)."""
    chat = read_chat(body, limits)
    return chat.req, chat.messages, chat.params


def parse_completion(body: bytes, limits: ProxyConfig
                     ) -> tuple[CompletionRequest, str, SamplingParams]:
    """`read_completion`, as (request, prompt, sampling)."""
    done = read_completion(body, limits)
    return done.req, done.prompt, done.params
