"""Every message that crosses a process boundary.

Frames are msgspec tagged Structs encoded as msgpack; nothing is pickled.  New
fields get defaults and go last, so an older peer still decodes a newer frame.

Directions:

    proxyd / seatd  --Request-->  seat worker (ZeroMQ ROUTER on the worker)
    seat worker     --Reply---->  proxyd / seatd
    sanctum CLI     --Control-->  seatd control socket  --ControlReply-->

A frame that does not decode is answered with `BadFrame` and counted by the
receiver; it is never fatal to it.  What every receiver does with a bad frame is
decided once, by the pure readers at the end of this module (`read_request`,
`read_control`), which never raise:

    bad input                                  reason          answer
    ---------------------------------------    -------------   -----------------------
    not [identity, payload] on a seat socket   wrong_parts     BadFrame
      (not [identity, "", payload] on seatd's)                 ControlError
    empty payload, truncated or invalid        undecodable     BadFrame / ControlError
      msgpack, not a map, no tag, unknown tag
    `version` other than PROTOCOL_VERSION      wrong_version   BadFrame / ControlError
    a known tag with a field of the wrong      invalid_value   Final(Rejected 400
      type or out of its bounds (below)                          invalid_value) for a
                                                               Generate whose id reads,
                                                               else BadFrame /
                                                               ControlError
    a frame over the socket's MAXMSGSIZE       (none: ZeroMQ   the sender's connection
      (`max_frame_bytes`)                       drops it)        is dropped

A `BadFrame` names its `reason`, and the request it was about when its id reads, so
that a peer ends that request at once instead of waiting for its clock.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

# ---------------------------------------------------------------------------
# Versions and bounds: what a receiver accepts, in one place.

# The frames that begin a conversation (Ping, Generate) say which protocol they speak;
# a frame without `version` is from a peer older than versions: version 1.  A change
# an older peer cannot decode raises it.
PROTOCOL_VERSION = 1

# Bounds on the values that would break a seat later (a negative budget, a sort of
# NaNs, an embedding row that does not exist, a stop scan that costs seconds a token).
# The proxy checks client input against its own, stricter limits (proxyd/doors/openai_api.py,
# the config's max_* keys) first, so a frame from it never meets these: a value past
# them is a peer's bug, answered with Rejected(400, "invalid_value") naming the field.
INT64_MAX = 2**63 - 1
MAX_REQUEST_ID_CHARS = 128  # the proxy's ids are at most 64 (X-Request-Id) or 32 (uuid4)
MAX_TEMPERATURE = 100.0  # any finite one samples; past 100 every answer is noise anyway
MAX_NEW_TOKENS = 2**31 - 1  # MLX counts positions in int32; config max_completion_tokens
MAX_STOPS = 64  # config max_stop (16 by default) must stay within these two
MAX_STOP_CHARS = 1024  # config max_stop_chars (256 by default)
MAX_DRAFT_DEPTH = 16  # as config's seat draft_depth and the request's sanctum.draft_depth
MAX_TOKEN_ID = 2**31 - 1  # the seat also holds ids to its own vocabulary
MAX_REPETITION_PENALTY = 10.0
MAX_TOP_LOGPROBS = 20  # OpenAI's bound of top_logprobs
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI's own limit is lower: 300)
MAX_TOOL_NAME_CHARS = 64  # OpenAI's bound of a function name

RequestId = Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID_CHARS)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TEMPERATURE)]  # NaN fails both
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]  # 0: off; past the vocabulary: off
MaxNewTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS)]
Seed = int  # any: msgpack carries -2**63 .. 2**64-1, and the seat masks it to 64 bits
StopText = Annotated[str, msgspec.Meta(max_length=MAX_STOP_CHARS)]
Stops = Annotated[tuple[StopText, ...], msgspec.Meta(max_length=MAX_STOPS)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
DraftDepth = Annotated[int, msgspec.Meta(ge=0, le=MAX_DRAFT_DEPTH)]
KVLane = Literal["fp16", "q8"]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]  # presence, frequency (OpenAI's range)
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_REPETITION_PENALTY)]
Bias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]
ToolChoice = Annotated[str, msgspec.Meta(max_length=MAX_TOOL_NAME_CHARS + 9)]

# The largest frame a seat's socket takes (ZMQ_MAXMSGSIZE); a larger one drops its
# sender's connection before a byte of it is buffered for decoding.  A Generate holds
# the client's body decoded (its text is never longer than the JSON that carried it;
# msgpack's per-field overhead can be larger than JSON's, so twice the body covers it)
# and, for a continued answer, the text and ids already sent: at most
# max_completion_tokens tokens of at most TOKEN_TEXT_BYTES each (no tokenizer we know
# has tokens near that) and ID_BYTES each as msgpack ints.  The default config's
# limits (8 MiB body, 65,536 tokens) give 34.4 MB.
TOKEN_TEXT_BYTES = 256
ID_BYTES = 9
FRAME_HEADROOM_BYTES = 1 << 20
# seatd's control socket takes only small frames (a status query, a seat's name).
CONTROL_MAX_FRAME_BYTES = 64 * 1024


def max_frame_bytes(max_body_bytes: int, max_completion_tokens: int) -> int:
    """The bound of a seat's request frames, for the proxy's body and answer limits."""
    answer = max_completion_tokens * (TOKEN_TEXT_BYTES + ID_BYTES)
    return 2 * max_body_bytes + answer + FRAME_HEADROOM_BYTES

# ---------------------------------------------------------------------------
# Pieces shared by several messages


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str
    name: str | None = None
    # An assistant turn's calls, as the OpenAI JSON list of {"id", "type", "function":
    # {"name", "arguments"}}; rendered by the chat template (shared/prompt.py).
    tool_calls_json: str | None = None
    tool_call_id: str | None = None  # a `tool` message: the call it answers


class ToolCall(msgspec.Struct, frozen=True):
    """One tool call of an answer, parsed from the model's own tool-call syntax."""

    index: int
    id: str
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One answer token's log-probability under the target's distribution, with the
    `top` most likely alternatives at that position (SamplingParams.logprobs)."""

    token: str
    logprob: float
    bytes: tuple[int, ...] = ()
    top: tuple[tuple[str, float], ...] = ()


class SamplingParams(msgspec.Struct, frozen=True):
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    max_tokens: MaxNewTokens = 256
    stop: Stops = ()
    seed: Seed | None = None
    # Shaping of the logits before the draw (seatd/shaping.py): the same in the plain
    # step, the verifier and a drafter's proposal, so speculation stays exact.
    presence_penalty: Penalty = 0.0  # minus this for each token already in the answer
    frequency_penalty: Penalty = 0.0  # minus this times the token's count in the answer
    repetition_penalty: RepetitionPenalty = 1.0  # over prompt and answer tokens (>1 lowers)
    logit_bias: Annotated[tuple[tuple[TokenId, Bias], ...],
                          msgspec.Meta(max_length=MAX_LOGIT_BIAS)] = ()
    min_p: MinP = 0.0  # drop tokens below min_p times the best token's probability
    # None: no log-probabilities; n: each answer token's, with its n best alternatives
    logprobs: TopLogprobs | None = None


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
    request_id: RequestId
    stream: bool
    params: SamplingParams
    messages: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    kv: KVLane | None = None
    speculation: bool | None = None
    # The request's tools as JSON, rendered by the chat template like the messages.
    tools_json: str | None = None
    # False: this request neither reuses nor leaves a cached prompt prefix.
    prompt_cache: bool | None = None
    # Pins this request's draft length (0..16), for measuring; None: the seat's rule.
    draft_depth: DraftDepth | None = None
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
    prefix_ids: tuple[TokenId, ...] | None = None
    # Structured output: the request's response_format as JSON ({"type": "json_object"}
    # or {"type": "json_schema", "json_schema": {...}}); None: free text.
    response_format: str | None = None
    # "none" | "auto" | "required" | "function:NAME"; None: auto when tools are given.
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    version: int = 1  # the sender's PROTOCOL_VERSION; absent: a peer older than versions
    # A completion's prompt given as token ids (the OpenAI API takes them): used as they
    # are, no template and no special token added; `prompt` is then empty.
    prompt_ids: tuple[TokenId, ...] | None = None
    # An on-demand seat's idle seconds before it sleeps after this request (the proxy's
    # to keep: proxyd/on_demand.py; the seat ignores it); None: the seat's keep_alive_s.
    keep_alive_s: float | None = None


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    request_id: RequestId


class Ping(msgspec.Struct, frozen=True, tag="ping"):
    sent_at: float = 0.0
    version: int = 1  # as Generate.version


class GetCounters(msgspec.Struct, frozen=True, tag="get_counters"):
    pass


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    """Stop taking work, finish what is in flight (up to `drain_s`), then exit."""

    drain_s: Annotated[float, msgspec.Meta(ge=0.0)] = 10.0  # inf: until all is done


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
    # The seat's memory (`seatd.memory`): what it held once loaded, the KV bytes its rows
    # and prompt cache may use, and its memory budget (0: none set).
    loaded_bytes: int = 0
    kv_budget_bytes: int = 0
    memory_budget_bytes: int = 0
    # Compiling its decode shapes in idle time (`seatd.warm_shapes.Warming`, on a GPU):
    # it serves meanwhile, but its first requests of a shape may still compile it.
    warming: bool = False


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
    # Tool calls completed in this chunk (the text around them is in `text`).
    tool_calls: tuple[ToolCall, ...] = ()
    # Log-probabilities of the tokens in `ids` (when the request asked for them).
    logprobs: tuple[TokenLogprob, ...] = ()
    # The answer's first chunk from a local seat: its prompt's tokens, and of them those
    # read from the prompt cache (Anthropic's message_start tells them); 0 otherwise.
    prompt_tokens: int = 0
    cached_tokens: int = 0


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
    # The stop string that ended the answer (finish_reason "stop"); "" for none.
    stop_sequence: str = ""


class Started(msgspec.Struct, frozen=True, tag="started"):
    """The seat took the request off its queue and begins it: the first-token clock
    starts here, so time spent waiting behind other requests is never a timeout of
    the seat (it is bounded by the seat's `queue_timeout_s` instead)."""

    request_id: str


class CountersReply(msgspec.Struct, frozen=True, tag="counters"):
    seat: str
    counters: dict[str, object]


class BadFrame(msgspec.Struct, frozen=True, tag="bad_frame"):
    """A frame the seat could not take; its shape stays the same in every version."""

    error: str
    reason: str = ""  # BAD_FRAME_REASONS
    request_id: str = ""  # the request it was about, when its id reads
    speaks: int = PROTOCOL_VERSION  # the protocol version of the seat that refused it


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


class WakeSeat(msgspec.Struct, frozen=True, tag="wake"):
    """Load an on-demand seat (a request waits for it).  `idle`: the loaded seats the
    proxy has nothing in flight or waiting for, least recently used first, which seatd
    may put to sleep to make room (`seatd.room`); the proxy sends none to them until
    the answer."""

    seat: str
    idle: tuple[str, ...] = ()


class SleepSeat(msgspec.Struct, frozen=True, tag="sleep"):
    """Put an idle on-demand seat to sleep; `reason`: idle or request (its keep_alive)."""

    seat: str
    reason: str = "idle"


Control = StatusQuery | RestartSeat | GetCounters | WakeSeat | SleepSeat


class SeatStatus(msgspec.Struct, frozen=True):
    name: str
    state: str
    pid: int | None
    rss_bytes: int | None
    uptime_s: float | None
    restarts: int
    incarnation: int
    last_exit: str | None
    device: str = ""  # "cuda: NVIDIA H200", "metal: Apple M4", "cpu: cpu (...)"; "": not yet
    load: str = "always"  # "always" | "on_demand"
    estimated_bytes: int = 0  # what it holds once loaded and busy, from its files
    idle_s: float | None = None  # since it last had a request in flight (loaded only)


class StatusReply(msgspec.Struct, frozen=True, tag="status_reply"):
    seats: tuple[SeatStatus, ...]
    bad_frames: int = 0  # frames the control socket refused since seatd started
    memory_budget_bytes: int = 0  # what loaded seats may hold together (seatd.room)
    max_loaded: int = 0  # 0: no count limit


class Woken(msgspec.Struct, frozen=True, tag="woken"):
    """A WakeSeat's answer: the seat loads (or was loaded); `slept` made room for it."""

    seat: str
    slept: tuple[str, ...] = ()


class NoRoom(msgspec.Struct, frozen=True, tag="no_room"):
    """A WakeSeat's answer when nothing can make room: the budget and what holds it."""

    message: str
    budget_bytes: int = 0
    loaded: dict[str, int] = {}


class ControlError(msgspec.Struct, frozen=True, tag="control_error"):
    error: str
    reason: str = ""  # BAD_FRAME_REASONS, for a frame seatd could not take


class ControlOk(msgspec.Struct, frozen=True, tag="control_ok"):
    message: str


class SeatCounters(msgspec.Struct, frozen=True, tag="seat_counters"):
    seats: dict[str, dict[str, object]]


ControlReply = StatusReply | ControlError | ControlOk | SeatCounters | Woken | NoRoom


# ---------------------------------------------------------------------------
# Codecs.  One encoder is enough; decoders are typed per direction.

_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
control_decoder = msgspec.msgpack.Decoder(Control)
control_reply_decoder = msgspec.msgpack.Decoder(ControlReply)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


# ---------------------------------------------------------------------------
# Readers: every receiver's one way from bytes to a message.  Pure, and they never
# raise: the result is a message, or a `Refused` that the receiver counts (by its
# reason) and answers (seat side: shared/seat_side.py; seatd: ControlError).

BAD_FRAME_REASONS = ("wrong_parts", "undecodable", "wrong_version", "invalid_value")
ERROR_CHARS = 300  # an error names the bad value; a 10-MB one is not sent back whole


class Refused(msgspec.Struct, frozen=True):
    """A frame that was not taken, and why.  Never sent: it is what a reader returns."""

    reason: str  # one of BAD_FRAME_REASONS
    error: str
    # The id of a Generate whose id reads: it is answered as that request (a Final).
    request_id: str | None = None


class _Head(msgspec.Struct):
    """What can be read of any map, to say why its frame did not decode."""

    type: Any = None
    version: Any = 1
    request_id: Any = None


_head_decoder = msgspec.msgpack.Decoder(_Head)


def _tags(union: Any) -> frozenset[str]:
    return frozenset(cls.__struct_config__.tag for cls in union.__args__)


REQUEST_TAGS = _tags(Request)
CONTROL_TAGS = _tags(Control)
REPLY_TAGS = _tags(Reply)


def _short(text: str) -> str:
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + "..."


def _wrong_version(version: object) -> str:
    return _short(f"protocol version {version!r}; this peer speaks version {PROTOCOL_VERSION}")


def _generate_id(head: _Head) -> str | None:
    rid = head.request_id
    if head.type == "generate" and isinstance(rid, str) and len(rid) <= MAX_REQUEST_ID_CHARS:
        return rid
    return None


def _why(payload: bytes, error: str, tags: frozenset[str]) -> Refused:
    """A frame that parsed as msgpack but is no message: which bad input it is."""
    try:
        head = _head_decoder.decode(payload)
    except Exception:  # not a map at all (a list, an int, a string)
        return Refused("undecodable", _short(f"not a message: {error}"))
    rid = _generate_id(head)
    if head.version != PROTOCOL_VERSION:
        return Refused("wrong_version", _wrong_version(head.version), rid)
    if not isinstance(head.type, str) or head.type not in tags:
        what = "no message type" if head.type is None else f"unknown message type {head.type!r}"
        return Refused("undecodable", _short(what))
    return Refused("invalid_value", _short(f"invalid {head.type}: {error}"), rid)


def _read(decoder: msgspec.msgpack.Decoder[Any], payload: bytes,
          tags: frozenset[str]) -> Any:
    if not payload:
        return Refused("undecodable", "empty payload")
    try:
        message = decoder.decode(payload)
    except msgspec.ValidationError as exc:
        return _why(payload, str(exc), tags)
    except Exception as exc:  # DecodeError, or anything else hostile bytes provoke
        return Refused("undecodable", _short(f"not msgpack: {exc}"))
    version = getattr(message, "version", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        rid = message.request_id if isinstance(message, Generate) else None
        return Refused("wrong_version", _wrong_version(version), rid)
    return message


def read_request(payload: bytes) -> Request | Refused:
    """A seat's request frame: the message, or why it was refused."""
    result: Request | Refused = _read(request_decoder, payload, REQUEST_TAGS)
    return result


def read_control(payload: bytes) -> Control | Refused:
    """A frame on seatd's control socket: the message, or why it was refused."""
    result: Control | Refused = _read(control_decoder, payload, CONTROL_TAGS)
    return result


def read_reply(payload: bytes) -> Reply | Refused:
    """A seat's reply, as its peers (the proxy, seatd's heartbeat) read it."""
    result: Reply | Refused = _read(reply_decoder, payload, REPLY_TAGS)
    return result


def payload_of(frames: list[bytes], delimited: bool) -> bytes | Refused:
    """The payload of a ROUTER's multipart message: [identity, payload] from a DEALER,
    or [identity, "", payload] from a REQ peer (`delimited`, seatd's control socket)."""
    shape = 3 if delimited else 2
    if len(frames) == shape and (not delimited or frames[1] == b""):
        return frames[-1]
    want = "[identity, empty, payload]" if delimited else "[identity, payload]"
    parts = max(len(frames) - 1, 0)
    return Refused("wrong_parts", f"a frame of {parts} parts after the identity; "
                                  f"expected {want}")


def read_control_frames(frames: list[bytes]) -> Control | Refused:
    """A ROUTER's multipart message on seatd's control socket (from a REQ peer, or a
    DEALER that sends the empty delimiter as the CLI's REQ does)."""
    payload = payload_of(frames, delimited=True)
    return payload if isinstance(payload, Refused) else read_control(payload)


def control_refusal(refused: Refused) -> ControlError:
    return ControlError(f"bad control frame: {refused.error}", refused.reason)


SpeculationState = Literal["accelerated", "off"] | str

