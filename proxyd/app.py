"""The aiohttp application: routes, middleware, and the front doors.

A door's handler parses its API's body into a `Generate` (proxyd/doors/openai_api.py for
chat and text completions, proxyd/doors/anthropic_api.py for Anthropic Messages,
proxyd/doors/openai_responses_api.py for OpenAI Responses), picks the route and the door that
renders its format, and hands both to the plumbing (proxyd/front.py), which runs the
ladder (proxyd/journey.py).  The body's top-level fields unknown to its API are counted
(`ignored_fields{field}`) and named in `X-Sanctum-Ignored` on the answer, or on the
error, whichever the request gets.  Errors take the shape of the door they came to
(proxyd/doors/__init__.py); each door counts its requests and its errors by type.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import msgspec
import structlog
from aiohttp import web
from aiohttp.web_urldispatcher import _default_expect_handler

from proxyd.auth import allowed_routes, auth
from proxyd.cors import allowed, answer_headers, preflight
from proxyd.counters import render_metrics
from proxyd.doors import anthropic_api, door_of, error_body, openai_responses_api
from proxyd.doors.door import Door
from proxyd.doors.openai_api import ChatRequest, CompletionRequest, read_chat, read_completion
from proxyd.doors.openai_fields import ignored_fields, ignored_header
from proxyd.front import serve
from proxyd.hosted import HostedClient
from proxyd.limits import OverSize, body_too_large, check_body, refused_field
from proxyd.proxy import PROXY, Proxy
from proxyd.readiness import health, live
from proxyd.seat_client import SeatClient
from shared.clock import Clock
from shared.clock import monotonic as real_clock
from shared.config import Config, ProxyConfig, RouteConfig
from shared.errors import ClientError, NotFound, SanctumError
from shared.protocol import Generate, SamplingParams

REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


RID = web.RequestKey("request_id", str)
# X-Sanctum-Ignored of a request whose body named fields unknown to its API: on its
# answer and on its error alike.
IGNORED = web.RequestKey("ignored", str)


def request_id(request: web.Request) -> str:
    given = request.headers.get("X-Request-Id", "")
    return given if given and REQUEST_ID.match(given) else os.urandom(16).hex()


# -- middleware -----------------------------------------------------------


def json_response(body: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status,
                        content_type="application/json", headers=headers)


def error_response(exc: SanctumError, rid: str | None = None,
                   ignored: str | None = None,
                   body: dict[str, Any] | None = None) -> web.Response:
    """The error as a response: `body` in the door's shape (OpenAI's by default)."""
    headers = {"X-Request-Id": rid} if rid else {}
    if ignored:
        headers["X-Sanctum-Ignored"] = ignored
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    if exc.should_retry is False:
        headers["x-should-retry"] = "false"
    if exc.status == 401:  # RFC 9110: a 401 names the scheme it wants
        headers["WWW-Authenticate"] = 'Bearer realm="sanctum"'
    return json_response(exc.body() if body is None else body, exc.status, headers or None)


def _refused(request: web.Request, exc: SanctumError) -> web.Response:
    counters = request.app[PROXY].counters
    if exc.status < 500:
        counters.inc("bad_requests")
    field = refused_field(exc)
    if field is not None:
        counters.inc("input_refused", field)
    door = door_of(request.path)
    body, kind = error_body(door, exc)
    if door is not None and RID not in request:  # refused before its handler ran
        request[RID] = request_id(request)
        counters.inc("door_requests", door)  # so a door never has more errors than requests
    if door == "messages":  # Anthropic's errors name their request
        body["request_id"] = request[RID]
    if door is not None:
        counters.inc("door_errors", door, kind)
    return error_response(exc, request.get(RID), request.get(IGNORED), body)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every refusal in the error shape of the door it came to (OpenAI's elsewhere):
    ours and aiohttp's own (404, 405, and 413 for a body past client_max_size)."""
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
        error = ClientError(exc.reason, status=exc.status,
                            code=exc.reason.lower().replace(" ", "_"))
        door = door_of(request.path)
        return json_response(error_body(door, error)[0], exc.status,
                             {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers
                             else None)


@web.middleware
async def cors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A listed origin's preflight, answered before any key is asked for
    (proxyd/cors.py); everything else goes on."""
    origin = request.headers.get("Origin")
    if (request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers
            and origin and allowed(origin, request.app[PROXY].config.proxy.cors_origins)):
        return web.Response(status=204, headers=preflight(
            origin, request.headers.get("Access-Control-Request-Headers")))
    return await handler(request)


async def _cors_answer(request: web.Request, response: web.StreamResponse) -> None:
    """A listed origin's answer (a stream's too, as it starts) names the origin."""
    origin = request.headers.get("Origin")
    if origin and allowed(origin, request.app[PROXY].config.proxy.cors_origins) \
            and "Access-Control-Allow-Origin" not in response.headers:
        response.headers.update(answer_headers(origin))


# -- handlers -------------------------------------------------------------


def _route(proxy: Proxy, model: str) -> RouteConfig:
    route = proxy.routes.get(model)
    if route is None:
        raise NotFound(f"no route named {model!r}; GET /v1/models lists them", param="model")
    return route


def _begin(request: web.Request) -> str:
    """Count the request (and at its door) and give it its id (the client's, when it sent
    a usable one)."""
    counters = request.app[PROXY].counters
    counters.inc("requests")
    door = door_of(request.path)
    if door is not None:
        counters.inc("door_requests", door)
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


def _ignored(request: web.Request, names: tuple[str, ...]) -> dict[str, str]:
    """Count the body's unknown fields, and name them on whatever answers the request."""
    if not names:
        return {}
    request.app[PROXY].counters.ignored(names)
    request[IGNORED] = ignored_header(names)
    return {"X-Sanctum-Ignored": request[IGNORED]}


