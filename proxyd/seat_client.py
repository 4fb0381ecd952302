"""The proxy's side of one local seat: a ZeroMQ DEALER, heartbeats, and demux.

One socket per seat carries work and heartbeats (any message counts as a sign
of life).  Frames are routed to the attempt that owns their request id.  An
attempt learns that its worker is gone from the heartbeat (silence for
`liveness` intervals) or from a pong with a new incarnation, whichever comes
first, without waiting for its own timeout.  An attempt whose client has gone away
ends at once, whatever it waits for (a queue place, a prefill, the next chunk), and
its end cancels the request in the seat.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Callable

import msgspec
import structlog
import zmq
import zmq.asyncio

from proxyd.seat_state import SeatFacts, SeatState, seat_state
from shared import clock as clocks
from shared import curve, protocol
from shared.clock import Clock
from shared.curve import ClientKeys
from shared.protocol import Chunk, Failed, Final, Generate, Pong, SeatFrame, Started

log = structlog.get_logger()

# How often an attempt waiting on its seat looks whether its client is still there.
# A client that left must not keep a queue place, nor have a prompt prefilled for it:
# nothing else tells an HTTP handler that its client is gone until it writes.
GONE_POLL_S = 0.1


def _never() -> bool:
    return False


def is_alive(now: float, heard_at: float, heartbeat_s: float, liveness: int) -> bool:
    """Heard from within `liveness` heartbeats (any message counts)."""
    return now - heard_at <= heartbeat_s * liveness


def overdue(reason: str, timeout_s: float, alive: bool) -> Failed:
    """How an attempt ends when its clock ran out: a seat that also stopped
    heartbeating is lost (never merely busy); otherwise the clock's own reason."""
    if not alive:
        return Failed("worker_lost", "no heartbeat")
    said = (f"still queued after {timeout_s:g}s" if reason == "queue_timeout"
            else f"no frame for {timeout_s:g}s")
    return Failed(reason, said)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def merged(first: Chunk, frames: deque[SeatFrame]) -> Chunk:
    """`first` and the chunks queued right behind it, as one chunk: the text they
    commit together, the counts of the last (a burst becomes one write downstream)."""
    texts = [first.text]
    ids = list(first.ids)
    calls = list(first.tool_calls)
    logprobs = list(first.logprobs)
    last = first
    while frames and type(frames[0]) is Chunk:
        nxt = frames.popleft()
        assert isinstance(nxt, Chunk)
        texts.append(nxt.text)
        ids.extend(nxt.ids)
        calls.extend(nxt.tool_calls)
        logprobs.extend(nxt.logprobs)
        last = nxt
    return Chunk(first.request_id, "".join(texts), last.completion_tokens, last.served_if_ok,
                 last.speculation or first.speculation, last.fingerprint or first.fingerprint,
                 tuple(ids), tool_calls=tuple(calls), logprobs=tuple(logprobs),
                 prompt_tokens=first.prompt_tokens, cached_tokens=first.cached_tokens)


class Inbox:
    """One attempt's frames, in order: the reader puts, the attempt takes with a timeout.
    Lighter than `asyncio.wait_for(queue.get())`, which wraps every get in a task."""

    __slots__ = ("frames", "incarnation", "waiter")

    def __init__(self, incarnation: int) -> None:
        self.frames: deque[SeatFrame] = deque()
        self.incarnation = incarnation
        self.waiter: asyncio.Future[None] | None = None

    def put(self, frame: SeatFrame) -> None:
        self.frames.append(frame)
        if self.waiter is not None:
            _wake(self.waiter)

    async def get(self, timeout_s: float) -> SeatFrame | None:
        """The next frame, or None after `timeout_s` of real time without one."""
        if self.frames:
            return self.frames.popleft()
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        handle = loop.call_later(timeout_s, _wake, waiter)
        try:
            await waiter
        finally:
            handle.cancel()
            self.waiter = None
        return self.frames.popleft() if self.frames else None


