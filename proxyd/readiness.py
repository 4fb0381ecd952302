"""What `/health` says: whether the proxy can answer, route by route and seat by seat.

`/health` is 200 only when every route has a ready rung (one that a request
without the off-box opt-in header may use: proxyd/seat_state.py says what ready,
loading and down mean; a sleeping on-demand seat counts as ready, since a request
wakes it); otherwise 503, with the same body:

    {"status": "ok" | "loading" | "down",
     "routes": {model: {"state": ..., "rungs": {seat: state}}},
     "seats": {seat: {"state", "ready", "alive", "busy", "pid", "rows", "waiting", ...}},
     "hosted": {seat: {"state", "circuit"}}}

`status` is "ok" when every route is ready, "down" when some route is down, else
"loading" (nothing failed; wait).  A seat's `waiting` counts the requests waiting
for it to be ready.  `/health/live` says only that the proxy's loop runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
from aiohttp import web

from proxyd import breaker
from proxyd.ladder import offbox_allowed, plan
from proxyd.proxy import PROXY, Proxy
from proxyd.seat_client import SeatClient
from proxyd.seat_state import SeatState, route_state, rung_state


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status,
                        content_type="application/json")


def rung_states(proxy: Proxy, names: Iterable[str]) -> dict[str, SeatState]:
    """Each rung's state now: its seat's (a hosted rung: ready) unless its circuit
    refuses it.  Looking does not take a half-open circuit's probe."""
    now = proxy.clock()
    out: dict[str, SeatState] = {}
    for name in names:
        client = proxy.clients[name]
        admits = breaker.admit(proxy.breakers[name], now, proxy.breaker_policy)[1]
        out[name] = rung_state(client.state, admits)
    return out


def routes_body(proxy: Proxy) -> dict[str, dict[str, Any]]:
    routes: dict[str, dict[str, Any]] = {}
    for route in proxy.config.route:
        usable = plan(route, proxy.seats, offbox_allowed(route, None)).rungs
        states = rung_states(proxy, usable)
        routes[route.model] = {"state": route_state(states.values()).value,
                               "rungs": {n: s.value for n, s in states.items()}}
    return routes


async def health(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    seats: dict[str, dict[str, Any]] = {}
    hosted: dict[str, dict[str, Any]] = {}
    for name, c in proxy.clients.items():
        if not isinstance(c, SeatClient):  # the seat's own fields below
            hosted[name] = {"state": rung_states(proxy, [name])[name].value,
                            "circuit": proxy.breakers[name].circuit.value}
            continue
        pong = c.pong
        seats[name] = {"state": c.state.value, "ready": c.ready, "alive": c.alive,
                       "busy": bool(pong and pong.busy),
                       "incarnation": pong.incarnation if pong else None,
                       "pid": pong.pid if pong else None,
                       "queued": pong.queued if pong else 0,
                       "rows": pong.rows if pong else 0,
                       "max_batch": pong.max_batch if pong else 0,
                       "kv_bytes": pong.kv_bytes if pong else 0,
                       # its memory (seatd/memory.py): the model loaded, the KV room
                       # within its budget, the budget (0: none)
                       "loaded_bytes": pong.loaded_bytes if pong else 0,
                       "kv_budget_bytes": pong.kv_budget_bytes if pong else 0,
                       "memory_budget_bytes": pong.memory_budget_bytes if pong else 0,
                       # compiling its shapes in idle time (seatd/warm_shapes.py)
                       "warming": bool(pong and pong.warming),
                       "waiting": c.waiting,
                       # an on-demand seat: loaded or sleeping (proxyd/on_demand.py), and
                       # its seconds idle while loaded (None: busy, or not loaded)
                       "load": proxy.seats[name].load,
                       "idle_s": (round(proxy.clock() - c.last_used, 1)
                                  if c.on_demand and c.idle and c.state is SeatState.READY
                                  else None)}
    routes = routes_body(proxy)
    states = {r["state"] for r in routes.values()}
    if states <= {SeatState.READY.value}:
        status, code = "ok", 200
    elif SeatState.DOWN.value in states:
        status, code = "down", 503
    else:
        status, code = "loading", 503
    return _json({"status": status, "routes": routes, "seats": seats, "hosted": hosted}, code)


async def live(request: web.Request) -> web.Response:
    return _json({"status": "alive"})
