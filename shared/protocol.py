"""Every message that crosses a process boundary.

Frames are msgspec tagged Structs encoded as msgpack; nothing is pickled.  New
fields get defaults and go last, so an older peer still decodes a newer frame.

Directions:

    proxyd / seatd  --Request-->  seat worker (ZeroMQ ROUTER on the worker)
    seat worker     --Reply---->  proxyd / seatd
    sanctum CLI     --Control-->  seatd control socket  --ControlReply-->

A frame that does not decode is answered with `BadFrame` and counted by the
receiver; it is never fatal to it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

# ---------------------------------------------------------------------------
# Pieces shared by several messages


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str
    name: str | None = None


class SamplingParams(msgspec.Struct, frozen=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


# Outcomes of one seat attempt (DESIGN.md, "Outcomes").  `skipped` is decided by
# the proxy alone and never travels on the wire, so it lives in the ladder.


class Ok(msgspec.Struct, frozen=True, tag="ok"):
    pass


class Rejected(msgspec.Struct, frozen=True, tag="rejected"):
    """A deterministic client error: another rung cannot fix it."""

    status: int
    code: str
    message: str
    extra: dict[str, int | str] = {}


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    """A real failure of the seat: the ladder may try the next rung."""

    reason: str
    message: str = ""


class Cancelled(msgspec.Struct, frozen=True, tag="cancelled"):
    pass


Outcome = Ok | Rejected | Failed | Cancelled


# ---------------------------------------------------------------------------
# Requests to a seat worker


class Generate(msgspec.Struct, frozen=True, tag="generate"):
    request_id: str
    stream: bool
    params: SamplingParams
    messages: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    kv: str | None = None
    speculation: bool | None = None
    # The request's tools as JSON, rendered by the chat template like the messages.
    tools_json: str | None = None
    # False: this request neither reuses nor leaves a cached prompt prefix.
    prompt_cache: bool | None = None
    # Pins this request's draft length (0..16), for measuring; None: the seat's rule.
    draft_depth: int | None = None
    # True: a row of its own, never in a forward with other requests (seatd/batch.py).
    solo: bool | None = None
    # A continued answer (another rung began it and failed mid-stream): the text the
    # client already has, which this rung's answer starts with and must not send again.
    # A local seat puts its tokens after the prompt and samples from the answer
    # position after them; a hosted rung gets it as an assistant prefill (chat) or the
    # prompt's tail (completions).
    prefix: str | None = None
    # The prefix's tokens as the seat that produced them sent them (only from a seat
    # with the same tokenizer); None: the seat encodes `prefix` itself.
    prefix_ids: tuple[int, ...] | None = None


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    request_id: str


class Ping(msgspec.Struct, frozen=True, tag="ping"):
    sent_at: float = 0.0


class GetCounters(msgspec.Struct, frozen=True, tag="get_counters"):
    pass


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    """Stop taking work, finish what is in flight (up to `drain_s`), then exit."""

    drain_s: float = 10.0


Request = Generate | Cancel | Ping | GetCounters | Shutdown


# ---------------------------------------------------------------------------
# Replies from a seat worker


class Pong(msgspec.Struct, frozen=True, tag="pong"):
    seat: str
    pid: int
    incarnation: int
    ready: bool
    busy: bool = False
    sent_at: float = 0.0
    max_prompt_tokens: int = 0
    context_length: int = 0
    tokenizer_hash: str = ""
    in_flight: tuple[str, ...] = ()
    tokens_generated: int = 0
    queued: int = 0  # requests waiting for a row in the batch
    rows: int = 0  # requests decoding (or prefilling) as rows of the batch
    max_batch: int = 0
    kv_bytes: int = 0  # KV of the rows in flight, in bytes


class Chunk(msgspec.Struct, frozen=True, tag="chunk"):
    """Committed text, never retracted.  Sent for sync requests too: the proxy
    watches them for progress and joins them for a sync answer."""

    request_id: str
    text: str
    completion_tokens: int
    # The seat's `served` counter after this request if it completes and the rows that
    # started before it finish first (the final frame carries the exact count).
    served_if_ok: int = 0
    # Speculation's state when this text was committed, so that the header sent
    # at the commit point can say it; the Final frame carries the final state.
    speculation: str = ""
    # The seat's system_fingerprint for this request's lane (`seatd.fingerprint`).
    fingerprint: str = ""
    # The answer tokens taken since the previous chunk (some of their text may still be
    # held back), so that another seat with the same tokenizer can continue the answer
    # from exactly these tokens.  Empty from a hosted rung.
    ids: tuple[int, ...] = ()


class Final(msgspec.Struct, frozen=True, tag="final"):
    """The last frame of a request: its outcome, and the seat's own `served`."""

    request_id: str
    outcome: Outcome
    seat: str
    served: int
    incarnation: int
    finish_reason: str | None = None
    usage: Usage = Usage()
    speculation: str = "off"
    ttft_s: float = 0.0
    # The model the answer came from as its source names it (a hosted rung's
    # upstream model); empty for a local seat, whose name says it all.
    model: str = ""
    # What can change a seeded answer's bytes (`seatd.fingerprint`); a hosted rung
    # passes on its upstream's, or leaves it empty.
    fingerprint: str = ""


