"""Keep-alive HTTP/1.1 connections to one upstream: the wire of a hosted rung.

    pool = Upstream(base_url, headers, connect_timeout_s)
    resp = await pool.post(path, body, until) returns once the response's head arrived
    resp.status, resp.reason, resp.headers, resp.content_type
    await resp.read_some(until) -> bytes      what has arrived; b"" at the body's end
    await resp.read_all(limit, until) -> bytes  the body, at most `limit` bytes of it
    resp.at_eof                               the body was read to its end
    resp.release()                            back to the pool when whole and reusable
    resp.close()                              never reused
    await pool.close()

`until` (the event loop's clock; None: no limit) bounds each wait: `post` raises
TimeoutError when no head arrived by then, a read when no byte did, as a hosted
rung's first-token and stall clocks ask.  The connect has its own limit,
`connect_timeout_s`.  A read that finds bytes waiting never waits, and a response
keeps one alarm for all its waits, moved only when it rings before the wait it
serves is due: an `asyncio.timeout` around every await started and cancelled two
timers per request, with a task's cancel and uncancel each (with the `answered`
log line, about a seventh of proxyd's CPU per hosted request, measured in the
hop benchmark's throughput workload).  Errors, as proxyd/hosted.py turns them
into a try's outcome:

    UpstreamError
    ├── ConnectTimeout      no connection (TCP, and TLS for https) in connect_timeout_s
    ├── ConnectFailed       refused, no route, DNS, the TLS handshake or certificate
    ├── Disconnected        closed or reset before the head (nothing was answered),
    │                       or inside a body that promised more (a cut)
    └── Malformed           bytes that are not an HTTP/1.x response

Why not aiohttp's client, which hosted rungs used before: measured on loopback
against the fake upstream (sanctum/bench/fake_openai.py), 16 concurrent one-token
streamed requests, its `ClientSession.post` plus reading the body cost about 150 us
of CPU per request, this client about 30 us, and proxyd's whole hosted hop about
630 us.  A rung needs little of what aiohttp's client is for: one host, a POST with
a JSON body, a response read as it arrives; no cookies, redirects, proxies from the
environment, compression asked for, or multipart.  The response's framing is read
by proxyd/http1.py, a pure parser with table tests.  aiohttp still serves the
front doors.

A pooled connection that the upstream closed while idle is noticed when its close
arrives (it leaves the pool) or, in a race, as a `Disconnected` before the head,
which the rung's retry policy tries again (`connection_reset`).  Connections idle
for longer than `idle_s` are closed rather than reused.  Reading pauses while more
than `BUFFER_HIGH` bytes of a body wait unread, so a fast upstream cannot fill
proxyd's memory ahead of a slow client.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections.abc import Callable, Mapping
from typing import cast
from urllib.parse import quote, urlsplit

from proxyd import http1

BUFFER_HIGH = 1 << 20
IDLE_S = 15.0
IDLE_MAX = 64  # connections kept open between requests
# A response released before its end (a stream read up to its finish reason and usage,
# whose last chunk is still on its way) may finish arriving: this much more, this soon,
# and its connection goes back to the pool; else it is closed.
DRAIN_BYTES = 64 << 10
DRAIN_S = 2.0
CLOCK_SLACK_S = 1e-3


class UpstreamError(Exception):
    """The upstream's connection failed to carry a response."""


class ConnectTimeout(UpstreamError):
    pass


class ConnectFailed(UpstreamError):
    pass


class Disconnected(UpstreamError):
    pass


class Malformed(UpstreamError):
    pass


def _due(loop: asyncio.AbstractEventLoop, until: float) -> bool:
    # A timer may ring up to the clock's resolution early (uvloop keeps milliseconds),
    # as asyncio's own loop counts a handle due within it.
    return loop.time() + CLOCK_SLACK_S >= until


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The system's trusted roots, loaded once (loading them costs tens of ms)."""
    return ssl.create_default_context()


class _Conn(asyncio.Protocol):
    def __init__(self, pool: Upstream) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.lost = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.response is None:
            self.close()  # bytes nobody asked for: the connection is out of step
            return
        self.response._received(data)

    def eof_received(self) -> bool | None:
        self.lost = True  # closing: never handed out again, even before connection_lost
        if self.response is not None:
            self.response._closed(None)
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool._forget(self)
        if self.response is not None:
            self.response._closed(exc)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    @property
    def usable(self) -> bool:
        return not self.lost and self.transport is not None and not self.transport.is_closing()


