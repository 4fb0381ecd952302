"""The OpenAI Responses door (POST /v1/responses): the ladder's events as a Response
object, or as the Responses event sequence.

    door.body(done)                          the Response object (non-stream)
    door.opening(answer)                     response.created, response.in_progress
    door.text(answer, piece)                 output_text.delta events (a message item is
                                             opened at its first text), and per completed
                                             tool call a function_call item whole
    door.closing(answer, finish, usage)      the open message item's done events, then
                                             response.completed (or response.incomplete)
                                             with the whole response and its usage
    door.error_event(message, code, extra)   response.failed, then an `error` event
    door.trailer(answer)                     nothing: the segments of a continued answer
                                             are in the final response's `sanctum` object

A door decides nothing (proxyd/doors/openai_door.py says so of every door); one door renders
one request, so it keeps the stream's `sequence_number` and the items it has sent.

Shapes are OpenAI's: the response `id` is "resp_" + the request id; a message item
{"type": "message", "id": "msg_...", "status", "role": "assistant", "content":
[{"type": "output_text", "text", "annotations": [], "logprobs"}]} comes first when
the answer has text (a body with neither text nor calls has an empty one), then a
{"type": "function_call", "id": "fc_...", "call_id", "name", "arguments", "status":
"completed"} per call.  `logprobs` (asked with include message.output_text.logprobs)
are the chat door's: each token with its bytes and its alternatives, -inf as -9999,
on each delta and on the whole text part.  `model` names the seat that answered (DESIGN.md rule 4);
an answer cut by its budget is status "incomplete" with incomplete_details.reason
"max_output_tokens", as OpenAI sends it (the SDK's stream helper then has no final
response to give: `response.completed` never came).

A stream that breaks after its commit ends with `response.failed` (status "failed",
error {"code": "server_error", "message"}, and the output sent so far, its message
"incomplete") and then an `error` event, the Responses API's terminal pair.  The error
event carries its fields both flat (code, message, param: the API reference's shape)
and nested under `error` with the type, our code and the ladder's facts (seat,
attempts, segments): the live API nests them so, and the openai SDK raises APIError
on that shape, where a flat one alone would pass as one more event.  So no client
takes a broken stream for a complete answer.
"""

from __future__ import annotations

from typing import Any

import msgspec

from proxyd.doors.openai_door import KEEPALIVE, chat_logprobs
from proxyd.events import Answer, Done, Text
from shared.protocol import TokenLogprob, ToolCall, Usage

_encode = msgspec.json.encode

