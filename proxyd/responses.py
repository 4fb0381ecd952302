"""OpenAI response bodies and SSE chunks, for chat and text completions."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["chat", "completion"]


@dataclass
class Answer:
    """What the ladder learned about the answering attempt."""

    request_id: str
    kind: Kind
    seat: str
    created: int
    served: int = 0
    attempts: str = ""
    speculation: str = "off"
    # A hosted rung's upstream model, as the upstream named it; `model` stays the
    # seat's name (DESIGN.md rule 4), this goes in the `sanctum` object.
    upstream_model: str = ""
    # The seat's system_fingerprint: changes exactly when a seeded answer's bytes can.
    fingerprint: str = ""

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id

    def sanctum(self) -> dict[str, Any]:
        out = {"seat": self.seat, "served": self.served, "attempts": self.attempts,
               "speculation": self.speculation, "request_id": self.request_id}
        if self.upstream_model:
            out["upstream_model"] = self.upstream_model
        return out

    def headers(self) -> dict[str, str]:
        return {
            "X-Sanctum-Seat": self.seat,
            "X-Sanctum-Served": str(self.served),
            "X-Sanctum-Attempts": self.attempts,
            "X-Sanctum-Speculation": self.speculation,
            "X-Request-Id": self.request_id,
        }


def usage_body(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def full_body(a: Answer, text: str, finish: str | None, usage: dict[str, Any]) -> dict[str, Any]:
    if a.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": finish, "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": a.id, "object": obj, "created": a.created, "model": a.seat,
            "system_fingerprint": a.fingerprint or None, "choices": [choice], "usage": usage,
            "sanctum": a.sanctum()}


def _chunk(a: Answer, choices: list[dict[str, Any]], **extra: Any) -> bytes:
    obj = "chat.completion.chunk" if a.kind == "chat" else "text_completion"
    body = {"id": a.id, "object": obj, "created": a.created, "model": a.seat,
            "system_fingerprint": a.fingerprint or None, "choices": choices}
    body.update(extra)
    return sse(body)


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def first_chunk(a: Answer) -> bytes:
    if a.kind == "chat":
        return _chunk(a, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                           "finish_reason": None, "logprobs": None}])
    return b""


def text_chunk(a: Answer, text: str) -> bytes:
    if a.kind == "chat":
        return _chunk(a, [{"index": 0, "delta": {"content": text}, "finish_reason": None,
                           "logprobs": None}])
    return _chunk(a, [{"index": 0, "text": text, "finish_reason": None, "logprobs": None}])


def last_chunks(a: Answer, finish: str | None, usage: dict[str, Any] | None) -> bytes:
    """The finish chunk, the usage chunk when asked, and [DONE].  The last data
    chunk carries the `sanctum` object."""
    if a.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": finish,
                                  "logprobs": None}
    else:
        choice = {"index": 0, "text": "", "finish_reason": finish, "logprobs": None}
    if usage is None:
        return _chunk(a, [choice], sanctum=a.sanctum()) + DONE
    return _chunk(a, [choice]) + _chunk(a, [], usage=usage, sanctum=a.sanctum()) + DONE


def error_event(message: str, code: str, **extra: Any) -> bytes:
    """A terminal SSE error event: the stream ends here, with no [DONE]."""
    error = {"message": message, "type": "server_error", "code": code}
    error.update(extra)
    return b"event: error\n" + sse({"error": error})
