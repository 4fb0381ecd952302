"""The Anthropic Messages door: the ladder's events as Anthropic's JSON and SSE.

    door.opening(answer)                    message_start (usage not known yet: 0), ping
    door.text(answer, piece)                content blocks: a text block opened on the
                                            first text and fed text_delta events; each
                                            tool call a tool_use block of its own, its
                                            input in one input_json_delta
    door.closing(answer, finish, usage)     the open block's content_block_stop,
                                            message_delta (stop_reason, usage with
                                            input_tokens, the `sanctum` object), message_stop
    door.body(done)                         the whole non-stream Message
    door.error_event(message, code, extra)  `event: error` with Anthropic's error object
    door.trailer(answer)                    after message_stop of a continued stream:
                                            `event: sanctum` listing every segment
    error_body(exc)                         a refusal in Anthropic's error shape

Every event carries its `event:` line (Anthropic's SDK skips data without one).  The
message's `model` is the seat that answered (DESIGN.md rule 4), its id `msg_` and the
request id, a tool call's id `toolu_` and the call's own (`call_` dropped).

stop_reason: `length` is max_tokens, a call made (or finish `tool_calls`) is tool_use,
`content_filter` (a hosted rung's) is refusal, a stop string that ended the answer (a
local seat's final frame names it) is stop_sequence with `stop_sequence` set to it,
anything else end_turn.

The stream's usage: message_start has the prompt's input_tokens and
cache_read_input_tokens as the answering local seat told them with its first text
(a hosted rung's are known only at the end: 0 there); message_delta carries
input_tokens (the prompt's tokens less those read from the prompt cache),
output_tokens and cache_read_input_tokens, which Anthropic's SDK takes as the totals.
The SDK reads every event to the end of the stream and passes by one it does not know,
so the trailer reaches who looks for it; its data names its `type` as Anthropic's do.
"""

from __future__ import annotations

from typing import Any

import msgspec

from proxyd.events import Answer, Done, Text
from shared.errors import CONTEXT_LENGTH, SanctumError
from shared.protocol import ToolCall, Usage

_encode = msgspec.json.encode
_decode = msgspec.json.decode
PING = b'event: ping\ndata: {"type": "ping"}\n\n'
STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'

# Anthropic's error types by HTTP status (its documented table); our status stays ours.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               504: "timeout_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error type for a status: other 4xx are invalid_request_error (as
    Anthropic documents), other 5xx api_error."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


PROMPT_TOO_LONG = CONTEXT_LENGTH  # over a cap: the 413 with its numbers