_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def usage_body(u: Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def status_of(finish: str | None) -> tuple[str, dict[str, str] | None]:
    """The response's status and incomplete_details for a finish reason."""
    reason = _INCOMPLETE.get(finish or "")
    return ("incomplete", {"reason": reason}) if reason else ("completed", None)


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": logprobs or []}


def message_item(item_id: str, text: str | None, status: str,
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    content = [] if text is None else [text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def call_item(item_id: str, call: ToolCall, status: str = "completed",
              arguments: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments,
            "status": status}


class _Message:
    """The message item a stream has open: its place, and its text so far."""

    def __init__(self, item_id: str, index: int) -> None:
        self.id = item_id
        self.index = index
        self.texts: list[str] = []
        self.logprobs: list[dict[str, Any]] = []  # its tokens', when the request asked
        # the delta event around its text, built once per item (the hot path)
        self.head = (b"event: response.output_text.delta\ndata: "
                     + _encode({"type": "response.output_text.delta", "item_id": item_id,
                                "output_index": index, "content_index": 0,
                                "logprobs": []})[:-1] + b',"delta":')

    @property
    def text(self) -> str:
        return "".join(self.texts)


class ResponsesDoor:
    """POST /v1/responses.  `echo`: the request's settings as the Response object
    repeats them (tools, tool_choice, temperature, ...: openai_responses_api.echo)."""

    name = "responses"

    def __init__(self, stream: bool, echo: dict[str, Any], logprobs: bool = False) -> None:
        self.stream = stream
        self.echo = echo
        self.logprobs = logprobs  # the request asked for them (include)
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # sent whole, in output order
        self.open: _Message | None = None
        self.messages = 0
        self.answer: Answer | None = None  # the stream's, from its opening

    # -- the envelope ------------------------------------------------------

    def response(self, a: Answer, status: str, output: list[dict[str, Any]],
                 **extra: Any) -> dict[str, Any]:
        return {"id": "resp_" + a.request_id, "object": "response",
                "created_at": a.created, "status": status, "error": None,
                "incomplete_details": None, "model": a.seat, "output": output,
                "usage": None, **self.echo,
                "system_fingerprint": a.fingerprint or None, **extra}

    def event(self, kind: str, **fields: Any) -> bytes:
        data = _encode({"type": kind, **fields, "sequence_number": self.seq})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def message_id(self, a: Answer) -> str:
        self.messages += 1
        suffix = "" if self.messages == 1 else f"_{self.messages}"
        return f"msg_{a.request_id}{suffix}"

    # -- non-stream --------------------------------------------------------

    def body(self, done: Done) -> bytes:
        a = done.answer
        status, incomplete = status_of(done.finish_reason)
        output: list[dict[str, Any]] = []
        parts = done.in_order() or ("",)  # an empty answer is one empty message
        lps = list(done.logprobs)
        for part in parts:  # the stream's items, in its order
            if not isinstance(part, str):
                output.append(call_item(f"fc_{a.request_id}_{part.index}", part))
                continue
            mine, used = [], 0  # this message's tokens: as many as its text holds
            while lps and used < len(part):
                used += len(lps[0].token)
                mine.append(lps.pop(0))
            output.append(message_item(self.message_id(a), part, status,
                                       chat_logprobs(mine) if self.logprobs else None))
        return _encode(self.response(a, status, output, incomplete_details=incomplete,
                                     usage=usage_body(done.usage), sanctum=a.sanctum()))

    # -- stream ------------------------------------------------------------

    def opening(self, a: Answer) -> bytes:
        self.answer = a
        created = self.response(a, "in_progress", [])
        return (self.event("response.created", response=created)
                + self.event("response.in_progress", response=created))

    def _open(self, a: Answer) -> tuple[_Message, bytes]:
        m = _Message(self.message_id(a), len(self.items))
        self.open = m
        return m, (self.event("response.output_item.added", output_index=m.index,
                              item=message_item(m.id, None, "in_progress"))
                   + self.event("response.content_part.added", item_id=m.id,
                                output_index=m.index, content_index=0, part=text_part("")))

    def _close(self, status: str) -> bytes:
        m = self.open
        if m is None:
            return b""
        self.open = None
        text = m.text
        item = message_item(m.id, text, status, m.logprobs)
        self.items.append(item)
        at = {"item_id": m.id, "output_index": m.index, "content_index": 0}
        return (self.event("response.output_text.done", **at, text=text,
                           logprobs=m.logprobs)
                + self.event("response.content_part.done", **at,
                             part=text_part(text, m.logprobs))
                + self.event("response.output_item.done", output_index=m.index, item=item))

    def text(self, a: Answer, piece: Text) -> bytes:
        out = b""
        if piece.text:
            m = self.open
            if m is None:
                m, out = self._open(a)
            m.texts.append(piece.text)
            if self.logprobs and piece.logprobs:
                out += self._rich(m, piece.text, piece.logprobs)
            else:
                out += (m.head + _encode(piece.text) + b',"sequence_number":'
                        + str(self.seq).encode() + b"}\n\n")
                self.seq += 1
        for call in piece.tool_calls:
            out += self._close("completed") + self._call(a, call)
        return out

    def _rich(self, m: _Message, text: str, tokens: tuple[TokenLogprob, ...]) -> bytes:
        """A delta with its tokens' log-probabilities (kept for the done events too)."""
        lps = chat_logprobs(tokens)
        m.logprobs += lps
        return self.event("response.output_text.delta", item_id=m.id,
                          output_index=m.index, content_index=0, logprobs=lps, delta=text)

    def _call(self, a: Answer, call: ToolCall) -> bytes:
        index = len(self.items)
        item_id = f"fc_{a.request_id}_{call.index}"
        item = call_item(item_id, call)
        self.items.append(item)
        at = {"item_id": item_id, "output_index": index}
        return (self.event("response.output_item.added", output_index=index,
                           item=call_item(item_id, call, "in_progress", ""))
                + self.event("response.function_call_arguments.delta", **at,
                             delta=call.arguments)
                + self.event("response.function_call_arguments.done", **at,
                             arguments=call.arguments)
                + self.event("response.output_item.done", output_index=index, item=item))

    def closing(self, a: Answer, finish: str | None, usage: Usage) -> bytes:
        status, incomplete = status_of(finish)
        out = b""
        if self.open is None and not self.items:  # an empty answer: an empty message
            _, out = self._open(a)
        out += self._close(status)
        final = self.response(a, status, self.items, incomplete_details=incomplete,
                              usage=usage_body(usage), sanctum=a.sanctum())
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self.event(kind, response=final)

    def error_event(self, message: str, code: str, extra: dict[str, Any]) -> bytes:
        """response.failed with the output sent so far, then the `error` event."""
        output = list(self.items)
        if self.open is not None:
            output.insert(self.open.index, message_item(self.open.id, self.open.text,
                                                        "incomplete", self.open.logprobs))
        error = {"code": "server_error", "message": message}
        a = self.answer or Answer(str(extra.get("request_id", "")), str(extra.get("seat", "")),
                                  0)
        failed = self.response(a, "failed", output, error=error)
        nested = {"message": message, "type": "server_error", "code": code, "param": None,
                  **extra}
        return (self.event("response.failed", response=failed)
                + self.event("error", code=code, message=message, param=None,
                             error=nested))

    def trailer(self, a: Answer) -> bytes:
        return b""

    def keepalive(self) -> bytes:
        """An SSE comment: no event, so no sequence_number is spent on it."""
        return KEEPALIVE