class Started(msgspec.Struct, frozen=True, tag="started"):
    """The seat took the request off its queue and begins it: the first-token clock
    starts here, so time spent waiting behind other requests is never a timeout of
    the seat (it is bounded by the seat's `queue_timeout_s` instead)."""

    request_id: str


class CountersReply(msgspec.Struct, frozen=True, tag="counters"):
    seat: str
    counters: dict[str, object]


class BadFrame(msgspec.Struct, frozen=True, tag="bad_frame"):
    error: str


Reply = Pong | Started | Chunk | Final | CountersReply | BadFrame

# What one attempt on a local seat yields to the ladder (proxyd/seat_client.py).
SeatFrame = Started | Chunk | Final


# ---------------------------------------------------------------------------
# Frames of a hosted rung (proxyd/hosted.py): they never leave the proxy, but the
# ladder reads them beside a local seat's, so they live with them.


class Retry(msgspec.Struct, frozen=True, tag="retry"):
    """A failed try of a hosted rung that will be tried again after `delay_s`.

    Not the rung's outcome (its `Final` still comes); the ladder lists it in
    `X-Sanctum-Attempts` and counts it as a failed attempt, never as served.
    """

    request_id: str
    outcome: Failed
    delay_s: float


class TryEnd(msgspec.Struct, frozen=True, tag="try_end"):
    """How one try of a hosted rung ended; the rung decides whether to try again."""

    outcome: Outcome
    retry_after_s: float | None = None
    finish_reason: str | None = None
    usage: Usage = Usage()
    model: str = ""
    fingerprint: str = ""  # the upstream's system_fingerprint, passed on


# What any rung's attempt yields to the ladder: a local seat's frames once started,
# or a hosted rung's (with its retries).
RungFrame = Chunk | Retry | Final


# ---------------------------------------------------------------------------
# seatd's control socket


class StatusQuery(msgspec.Struct, frozen=True, tag="status"):
    pass


class RestartSeat(msgspec.Struct, frozen=True, tag="restart"):
    seat: str


Control = StatusQuery | RestartSeat | GetCounters


class SeatStatus(msgspec.Struct, frozen=True):
    name: str
    state: str
    pid: int | None
    rss_bytes: int | None
    uptime_s: float | None
    restarts: int
    incarnation: int
    last_exit: str | None


class StatusReply(msgspec.Struct, frozen=True, tag="status_reply"):
    seats: tuple[SeatStatus, ...]


class ControlError(msgspec.Struct, frozen=True, tag="control_error"):
    error: str


class ControlOk(msgspec.Struct, frozen=True, tag="control_ok"):
    message: str


class SeatCounters(msgspec.Struct, frozen=True, tag="seat_counters"):
    seats: dict[str, dict[str, object]]


ControlReply = StatusReply | ControlError | ControlOk | SeatCounters


# ---------------------------------------------------------------------------
# Codecs.  One encoder is enough; decoders are typed per direction.

_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
control_decoder = msgspec.msgpack.Decoder(Control)
control_reply_decoder = msgspec.msgpack.Decoder(ControlReply)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


SpeculationState = Literal["accelerated", "off"] | str
