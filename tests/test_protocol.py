"""The wire protocol: tagged msgpack frames, typed per direction."""

import msgspec
import pytest

from shared import protocol
from shared.config import ProxyConfig
from shared.protocol import (
    ChatMessage,
    Chunk,
    Failed,
    Final,
    Generate,
    Ok,
    Ping,
    Rejected,
    SamplingParams,
    StatusQuery,
    Usage,
)


def test_request_round_trip() -> None:
    """A Generate frame decodes back into the same Struct."""
    g = Generate("r1", True, SamplingParams(temperature=0.5, stop=("x",), seed=7),
                 messages=(ChatMessage("user", "héllo"),))
    assert protocol.request_decoder.decode(protocol.encode(g)) == g


@pytest.mark.parametrize("outcome", [Ok(), Rejected(413, "prompt_too_long", "m", {"cap": 5}),
                                     Failed("worker_lost")])
def test_final_carries_typed_outcome(outcome) -> None:
    """The outcome travels as a typed value, never as a status string."""
    f = Final("r", outcome, "brain", 12, 3, "stop", Usage(4, 5))
    back = protocol.reply_decoder.decode(protocol.encode(f))
    assert back == f and type(back.outcome) is type(outcome)


def test_reply_decoder_refuses_a_request() -> None:
    """A frame of the wrong direction does not decode as a reply."""
    with pytest.raises(msgspec.ValidationError):
        protocol.reply_decoder.decode(protocol.encode(Ping()))


def test_older_peer_decodes_newer_chunk() -> None:
    """Fields added last with defaults keep older frames decodable."""
    old = msgspec.msgpack.encode({"type": "chunk", "request_id": "r", "text": "a",
                                  "completion_tokens": 1})
    assert protocol.reply_decoder.decode(old) == Chunk("r", "a", 1)


def test_garbage_is_a_decode_error() -> None:
    """Garbage raises a msgspec error the receiver can count and answer."""
    with pytest.raises(msgspec.DecodeError):
        protocol.request_decoder.decode(b"\xc1\xff\x00")


def _gen(**fields: object) -> bytes:
    frame: dict[str, object] = {"type": "generate", "request_id": "r9", "stream": True,
                                "params": {}, "prompt": "hi"}
    frame.update(fields)
    return msgspec.msgpack.encode(frame)


def _params(**params: object) -> bytes:
    return _gen(params=params)


GOOD = protocol.encode(Generate("r9", True, SamplingParams(), prompt="hi"))
TEN_MB = "x" * 10_000_000

# Every class of bad input a seat may meet, and the reason it is refused with; the
# request id is read back only from a Generate whose id itself is fine.
BAD_REQUESTS = [
    ("empty payload", b"", "undecodable", None),
    ("truncated msgpack", GOOD[:-4], "undecodable", None),
    ("one byte of msgpack", GOOD[:1], "undecodable", None),
    ("reserved msgpack byte", b"\xc1", "undecodable", None),
    ("a list", msgspec.msgpack.encode([1, 2, 3]), "undecodable", None),
    ("an int", msgspec.msgpack.encode(7), "undecodable", None),
    ("a map without a tag", msgspec.msgpack.encode({"request_id": "r9"}), "undecodable", None),
    ("an unknown tag", msgspec.msgpack.encode({"type": "launch"}), "undecodable", None),
    ("a reply's tag", protocol.encode(Chunk("r9", "a", 1)), "undecodable", None),
    ("a wrong field type", _gen(stream="yes"), "invalid_value", "r9"),
    ("params not a map", _gen(params=[1]), "invalid_value", "r9"),
    ("a missing field", msgspec.msgpack.encode({"type": "generate", "request_id": "r9"}),
     "invalid_value", "r9"),
    ("negative max_tokens", _params(max_tokens=-1), "invalid_value", "r9"),
    ("zero max_tokens", _params(max_tokens=0), "invalid_value", "r9"),
    ("astronomical max_tokens", _params(max_tokens=2**64 - 1), "invalid_value", "r9"),
    ("top_k of -5", _params(top_k=-5), "invalid_value", "r9"),
    ("temperature NaN", _params(temperature=float("nan")), "invalid_value", "r9"),
    ("temperature inf", _params(temperature=float("inf")), "invalid_value", "r9"),
    ("negative temperature", _params(temperature=-0.5), "invalid_value", "r9"),
    ("top_p 0", _params(top_p=0.0), "invalid_value", "r9"),
    ("top_p NaN", _params(top_p=float("nan")), "invalid_value", "r9"),
    ("too many stops", _params(stop=["s"] * (protocol.MAX_STOPS + 1)), "invalid_value", "r9"),
    ("a 10-MB stop", _params(stop=[TEN_MB]), "invalid_value", "r9"),
    ("negative token id", _gen(prefix="a", prefix_ids=[3, -1]), "invalid_value", "r9"),
    ("token id past int32", _gen(prefix="a", prefix_ids=[2**40]), "invalid_value", "r9"),
    ("an unknown kv lane", _gen(kv="fp8"), "invalid_value", "r9"),
    ("a 10-MB kv lane", _gen(kv=TEN_MB), "invalid_value", "r9"),
    ("draft_depth 17", _gen(draft_depth=17), "invalid_value", "r9"),
    ("a 10-MB request id", _gen(request_id=TEN_MB), "invalid_value", None),
    ("a request id that is an int", _gen(request_id=5), "invalid_value", None),
    ("a cancel without its id", msgspec.msgpack.encode({"type": "cancel"}), "invalid_value",
     None),
    ("a newer Generate", _gen(version=2), "wrong_version", "r9"),
    ("a newer Generate that no longer decodes", _gen(version=2, stream="yes"),
     "wrong_version", "r9"),
    ("a newer Ping", msgspec.msgpack.encode({"type": "ping", "version": 2}),
     "wrong_version", None),
    ("a newer peer's new message", msgspec.msgpack.encode({"type": "hello", "version": 2}),
     "wrong_version", None),
    ("a version that is a string", _gen(version="1"), "wrong_version", "r9"),
]


