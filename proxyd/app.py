"""The aiohttp application: routes, middleware, and the OpenAI front doors.

A completion handler parses its API's body into a `Generate`, picks the route and
the door that renders its format (proxyd/responses.py), and hands both to the
plumbing (proxyd/front.py), which runs the ladder (proxyd/journey.py).  The body's
top-level fields unknown to its API are counted (`ignored_fields{field}`) and named in
`X-Sanctum-Ignored` on the answer, or on the error, whichever the request gets.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import structlog
from aiohttp import web
from aiohttp.web_urldispatcher import _default_expect_handler

from proxyd.auth import allowed_routes, auth
from proxyd.counters import render_metrics
from proxyd.front import serve
from proxyd.hosted import HostedClient
from proxyd.limits import OverSize, body_too_large, check_body, refused_field
from proxyd.openai_api import ChatRequest, CompletionRequest, read_chat, read_completion
from proxyd.openai_fields import ignored_fields, ignored_header
from proxyd.proxy import PROXY, Proxy
from proxyd.readiness import health, live
from proxyd.responses import ChatDoor, CompletionDoor, Door
from proxyd.seat_client import SeatClient
from shared.clock import Clock
from shared.clock import monotonic as real_clock
from shared.config import Config, RouteConfig
from shared.errors import NotFound, SanctumError

REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


RID = web.RequestKey("request_id", str)
# X-Sanctum-Ignored of a request whose body named fields unknown to its API: on its
# answer and on its error alike.
IGNORED = web.RequestKey("ignored", str)


def request_id(request: web.Request) -> str:
    given = request.headers.get("X-Request-Id", "")
    return given if REQUEST_ID.match(given) else uuid.uuid4().hex


# -- middleware -----------------------------------------------------------


def json_response(body: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status,
                        content_type="application/json", headers=headers)


def error_response(exc: SanctumError, rid: str | None = None,
                   ignored: str | None = None) -> web.Response:
    headers = {"X-Request-Id": rid} if rid else {}
    if ignored:
        headers["X-Sanctum-Ignored"] = ignored
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    if exc.status == 401:  # RFC 9110: a 401 names the scheme it wants
        headers["WWW-Authenticate"] = 'Bearer realm="sanctum"'
    return json_response(exc.body(), exc.status, headers or None)


def _refused(request: web.Request, exc: SanctumError) -> web.Response:
    counters = request.app[PROXY].counters
    if exc.status < 500:
        counters.inc("bad_requests")
    field = refused_field(exc)
    if field is not None:
        counters.inc("input_refused", field)
    return error_response(exc, request.get(RID), request.get(IGNORED))


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every refusal in the OpenAI error shape: ours and aiohttp's own (404, 405, and
    413 for a body past client_max_size)."""
    try:
        return await handler(request)
    except SanctumError as exc:
        return _refused(request, exc)
    except web.HTTPRequestEntityTooLarge:
        # Only a body whose size was not declared (chunked) or grew as it was read
        # (compressed) gets here: read_body refuses a declared one before reading it.
        return _refused(request, body_too_large(request.app[PROXY].config.proxy))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        body = {"error": {"message": exc.reason, "type": "invalid_request_error",
                          "code": exc.reason.lower().replace(" ", "_"), "param": None}}
        return json_response(body, exc.status)


# -- handlers -------------------------------------------------------------


def _route(proxy: Proxy, model: str) -> RouteConfig:
    route = proxy.routes.get(model)
    if route is None:
        raise NotFound(f"no route named {model!r}; GET /v1/models lists them", param="model")
    return route


def _begin(request: web.Request) -> str:
    """Count the request and give it its id (the client's, when it sent a usable one)."""
    request.app[PROXY].counters.inc("requests")
    rid: str = request_id(request)
    request[RID] = rid
    return rid


async def read_body(request: web.Request) -> bytes:
    """The body, within max_body_bytes: a declared Content-Length past it is refused
    before a byte is read; a chunked or compressed body past it, by aiohttp as it
    reads (client_max_size, answered by the errors middleware)."""
    check_body(request.content_length, request.app[PROXY].config.proxy)
    return await request.read()


