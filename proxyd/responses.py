"""The OpenAI front doors: chat and text completions render the ladder's events.

    door.opening(answer)                     bytes after the headers (chat: the role chunk)
    door.text(answer, text)                  one SSE chunk of committed text
    door.closing(answer, finish, usage)      finish chunk, usage chunk when asked, [DONE]
    door.body(answer, text, finish, usage)   the whole non-stream JSON body
    door.error_event(message, code, extra)   a terminal SSE error event (no [DONE])
    door.trailer(answer)                     after [DONE] of a continued stream: an
                                             `event: sanctum` listing every segment

A door decides nothing: the ladder (proxyd/journey.py) says what happened, the
door says it in its API's format.  A new API is one more class with these methods.

Text chunks are the hot path: each is a prefix and a suffix built once per answer
(while its seat and fingerprint stay the same) around the JSON-encoded text, so a
chunk costs one string encode, not a dict and a `json.dumps`.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from proxyd.events import Answer
from shared.protocol import Usage

_encode = msgspec.json.encode
DONE = b"data: [DONE]\n\n"
# Splits a rendered chunk around its text; never appears in JSON-encoded text.
_HOLE = "\x00hole\x00"
_HOLE_JSON = _encode(_HOLE)


class Door(Protocol):
    """What the plumbing (proxyd/front.py) needs from a front door."""

    stream: bool

    def opening(self, a: Answer) -> bytes: ...
    def text(self, a: Answer, text: str) -> bytes: ...
    def closing(self, a: Answer, finish: str | None, usage: Usage) -> bytes: ...
    def body(self, a: Answer, text: str, finish: str | None, usage: Usage) -> bytes: ...
    def error_event(self, message: str, code: str, extra: dict[str, Any]) -> bytes: ...
    def trailer(self, a: Answer) -> bytes: ...


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


class _OpenAIDoor:
    """What chat and text completions share: the chunk envelope and the usage chunk."""

    prefix = ""  # of the response id
    chunk_object = ""
    body_object = ""

    def __init__(self, stream: bool, include_usage: bool) -> None:
        self.stream = stream
        self.include_usage = include_usage
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

    def text(self, a: Answer, text: str) -> bytes:
        key = (a.seat, a.fingerprint)
        if key != self._key:
            whole = self.chunk(a, [self.text_choice(_HOLE)])
            head, _, tail = whole.partition(_HOLE_JSON)
            self._key, self._around = key, (head, tail)
        head, tail = self._around
        return head + _encode(text) + tail

    def error_event(self, message: str, code: str, extra: dict[str, Any]) -> bytes:
        return error_event(message, code, extra)

    def trailer(self, a: Answer) -> bytes:
        """The `sanctum` object again, as a named event after [DONE]: clients stop at
        [DONE] (OpenAI's SDK does), so it is read only by who looks for it."""
        return b"event: sanctum\n" + sse({"sanctum": a.sanctum()})

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

    def message(self, text: str, finish: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def body(self, a: Answer, text: str, finish: str | None, usage: Usage) -> bytes:
        return _encode({**self.envelope(a, [self.message(text, finish)], self.body_object),
                        "usage": usage_body(usage), "sanctum": a.sanctum()})


class ChatDoor(_OpenAIDoor):
    """POST /v1/chat/completions."""

    prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"
    body_object = "chat.completion"

    def opening(self, a: Answer) -> bytes:
        return self.chunk(a, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                               "finish_reason": None, "logprobs": None}])

    def text_choice(self, text: str) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": text}, "finish_reason": None,
                "logprobs": None}

    def finish_choice(self, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": {}, "finish_reason": finish, "logprobs": None}

    def message(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": finish, "logprobs": None}


class CompletionDoor(_OpenAIDoor):
    """POST /v1/completions."""

    prefix = "cmpl-"
    chunk_object = "text_completion"
    body_object = "text_completion"

    def opening(self, a: Answer) -> bytes:
        return b""

    def text_choice(self, text: str) -> dict[str, Any]:
        return {"index": 0, "text": text, "finish_reason": None, "logprobs": None}

    def finish_choice(self, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": "", "finish_reason": finish, "logprobs": None}

    def message(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
