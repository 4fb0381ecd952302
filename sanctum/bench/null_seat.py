"""A seat that answers instantly: the real protocol, no model.

    python -m sanctum.bench.null_seat --endpoint ipc://PATH [--seat NAME]

It pongs like a ready worker and answers a `Generate` with `max_tokens` one-token
chunks and a `Final(ok)`, as fast as it can.  Timing the proxy in front of it,
against calling it directly, measures what the proxy adds and nothing else.
Unlike the fault-injecting fake in tests/fakes, it logs nothing per request: any
work here would be charged to the proxy.
"""

from __future__ import annotations

import argparse
import os
import signal
from types import FrameType

import msgspec
import zmq

from shared import protocol
from shared.config import unlink_endpoint
from shared.protocol import (
    BadFrame,
    Chunk,
    CountersReply,
    Final,
    Generate,
    GetCounters,
    Ok,
    Ping,
    Pong,
    Shutdown,
    Started,
    Usage,
)

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


def serve(endpoint: str, seat: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    served = 0
    try:
        while not stop:
            if not sock.poll(200):
                continue
            identity, *_, payload = sock.recv_multipart()
            try:
                message = protocol.request_decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                sock.send_multipart([identity, protocol.encode(BadFrame(str(exc)))])
                continue
            if isinstance(message, Shutdown):
                break
            frames, served = answer(message, seat, served)
            for frame in frames:
                sock.send_multipart([identity, frame])
    finally:
        sock.close(linger=0)
        ctx.term()
        unlink_endpoint(endpoint)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="null_seat")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--seat", default="null")
    args = ap.parse_args(argv)
    serve(args.endpoint, args.seat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
