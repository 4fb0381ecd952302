"""Browser pages on the household network (a notes app, a chat page) calling the port:
CORS for the origins the config lists, and for no other.

    [proxy] cors_origins = ["http://192.168.1.10:3000"]      (default: none, no CORS)

A preflight (`OPTIONS` with `Access-Control-Request-Method`) from a listed origin is
answered at once, without a key (a browser sends none there): the methods, the headers
clients send (the asked ones, when each is a plain header name), and how long a browser
may keep the answer.  A real request from a listed origin is answered as any other
(its key is still needed) with `Access-Control-Allow-Origin` naming it, and the headers
a page may read (`X-Sanctum-*`, `X-Request-Id`, `Retry-After`).  An unlisted origin gets
no CORS header at all, so its browser withholds the answer.  `"*"` lists every origin:
`sanctum check` warns when it is set together with keys (a key in a page's code is
readable by anyone who loads it).

    allowed(origin, origins) -> bool
    preflight(origin, asked_headers) -> headers
    answer_headers(origin) -> headers
"""

from __future__ import annotations

import re
from collections.abc import Sequence

ANY = "*"
METHODS = "GET, POST, OPTIONS"
# What the openai and anthropic SDKs and fetch() send.
HEADERS = ("authorization, content-type, x-api-key, anthropic-version, anthropic-beta, "
           "openai-organization, openai-project, x-request-id, x-sanctum-offbox")
EXPOSED = ("X-Request-Id, X-Sanctum-Seat, X-Sanctum-Attempts, X-Sanctum-Ignored, "
           "X-Sanctum-Speculation, Retry-After")
MAX_AGE_S = 600
_HEADER_LIST = re.compile(r"^[A-Za-z0-9-]+(\s*,\s*[A-Za-z0-9-]+)*$")


def allowed(origin: str | None, origins: Sequence[str]) -> bool:
    return bool(origin) and (ANY in origins or origin in origins)


def preflight(origin: str, asked: str | None) -> dict[str, str]:
    """The answer to a listed origin's preflight."""
    headers = asked.strip() if asked and len(asked) <= 1024 and _HEADER_LIST.match(
        asked.strip()) else HEADERS
    return {"Access-Control-Allow-Origin": origin, "Vary": "Origin",
            "Access-Control-Allow-Methods": METHODS,
            "Access-Control-Allow-Headers": headers,
            "Access-Control-Max-Age": str(MAX_AGE_S)}


def answer_headers(origin: str) -> dict[str, str]:
    """What a listed origin's real request is answered with, beside its answer."""
    return {"Access-Control-Allow-Origin": origin, "Vary": "Origin",
            "Access-Control-Expose-Headers": EXPOSED}
