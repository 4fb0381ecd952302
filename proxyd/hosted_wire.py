"""What a hosted rung sends an OpenAI-compatible upstream, and what it reads back
besides text: pure, no I/O (proxyd/hosted.py is the network shell).

    request_body(gen, seat) -> (path, body)     the upstream request for a Generate
    extras(data, chat) -> Extras                 one event's tool-call deltas and logprobs
    whole_extras(data, chat) -> Extras           a JSON (non-stream) body's, calls complete
    ToolCallAssembler.feed(deltas) -> calls      calls completed by these deltas
    ToolCallAssembler.finish() -> calls          the calls still open at the finish

What is forwarded, field by field, and what makes the rung skip instead, is the
table in proxyd/ladder.py (`unsupported`); the body built here sends exactly the
fields that table forwards, and only off their neutral values where an upstream
might not know them (penalties, the non-OpenAI fields, parallel_tool_calls).

Tool calls arrive in pieces: the first delta of a call carries its `index`, `id`
and `function.name`, later ones pieces of `function.arguments`.  A call is complete
when a delta of another call arrives (another index, or the same index with another
id, as some upstreams number every call 0) or the choice finishes; it is passed on
whole, never in pieces, so a stream cut in the middle of a call sends none of it.
Calls are numbered 0, 1, ... in the order they completed.  A delta for a call that
already completed is a malformed stream: what was passed on cannot be taken back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from proxyd.sse import Malformed
from shared.config import SeatConfig
from shared.protocol import ChatMessage, Generate, TokenLogprob, ToolCall

TOOL_CHOICE_FUNCTION = "function:"


def tool_choice(choice: str) -> str | dict[str, Any]:
    """Generate.tool_choice as OpenAI spells it: a named function is an object."""
    if choice.startswith(TOOL_CHOICE_FUNCTION):
        return {"type": "function", "function": {"name": choice[len(TOOL_CHOICE_FUNCTION):]}}
    return choice


def message(m: ChatMessage) -> dict[str, Any]:
    """One chat message as OpenAI's API takes it, tool calls and tool results included."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls_json is not None:
        out["tool_calls"] = msgspec.Raw(m.tool_calls_json.encode())
        if not m.content:
            out["content"] = None  # OpenAI's own form of a turn that only calls tools
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def request_body(gen: Generate, seat: SeatConfig) -> tuple[str, dict[str, Any]]:
    """The upstream path and JSON body (msgspec-encodable: tools and schemas travel as
    the client's own JSON text, never decoded) for `gen` on hosted rung `seat`.  The
    caller checked `ladder.unsupported(gen, seat)` is None."""
    p = gen.params
    chat = gen.messages is not None
    body: dict[str, Any] = {
        "model": seat.upstream_model or seat.name,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": p.temperature,
        "top_p": p.top_p,
        "max_tokens": p.max_tokens,
    }
    if p.stop:
        body["stop"] = list(p.stop)
    if p.seed is not None:
        body["seed"] = p.seed
    if p.presence_penalty:
        body["presence_penalty"] = p.presence_penalty
    if p.frequency_penalty:
        body["frequency_penalty"] = p.frequency_penalty
    if p.logprobs is not None:
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = p.logprobs
        else:
            body["logprobs"] = p.logprobs
    extras = seat.upstream_fields
    if p.top_k and "top_k" in extras:
        body["top_k"] = p.top_k
    if p.min_p and "min_p" in extras:
        body["min_p"] = p.min_p
    if p.repetition_penalty != 1.0 and "repetition_penalty" in extras:
        body["repetition_penalty"] = p.repetition_penalty
    if gen.messages is None:
        body["prompt"] = list(gen.prompt_ids) if gen.prompt_ids is not None \
            else (gen.prompt or "") + (gen.prefix or "")
        return "/completions", body
    messages = [message(m) for m in gen.messages]
    if gen.prefix:  # continue the answer another rung began
        messages.append({"role": "assistant", "content": gen.prefix})
    body["messages"] = messages
    if gen.tools_json is not None:
        body["tools"] = msgspec.Raw(gen.tools_json.encode())
        if gen.tool_choice is not None:
            body["tool_choice"] = tool_choice(gen.tool_choice)
        if not gen.parallel_tool_calls:  # true is every upstream's default
            body["parallel_tool_calls"] = False
    # tool_choice without tools ("none") is not sent: OpenAI refuses it without tools.
    if gen.response_format is not None:
        body["response_format"] = msgspec.Raw(gen.response_format.encode())
    return "/chat/completions", body


# ---------------------------------------------------------------------------
# Reading: the parts of a chunk that sse.piece leaves (it reads text, finish, usage).