class SeatClient:
    local = True  # as a rung (`proxyd.rung.Rung`): a seat on this box

    def __init__(self, name: str, endpoint: str, ctx: zmq.asyncio.Context,
                 heartbeat_s: float = 1.0, liveness: int = 3, queue_s: float = 120.0,
                 clock: Clock = clocks.monotonic, keys: ClientKeys | None = None) -> None:
        self.name = name
        self.clock = clock
        self.endpoint = endpoint
        self.heartbeat_s = heartbeat_s
        self.liveness = liveness
        self.queue_s = queue_s  # the longest a request waits in the seat's queue
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Queue only to a connected worker: a frame must never wait in a pipe
        # for the next incarnation of a crashed worker.
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        curve.dial(self.sock, endpoint, keys)  # CURVE where the seat has keys
        # The same socket without asyncio's wrapper: sends and reads need no future each
        # (the reader is a callback on its FD, `_drain`).
        self._io: zmq.Socket[bytes] = zmq.Socket.shadow(self.sock.underlying)
        self._reading: asyncio.AbstractEventLoop | None = None
        self.pong: Pong | None = None
        self.heard_at = 0.0
        self.started_at: float | None = None  # when this client began watching its seat
        self.was_ready = False  # some pong since then said ready
        self.waiting = 0  # requests waiting for this seat to be ready (proxyd/load_wait.py)
        # An on-demand seat (proxyd/on_demand.py): asleep until woken; what it last did;
        # the keep-alive its last request asked for; a hold while seatd decides whether
        # it sleeps to make room for another (nothing is sent to it meanwhile).
        self.on_demand = False
        self.sleeping = False
        self._slept_incarnation: int | None = None
        self.last_used = clock()
        self.keep_alive: float | None = None
        self.held: asyncio.Event | None = None
        self._pong_waiters: list[asyncio.Future[None]] = []
        self.bad_frames = 0
        self._pending: dict[str, Inbox] = {}
        self._counter_waiters: list[asyncio.Future[dict[str, object]]] = []
        self._tasks: list[asyncio.Task[None]] = []

    # -- liveness ---------------------------------------------------------

    @property
    def alive(self) -> bool:
        return is_alive(self.clock(), self.heard_at, self.heartbeat_s, self.liveness)

    @property
    def ready(self) -> bool:
        return self.alive and self.pong is not None and self.pong.ready

    @property
    def state(self) -> SeatState:
        """Ready, loading, down or sleeping (proxyd/seat_state.py)."""
        started = self.started_at if self.started_at is not None else self.clock()
        return seat_state(SeatFacts(self.alive, bool(self.pong and self.pong.ready),
                                    self.pong is not None, self.was_ready,
                                    self.clock() - started, self.sleeping))

    @property
    def idle(self) -> bool:
        """Nothing in flight, nothing waiting for it, no hold."""
        return not self._pending and self.waiting == 0 and self.held is None

    def put_to_sleep(self) -> None:
        """Seatd was asked to put it to sleep: nothing more is sent to this worker."""
        self.sleeping = True
        self._slept_incarnation = self.pong.incarnation if self.pong is not None else None

    def woken(self) -> None:
        """Seatd loads it: it is loading, as at start, until a new worker says ready;
        the old worker's last pongs (it may still be draining) are not heard."""
        self.sleeping = False
        self.pong = None
        self.heard_at = 0.0
        self.was_ready = False
        self.started_at = self.clock()
        self.last_used = self.clock()

    def next_pong(self) -> asyncio.Future[None]:
        """A future done when the next pong arrives (readiness changes only then, or
        with silence, which a waiter sees by looking again)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # A waiter that stopped waiting cancelled its future: drop those here.
        self._pong_waiters = [f for f in self._pong_waiters if not f.done()]
        self._pong_waiters.append(fut)
        return fut

    def _lose_all(self, reason: str, only_incarnation: int | None = None) -> None:
        for rid, inbox in list(self._pending.items()):
            if only_incarnation is None or inbox.incarnation == only_incarnation:
                inbox.put(Final(rid, Failed(reason), self.name, 0, inbox.incarnation))

    # -- background tasks -------------------------------------------------

    def start(self) -> None:
        self.started_at = self.clock()
        self._tasks = [asyncio.create_task(self._beat())]
        loop = asyncio.get_running_loop()
        loop.add_reader(self._io.FD, self._drain)
        self._reading = loop
        loop.call_soon(self._drain)  # whatever came before the reader was added

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._reading is not None:
            self._reading.remove_reader(self._io.FD)
            self._reading = None
        self.sock.close(linger=0)

    def _send(self, message: msgspec.Struct) -> bool:
        """Send without waiting; False when the worker is not connected (IMMEDIATE is
        set, so a send with no worker raises `zmq.Again` at once)."""
        try:
            self._io.send(protocol.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            return False
        finally:
            self._wake_reader()
        return True

    def _wake_reader(self) -> None:
        # The socket's FD signals an edge, and any operation on the socket may take in
        # a message without one: after a send, look whether one is waiting.
        if self._reading is not None and int(self._io.get(zmq.EVENTS)) & zmq.POLLIN:
            self._reading.call_soon(self._drain)

    async def _beat(self) -> None:
        while True:
            self._send(protocol.Ping(sent_at=self.clock()))
            await asyncio.sleep(self.heartbeat_s)
            if self._pending and not self.alive:
                self._lose_all("worker_lost")

    def _drain(self) -> None:
        """Take every message waiting, each in turn (the FD's reader, and after a send):
        a burst of chunks lands in its attempt's inbox together, and is written out
        together; one read costs no future nor task."""
        if self._reading is None:
            return
        while True:
            try:
                payload = self._io.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:  # the socket closed under the reader
                log.warning("seat_socket_error", seat=self.name, error=str(exc))
                return
            try:
                self._take(payload)
            except Exception as exc:  # one bad frame must not stop the reader
                self.bad_frames += 1
                log.error("seat_frame_failed", seat=self.name, error=repr(exc))

    def _take(self, payload: bytes) -> None:
        reply = protocol.read_reply(payload)
        if isinstance(reply, protocol.Refused):
            self.bad_frames += 1
            log.warning("bad_frame_from_seat", seat=self.name, reason=reply.reason,
                        error=reply.error)
            return
        if type(reply) is Pong and self._slept_incarnation is not None \
                and reply.incarnation == self._slept_incarnation:
            return  # the worker put to sleep, draining: not this seat's state any more
        self.heard_at = self.clock()
        match reply:
            case Pong():
                if self.sleeping:  # a worker of its own (`sanctum restart` woke it)
                    self.sleeping, self.was_ready = False, False
                    self.started_at = self.last_used = self.clock()
                old = self.pong
                self.pong = reply
                self.was_ready = self.was_ready or reply.ready
                pongs, self._pong_waiters = self._pong_waiters, []
                for woken in pongs:
                    _wake(woken)
                if old is not None and old.incarnation != reply.incarnation:
                    # Whatever the old incarnation was doing is gone with it.
                    self._lose_all("worker_lost", only_incarnation=old.incarnation)
            case Started(request_id=rid) | Chunk(request_id=rid) | Final(request_id=rid):
                inbox = self._pending.get(rid)
                if inbox is not None:
                    inbox.put(reply)
            case protocol.CountersReply(counters=counters):
                waiters, self._counter_waiters = self._counter_waiters, []
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(counters)
            case protocol.BadFrame(error=error, reason=reason, request_id=rid):
                log.error("seat_refused_frame", seat=self.name, error=error, reason=reason,
                          seat_speaks=reply.speaks)
                inbox = self._pending.get(rid) if rid else None
                if inbox is not None:  # that attempt ends now, not at its clock
                    inbox.put(Final(rid, Failed(reason or "bad_frame", error), self.name, 0,
                                    inbox.incarnation))

    # -- requests ---------------------------------------------------------

    async def frames(self, request: Generate, first_token_s: float, stall_s: float,
                     gone: Callable[[], bool] = _never,
                     tries: int | None = None) -> AsyncGenerator[Chunk | Final, None]:
        """Send `request` and yield its chunks and Final; a lost or silent seat yields a
        failed Final, and so does a client that went away (`gone()`, looked at every
        GONE_POLL_S while waiting): `client_disconnected`.

        Three clocks, one at a time: `queue_s` until the seat starts the request (a
        request still waiting then fails `queue_timeout`: the seat is busy, not broken),
        `first_token_s` from its start to the first chunk, `stall_s` between chunks.
        Leaving the iterator early cancels the request in the seat.  A local seat is
        tried once per attempt whatever `tries` says (a hosted rung's retry cap).
        """
        rid = request.request_id
        if not self.ready:
            reason = "not_ready" if self.alive else "worker_lost"
            yield Final(rid, Failed(reason, "seat not ready"), self.name, 0, 0)
            return
        assert self.pong is not None
        inbox = self._pending[rid] = Inbox(self.pong.incarnation)
        now = self.clock
        finished = False
        try:
            if not self._send(request):
                yield Final(rid, Failed("connection_refused"), self.name, 0, 0)
                finished = True
                return
            timeout, reason = self.queue_s, "queue_timeout"
            deadline = now() + timeout
            while True:
                frame = inbox.frames.popleft() if inbox.frames else None
                if frame is None:
                    if gone():
                        yield Final(rid, Failed("client_disconnected", "the client went away"),
                                    self.name, 0, 0)
                        return
                    left = deadline - now()
                    if left <= 0:
                        yield Final(rid, overdue(reason, timeout, self.alive), self.name, 0, 0)
                        return
                    frame = await inbox.get(min(left, GONE_POLL_S))
                    if frame is None:
                        continue
                if type(frame) is Chunk:
                    if inbox.frames and type(inbox.frames[0]) is Chunk:
                        frame = merged(frame, inbox.frames)
                    yield frame
                    timeout, reason = stall_s, "stall_timeout"
                    deadline = now() + timeout
                    continue
                if isinstance(frame, Started):
                    timeout, reason = first_token_s, "first_token_timeout"
                    deadline = now() + timeout
                    continue
                assert isinstance(frame, Final)
                # A seat that sent its own Final is done; a lost one may be hung.
                outcome = frame.outcome
                finished = not (isinstance(outcome, Failed) and outcome.reason == "worker_lost")
                yield frame
                return
        finally:
            self._pending.pop(rid, None)
            self.last_used = self.clock()
            self.keep_alive = request.keep_alive_s  # the last request's, or the seat's
            if not finished:
                self._send(protocol.Cancel(rid))

    def cancel(self, request_id: str) -> None:
        self._send(protocol.Cancel(request_id))

    async def counters(self, timeout_s: float = 1.0) -> dict[str, object] | None:
        if not self.alive:
            return None
        fut: asyncio.Future[dict[str, object]] = asyncio.get_running_loop().create_future()
        self._counter_waiters.append(fut)
        if not self._send(protocol.GetCounters()):
            return None
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            return None