class Response:
    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self._parser = http1.ResponseParser()
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._settled = False
        self._drain: asyncio.TimerHandle | None = None  # released before its end
        self._drained = 0
        self._until: float | None = None  # when the wait under way gives up
        self._alarm: asyncio.TimerHandle | None = None
        self._alarm_at = 0.0

    @property
    def head(self) -> http1.Head:
        head = self._parser.head
        assert head is not None, "read only after post() returned"
        return head

    @property
    def status(self) -> int:
        return self.head.status

    @property
    def reason(self) -> str:
        return self.head.reason

    @property
    def headers(self) -> dict[str, str]:
        return self.head.headers

    @property
    def content_type(self) -> str:
        return self.head.content_type

    @property
    def at_eof(self) -> bool:
        return self._parser.done and not self._parser.buffered

    async def read_some(self, until: float | None = None) -> bytes:
        parser = self._parser
        while not parser.buffered and not parser.done:
            if self._error is not None:
                raise self._error
            await self._wait(until)
        data = parser.take()
        self._resume()
        return data

    async def read_all(self, limit: int, until: float | None = None) -> bytes:
        """The body, cut at `limit` bytes (the connection is then not reused)."""
        got = bytearray()
        while len(got) <= limit:
            data = await self.read_some(until)
            if not data:
                return bytes(got)
            got += data
        self.close()
        return bytes(got[:limit])

    def release(self) -> None:
        """Done with this response: its connection goes back to the pool once the whole
        response has arrived (now, or within DRAIN_BYTES and DRAIN_S) and the upstream
        keeps it alive; else it is closed."""
        if self._settled:
            return
        self._settled = True
        parser, conn = self._parser, self._conn
        self._resume()
        if self._error is not None or not conn.usable or parser.head is None \
                or not parser.head.keep_alive:
            self._let_go(False)
        elif parser.done:
            self._let_go(parser.reusable)
        else:
            parser.take()
            self._drain = asyncio.get_running_loop().call_later(
                DRAIN_S, self._let_go, False)

    def close(self) -> None:
        if not self._settled:
            self._settled = True
            self._let_go(False)

    def _resume(self) -> None:
        if self._paused and self._conn.transport is not None:
            self._paused = False
            self._conn.transport.resume_reading()

    def _let_go(self, reuse: bool) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None
        if self._drain is not None:
            self._drain.cancel()
            self._drain = None
        conn = self._conn
        if conn.response is self:
            conn.response = None
        if reuse and conn.usable:
            conn.pool._put(conn)
        else:
            conn.close()

    # -- fed by the connection ------------------------------------------------

    async def _head(self, until: float | None) -> None:
        while self._parser.head is None:
            if self._error is not None:
                raise self._error
            await self._wait(until)

    async def _wait(self, until: float | None) -> None:
        loop = asyncio.get_running_loop()
        self._until = until
        if until is not None:
            if _due(loop, until):
                raise TimeoutError
            if self._alarm is None or self._alarm_at > until:
                if self._alarm is not None:
                    self._alarm.cancel()
                self._alarm, self._alarm_at = loop.call_at(until, self._ring), until
        self._waiter = loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _ring(self) -> None:
        # The alarm rang: the wait under way gives up if its time came, else the alarm
        # moves to it (a later wait than the one it was set for).
        self._alarm = None
        waiter, until = self._waiter, self._until
        if waiter is None or waiter.done() or until is None:
            return
        loop = asyncio.get_running_loop()
        if _due(loop, until):
            waiter.set_exception(TimeoutError())
        else:
            self._alarm, self._alarm_at = loop.call_at(until, self._ring), until

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _received(self, data: bytes) -> None:
        try:
            self._parser.feed(data)
        except ValueError as exc:  # http1.BadResponse, and whatever else it could not read
            self._error = Malformed(str(exc))
            if self._drain is not None:
                self._let_go(False)
            else:
                self._conn.close()
        else:
            if self._drain is not None:  # released: the rest is read only to reuse the line
                self._drained += len(self._parser.take())
                if self._parser.done or self._drained > DRAIN_BYTES:
                    self._let_go(self._parser.reusable)
                return
            transport = self._conn.transport
            if self._parser.buffered > BUFFER_HIGH and not self._paused and transport:
                self._paused = True
                transport.pause_reading()
        self._wake()

    def _closed(self, exc: Exception | None) -> None:
        if self._drain is not None:
            self._let_go(False)
            return
        if self._error is None:
            try:
                self._parser.end()
            except http1.Cut as cut:
                why = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
                self._error = Disconnected(f"{cut}{why}")
            except http1.BadResponse as bad:
                self._error = Malformed(str(bad))
        self._wake()


