"""What the ladder tells a front door, as typed events (proxyd/journey.py yields them).

    Commit(answer)                      the answer begins: headers may go (streams only)
    Text(text, tool_calls, logprobs)    committed text, in order, with the tool calls
                                        completed in it and its tokens' log-probabilities
                                        (streams only)
    Done(answer, text, finish, usage,   the answer is complete; `text`, `tool_calls` and
         tool_calls, logprobs, parts)   `logprobs` are all of it for a non-stream
                                        request, empty for a stream; `parts` its text
                                        pieces and calls in the order they came, so a
                                        body's blocks are a stream's, in its order
    Abort(message, code, seat, attempts)  a begun stream no rung could finish: it ends
                                        with a terminal error, never a short "complete"

A stream whose answering rung fails after the commit is continued by the next
allowed rung: its text follows as more `Text` events, without a seam, and
`answer.seat` names the rung sending now (each chunk names the rung that wrote
it); `answer.segments` lists every rung's part.  A stream under a constraint (tools the
model may call, or a response_format) is not continued: another rung could not be
held to the constraint across the seam, so it ends with `Abort` (proxyd/journey.py,
`constraint`).

A request that no rung answered before commit ends with a `SanctumError` raised
from the ladder instead (proxyd/conclusion.py), which the error middleware
renders.  Each front door (proxyd/doors/openai_door.py for the OpenAI formats) renders
these events in its own API's shape; none of them decides anything.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.protocol import TokenLogprob, ToolCall, Usage


class Answer(msgspec.Struct):
    """What the ladder learned about the answering attempt (mutable while it streams)."""

    request_id: str
    seat: str
    created: int
    served: int = 0
    attempts: str = ""
    speculation: str = "off"
    # A hosted rung's upstream model, as the upstream named it; the answer is named
    # after the seat (DESIGN.md rule 4), this goes in the `sanctum` object.
    upstream_model: str = ""
    # The seat's system_fingerprint: changes exactly when a seeded answer's bytes can.
    fingerprint: str = ""
    # Every rung's part of the answer, in order (one for an answer nothing interrupted).
    segments: list[dict[str, str | int]] = []
    # The prompt's tokens and those read from a cache, as the answering local seat told
    # them with its first text (0: not told before the end); the stop string that
    # ended the answer, from its final frame.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    stop_sequence: str = ""

    def sanctum(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seat": self.seat, "served": self.served,
                               "attempts": self.attempts,
                               "speculation": self.speculation,
                               "request_id": self.request_id}
        if self.upstream_model:
            out["upstream_model"] = self.upstream_model
        if self.segments:
            out["segments"] = self.segments
        return out

    @property
    def continued(self) -> bool:
        """More than one rung wrote this answer."""
        return len(self.segments) > 1

    def headers(self) -> dict[str, str]:
        return {
            "X-Sanctum-Seat": self.seat,
            "X-Sanctum-Served": str(self.served),
            "X-Sanctum-Attempts": self.attempts,
            "X-Sanctum-Speculation": self.speculation,
            "X-Request-Id": self.request_id,
        }


class Commit(msgspec.Struct, frozen=True):
    answer: Answer


class Text(msgspec.Struct, frozen=True):
    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


class Done(msgspec.Struct, frozen=True):
    answer: Answer
    text: str
    finish_reason: str | None
    usage: Usage
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    parts: tuple[str | ToolCall, ...] = ()  # (): the text, then the calls

    def in_order(self) -> tuple[str | ToolCall, ...]:
        """The answer's text pieces (never empty) and calls, in the order they came."""
        if self.parts:
            return self.parts
        return ((self.text,) if self.text else ()) + self.tool_calls


class Abort(msgspec.Struct, frozen=True):
    message: str
    code: str
    seat: str  # the rung that broke the answer
    attempts: str = ""
    segments: list[dict[str, str | int]] = []  # what each rung had sent
    # rungs that could not take the longer prompt of the continuation, with the numbers
    over_cap: list[dict[str, str | int]] = []


Event = Commit | Text | Done | Abort