class _Function(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class ToolDelta(msgspec.Struct):
    index: int = 0
    id: str | None = None
    function: _Function | None = None


class _Top(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class _ChatToken(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[_Top] | None = None


class _ChatLogprobs(msgspec.Struct):
    content: list[_ChatToken] | None = None


class _Delta(msgspec.Struct):
    tool_calls: list[ToolDelta] | None = None


class _ChatChoice(msgspec.Struct):
    delta: _Delta | None = None
    message: _Delta | None = None
    logprobs: _ChatLogprobs | None = None


class _CompletionLogprobs(msgspec.Struct):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] | None = None


class _CompletionChoice(msgspec.Struct):
    logprobs: _CompletionLogprobs | None = None


class _ChatBody(msgspec.Struct):
    choices: list[_ChatChoice] | None = None


class _CompletionBody(msgspec.Struct):
    choices: list[_CompletionChoice] | None = None


_chat = msgspec.json.Decoder(_ChatBody)
_completion = msgspec.json.Decoder(_CompletionBody)


@dataclass(frozen=True)
class Extras:
    tool_deltas: tuple[ToolDelta, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


NONE = Extras()


def _chat_logprobs(lp: _ChatLogprobs | None) -> list[TokenLogprob]:
    if lp is None or not lp.content:
        return []
    return [TokenLogprob(t.token, t.logprob, tuple(t.bytes or ()),
                         tuple((a.token, a.logprob) for a in t.top_logprobs or ()))
            for t in lp.content]


def _completion_logprobs(lp: _CompletionLogprobs | None) -> list[TokenLogprob]:
    if lp is None:
        return []
    tops = lp.top_logprobs or []
    out: list[TokenLogprob] = []
    for i, token in enumerate(lp.tokens):
        value = lp.token_logprobs[i] if i < len(lp.token_logprobs) else None
        top = tops[i] if i < len(tops) else None
        out.append(TokenLogprob(token, 0.0 if value is None else value, (),
                                tuple((top or {}).items())))
    return out


def extras(data: str, chat: bool) -> Extras:
    """One stream event's tool-call deltas and log-probabilities (NONE when it has
    neither); raises Malformed for a shape no OpenAI-compatible server sends."""
    try:
        if chat:
            body = _chat.decode(data)
            deltas: list[ToolDelta] = []
            lps: list[TokenLogprob] = []
            for c in body.choices or ():
                part = c.delta or c.message
                if part is not None and part.tool_calls:
                    deltas.extend(part.tool_calls)
                lps.extend(_chat_logprobs(c.logprobs))
            return Extras(tuple(deltas), tuple(lps)) if deltas or lps else NONE
        completion = _completion.decode(data)
        lps = [t for c in completion.choices or () for t in _completion_logprobs(c.logprobs)]
        return Extras((), tuple(lps)) if lps else NONE
    except msgspec.ValidationError as exc:
        raise Malformed(f"bad tool calls or logprobs: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise Malformed(f"event is not JSON: {data[:80]!r}") from exc


def whole_extras(data: str, chat: bool) -> Extras:
    """A non-stream body's: its message's tool calls (each complete, numbered by its
    place in the list) and log-probabilities."""
    got = extras(data, chat)
    deltas = tuple(msgspec.structs.replace(d, index=i) for i, d in enumerate(got.tool_deltas))
    return Extras(deltas, got.logprobs)


@dataclass
class _Open:
    index: int
    id: str | None
    name: str | None = None
    arguments: list[str] = field(default_factory=list)


class ToolCallAssembler:
    """Tool-call deltas in, whole calls out (the module's rules).  `rid` names the
    calls an upstream sent without an id."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.done: list[ToolCall] = []
        self._closed: set[int] = set()  # upstream indexes of completed calls
        self._open: _Open | None = None

    def feed(self, deltas: tuple[ToolDelta, ...]) -> list[ToolCall]:
        out: list[ToolCall] = []
        for d in deltas:
            cur = self._open
            if cur is not None and (d.index != cur.index
                                    or (d.id and cur.id and d.id != cur.id)):
                out.append(self._close())
                cur = None
            if cur is None:
                if d.index in self._closed and not d.id:
                    raise Malformed(f"tool call {d.index} went on after the next one began")
                cur = self._open = _Open(d.index, d.id or None)
            cur.id = cur.id or d.id or None
            fn = d.function
            if fn is not None:
                cur.name = cur.name or fn.name or None
                if fn.arguments:
                    cur.arguments.append(fn.arguments)
        return out

    def finish(self) -> list[ToolCall]:
        return [self._close()] if self._open is not None else []

    def _close(self) -> ToolCall:
        cur = self._open
        assert cur is not None
        self._open = None
        if not cur.name:
            raise Malformed(f"tool call {cur.index} has no function name")
        self._closed.add(cur.index)
        n = len(self.done)
        call = ToolCall(n, cur.id or f"call_{self.rid}_{n}", cur.name,
                        "".join(cur.arguments) or "{}")
        self.done.append(call)
        return call
