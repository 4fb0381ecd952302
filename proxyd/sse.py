"""Reading an OpenAI-compatible SSE stream: lines to events, events to pieces.

    Decoder.line(text) -> Event | None      one line in; an event when a blank line ends it
    Decoder.end() -> Event | None           what was pending when the stream closed
    piece(event, chat) -> Piece             raises Malformed for anything not a valid event

Pure: no I/O, no clocks.  The network shell (proxyd/hosted.py) feeds it lines
and decides what a piece means for the stream's outcome.  An event whose data
is not JSON, or JSON of the wrong shape, is `Malformed`: a broken upstream, and
never skipped, because a skipped event could be the text the client needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from shared.protocol import Usage


class Malformed(ValueError):
    """An SSE event that is not a valid completion chunk."""


@dataclass(frozen=True)
class Event:
    data: str
    name: str = "message"  # the SSE `event:` field


@dataclass(frozen=True)
class Piece:
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    model: str | None = None
    done: bool = False  # data: [DONE]
    error: dict[str, Any] | None = None  # the upstream reported an error in the stream
    fingerprint: str | None = None  # the upstream's system_fingerprint


class Decoder:
    """The SSE line protocol: `data:` lines gather until a blank line ends the event."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._name = "message"

    def line(self, text: str) -> Event | None:
        text = text.rstrip("\r\n")
        if not text:
            return self._dispatch()
        if text.startswith(":"):
            return None  # a comment, used as keep-alive
        field, _, value = text.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._name = value
        return None

    def end(self) -> Event | None:
        return self._dispatch()

    def _dispatch(self) -> Event | None:
        if not self._data:
            self._name = "message"
            return None
        event = Event("\n".join(self._data), self._name)
        self._data, self._name = [], "message"
        return event


def piece(event: Event, chat: bool) -> Piece:
    """What one event says: text, a finish reason, usage, the end, or an upstream error."""
    data = event.data.strip()
    if data == "[DONE]":
        return Piece(done=True)
    try:
        body = msgspec.json.decode(data)  # 3x json.loads on a chunk
    except msgspec.DecodeError:
        try:  # Python's json also reads NaN and -Infinity (a logprob some servers send)
            body = json.loads(data)
        except ValueError as exc:
            raise Malformed(f"event is not JSON: {data[:80]!r}") from exc
    if not isinstance(body, dict):
        raise Malformed(f"event is not a JSON object: {data[:80]!r}")
    if event.name == "error" or "error" in body:
        err = body.get("error", body)
        return Piece(error=err if isinstance(err, dict) else {"message": str(err)})
    model = body.get("model")
    usage = _usage(body.get("usage"))
    choices = body.get("choices") or []
    if not isinstance(choices, list):
        raise Malformed("`choices` is not a list")
    text: list[str] = []
    finish: str | None = None
    for choice in choices:
        if not isinstance(choice, dict):
            raise Malformed("a choice is not an object")
        if chat:
            delta = choice.get("delta") or choice.get("message") or {}
            if not isinstance(delta, dict):
                raise Malformed("`delta` is not an object")
            got = delta.get("content")
        else:
            got = choice.get("text")
        if got is not None and not isinstance(got, str):
            raise Malformed("content is not a string")
        if got:
            text.append(got)
        if choice.get("finish_reason"):
            finish = str(choice["finish_reason"])
    fingerprint = body.get("system_fingerprint")
    return Piece("".join(text), finish, usage, model if isinstance(model, str) else None,
                 fingerprint=fingerprint if isinstance(fingerprint, str) else None)


def _usage(raw: Any) -> Usage | None:
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise Malformed("`usage` is not an object")
    try:
        details = raw.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
        return Usage(int(raw.get("prompt_tokens") or 0), int(raw.get("completion_tokens") or 0),
                     cached)
    except (TypeError, ValueError) as exc:
        raise Malformed(f"bad usage: {raw!r:.80}") from exc
