"""Whether a rung can answer now, is loading, or is down: pure functions.

    seat_state(facts, spawn_grace_s) -> SeatState     one local seat, from what its pongs said
    rung_state(seat, admits) -> SeatState             a rung: its seat (None: hosted) and circuit
    route_state(rungs) -> SeatState                   a route: its best rung

A local seat is

    sleeping  an on-demand seat with no worker, by choice (it loads on a request:
              proxyd/on_demand.py); checked first
    ready     alive, and its last pong says ready
    loading   alive and not ready, and never ready since the proxy started (its model
              loads); or not heard from at all yet, within `spawn_grace_s` of the proxy's
              start (seatd may still be spawning it)
    down      anything else: a seat that was ready and was lost (or says not ready
              again) has failed, and its failure is a real one; a seat never heard from
              after the grace is not coming

A hosted rung is ready unless its circuit refuses it; so is a local rung whose seat
is ready.  A route is ready when some rung it may use is ready or sleeping (a
sleeping seat answers once woken: nothing failed), loading when none is and some is
loading (a request waits: proxyd/load_wait.py), else down.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

# How long after the proxy started a seat it has never heard from still counts as
# starting: seatd and the worker start beside the proxy, and a worker answers pings
# before it loads anything heavy.
SPAWN_GRACE_S = 30.0


class SeatState(StrEnum):
    READY = "ready"
    LOADING = "loading"
    DOWN = "down"
    SLEEPING = "sleeping"


@dataclass(frozen=True)
class SeatFacts:
    """What the proxy knows of one local seat, from its pongs."""

    alive: bool  # heard from within the liveness window
    says_ready: bool  # its last pong said ready
    heard: bool  # some pong came since the proxy started
    was_ready: bool  # some pong since the proxy started said ready
    since_start_s: float  # how long the proxy has been watching it
    asleep: bool = False  # an on-demand seat put to sleep, or never loaded yet


def seat_state(f: SeatFacts, spawn_grace_s: float = SPAWN_GRACE_S) -> SeatState:
    if f.asleep:
        return SeatState.SLEEPING
    if f.alive and f.says_ready:
        return SeatState.READY
    if f.was_ready:
        return SeatState.DOWN  # lost, or not ready again: a failure, not a load
    if f.alive:
        return SeatState.LOADING
    if not f.heard and f.since_start_s <= spawn_grace_s:
        return SeatState.LOADING
    return SeatState.DOWN


def rung_state(seat: SeatState | None, admits: bool) -> SeatState:
    """A rung: `seat` is its local seat's state (None for a hosted rung), `admits`
    whether its circuit would let a request through now."""
    if not admits:
        return SeatState.DOWN
    return SeatState.READY if seat is None else seat


def route_state(rungs: Iterable[SeatState]) -> SeatState:
    """The best state among a route's usable rungs (none: down)."""
    seen = set(rungs)
    if SeatState.SLEEPING in seen:
        seen.add(SeatState.READY)
    for state in (SeatState.READY, SeatState.LOADING):
        if state in seen:
            return state
    return SeatState.DOWN
