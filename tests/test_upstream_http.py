"""proxyd/upstream_http.py against a real server on loopback that answers scripted bytes.

Each test runs on uvloop (proxyd's loop) and on asyncio's own.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import struct
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from proxyd import upstream_http
from proxyd.upstream_http import (
    BUFFER_HIGH,
    ConnectFailed,
    Disconnected,
    Malformed,
    Upstream,
)
from shared.loops import new_event_loop

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
Answer = Callable[[int, bytes, asyncio.StreamWriter], Awaitable[bool]]


class Server:
    """Reads each request whole (head and Content-Length body), then `answer(n, request,
    writer)` writes what the test scripts; False from it closes the connection."""

    def __init__(self, answer: Answer, tls: ssl.SSLContext | None = None) -> None:
        self.answer = answer
        self.tls = tls
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed_by_client = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for w in self.writers:
            w.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed_by_client += 1
                    return
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                if not await self.answer(len(self.requests), request, writer):
                    writer.close()
                    return
        except ConnectionError:
            return


def both_loops(test: Callable[[], Awaitable[None]]) -> Callable[[str], None]:
    @pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
    def run(loop_kind: str) -> None:
        loop = new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
        try:
            loop.run_until_complete(asyncio.wait_for(test(), 30))
        finally:
            loop.close()
    run.__doc__ = test.__doc__
    return run


async def until(fact: Callable[[], bool]) -> None:
    while not fact():
        await asyncio.sleep(0.005)


async def ok(n: int, request: bytes, w: asyncio.StreamWriter) -> bool:
    w.write(OK)
    return True


@both_loops
async def test_keep_alive_reuses_one_connection_and_sends_the_request_whole() -> None:
    """Three requests, one connection; the request names the host, the base path and the
    pool's headers, and carries its body."""
    async with Server(ok) as server:
        up = Upstream(f"http://127.0.0.1:{server.port}/v1?api-version=1",
                      {"Authorization": "Bearer k"}, 1.0)
        for i in range(3):
            resp = await up.post("/chat/completions", b'{"i": %d}' % i)
            assert resp.status == 200 and await resp.read_some() == b"ok"
            assert await resp.read_some() == b"" and resp.at_eof
            resp.release()
        assert server.connections == 1
        first = server.requests[0]
        assert first.startswith(b"POST /v1/chat/completions?api-version=1 HTTP/1.1\r\n")
        assert f"Host: 127.0.0.1:{server.port}\r\n".encode() in first
        assert b"Authorization: Bearer k\r\n" in first and first.endswith(b'{"i": 0}')
        await up.close()
        await until(lambda: server.closed_by_client == 1)


@both_loops
async def test_a_response_that_closes_or_is_left_unread_is_not_reused() -> None:
    """`Connection: close`, and a body released before its end, each cost a connection."""
    async def answer(n: int, request: bytes, w: asyncio.StreamWriter) -> bool:
        if n == 1:
            w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
            return False
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n")
        return True  # the last chunk never comes
    async with Server(answer) as server:
        up = Upstream(f"http://127.0.0.1:{server.port}", {}, 1.0)
        for _ in range(3):
            resp = await up.post("/x", b"")
            await resp.read_some()
            resp.release()
        assert server.connections == 3
        await up.close()


@both_loops
async def test_a_reset_before_the_head_and_a_cut_body_are_disconnects() -> None:
    """A reset before any byte fails the post; a close inside a promised body fails the
    read after the bytes that did arrive."""
    async def answer(n: int, request: bytes, w: asyncio.StreamWriter) -> bool:
        if n == 1:
            sock = w.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False  # closed with linger 0: a reset
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        return False
    async with Server(answer) as server:
        up = Upstream(f"http://127.0.0.1:{server.port}", {}, 1.0)
        with pytest.raises(Disconnected):
            await up.post("/x", b"")
        resp = await up.post("/x", b"")
        got = b""
        with pytest.raises(Disconnected, match="before the end"):
            while True:
                got += await resp.read_some()
        assert got == b"partial" and not resp.at_eof
        resp.release()
        await up.close()


