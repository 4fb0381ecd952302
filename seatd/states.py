"""The supervisor's seat state machine, as a pure function.

    transition(seat, event, now, policy) -> (seat, actions)

No processes, sockets or clocks in here: the shell in `supervisor.py` turns
events into calls and actions into effects.

    STARTING --ready pong--> READY <--pong idle/busy--> BUSY
       |                       |                          |
       +--exit/lost--> BACKOFF --delay elapsed--> STARTING (respawn)
       |                 |
       |                 +--N crashes in window--> FATAL --restart cmd--> STARTING
       +--exit with a fatal code (config, model load)--> FATAL
    any --stop--> STOPPING --exit--> STOPPED
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from enum import Enum


class State(str, Enum):
    STARTING = "STARTING"
    READY = "READY"
    BUSY = "BUSY"
    BACKOFF = "BACKOFF"
    FATAL = "FATAL"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"


ALIVE = (State.STARTING, State.READY, State.BUSY)


@dataclass(frozen=True)
class Policy:
    max_crashes: int = 5
    crash_window_s: float = 60.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    fatal_cooldown_s: float | None = None


# -- events ---------------------------------------------------------------


@dataclass(frozen=True)
class Spawned:
    pid: int


@dataclass(frozen=True)
class Heard:
    """A pong from the worker: it is alive, maybe loaded, maybe busy."""

    ready: bool
    busy: bool


@dataclass(frozen=True)
class Lost:
    """Liveness ran out (no message for `liveness` heartbeats), or progress stalled."""

    reason: str


@dataclass(frozen=True)
class Exited:
    reason: str
    fatal: bool = False


@dataclass(frozen=True)
class Tick:
    """Time passed: back-off and cool-down deadlines are checked."""


@dataclass(frozen=True)
class RestartRequested:
    pass


@dataclass(frozen=True)
class StopRequested:
    pass


Event = Spawned | Heard | Lost | Exited | Tick | RestartRequested | StopRequested

# -- actions --------------------------------------------------------------


@dataclass(frozen=True)
class Spawn:
    pass


@dataclass(frozen=True)
class Kill:
    """Kill the worker process (it is lost or asked to restart)."""

    reason: str


@dataclass(frozen=True)
class Terminate:
    """Ask the worker to drain and exit (SIGTERM)."""


Action = Spawn | Kill | Terminate


@dataclass(frozen=True)
class SeatState:
    state: State = State.STARTING
    pid: int | None = None
    crashes: tuple[float, ...] = ()
    restarts: int = 0
    last_exit: str | None = None
    retry_at: float | None = None
    fatal_at: float | None = None
    extra: dict[str, str] = field(default_factory=dict)


def backoff_delay(crashes_in_window: int, policy: Policy, rng: random.Random | None = None) -> float:
    """Jittered exponential back-off: base * 2^(n-1), capped, times [0.5, 1.0)."""
    base = min(policy.backoff_max_s, policy.backoff_initial_s * 2 ** max(crashes_in_window - 1, 0))
    jitter = (rng or random).uniform(0.5, 1.0)
    return base * jitter


def _crashed(seat: SeatState, reason: str, fatal: bool, now: float, policy: Policy,
             rng: random.Random | None) -> tuple[SeatState, list[Action]]:
    crashes = tuple(t for t in seat.crashes if now - t <= policy.crash_window_s) + (now,)
    if fatal or len(crashes) >= policy.max_crashes:
        why = reason if fatal else f"{reason}; {len(crashes)} crashes in {policy.crash_window_s:g}s"
        return replace(seat, state=State.FATAL, pid=None, crashes=crashes, last_exit=why,
                       retry_at=None, fatal_at=now), []
    delay = backoff_delay(len(crashes), policy, rng)
    return replace(seat, state=State.BACKOFF, pid=None, crashes=crashes, last_exit=reason,
                   retry_at=now + delay), []


def transition(seat: SeatState, event: Event, now: float, policy: Policy,
               rng: random.Random | None = None) -> tuple[SeatState, list[Action]]:
    s = seat.state
    match event:
        case StopRequested():
            if s in ALIVE:
                return replace(seat, state=State.STOPPING), [Terminate()]
            if s in (State.BACKOFF, State.FATAL):
                return replace(seat, state=State.STOPPED, retry_at=None), []
            return seat, []
        case Spawned(pid=pid):
            return replace(seat, state=State.STARTING, pid=pid, retry_at=None), []
        case Heard(ready=ready, busy=busy):
            if s not in ALIVE:
                return seat, []
            if not ready:
                return seat, []
            return replace(seat, state=State.BUSY if busy else State.READY), []
        case Lost(reason=reason):
            if s not in ALIVE:
                return seat, []
            # The process may still exist (hung, stopped): kill it; its exit is not a
            # second crash, so the crash is counted here and the exit is then ignored.
            new, actions = _crashed(seat, reason, False, now, policy, rng)
            return replace(new, pid=seat.pid), [Kill(reason), *actions]
        case Exited(reason=reason, fatal=fatal):
            if s == State.STOPPING:
                return replace(seat, state=State.STOPPED, pid=None, last_exit=reason), []
            if s in ALIVE:
                return _crashed(seat, reason, fatal, now, policy, rng)
            # BACKOFF/FATAL after a Lost: the killed process is now gone.
            return replace(seat, pid=None), []
        case Tick():
            if s == State.BACKOFF and seat.retry_at is not None and now >= seat.retry_at \
                    and seat.pid is None:
                return replace(seat, state=State.STARTING, restarts=seat.restarts + 1,
                               retry_at=None), [Spawn()]
            if (s == State.FATAL and policy.fatal_cooldown_s is not None
                    and seat.fatal_at is not None and seat.pid is None
                    and now - seat.fatal_at >= policy.fatal_cooldown_s):
                return replace(seat, state=State.STARTING, restarts=seat.restarts + 1,
                               crashes=(), fatal_at=None), [Spawn()]
            return seat, []
        case RestartRequested():
            if s in (State.BACKOFF, State.FATAL, State.STOPPED):
                if seat.pid is not None:
                    return seat, []
                return replace(seat, state=State.STARTING, restarts=seat.restarts + 1,
                               crashes=(), retry_at=None, fatal_at=None), [Spawn()]
            if s in ALIVE:
                # An operator restart is not a crash: kill, then respawn at once.
                return replace(seat, state=State.BACKOFF, retry_at=now, crashes=seat.crashes,
                               last_exit="restart requested"), [Kill("restart requested")]
            return seat, []
    return seat, []
