"""On-demand seats, the proxy's side: wake one for a request, put idle ones to sleep.

    await wake(proxy, name) -> Unwoken | None      None: seatd loads it; else why not
    await sleep(proxy, name, reason)               nothing more is sent to it
    sleep_reason(keep_alive, override, idle_s) -> str | None     pure: idle, request, None
    await keep_alive_loop(proxy)                   puts seats to sleep as they come due

The proxy, not seatd, decides when a seat sleeps for idleness, because only the
proxy knows, on its own loop and without a race, that nothing is in flight to a
seat or about to be sent to it: it marks the seat asleep (`SeatClient.put_to_sleep`:
no more sends) before it asks seatd to stop the worker.  Room for a seat being woken
is seatd's to judge (`seatd.room`: it knows every seat's size); the proxy names the
seats it could give up, least recently used first, and holds them (no sends) until
seatd's answer says which it put to sleep.

A request's `sanctum.keep_alive` replaces the seat's `keep_alive_s` after that
request, as Ollama's does; -1 means never, 0 right after the answer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog

from proxyd.proxy import Proxy
from proxyd.seat_client import SeatClient
from proxyd.seat_state import SeatState
from shared import protocol

log = structlog.get_logger()

TICK_S = 0.2  # how often idle seats are looked at


@dataclass(frozen=True)
class Unwoken:
    """Why a seat was not woken: `no_room` (the budget and what holds it: 503 with
    Retry-After if no other rung answers) or `wake_failed` (seatd refused or is away)."""

    reason: str
    message: str


def sleep_reason(keep_alive: float, override: float | None, idle_s: float) -> str | None:
    """Why an idle on-demand seat sleeps now (`idle`: its keep_alive_s ran out;
    `request`: its last request's keep_alive did), or None: not yet, or never."""
    limit = keep_alive if override is None else override
    if limit < 0 or idle_s < limit:
        return None
    return "idle" if override is None else "request"


def _on_demand(proxy: Proxy) -> dict[str, SeatClient]:
    return {n: c for n, c in proxy.clients.items()
            if isinstance(c, SeatClient) and c.on_demand}


async def wake(proxy: Proxy, name: str) -> Unwoken | None:
    """Ask seatd to load on-demand seat `name`; None when it loads (or is loaded), else
    why it cannot."""
    client = proxy.clients[name]
    assert isinstance(client, SeatClient)
    others = _on_demand(proxy)
    idle = sorted((n for n, c in others.items()
                   if n != name and c.idle and c.state is SeatState.READY),
                  key=lambda n: others[n].last_used)
    held = asyncio.Event()
    for n in idle:
        others[n].held = held
    try:
        reply = await proxy.control(protocol.WakeSeat(name, tuple(idle)))
    finally:
        for n in idle:
            others[n].held = None
        held.set()
    if isinstance(reply, protocol.NoRoom):
        proxy.counters.inc("no_room", name)
        return Unwoken("no_room", reply.message)
    if not isinstance(reply, protocol.Woken):
        why = reply.error if isinstance(reply, protocol.ControlError) else "seatd did not answer"
        log.warning("wake_failed", seat=name, error=why)
        return Unwoken("wake_failed", why)
    for victim in reply.slept:
        if victim in others:
            others[victim].put_to_sleep()
            log.info("seat_slept", seat=victim, reason="room", for_seat=name)
    if client.state is SeatState.SLEEPING:
        client.woken()
    proxy.counters.inc("wakes", name)
    log.info("seat_woken", seat=name, slept=list(reply.slept))
    return None


async def sleep(proxy: Proxy, name: str, reason: str) -> None:
    client = proxy.clients[name]
    assert isinstance(client, SeatClient)
    client.put_to_sleep()  # first: nothing is sent to it from now on
    reply = await proxy.control(protocol.SleepSeat(name, reason))
    if not isinstance(reply, protocol.ControlOk):
        log.warning("sleep_failed", seat=name, reply=repr(reply))
    log.info("seat_slept", seat=name, reason=reason)


async def keep_alive_loop(proxy: Proxy) -> None:
    """Put each idle on-demand seat to sleep once its keep-alive has run out."""
    while True:
        now = proxy.clock()
        for name, client in _on_demand(proxy).items():
            if client.state is not SeatState.READY or not client.idle:
                continue
            why = sleep_reason(proxy.seats[name].keep_alive, client.keep_alive,
                               now - client.last_used)
            if why is not None:
                try:
                    await sleep(proxy, name, why)
                except Exception:  # the loop outlives one seat's trouble
                    log.exception("sleep_failed", seat=name)
        await asyncio.sleep(TICK_S)
