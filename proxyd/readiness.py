"""What `/health` says: whether the proxy can answer, seat by seat.

`/health/live` says only that the proxy's loop runs.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from proxyd.proxy import PROXY
from proxyd.seat_client import SeatClient


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status,
                        content_type="application/json")


async def health(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    seats: dict[str, dict[str, Any]] = {}
    for name, c in proxy.clients.items():
        if not isinstance(c, SeatClient):
            continue
        pong = c.pong
        seats[name] = {"ready": c.ready, "alive": c.alive, "busy": bool(pong and pong.busy),
                       "incarnation": pong.incarnation if pong else None,
                       "pid": pong.pid if pong else None,
                       "queued": pong.queued if pong else 0,
                       "rows": pong.rows if pong else 0,
                       "max_batch": pong.max_batch if pong else 0,
                       "kv_bytes": pong.kv_bytes if pong else 0}
    ready = any(s["ready"] for s in seats.values())
    return _json({"status": "ok" if ready else "degraded", "seats": seats})


async def live(request: web.Request) -> web.Response:
    return _json({"status": "alive"})