def error_body(exc: SanctumError) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message", "code", "param", ...extras}}: the
    extras (prompt_tokens, cap, seat, attempts ...) as in the OpenAI shape."""
    error = dict(exc.body()["error"])
    error["type"] = error_type(exc.status)
    if exc.code == PROMPT_TOO_LONG and "prompt_tokens" in error and "cap" in error:
        # Anthropic's own words first: Claude Code reads "prompt is too long" as a
        # context past the model's, and offers to compact the conversation.
        error["message"] = (f"prompt is too long: {error['prompt_tokens']} tokens > "
                            f"{error['cap']} maximum ({error['message']})")
    return {"type": "error", "error": error}


def event(name: str, body: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encode(body) + b"\n\n"


def error_event(message: str, code: str, extra: dict[str, Any]) -> bytes:
    """A terminal error event: the stream ends here, with no message_stop (the SDK
    raises it)."""
    return event("error", {"type": "error", "error": {
        "type": "api_error", "message": message, "code": code, **extra}})


def stop_reason(finish: str | None, called: bool, stop_sequence: str = "") -> str:
    if finish == "length":
        return "max_tokens"
    if called or finish == "tool_calls":
        return "tool_use"
    if finish == "content_filter":
        return "refusal"
    if finish == "stop" and stop_sequence:
        return "stop_sequence"
    return "end_turn"


def tool_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is: no arguments are {}; text
    that is no JSON object (a hosted rung's model may write any) is kept under
    "arguments", never lost."""
    if not arguments.strip():
        return {}
    try:
        value = _decode(arguments)
    except (msgspec.DecodeError, RecursionError):
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def usage_body(u: Usage) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are the prompt's tokens not read from the cache,
    so that input_tokens + cache_read_input_tokens is the whole prompt, as Anthropic
    defines them (clients add the two to know a conversation's size)."""
    return {"input_tokens": u.prompt_tokens - u.cached_tokens,
            "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens}


class MessagesDoor:
    """POST /v1/messages."""

    name = "messages"

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self._blocks = 0  # content blocks begun so far; the open one is the last
        self._open = False  # a block is begun and not stopped
        self._text_open = False  # ... and it is a text block
        self._called = False
        self._around = (b"", b"")  # a text_delta of the open block, around its text

    def id(self, a: Answer) -> str:
        return "msg_" + a.request_id

    def message(self, a: Answer, content: list[dict[str, Any]], stop: str | None,
                usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id(a), "type": "message", "role": "assistant", "model": a.seat,
                "content": content, "stop_reason": stop,
                "stop_sequence": (a.stop_sequence or None) if stop == "stop_sequence" else None,
                "usage": usage}

    def opening(self, a: Answer) -> bytes:
        start = self.message(a, [], None, {"input_tokens": a.prompt_tokens - a.cached_tokens,
                                           "output_tokens": 0,
                                           "cache_read_input_tokens": a.cached_tokens})
        return event("message_start", {"type": "message_start", "message": start}) + PING

    def _stop(self) -> bytes:
        if not self._open:
            return b""
        self._open = self._text_open = False
        return event("content_block_stop", {"type": "content_block_stop",
                                            "index": self._blocks - 1})

    def _begin(self, block: dict[str, Any]) -> bytes:
        out = self._stop() + event("content_block_start", {
            "type": "content_block_start", "index": self._blocks, "content_block": block})
        self._blocks += 1
        self._open = True
        return out

    def _text(self, text: str) -> bytes:
        """A text_delta: the hot path, one string encode between a head and a tail
        built when the block began."""
        out = b""
        if not self._text_open:
            out = self._begin({"type": "text", "text": ""})
            self._text_open = True
            whole = event("content_block_delta", {
                "type": "content_block_delta", "index": self._blocks - 1,
                "delta": {"type": "text_delta", "text": ""}})
            cut = whole.rindex(b'""')
            self._around = (whole[:cut], whole[cut + 2:])
        head, tail = self._around
        return out + head + _encode(text) + tail

    def text(self, a: Answer, piece: Text) -> bytes:
        out = self._text(piece.text) if piece.text else b""
        for call in piece.tool_calls:
            self._called = True
            out += self._begin({"type": "tool_use", "id": tool_id(call), "name": call.name,
                                "input": {}})
            out += event("content_block_delta", {
                "type": "content_block_delta", "index": self._blocks - 1,
                "delta": {"type": "input_json_delta",
                          "partial_json": _encode(tool_input(call.arguments)).decode()}})
            out += self._stop()
        return out

    def closing(self, a: Answer, finish: str | None, usage: Usage) -> bytes:
        """The open block's stop, message_delta (with the `sanctum` object), message_stop."""
        delta = {"type": "message_delta",
                 "delta": {"stop_reason": (stop := stop_reason(finish, self._called,
                                                               a.stop_sequence)),
                           "stop_sequence": (a.stop_sequence or None)
                           if stop == "stop_sequence" else None},
                 "usage": usage_body(usage), "sanctum": a.sanctum()}
        return self._stop() + event("message_delta", delta) + STOP

    def body(self, done: Done) -> bytes:
        content: list[dict[str, Any]] = [
            {"type": "text", "text": part} if isinstance(part, str) else
            {"type": "tool_use", "id": tool_id(part), "name": part.name,
             "input": tool_input(part.arguments)}
            for part in done.in_order()]  # the stream's blocks, in its order
        a = done.answer
        message = self.message(a, content, stop_reason(done.finish_reason,
                                                       bool(done.tool_calls),
                                                       a.stop_sequence),
                               usage_body(done.usage))
        return _encode({**message, "sanctum": a.sanctum()})

    def error_event(self, message: str, code: str, extra: dict[str, Any]) -> bytes:
        return error_event(message, code, extra)

    def trailer(self, a: Answer) -> bytes:
        """The `sanctum` object again, after message_stop, for who reads on."""
        return event("sanctum", {"type": "sanctum", "sanctum": a.sanctum()})

    def keepalive(self) -> bytes:
        """Anthropic's own keep-alive, which its SDK passes over."""
        return PING