class Upstream:
    def __init__(self, base_url: str, headers: Mapping[str, str], connect_timeout_s: float,
                 idle_s: float = IDLE_S, clock: Callable[[], float] = time.monotonic,
                 tls: ssl.SSLContext | None = None) -> None:
        """`tls`: the context for an https URL (default: the system's trusted roots)."""
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        for name, value in headers.items():
            if any(c in f"{name}{value}" for c in "\r\n\0"):
                raise ValueError(f"header {name!r}: a line break or NUL in its value")
        self.tls = url.scheme == "https"
        self._tls_context = tls
        self.host = url.hostname
        default = 443 if self.tls else 80
        self.port = url.port or default
        try:  # a name of other scripts goes out as its ASCII (punycode) form
            ascii_host = self.host.encode("idna").decode("ascii")
        except UnicodeError:
            raise ValueError(f"not a host name: {self.host!r}") from None
        bracketed = f"[{ascii_host}]" if ":" in ascii_host else ascii_host
        authority = bracketed if self.port == default else f"{bracketed}:{self.port}"
        self._prefix = quote(url.path.rstrip("/"), safe="/%:@!$&'()*+,;=~")
        self._query = f"?{quote(url.query, safe='=&%+/:,;@!$()*~')}" if url.query else ""
        fields = {"Host": authority, "User-Agent": "sanctum", **headers}
        if not all(f"{k}{v}".isascii() for k, v in fields.items()):
            raise ValueError("a header that is not ASCII (the API key?)")
        self._fields = "".join(f"{k}: {v}\r\n" for k, v in fields.items())
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s
        self._clock = clock
        self._idle: list[_Conn] = []
        self._open: set[_Conn] = set()

    async def post(self, path: str, body: bytes, until: float | None = None) -> Response:
        conn = self._take()
        if conn is None:
            if until is None:
                conn = await self._connect()
            else:
                async with asyncio.timeout_at(until):
                    conn = await self._connect()
        resp = Response(conn)
        conn.response = resp
        head = (f"POST {self._prefix}{path}{self._query} HTTP/1.1\r\n{self._fields}"
                f"Content-Length: {len(body)}\r\n\r\n")
        try:
            if not conn.usable or conn.transport is None:
                raise Disconnected("the connection closed before the request went out")
            try:
                conn.transport.write(head.encode("ascii") + body)
            except (RuntimeError, OSError) as exc:  # uvloop: a transport already closed
                raise Disconnected(f"the request could not be sent: {exc}") from exc
            await resp._head(until)
        except BaseException:
            resp.close()
            raise
        return resp

    async def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()

    # -- the pool -------------------------------------------------------------

    def _take(self) -> _Conn | None:
        now = self._clock()
        while self._idle:
            conn = self._idle.pop()
            if conn.usable and now - conn.idle_since <= self.idle_s:
                return conn
            conn.close()
        return None

    def _put(self, conn: _Conn) -> None:
        now = self._clock()
        # The newest is handed out first: the oldest, left from a burst, expire here.
        while self._idle and now - self._idle[0].idle_since > self.idle_s:
            self._idle.pop(0).close()
        if len(self._idle) >= IDLE_MAX:
            conn.close()
            return
        conn.idle_since = now
        self._idle.append(conn)

    def _forget(self, conn: _Conn) -> None:
        self._open.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Conn(self), self.host, self.port,
                    ssl=(self._tls_context or tls_context()) if self.tls else None,
                    server_hostname=self.host if self.tls else None)
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {self.host}:{self.port} within "
                                 f"{self.connect_timeout_s:g}s") from None
        except (OSError, ValueError) as exc:  # ValueError: a name IDNA cannot encode
            raise ConnectFailed(f"{self.host}:{self.port}: {exc}") from exc
        self._open.add(conn)
        return conn
