"""The seat side of the seat protocol, once: the socket, the decoding, the dispatch.

    SeatSocket(endpoint)        a bound ROUTER: recv() -> (peer, Request) | None, send()
    SeatHandler                 what a seat decides: pong, generate, cancel, counters, tick
    serve(socket, handler)      the loop: poll until the next tick, dispatch, tick

Every seat (the worker, the fault-injecting fake seat in tests/fakes, the null seat
of the benchmarks) speaks the same protocol; this is the part they share, so a
frame that does not decode is answered with `BadFrame` and counted the same way in
all of them, pings are answered from the same place, and `Shutdown` ends each loop.
A handler decides what to answer and when; it sends through `SeatSocket.send`.

The loop is synchronous (the fakes have no event loop); an asyncio seat uses the
same `SeatSocket.decode` and `dispatch` from its own reader task.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import zmq

from shared import protocol
from shared.config import unlink_endpoint
from shared.protocol import (
    BadFrame,
    Cancel,
    CountersReply,
    Generate,
    GetCounters,
    Ping,
    Pong,
    Reply,
    Request,
    Shutdown,
)

IDLE_POLL_S = 0.1  # how often an idle loop looks whether it was asked to stop


class SeatHandler(Protocol):
    """What one seat decides.  `peer` is the ROUTER identity to answer."""

    name: str

    def pong(self, ping: Ping) -> Pong: ...
    def generate(self, peer: bytes, gen: Generate) -> None: ...
    def cancel(self, peer: bytes, request_id: str) -> None: ...
    def counters(self) -> dict[str, object]: ...
    def tick(self) -> float | None:
        """Do the work that is due (the next chunks); seconds until more is due, None
        when there is nothing to do until the next message."""
        ...


class SeatSocket:
    """A seat's bound ROUTER socket.  Undecodable frames are answered and counted."""

    def __init__(self, endpoint: str, ctx: zmq.Context[Any] | None = None,
                 on_bad_frame: Callable[[str], None] | None = None) -> None:
        """`ctx` may be a `zmq.asyncio.Context`: sends then never wait (a ROUTER drops
        what it cannot route), and the seat reads `sock` in its own task, handing each
        payload to `decode`.  `on_bad_frame(error)` lets a seat count and log it too."""
        self.endpoint = endpoint
        self.ctx: zmq.Context[Any] = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.sock: zmq.Socket[Any] = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.bad_frames = 0
        self._on_bad_frame = on_bad_frame

    def send(self, peer: bytes, reply: Reply) -> None:
        self.sock.send_multipart([peer, protocol.encode(reply)])

    def decode(self, peer: bytes, payload: bytes) -> Request | None:
        try:
            return protocol.request_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.bad_frames += 1
            if self._on_bad_frame is not None:
                self._on_bad_frame(str(exc))
            self.send(peer, BadFrame(str(exc)))
            return None

    def recv(self, timeout_s: float) -> tuple[bytes, Request] | None:
        """The next request within `timeout_s`, or None (nothing came, or it did not
        decode and was answered with BadFrame)."""
        if not self.sock.poll(max(0, int(timeout_s * 1000))):
            return None
        peer, *_, payload = self.sock.recv_multipart()
        message = self.decode(peer, payload)
        return None if message is None else (peer, message)

    def close(self) -> None:
        self.sock.close(linger=0)
        if self._own_ctx:
            self.ctx.term()
        unlink_endpoint(self.endpoint)


def dispatch(socket: SeatSocket, handler: SeatHandler, peer: bytes, message: Request) -> bool:
    """Answer one request; False when it asks the seat to stop."""
    match message:
        case Ping():
            socket.send(peer, handler.pong(message))
        case GetCounters():
            socket.send(peer, CountersReply(handler.name, handler.counters()))
        case Cancel(request_id=rid):
            handler.cancel(peer, rid)
        case Generate():
            handler.generate(peer, message)
        case Shutdown():
            return False
    return True


def serve(socket: SeatSocket, handler: SeatHandler,
          stopped: Callable[[], bool] = lambda: False) -> None:
    """Answer requests and tick the handler until `Shutdown` or `stopped()`."""
    wait = handler.tick()
    while not stopped():
        got = socket.recv(IDLE_POLL_S if wait is None else min(wait, IDLE_POLL_S))
        if got is not None and not dispatch(socket, handler, *got):
            return
        wait = handler.tick()
