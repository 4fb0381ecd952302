"""The wire protocol: tagged msgpack frames, typed per direction."""

import msgspec
import pytest

from shared import protocol
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
