"""The seat side of the protocol: dispatch, BadFrame for what does not decode, Shutdown."""

from __future__ import annotations

from pathlib import Path

import zmq

from shared import protocol
from shared.protocol import (
    BadFrame,
    Cancel,
    CountersReply,
    Generate,
    GetCounters,
    Ping,
    Pong,
    SamplingParams,
    Shutdown,
)
from shared.seat_side import SeatSocket, dispatch, serve


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
        peer.send(protocol.encode(Shutdown()))
        serve(seat, handler)  # returns at the Shutdown
        replies = [protocol.reply_decoder.decode(peer.recv()) for _ in range(3)]
        assert isinstance(replies[0], Pong) and replies[0].sent_at == 2.5
        assert replies[1] == CountersReply("s", {"served": 7})
        assert isinstance(replies[2], BadFrame)
        assert handler.calls == ["cancel:r1", "generate:r2"]
        assert seat.bad_frames == 1
        assert dispatch(seat, handler, b"x", Shutdown()) is False
    finally:
        peer.close(linger=0)
        seat.close()
        ctx.term()
    assert not (tmp_path / "s.sock").exists()  # the binder removes its socket file