@both_loops
async def test_a_refused_port_fails_to_connect_and_garbage_is_malformed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    up = Upstream(f"http://127.0.0.1:{port}", {}, 1.0)
    with pytest.raises(ConnectFailed, match=str(port)):
        await up.post("/x", b"")

    async def answer(n: int, request: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        return True
    async with Server(answer) as server:
        up = Upstream(f"http://127.0.0.1:{server.port}", {}, 1.0)
        with pytest.raises(Malformed):
            await up.post("/x", b"")
        await until(lambda: server.closed_by_client == 1)  # never reused


@both_loops
async def test_an_idle_connection_expires_and_stray_bytes_end_one() -> None:
    """On the pool's clock, a connection idle past `idle_s` is closed, not reused; bytes
    an upstream sends between requests put a connection out of step: it is dropped."""
    now = [0.0]

    async def answer(n: int, request: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(OK + (b"HTTP/1.1 200 OK\r\n" if n == 3 else b""))
        return True
    async with Server(answer) as server:
        up = Upstream(f"http://127.0.0.1:{server.port}", {}, 1.0, idle_s=10.0,
                      clock=lambda: now[0])
        for step in (0.0, 9.0, 11.0, 0.0):
            now[0] += step
            resp = await up.post("/x", b"")
            assert await resp.read_all(100) == b"ok"
            resp.release()
        # 1 connection for the first two requests, a new one after 11 s idle; the third
        # answer's stray bytes closed that one, so the fourth request opened a third.
        assert server.connections == 3
        await up.close()


@both_loops
async def test_a_large_body_pauses_reading_until_it_is_read() -> None:
    """32 MiB sent at once: past BUFFER_HIGH unread bytes the connection stops reading,
    and every byte arrives in order once read."""
    size = 32 << 20
    body = bytes(range(256)) * (size // 256)

    async def answer(n: int, request: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + body)
        return True
    async with Server(answer) as server:
        up = Upstream(f"http://127.0.0.1:{server.port}", {}, 1.0)
        resp = await up.post("/x", b"")
        await until(lambda: resp._parser.buffered > BUFFER_HIGH)
        transport = resp._conn.transport
        assert transport is not None and not transport.is_reading()
        got = bytearray()
        while data := await resp.read_some():
            got += data
        assert got == body and resp.at_eof
        resp.release()
        await up.close()


def test_a_header_that_cannot_go_on_the_wire_is_refused() -> None:
    with pytest.raises(ValueError, match="line break"):
        Upstream("http://127.0.0.1:1", {"Authorization": "Bearer k\r\nX-Evil: 1"}, 1.0)
    with pytest.raises(ValueError, match="ASCII"):
        Upstream("http://127.0.0.1:1", {"Authorization": "Bearer \u201ck\u201d"}, 1.0)
    with pytest.raises(ValueError, match="http"):
        Upstream("ftp://example.com", {}, 1.0)


LAST = b"0\r\n\r\n"
STREAM = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
          b"b\r\ndata: done\n\r\n")


@both_loops
async def test_a_stream_released_before_its_last_chunk_is_reused_once_it_comes() -> None:
    """An answer read to its finish reason is released before the stream's last chunk;
    when that chunk comes, the connection serves the next request.  One whose last chunk
    never comes is closed after DRAIN_S, and the next request opens another."""
    go = asyncio.Event()

    async def answer(n: int, request: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(STREAM)
        if n == 1:
            await go.wait()
            w.write(LAST)
        return True
    async with Server(answer) as server:
        up = Upstream(f"http://127.0.0.1:{server.port}", {}, 1.0)
        resp = await up.post("/x", b"")
        assert await resp.read_some() == b"data: done\n"
        resp.release()
        go.set()
        await until(lambda: len(up._idle) == 1)
        resp = await up.post("/x", b"")  # the second answer's last chunk never comes
        assert server.connections == 1
        assert await resp.read_some() == b"data: done\n"
        upstream_http.DRAIN_S, drain = 0.05, upstream_http.DRAIN_S
        try:
            resp.release()
        finally:
            upstream_http.DRAIN_S = drain
        await until(lambda: server.closed_by_client == 1)
        resp = await up.post("/x", b"")
        assert server.connections == 2
        resp.close()
        await up.close()



@both_loops
async def test_each_wait_gives_up_at_its_own_time_under_one_alarm() -> None:
    """A response keeps one alarm for its waits.  A read whose time is later than the
    head's outlives the head's (the alarm moves on when it rings early); a read whose
    time is earlier is cut at it; data already waiting is read whatever the time; and
    a released response leaves no alarm behind."""
    go = asyncio.Event()

    async def answer(n: int, request: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await go.wait()
        w.write(b"2\r\nab\r\n")
        if n == 2:
            w.write(LAST)
        return True
    async with Server(answer) as server:
        up = Upstream(f"http://127.0.0.1:{server.port}", {}, 1.0)
        loop = asyncio.get_running_loop()
        head_by = loop.time() + 0.05
        resp = await up.post("/x", b"", head_by)
        read = asyncio.ensure_future(resp.read_some(loop.time() + 30))
        await until(lambda: loop.time() > head_by + 0.05)  # the head's time has passed
        assert not read.done()
        go.set()
        assert await read == b"ab"
        with pytest.raises(TimeoutError):  # nothing more comes; this read's time is short
            await resp.read_some(loop.time() + 0.05)
        assert loop.time() < head_by + 30
        resp.close()
        assert resp._alarm is None
        go.clear()
        resp = await up.post("/x", b"", loop.time() + 30)
        go.set()
        await until(lambda: resp._parser.done)
        assert await resp.read_some(loop.time() - 1) == b"ab"  # waiting: read, never late
        assert await resp.read_some(loop.time() - 1) == b"" and resp.at_eof
        resp.release()
        assert resp._alarm is None
        await up.close()


@both_loops
async def test_a_connection_the_upstream_closes_after_its_answer_is_not_handed_out() -> None:
    """A keep-alive answer followed by a close: once the close has arrived, the pooled
    connection is not handed out; the next request opens a new one and is answered.
    (A close that crosses the next request on the wire is a `Disconnected`, which the
    rung's retry policy tries again as `connection_reset`.)"""
    async def answer(n: int, request: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(OK)
        await w.drain()
        return False
    async with Server(answer) as server:
        up = Upstream(f"http://127.0.0.1:{server.port}", {}, 1.0)
        for _ in range(3):
            resp = await up.post("/x", b"")
            assert await resp.read_all(10) == b"ok"
            resp.release()
            conns = list(up._open)
            await until(lambda conns=conns: all(not c.usable for c in conns))  # closed
        assert server.connections == 3
        await up.close()


def self_signed(where: Path) -> tuple[Path, Path]:
    """A certificate for localhost and its key, made by the openssl command."""
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_https_verifies_the_certificate_and_keeps_the_connection(loop_kind: str,
                                                                 tmp_path: Path) -> None:
    """Over TLS: a certificate the client trusts answers, twice on one connection; with the
    system's roots, the same self-signed certificate is refused at connect."""
    cert, key = self_signed(tmp_path)
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))

    async def main() -> None:
        async with Server(ok, tls=served) as server:
            up = Upstream(f"https://localhost:{server.port}/v1", {}, 5.0, tls=trusting)
            for _ in range(2):
                resp = await up.post("/chat/completions", b"{}")
                assert resp.status == 200 and await resp.read_all(100) == b"ok"
                resp.release()
            assert server.connections == 1
            assert f"Host: localhost:{server.port}\r\n".encode() in server.requests[0]
            await up.close()
            strict = Upstream(f"https://localhost:{server.port}/v1", {}, 5.0)
            with pytest.raises(ConnectFailed, match="certificate"):
                await strict.post("/chat/completions", b"{}")
    loop = new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(main(), 30))
    finally:
        loop.close()
