"""Plumbing between a front door and the ladder: events in, bytes out.

    serve(request, proxy, door, route, gen, headers) -> web.StreamResponse

The journey (proxyd/journey.py) decides; the door (proxyd/doors/openai_door.py)
renders; this writes.  Response headers are sent only at the commit point (the
answering seat's first text, or its whole answer), so `X-Sanctum-Seat` and
`X-Sanctum-Attempts` are true when they leave (the attempt that began the answer is
listed as `streaming`: it has not ended yet); `headers` are the door's own, sent
with them (X-Sanctum-Ignored).  A write that fails, or a client
whose transport is closing, ends the journey as a departure.  A begun stream quiet for
`keepalive_s` gets the door's keep-alive (`KeepAlive`).
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from aiohttp import web

from proxyd.doors.door import Door
from proxyd.events import Abort, Answer, Commit, Done, Text
from proxyd.journey import Journey
from proxyd.proxy import Proxy
from shared.config import RouteConfig
from shared.errors import SanctumError
from shared.protocol import Generate

STREAM_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _write(response: web.StreamResponse, data: bytes) -> bool:
    try:
        await response.write(data)
        return True
    except (ConnectionError, RuntimeError):
        return False


async def _commit(request: web.Request, door: Door, answer: Answer,
                  headers: dict[str, str]) -> web.StreamResponse | None:
    """Send the headers (and the door's opening chunk, if it has one); None when the
    client is already gone.  Only a stream commits before its end."""
    response = web.StreamResponse(headers={**STREAM_HEADERS, **answer.headers(), **headers})
    try:
        await response.prepare(request)
    except ConnectionError:
        return None
    first = door.opening(answer)
    if first:
        await _write(response, first)
    return response


class KeepAlive:
    """The door's keep-alive, written into a begun stream whenever nothing else was
    written for `every` seconds (config `keepalive_s`): a tool call held whole until
    it parses, or a stall within its budget, is quiet for long stretches, and a
    client or a proxy between may take the quiet for a dead connection.  Each write is
    one transport write, so a keep-alive never lands inside another event."""

    def __init__(self, response: web.StreamResponse, door: Door, every: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.response, self.door, self.every = response, door, every
        self.last = self.loop.time()
        self.task = asyncio.create_task(self._run())

    def wrote(self) -> None:
        self.last = self.loop.time()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(max(0.0, self.last + self.every - self.loop.time()))
            if self.loop.time() - self.last >= self.every:
                if not await _write(self.response, self.door.keepalive()):
                    return
                self.wrote()

    def stop(self) -> None:
        self.task.cancel()


async def serve(request: web.Request, proxy: Proxy, door: Door, route: RouteConfig,
                gen: Generate, headers: dict[str, str] | None = None) -> web.StreamResponse:
    own = headers or {}
    journey = Journey(proxy, route, gen, request.headers.get("X-Sanctum-Offbox"),
                      lambda: gone(request))
    response: web.StreamResponse | None = None
    answer: Answer | None = None
    quiet: KeepAlive | None = None
    try:
        async with aclosing(journey.events()) as events:
            async for event in events:
                if type(event) is Text:
                    assert response is not None and answer is not None and quiet is not None
                    if gone(request) or not await _write(response, door.text(answer, event)):
                        journey.left()
                        return response
                    quiet.wrote()
                elif isinstance(event, Commit):
                    answer = event.answer
                    response = await _commit(request, door, answer, own)
                    if response is None:
                        journey.left()
                        return web.Response(status=499)
                    quiet = KeepAlive(response, door, proxy.config.proxy.keepalive_s)
                elif isinstance(event, Done):
                    a = event.answer
                    if not door.stream:
                        return web.Response(body=door.body(event),
                                            content_type="application/json",
                                            headers={**a.headers(), **own})
                    if response is None:
                        response = await _commit(request, door, a, own)
                        if response is None:  # answered, but its client left meanwhile
                            proxy.counters.inc("client_disconnects")
                            return web.Response(status=499)
                    closing = door.closing(a, event.finish_reason, event.usage)
                    if a.continued:  # after [DONE]: every rung's part, for who reads on
                        closing += door.trailer(a)
                    await _write(response, closing)
                    return response
                elif isinstance(event, Abort):
                    assert response is not None
                    proxy.counters.inc("door_errors", door.name, "midstream")
                    extra: dict[str, object] = {"seat": event.seat, "attempts": event.attempts,
                                                "segments": event.segments}
                    if event.over_cap:
                        extra["over_cap"] = event.over_cap
                    await _write(response, door.error_event(event.message, event.code, extra))
                    return response
    except SanctumError as exc:
        # Refused after the commit (a continuing rung whose template refuses the chat):
        # the headers are gone, so the stream ends with the door's error event; before
        # the commit the error middleware answers it in the door's shape.
        if response is None:
            raise
        proxy.counters.inc("midstream_aborts")
        proxy.counters.inc("door_errors", door.name, "midstream")
        await _write(response, door.error_event(exc.message, exc.code,
                                                {"seat": journey.seat, **exc.extra}))
        return response
    except asyncio.CancelledError:
        # The proxy is stopping past its drain: end a begun answer honestly.
        if response is not None:
            proxy.counters.inc("midstream_aborts")
            proxy.counters.inc("door_errors", door.name, "midstream")
            await _write(response, door.error_event(
                "the proxy stopped before the answer was complete", "proxy_shutdown",
                {"seat": journey.seat}))
        raise
    finally:
        if quiet is not None:
            quiet.stop()
    return response or web.Response(status=499)
