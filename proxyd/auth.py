"""Client authentication: who may use the proxy's port, on which routes, how often.

`auth` is the middleware.  With no client key configured (proxyd/keys.py) every
request passes; with keys, every path but `/health` and `/health/live` needs one,
sent as `Authorization: Bearer KEY` or `x-api-key: KEY` (the Anthropic door's
header).  In order, a request is refused with

    401 invalid_api_key / missing_api_key   no key, or a key the proxy does not know
    403 route_not_allowed                   the body's "model" is a route the key's
                                            allow-list does not name
    429 rate_limited + Retry-After          the key already made `rpm` requests in
                                            the last 60 s (`admit_rate`, on the
                                            proxy's clock)

each counted in `auth_failures{reason}` or `rate_limited{key}` by the key's name.
No message, log line or counter ever holds a presented or a configured key.  The key
that passed is kept on the request (`CLIENT`) for handlers that answer per key
(`GET /v1/models` lists only the routes it may use).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping

import msgspec
import structlog
from aiohttp import web

from proxyd.keys import ClientKey
from proxyd.proxy import PROXY, Proxy
from shared.errors import Forbidden, RateLimited, Unauthorized

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/health", "/health/live"})
RATE_PERIOD_S = 60.0
CLIENT = web.RequestKey("client_key", ClientKey)

log = structlog.get_logger()


class _Model(msgspec.Struct):
    model: str | None = None


_model_decoder = msgspec.json.Decoder(_Model)


def presented(headers: Mapping[str, str]) -> str | None:
    """The key a request presents: `Authorization: Bearer KEY`, else `x-api-key: KEY`."""
    scheme, _, token = headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    given = headers.get("x-api-key", "").strip()
    return given or None


def admit_rate(window: tuple[float, ...], now: float, rpm: int,
               period: float = RATE_PERIOD_S) -> tuple[tuple[float, ...], int | None]:
    """A sliding window: (the times of the requests still in it, None) when a request
    at `now` fits, fewer than `rpm` having come in the last `period` seconds, and it
    joins the window; else (the window without it, whole seconds until one fits)."""
    recent = tuple(t for t in window if t > now - period)
    if len(recent) < rpm:
        return (*recent, now), None
    frees_at = recent[len(recent) - rpm] + period
    return recent, max(1, math.ceil(frees_at - now))


def allowed_routes(request: web.Request) -> Callable[[str], bool]:
    """Whether the request's key may use a route (every route when there is no key)."""
    key = request.get(CLIENT)
    return key.may_use if key is not None else (lambda route: True)


async def _route_of(request: web.Request) -> str | None:
    """The body's "model", or None where there is none to read; the handler answers a
    body that does not parse, or one declared past max_body_bytes (refused unread).
    aiohttp keeps the body: the handler reads it again."""
    if request.method != "POST" or not request.can_read_body:
        return None
    declared = request.content_length
    if declared is not None and declared > request.app[PROXY].config.proxy.max_body_bytes:
        return None
    try:
        return _model_decoder.decode(await request.read()).model
    except msgspec.DecodeError:
        return None


def _refuse(proxy: Proxy, request: web.Request, reason: str, key: str | None = None) -> None:
    proxy.counters.inc("auth_failures", reason)
    log.info("auth_refused", reason=reason, key=key, method=request.method, path=request.path)


@web.middleware
async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    proxy = request.app[PROXY]
    if not proxy.keys or request.path in OPEN_PATHS:
        return await handler(request)
    given = presented(request.headers)
    if given is None:
        _refuse(proxy, request, "missing_key")
        raise Unauthorized("no API key: send Authorization: Bearer KEY (or x-api-key: KEY)",
                           code="missing_api_key")
    key = proxy.keys.find(given)
    if key is None:
        _refuse(proxy, request, "unknown_key")
        raise Unauthorized("the API key is not one this proxy knows")
    if key.routes:
        route = await _route_of(request)
        if route is not None and not key.may_use(route):
            _refuse(proxy, request, "route_not_allowed", key.name)
            raise Forbidden(f"the key {key.name!r} may not use the route {route!r}; it may "
                            f"use: {', '.join(key.routes)}", param="model")
    if key.rpm is not None:
        window, wait = admit_rate(proxy.rate_windows.get(key.name, ()), proxy.clock(), key.rpm)
        proxy.rate_windows[key.name] = window
        if wait is not None:
            proxy.counters.inc("rate_limited", key.name)
            log.info("rate_limited", key=key.name, rpm=key.rpm, retry_after_s=wait,
                     path=request.path)
            raise RateLimited(f"the key {key.name!r} is over its {key.rpm} requests per "
                              f"minute; retry after {wait} s", retry_after_s=wait)
    request[CLIENT] = key
    return await handler(request)
