"""The OpenAI front doors: chat and text completions render the ladder's events.

    door.opening(answer)                     bytes after the headers (chat: the role chunk;
                                             completions with echo: the prompt)
    door.text(answer, piece)                 the SSE chunks of one `Text` event
    door.closing(answer, finish, usage)      finish chunk, usage chunk when asked, [DONE]
    door.body(done)                          the whole non-stream JSON body
    door.error_event(message, code, extra)   a terminal SSE error event (no [DONE])
    door.trailer(answer)                     after [DONE] of a continued stream: an
                                             `event: sanctum` listing every segment

A door decides nothing: the ladder (proxyd/journey.py) says what happened, the
door says it in its API's format.  A new API is one more class with these methods.

Text chunks are the hot path: each is a prefix and a suffix built once per answer
(while its seat and fingerprint stay the same) around the JSON-encoded text, so a
chunk costs one string encode, not a dict and a `json.dumps`.  A piece with tool
calls or log-probabilities is built whole, as OpenAI shapes them:

    chat, stream    a content delta (with `logprobs.content` for its tokens), then one
                    chunk per completed call: delta.tool_calls = [{"index", "id",
                    "type": "function", "function": {"name", "arguments"}}], the
                    arguments whole in that one delta
    chat, body      message.tool_calls, message.content null when there is no text
                    beside the calls, choices[0].logprobs.content for every token
    completions     choices[0].logprobs = {"tokens", "token_logprobs", "top_logprobs"
                    (one {token: logprob} per token), "text_offset"}

A log-probability below -9999 (or -inf: a token the shaping removed) is sent as -9999,
OpenAI's own value for a token of no probability: JSON has no -inf.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from proxyd.events import Answer, Done, Text
from shared.protocol import TokenLogprob, ToolCall, Usage

_encode = msgspec.json.encode
DONE = b"data: [DONE]\n\n"
# An SSE comment: every SSE parser skips it (the openai and anthropic SDKs' included).
KEEPALIVE = b": keepalive\n\n"
# Splits a rendered chunk around its text; never appears in JSON-encoded text.
_HOLE = "\x00hole\x00"
_HOLE_JSON = _encode(_HOLE)
LOGPROB_FLOOR = -9999.0


def usage_body(u: Usage) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def sse(body: Any) -> bytes:
    return b"data: " + _encode(body) + b"\n\n"


def error_event(message: str, code: str, extra: dict[str, Any]) -> bytes:
    """A terminal SSE error event: the stream ends here, with no [DONE]."""
    return b"event: error\n" + sse(
        {"error": {"message": message, "type": "server_error", "code": code, **extra}})


def logprob(value: float) -> float:
    """A log-probability JSON can carry: -inf and NaN as OpenAI's floor, never above 0."""
    if value >= 0.0:
        return 0.0
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN compares false


