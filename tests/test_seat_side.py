"""The seat side of the protocol: dispatch, BadFrame for what does not decode, Shutdown."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import zmq

from shared import protocol
from shared.protocol import (
    BadFrame,
    Cancel,
    CountersReply,
    Final,
    Generate,
    GetCounters,
    Ping,
    Pong,
    Refused,
    Rejected,
    SamplingParams,
    Shutdown,
)
from shared.seat_side import (
    SeatSocket,
    dispatch,
    out_of_vocabulary,
    read_frames,
    refusal_reply,
    serve,
)


class Recorder:
    name = "s"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pong(self, ping: Ping) -> Pong:
        return Pong(self.name, 1, 1, True, sent_at=ping.sent_at)

    def generate(self, peer: bytes, gen: Generate) -> None:
        self.calls.append(f"generate:{gen.request_id}")

    def cancel(self, peer: bytes, request_id: str) -> None:
        self.calls.append(f"cancel:{request_id}")

    def counters(self) -> dict[str, object]:
        return {"served": 7}

    def stamp(self) -> tuple[int, int]:
        return 7, 2

    def tick(self) -> float | None:
        return None


def test_dispatch_answers_pings_and_counters_and_stops_on_shutdown(tmp_path: Path) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    endpoint = f"ipc://{tmp_path / 's.sock'}"
    seat = SeatSocket(endpoint, ctx)
    peer = ctx.socket(zmq.DEALER)
    peer.connect(endpoint)
    handler = Recorder()
    try:
        for msg in (Ping(sent_at=2.5), GetCounters(), Cancel("r1"),
                    Generate("r2", True, SamplingParams())):
            peer.send(protocol.encode(msg))
        peer.send(b"not msgpack")
        peer.send_multipart([b"two", b"parts"])
        bad = msgspec.msgpack.encode({"type": "generate", "request_id": "r3", "stream": True,
                                      "params": {"top_k": -5}})
        peer.send(bad)
        peer.send(protocol.encode(Shutdown()))
        serve(seat, handler)  # returns at the Shutdown
        replies = [protocol.reply_decoder.decode(peer.recv()) for _ in range(5)]
        assert isinstance(replies[0], Pong) and replies[0].sent_at == 2.5
        assert replies[1] == CountersReply("s", {"served": 7})
        assert isinstance(replies[2], BadFrame) and replies[2].reason == "undecodable"
        assert isinstance(replies[3], BadFrame) and replies[3].reason == "wrong_parts"
        final = replies[4]
        assert isinstance(final, Final) and final.request_id == "r3"
        assert isinstance(final.outcome, Rejected) and final.outcome.status == 400
        assert "top_k" in final.outcome.message
        assert (final.seat, final.served, final.incarnation) == ("s", 7, 2)
        assert handler.calls == ["cancel:r1", "generate:r2"]
        assert seat.bad_frames == 3
        assert seat.bad_frames_by_reason == {"undecodable": 1, "wrong_parts": 1,
                                             "invalid_value": 1, "wrong_version": 0}
        assert dispatch(seat, handler, b"x", Shutdown()) is False
    finally:
        peer.close(linger=0)
        seat.close()
        ctx.term()
    assert not (tmp_path / "s.sock").exists()  # the binder removes its socket file


GOOD = protocol.encode(Ping(sent_at=1.0))


@pytest.mark.parametrize(("frames", "reason"), [
    ([b"id"], "wrong_parts"),
    ([b"id", b"", GOOD], "wrong_parts"),
    ([b"id", GOOD, GOOD], "wrong_parts"),
    ([], "wrong_parts"),
    ([b"id", b""], "undecodable"),
])
def test_read_frames_takes_exactly_identity_and_payload(frames: list[bytes], reason: str) -> None:
    """A seat takes [identity, payload]; any other shape is refused as wrong_parts."""
    _, got = read_frames(frames)
    assert isinstance(got, Refused) and got.reason == reason
    assert read_frames([b"id", GOOD]) == (b"id", Ping(sent_at=1.0))


@pytest.mark.parametrize(("refused", "expect"), [
    (Refused("invalid_value", "bad top_k", "r1"),
     Final("r1", Rejected(400, "invalid_value", "bad top_k"), "s", 3, 4)),
    (Refused("invalid_value", "bad id"), BadFrame("bad id", "invalid_value")),
    (Refused("wrong_version", "v2", "r1"), BadFrame("v2", "wrong_version", "r1")),
    (Refused("undecodable", "junk"), BadFrame("junk", "undecodable")),
])
def test_refusal_reply(refused: Refused, expect: object) -> None:
    """A Generate with a bad value is that request's 400; everything else a BadFrame."""
    assert refusal_reply(refused, "s", 3, 4) == expect


def test_token_ids_past_the_vocabulary_are_refused() -> None:
    """prefix_ids must name tokens of the seat's model; the last id of it is fine."""
    gen = Generate("r", True, SamplingParams(), prompt="x", prefix="ab", prefix_ids=(5, 100))
    refused = out_of_vocabulary(gen, 100)
    assert refused is not None and refused.reason == "invalid_value" and refused.request_id == "r"
    assert "100" in refused.error
    assert out_of_vocabulary(gen, 101) is None
    assert out_of_vocabulary(Generate("r", True, SamplingParams(), prompt="x"), 1) is None
