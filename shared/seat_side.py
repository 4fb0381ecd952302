"""The seat side of the seat protocol, once: the socket, the decoding, the dispatch.

    read_frames(frames)         pure: a ROUTER's multipart -> (peer, Request | Refused)
    refusal_reply(refused, ..)  pure: the answer to a refused frame (BadFrame or a Final)
    SeatSocket(endpoint)        a bound ROUTER: recv() -> (peer, Request | Refused) | None
    SeatHandler                 what a seat decides: pong, generate, cancel, counters, tick
    serve(socket, handler)      the loop: poll until the next tick, dispatch, tick

Every seat (the worker, the fault-injecting fake seat in tests/fakes, the null seat
of the benchmarks) speaks the same protocol; this is the part they share, so a
frame that does not decode is answered and counted the same way in all of them
(`shared.protocol` lists the bad inputs and what each gets: a Generate with a bad
value gets a Final with Rejected(400, "invalid_value"), anything else a `BadFrame`),
pings are answered from the same place, and `Shutdown` ends each loop.  A handler
decides what to answer and when; it sends through `SeatSocket.send`.  A frame past
the socket's `max_frame_bytes` never reaches any of this: ZeroMQ drops its sender's
connection.

The loop is synchronous (the fakes have no event loop); the asyncio worker reads its
own socket and uses the same `read_frames` and `refusal_reply`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq

from shared import protocol
from shared.config import ProxyConfig, unlink_endpoint
from shared.protocol import (
    BAD_FRAME_REASONS,
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
    Reply,
    Request,
    Shutdown,
)

IDLE_POLL_S = 0.1  # how often an idle loop looks whether it was asked to stop


def frame_bound(limits: ProxyConfig) -> int:
    """A seat's frame bound (ZMQ_MAXMSGSIZE) for the proxy's input limits."""
    return protocol.max_frame_bytes(limits.max_body_bytes, limits.max_completion_tokens)


DEFAULT_MAX_FRAME_BYTES = frame_bound(ProxyConfig())


def read_frames(frames: Sequence[bytes]) -> tuple[bytes, Request | Refused]:
    """The sender and its request, or why it was refused.  Never raises."""
    identity = frames[0] if frames else b""
    payload = protocol.payload_of(list(frames), delimited=False)
    if isinstance(payload, Refused):
        return identity, payload
    return identity, protocol.read_request(payload)


def refusal_reply(refused: Refused, seat: str, served: int, incarnation: int) -> Reply:
    """What a refused frame gets: a Generate with a bad value is a client error of that
    request (the proxy returns it as a 400); anything else a BadFrame."""
    if refused.reason == "invalid_value" and refused.request_id is not None:
        return Final(refused.request_id, Rejected(400, "invalid_value", refused.error),
                     seat, served, incarnation)
    return BadFrame(refused.error, refused.reason, refused.request_id or "")


def out_of_vocabulary(gen: Generate, vocabulary: int) -> Refused | None:
    """A Generate whose token ids name no token of this seat's model (`prompt_ids`,
    `prefix_ids`)."""
    for i, token in enumerate(gen.prompt_ids or ()):
        if token >= vocabulary:
            return Refused("invalid_value", f"prompt[{i}]: token id {token} is outside the "
                           f"vocabulary (0..{vocabulary - 1})", gen.request_id)
    for token in gen.prefix_ids or ():
        if token >= vocabulary:
            return Refused("invalid_value", f"invalid generate: token id {token} in prefix_ids "
                           f"is outside the vocabulary (0..{vocabulary - 1})", gen.request_id)
    return None


class SeatHandler(Protocol):
    """What one seat decides.  `peer` is the ROUTER identity to answer."""

    name: str

    def pong(self, ping: Ping) -> Pong: ...
    def generate(self, peer: bytes, gen: Generate) -> None: ...
    def cancel(self, peer: bytes, request_id: str) -> None: ...
    def counters(self) -> dict[str, object]: ...
    def stamp(self) -> tuple[int, int]:
        """(served, incarnation) now, for a Final the seat side sends itself."""
        ...
    def tick(self) -> float | None:
        """Do the work that is due (the next chunks); seconds until more is due, None
        when there is nothing to do until the next message."""
        ...


class SeatSocket:
    """A seat's bound ROUTER socket.  Refused frames are counted, by reason."""

    def __init__(self, endpoint: str, ctx: zmq.Context[Any] | None = None,
                 on_bad_frame: Callable[[Refused], None] | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        """`on_bad_frame(refused)` lets a seat log it too."""
        self.endpoint = endpoint
        self.ctx: zmq.Context[Any] = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.sock: zmq.Socket[Any] = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.sock.bind(endpoint)
        self.bad_frames = 0
        self.bad_frames_by_reason: dict[str, int] = dict.fromkeys(BAD_FRAME_REASONS, 0)
        self._on_bad_frame = on_bad_frame

    def send(self, peer: bytes, reply: Reply) -> None:
        self.sock.send_multipart([peer, protocol.encode(reply)])

    def take(self, frames: Sequence[bytes]) -> tuple[bytes, Request | Refused]:
        """`read_frames`, counting what it refuses."""
        peer, message = read_frames(frames)
        if isinstance(message, Refused):
            self.bad_frames += 1
            self.bad_frames_by_reason[message.reason] += 1
            if self._on_bad_frame is not None:
                self._on_bad_frame(message)
        return peer, message

    def recv(self, timeout_s: float) -> tuple[bytes, Request | Refused] | None:
        """The next frame within `timeout_s` (a request, or why it was refused), or None."""
        if not self.sock.poll(max(0, int(timeout_s * 1000))):
            return None
        return self.take(self.sock.recv_multipart())

    def close(self) -> None:
        self.sock.close(linger=0)
        if self._own_ctx:
            self.ctx.term()
        unlink_endpoint(self.endpoint)


def dispatch(socket: SeatSocket, handler: SeatHandler, peer: bytes,
             message: Request | Refused) -> bool:
    """Answer one request (or a refused frame); False when it asks the seat to stop."""
    match message:
        case Refused():
            socket.send(peer, refusal_reply(message, handler.name, *handler.stamp()))
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