@pytest.mark.parametrize(("what", "payload", "reason", "rid"), BAD_REQUESTS,
                         ids=[row[0] for row in BAD_REQUESTS])
def test_every_bad_request_is_refused_with_its_reason(what: str, payload: bytes, reason: str,
                                                      rid: str | None) -> None:
    """read_request never raises: each class of bad input is refused, by reason, with a
    short error (a 10-MB value is not sent back whole)."""
    got = protocol.read_request(payload)
    assert isinstance(got, protocol.Refused), what
    assert (got.reason, got.request_id) == (reason, rid)
    assert got.reason in protocol.BAD_FRAME_REASONS
    assert 0 < len(got.error) <= protocol.ERROR_CHARS + 3


def test_good_frames_read_as_their_messages() -> None:
    """Values at the bounds are taken; a frame from a peer older than versions (no
    `version` field) reads as version 1."""
    edge = SamplingParams(temperature=protocol.MAX_TEMPERATURE, top_p=1.0,
                          top_k=protocol.INT64_MAX, max_tokens=protocol.MAX_NEW_TOKENS,
                          stop=("s" * protocol.MAX_STOP_CHARS,) * protocol.MAX_STOPS,
                          seed=2**64 - 1)
    gen = Generate("r" * protocol.MAX_REQUEST_ID_CHARS, False, edge, prompt="x",
                   kv="q8", draft_depth=protocol.MAX_DRAFT_DEPTH, prefix="a",
                   prefix_ids=(0, protocol.MAX_TOKEN_ID))
    assert protocol.read_request(protocol.encode(gen)) == gen
    old_ping = msgspec.msgpack.encode({"type": "ping", "sent_at": 2.0})
    assert protocol.read_request(old_ping) == Ping(sent_at=2.0)


def test_senders_say_the_version_they_speak() -> None:
    """Ping and Generate carry PROTOCOL_VERSION by default; raising the version means
    changing these defaults (and the receivers' rule) on purpose."""
    assert Ping().version == protocol.PROTOCOL_VERSION
    assert Generate("r", True, SamplingParams()).version == protocol.PROTOCOL_VERSION


def test_the_proxys_default_limits_fit_the_protocols_bounds() -> None:
    """A request within the proxy's default limits never meets a bound of the protocol."""
    limits = ProxyConfig()
    assert limits.max_completion_tokens <= protocol.MAX_NEW_TOKENS
    assert limits.max_stop <= protocol.MAX_STOPS
    assert limits.max_stop_chars <= protocol.MAX_STOP_CHARS


def test_frame_bound_covers_the_largest_request_the_limits_allow() -> None:
    """A Generate of one message as large as the body limit, continuing an answer of
    max_completion_tokens long tokens, fits under the seat's frame bound."""
    body, tokens = 64 * 1024, 512
    bound = protocol.max_frame_bytes(body, tokens)
    gen = Generate("r" * 64, True, SamplingParams(max_tokens=tokens, stop=("x" * 256,) * 16),
                   messages=(ChatMessage("user", "é" * (body // 2)),),
                   prefix="w" * (tokens * protocol.TOKEN_TEXT_BYTES),
                   prefix_ids=(protocol.MAX_TOKEN_ID,) * tokens)
    assert len(protocol.encode(gen)) <= bound
    # The default limits give a bound of tens of megabytes, not gigabytes.
    assert protocol.max_frame_bytes(8 * 1024 * 1024, 65536) < 64 * 1024 * 1024


@pytest.mark.parametrize(("frames", "reason"), [
    ([b"id", protocol.encode(StatusQuery())], "wrong_parts"),
    ([b"id", b"x", protocol.encode(StatusQuery())], "wrong_parts"),
    ([b"id", b"", b"", protocol.encode(StatusQuery())], "wrong_parts"),
    ([b"id", b"", b""], "undecodable"),
    ([b"id", b"", protocol.encode(Ping())], "undecodable"),
    ([b"id", b"", msgspec.msgpack.encode({"type": "restart", "seat": 5})], "invalid_value"),
])
def test_control_frames(frames: list[bytes], reason: str) -> None:
    """seatd's control socket takes [identity, "", payload] of a control message."""
    got = protocol.read_control_frames(frames)
    assert isinstance(got, protocol.Refused) and got.reason == reason
    error = protocol.control_refusal(got)
    assert error.reason == reason and error.error.startswith("bad control frame")
    good = [b"id", b"", protocol.encode(StatusQuery())]
    assert protocol.read_control_frames(good) == StatusQuery()


def test_replies_read_the_same_way() -> None:
    """A seat's replies go through the same reader; a BadFrame from a newer seat still
    reads (its shape never changes), whatever version it names."""
    newer = protocol.encode(protocol.BadFrame("v3 only", "wrong_version", "r", speaks=3))
    assert protocol.read_reply(newer) == protocol.BadFrame("v3 only", "wrong_version", "r", 3)
    got = protocol.read_reply(protocol.encode(Ping()))
    assert isinstance(got, protocol.Refused) and got.reason == "undecodable"
