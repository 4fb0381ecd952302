"""A seat that answers instantly: the real protocol, no model.

    python -m sanctum.bench.null_seat --endpoint ipc://PATH [--seat NAME]

It pongs like a ready worker and answers a `Generate` with `max_tokens` one-token
chunks and a `Final(ok)`, as fast as it can.  Timing the proxy in front of it,
against calling it directly, measures what the proxy adds and nothing else.
Unlike the fault-injecting fake in tests/fakes, it logs nothing per request: any
work here would be charged to the proxy.  Both build on the seat side of the
protocol in shared/seat_side.py.
"""

from __future__ import annotations

import argparse
import os
import signal
from types import FrameType

from shared import protocol, seat_side
from shared.protocol import (
    Chunk,
    CountersReply,
    Final,
    Generate,
    GetCounters,
    Ok,
    Ping,
    Pong,
    Started,
    Usage,
)
from shared.seat_side import SeatSocket

TOKEN = "x"
BIG = 1 << 20


def answer(message: protocol.Request, seat: str, served: int) -> tuple[list[bytes], int]:
    """The frames that answer `message`, and the new served count.  Pure."""
    enc = protocol.encode
    match message:
        case Ping(sent_at=sent_at):
            return [enc(Pong(seat, os.getpid(), 1, True, False, sent_at, BIG, BIG))], served
        case Generate(request_id=rid, params=params, prompt=prompt, messages=messages):
            n = max(params.max_tokens, 1)
            frames = [enc(Started(rid))]
            frames += [enc(Chunk(rid, TOKEN, i + 1, served + 1)) for i in range(n)]
            size = len(prompt or "") + sum(len(m.content) for m in messages or ())
            frames.append(enc(Final(rid, Ok(), seat, served + 1, 1, "length",
                                    Usage(size, n))))
            return frames, served + 1
        case GetCounters():
            return [enc(CountersReply(seat, {"served": served}))], served
        case _:
            return [], served


class NullSeat:
    """The seat-side handler (shared/seat_side.py): every answer at once, from `answer`."""

    def __init__(self, name: str, socket: SeatSocket) -> None:
        self.name = name
        self.socket = socket
        self.served = 0

    def pong(self, ping: Ping) -> Pong:
        frames, _ = answer(ping, self.name, self.served)
        reply = protocol.reply_decoder.decode(frames[0])
        assert isinstance(reply, Pong)
        return reply

    def generate(self, peer: bytes, gen: Generate) -> None:
        frames, self.served = answer(gen, self.name, self.served)
        for frame in frames:
            self.socket.sock.send_multipart([peer, frame])

    def cancel(self, peer: bytes, request_id: str) -> None:
        pass  # every request is answered before its cancel could arrive

    def counters(self) -> dict[str, object]:
        return {"served": self.served, "bad_frames": self.socket.bad_frames}

    def stamp(self) -> tuple[int, int]:
        return self.served, 1

    def tick(self) -> float | None:
        return None


def serve(endpoint: str, seat: str) -> None:
    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    socket = SeatSocket(endpoint)
    try:
        seat_side.serve(socket, NullSeat(seat, socket), lambda: stop)
    finally:
        socket.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="null_seat")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--seat", default="null")
    args = ap.parse_args(argv)
    serve(args.endpoint, args.seat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