async def expect_body(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue` for a declared body past max_body_bytes: the 413 goes back
    instead of the 100, so the body is never sent (curl asks so for any body over 1 MiB).
    Any other: aiohttp's own answer (aiohttp has no public name for it)."""
    try:
        check_body(request.content_length, request.app[PROXY].config.proxy)
    except OverSize as exc:
        return _refused(request, exc)
    await _default_expect_handler(request)
    return None


def _usage(req: Any) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _ignored(request: web.Request, names: tuple[str, ...]) -> dict[str, str]:
    """Count the body's unknown fields, and name them on whatever answers the request."""
    if not names:
        return {}
    request.app[PROXY].counters.ignored(names)
    request[IGNORED] = ignored_header(names)
    return {"X-Sanctum-Ignored": request[IGNORED]}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    rid = _begin(request)
    proxy = request.app[PROXY]
    body = await read_body(request)
    try:
        chat = read_chat(body, proxy.config.proxy)
    except SanctumError:
        _ignored(request, ignored_fields(body, ChatRequest))
        raise
    headers = _ignored(request, chat.ignored)
    req = chat.req
    door: Door = ChatDoor(req.stream, _usage(req), logprobs=chat.params.logprobs is not None)
    with structlog.contextvars.bound_contextvars(request_id=rid):
        return await serve(request, proxy, door, _route(proxy, req.model), chat.generate(rid),
                           headers)


async def completions(request: web.Request) -> web.StreamResponse:
    rid = _begin(request)
    proxy = request.app[PROXY]
    body = await read_body(request)
    try:
        done = read_completion(body, proxy.config.proxy)
    except SanctumError:
        _ignored(request, ignored_fields(body, CompletionRequest))
        raise
    headers = _ignored(request, done.ignored)
    req = done.req
    door: Door = CompletionDoor(req.stream, _usage(req),
                                logprobs=done.params.logprobs is not None,
                                echo=done.prompt if req.echo else "")
    with structlog.contextvars.bound_contextvars(request_id=rid):
        return await serve(request, proxy, door, _route(proxy, req.model), done.generate(rid),
                           headers)


async def models(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    may_use = allowed_routes(request)  # a key with an allow-list sees only its routes
    data = [{"id": r.model, "object": "model", "created": 0, "owned_by": "sanctum",
             "ladder": list(r.ladder), "offbox": r.offbox}
            for r in proxy.config.route if may_use(r.model)]
    return json_response({"object": "list", "data": data})


async def counters(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    snapshot = proxy.counters.snapshot()
    snapshot["circuits"] = {n: b.circuit.value for n, b in proxy.breakers.items()}
    seats = await proxy.seat_counters()
    for name, totals in (await proxy.supervisor_totals()).items():
        seat = seats.get(name)
        if seat is not None:
            seat.update(totals)
    hosted = {n: {"served": c.served} for n, c in proxy.clients.items()
              if isinstance(c, HostedClient)}
    return json_response({"proxy": snapshot, "seats": seats, "hosted": hosted})


async def metrics(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    live = {name: {"rows_active": c.pong.rows, "rows_queued": c.pong.queued,
                   "kv_bytes": c.pong.kv_bytes}
            for name, c in proxy.clients.items() if isinstance(c, SeatClient) and c.pong}
    body = render_metrics(proxy.counters, await proxy.seat_counters(), live)
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    proxy = app[PROXY]
    await proxy.start()
    yield
    await proxy.stop()


def make_app(config: Config, clock: Clock = real_clock) -> web.Application:
    """The application; `clock` decides breakers and seat clocks (tests pass a ManualClock)."""
    app = web.Application(middlewares=[errors, auth],
                          client_max_size=config.proxy.max_body_bytes)
    app[PROXY] = Proxy(config, clock)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect_body)
    app.router.add_post("/v1/completions", completions, expect_handler=expect_body)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/health/live", live)
    app.router.add_get("/counters", counters)
    app.router.add_get("/metrics", metrics)
    return app