def chat_logprobs(tokens: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """`logprobs.content` of a chat choice: each token with its best alternatives."""
    return [{"token": t.token, "logprob": logprob(t.logprob),
             "bytes": list(t.bytes) if t.bytes else list(t.token.encode("utf-8")),
             "top_logprobs": [{"token": alt, "logprob": logprob(v),
                               "bytes": list(alt.encode("utf-8"))} for alt, v in t.top]}
            for t in tokens]


def completion_logprobs(tokens: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """A completion choice's `logprobs`; `offset`: where the first token's text begins
    in the choice's whole text."""
    texts, values, tops, offsets = [], [], [], []
    for t in tokens:
        texts.append(t.token)
        values.append(logprob(t.logprob))
        tops.append({alt: logprob(v) for alt, v in t.top})
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


class _OpenAIDoor:
    """What chat and text completions share: the chunk envelope and the usage chunk."""

    prefix = ""  # of the response id
    chunk_object = ""
    body_object = ""

    def __init__(self, stream: bool, include_usage: bool, logprobs: bool = False) -> None:
        self.stream = stream
        self.include_usage = include_usage
        self.logprobs = logprobs  # the request asked for them
        self._key: tuple[str, str] | None = None
        self._around = (b"", b"")

    def id(self, a: Answer) -> str:
        return self.prefix + a.request_id

    def envelope(self, a: Answer, choices: list[dict[str, Any]], obj: str) -> dict[str, Any]:
        return {"id": self.id(a), "object": obj, "created": a.created, "model": a.seat,
                "system_fingerprint": a.fingerprint or None, "choices": choices}

    def chunk(self, a: Answer, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse({**self.envelope(a, choices, self.chunk_object), **extra})

    def text_choice(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def plain(self, a: Answer, text: str) -> bytes:
        """A chunk of text alone: the hot path."""
        key = (a.seat, a.fingerprint)
        if key != self._key:
            whole = self.chunk(a, [self.text_choice(_HOLE)])
            head, _, tail = whole.partition(_HOLE_JSON)
            self._key, self._around = key, (head, tail)
        head, tail = self._around
        return head + _encode(text) + tail

    def text(self, a: Answer, piece: Text) -> bytes:
        if piece.tool_calls or (piece.logprobs and self.logprobs):
            return self.rich(a, piece)
        if not piece.text:  # (a call's text held back): no empty content delta
            return b""
        return self.plain(a, piece.text)

    def rich(self, a: Answer, piece: Text) -> bytes:
        raise NotImplementedError

    def error_event(self, message: str, code: str, extra: dict[str, Any]) -> bytes:
        return error_event(message, code, extra)

    def trailer(self, a: Answer) -> bytes:
        """The `sanctum` object again, as a named event after [DONE]: clients stop at
        [DONE] (OpenAI's SDK does), so it is read only by who looks for it."""
        return b"event: sanctum\n" + sse({"sanctum": a.sanctum()})

    def keepalive(self) -> bytes:
        return KEEPALIVE

    def finish_choice(self, finish: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def closing(self, a: Answer, finish: str | None, usage: Usage) -> bytes:
        """The finish chunk, the usage chunk when asked, and [DONE].  The last data
        chunk carries the `sanctum` object."""
        last = [self.finish_choice(finish)]
        if not self.include_usage:
            return self.chunk(a, last, sanctum=a.sanctum()) + DONE
        return (self.chunk(a, last)
                + self.chunk(a, [], usage=usage_body(usage), sanctum=a.sanctum()) + DONE)

    def choice(self, done: Done) -> dict[str, Any]:
        raise NotImplementedError

    def body(self, done: Done) -> bytes:
        a = done.answer
        return _encode({**self.envelope(a, [self.choice(done)], self.body_object),
                        "usage": usage_body(done.usage), "sanctum": a.sanctum()})


class ChatDoor(_OpenAIDoor):
    """POST /v1/chat/completions."""

    name = "chat"
    prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"
    body_object = "chat.completion"

    def opening(self, a: Answer) -> bytes:
        # The role alone: an empty `content` would be an empty content delta (the openai
        # SDK fires an event for it, and an answer of calls only would end with content
        # "" where the sync answer has null).
        return self.chunk(a, [{"index": 0, "delta": {"role": "assistant"},
                               "finish_reason": None, "logprobs": None}])

    def text_choice(self, text: str) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": text}, "finish_reason": None,
                "logprobs": None}

    def rich(self, a: Answer, piece: Text) -> bytes:
        """The piece's text (with its tokens' log-probabilities), then a chunk per call."""
        lp = {"content": chat_logprobs(piece.logprobs)} \
            if self.logprobs and piece.logprobs else None
        out = b""
        if piece.text or not piece.tool_calls:
            out = self.chunk(a, [{"index": 0, "delta": {"content": piece.text},
                                  "finish_reason": None, "logprobs": lp}])
            lp = None
        for call in piece.tool_calls:
            delta = {"tool_calls": [{"index": call.index, **tool_call(call)}]}
            out += self.chunk(a, [{"index": 0, "delta": delta, "finish_reason": None,
                                   "logprobs": lp}])
            lp = None
        return out

    def finish_choice(self, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": {}, "finish_reason": finish, "logprobs": None}

    def choice(self, done: Done) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": done.text if done.text or not done.tool_calls else None}
        if done.tool_calls:
            message["tool_calls"] = [tool_call(c) for c in done.tool_calls]
        lp = {"content": chat_logprobs(done.logprobs)} if self.logprobs else None
        return {"index": 0, "message": message, "finish_reason": done.finish_reason,
                "logprobs": lp}


class CompletionDoor(_OpenAIDoor):
    """POST /v1/completions.  `echo`: the prompt, when the answer starts with it (sent
    as the stream's first chunk, or at the start of the body's text)."""

    name = "completions"
    prefix = "cmpl-"
    chunk_object = "text_completion"
    body_object = "text_completion"

    def __init__(self, stream: bool, include_usage: bool, logprobs: bool = False,
                 echo: str = "") -> None:
        super().__init__(stream, include_usage, logprobs)
        self.echo = echo
        self._offset = len(echo)  # of the next token's text, in the stream's whole text

    def opening(self, a: Answer) -> bytes:
        return self.plain(a, self.echo) if self.echo else b""

    def text_choice(self, text: str) -> dict[str, Any]:
        return {"index": 0, "text": text, "finish_reason": None, "logprobs": None}

    def rich(self, a: Answer, piece: Text) -> bytes:
        if not self.logprobs:  # (no tool calls here: completions have no tools)
            return self.plain(a, piece.text)
        lp = completion_logprobs(piece.logprobs, self._offset)
        self._offset += sum(len(t.token) for t in piece.logprobs)
        return self.chunk(a, [{"index": 0, "text": piece.text, "finish_reason": None,
                               "logprobs": lp}])

    def finish_choice(self, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": "", "finish_reason": finish, "logprobs": None}

    def choice(self, done: Done) -> dict[str, Any]:
        lp = completion_logprobs(done.logprobs, len(self.echo)) if self.logprobs else None
        return {"index": 0, "text": self.echo + done.text, "finish_reason": done.finish_reason,
                "logprobs": lp}
