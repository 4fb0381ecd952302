"""Client authentication: who may use the proxy's port.

`auth` is the middleware; `/health` and `/health/live` are open to all.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from proxyd.proxy import PROXY
from shared.errors import Unauthorized

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/health", "/health/live"})


@web.middleware
async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    keys = request.app[PROXY].api_keys
    if keys and request.path not in OPEN_PATHS:
        given = request.headers.get("Authorization", "")
        token = given[7:].strip() if given.lower().startswith("bearer ") else ""
        if token not in keys:
            raise Unauthorized("missing or unknown API key")
    return await handler(request)