class DoorCall(Protocol):
    """A door's request body, read and checked (openai_api.Chat, anthropic_api.Messages,
    openai_responses_api.ResponsesCall ...)."""

    @property
    def model(self) -> str: ...
    @property
    def ignored(self) -> tuple[str, ...]: ...
    def generate(self, request_id: str) -> Generate: ...
    def door(self) -> Door: ...


Reader = Callable[[bytes, ProxyConfig], DoorCall]


def door_handler(read: Reader, kind: type[msgspec.Struct]) -> Handler:
    """The handler of a door: `read` turns the body into its call (a 400/413 naming the
    field otherwise; `kind` is the body's Struct, whose unknown fields are still named
    on that error), then the ladder serves it."""

    async def handle(request: web.Request) -> web.StreamResponse:
        rid = _begin(request)
        proxy = request.app[PROXY]
        body = await read_body(request)
        try:
            call = read(body, proxy.config.proxy)
        except SanctumError:
            _ignored(request, ignored_fields(body, kind))
            raise
        headers = _ignored(request, call.ignored)
        route = _route(proxy, call.model)
        # aiohttp runs each request in a task of its own, in a copy of the connection's
        # context: the binding names every line of this request and ends with it.
        structlog.contextvars.bind_contextvars(request_id=rid)
        return await serve(request, proxy, call.door(), route, call.generate(rid), headers)

    return handle


chat_completions = door_handler(read_chat, ChatRequest)
completions = door_handler(read_completion, CompletionRequest)
messages = door_handler(anthropic_api.read_messages, anthropic_api.MessagesRequest)
responses = door_handler(openai_responses_api.read_responses,
                         openai_responses_api.ResponsesRequest)


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt's tokens by the tokenizer of the
    route's first local rung (the seat's own), else its hosted rung's bound."""
    rid = _begin(request)
    proxy = request.app[PROXY]
    body = await read_body(request)
    try:
        call = anthropic_api.read_count_tokens(body, proxy.config.proxy)
    except SanctumError:
        _ignored(request, ignored_fields(body, anthropic_api.CountTokensRequest))
        raise
    headers = _ignored(request, call.ignored)
    route = _route(proxy, call.model)
    gen = Generate(rid, False, SamplingParams(), messages=call.messages,
                   tools_json=call.tools_json)
    counted = await proxy.admission.count(
        [proxy.config.seat_by_name(n) for n in route.ladder], gen)
    if counted is None:
        refusal = SanctumError(f"no rung of the route {route.model!r} can count tokens "
                               "here", code="no_tokenizer", status=501)
        refusal.should_retry = False  # no retry would change it
        raise refusal
    tokens, seat = counted
    return json_response({"input_tokens": tokens},
                         headers={"X-Request-Id": rid, "X-Sanctum-Seat": seat, **headers})


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
    hosted = {n: {"served": c.served} for n, c in proxy.clients.items()
              if isinstance(c, HostedClient)}
    return json_response({"proxy": snapshot, "seats": seats, "hosted": hosted})


async def metrics(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    live = {name: {"rows_active": c.pong.rows, "rows_queued": c.pong.queued,
                   "kv_bytes": c.pong.kv_bytes, "loaded_bytes": c.pong.loaded_bytes,
                   "kv_budget_bytes": c.pong.kv_budget_bytes,
                   "memory_budget_bytes": c.pong.memory_budget_bytes}
            for name, c in proxy.clients.items() if isinstance(c, SeatClient) and c.pong}
    now = proxy.clock()
    states = {name: c.state.value for name, c in proxy.clients.items()
              if isinstance(c, SeatClient)}
    for name, c in proxy.clients.items():
        if isinstance(c, SeatClient) and c.on_demand and c.state.value == "ready":
            live.setdefault(name, {})["idle_seconds"] = int(now - c.last_used) if c.idle else 0
    body = render_metrics(proxy.counters, await proxy.seat_counters(), live, states)
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    proxy = app[PROXY]
    await proxy.start()
    yield
    await proxy.stop()


def make_app(config: Config, clock: Clock = real_clock) -> web.Application:
    """The application; `clock` decides breakers and seat clocks (tests pass a ManualClock)."""
    proxy = Proxy(config, clock)
    # With no keys every request passes `auth`: it is not a layer of every request then;
    # nor is CORS without an origin listed.
    layers = [errors, auth] if proxy.keys else [errors]
    if config.proxy.cors_origins:
        layers.insert(0, cors)
    app = web.Application(middlewares=layers, client_max_size=config.proxy.max_body_bytes)
    if config.proxy.cors_origins:
        app.on_response_prepare.append(_cors_answer)
    app[PROXY] = proxy
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect_body)
    app.router.add_post("/v1/completions", completions, expect_handler=expect_body)
    app.router.add_post("/v1/messages", messages, expect_handler=expect_body)
    app.router.add_post("/v1/messages/count_tokens", count_tokens, expect_handler=expect_body)
    app.router.add_post("/v1/responses", responses, expect_handler=expect_body)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/health/live", live)
    app.router.add_get("/counters", counters)
    app.router.add_get("/metrics", metrics)
    return app
