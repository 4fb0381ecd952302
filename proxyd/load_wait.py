"""A request whose rungs are loading waits for one to be ready.

    await wait_for_rung(proxy, rungs, deadline, gone) -> Waited

The journey (proxyd/journey.py) calls this when the rung it is at is loading and
no rung after it is ready: rather than fail every rung at once (a loading seat is
not a failed one), it waits until one of `rungs` is ready, until none is loading
any more (each is ready or down), until the client leaves, or until `deadline` on
the proxy's clock.  It wakes on every pong of the seats it waits for (a seat
becomes ready only with a pong), and looks again at least every `LOOK_S` for the
rest (a seat gone silent, a client gone, a deadline on a test's ManualClock).
Nothing else is counting while it waits: the seats' queue and first-token clocks
start only when the request is sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from enum import StrEnum

from proxyd.proxy import Proxy
from proxyd.readiness import rung_states
from proxyd.seat_client import SeatClient
from proxyd.seat_state import SeatState, route_state

LOOK_S = 0.1


class Waited(StrEnum):
    READY = "ready"  # some rung is ready: go down the ladder
    DOWN = "down"  # nothing is loading any more, and nothing is ready
    TIMEOUT = "timeout"  # the deadline passed with rungs still loading
    GONE = "gone"  # the client went away


def must_wait(proxy: Proxy, rungs: Sequence[str]) -> bool:
    """None of `rungs` is ready and some is loading."""
    return route_state(rung_states(proxy, rungs).values()) is SeatState.LOADING


async def wait_for_rung(proxy: Proxy, rungs: Sequence[str], deadline: float,
                        gone: Callable[[], bool]) -> Waited:
    clients = [c for n in rungs if isinstance(c := proxy.clients[n], SeatClient)]
    for c in clients:
        c.waiting += 1
    try:
        while True:
            state = route_state(rung_states(proxy, rungs).values())
            if state is SeatState.READY:
                return Waited.READY
            if state is SeatState.DOWN:
                return Waited.DOWN
            if gone():
                return Waited.GONE
            left = deadline - proxy.clock()
            if left <= 0:
                return Waited.TIMEOUT
            pongs = [c.next_pong() for c in clients]
            if not pongs:  # loading implies a local rung; never wait on nothing
                return Waited.DOWN
            try:
                await asyncio.wait(pongs, timeout=min(left, LOOK_S),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                for fut in pongs:
                    fut.cancel()
    finally:
        for c in clients:
            c.waiting -= 1
