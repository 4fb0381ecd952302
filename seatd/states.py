"""The supervisor's seat state machine, as a pure function.

    transition(seat, event, now, policy) -> (seat, actions)

No processes, sockets or clocks in here: the shell in `supervisor.py` turns
events into calls and actions into effects.

    STARTING --pong: model loaded--> READY <--pong idle/busy--> BUSY
       |                               |                          |
       +--exit/lost (crash)--> BACKOFF --delay elapsed--> STARTING (respawn)
       |                          |
       |                          +--N crashes in window--> FATAL
       |                                                      |
       |                                  restart cmd / cool-down --> STARTING
       +--exit with a fatal code (config, model load)--> FATAL
    READY/BUSY --over memory budget--> STOPPING (drain) --exit--> STARTING (recycled)
    any alive --stop--> STOPPING (drain) --exit--> STOPPED
    STOPPING --drain deadline passed--> kill
    any alive --sleep (on-demand)--> STOPPING (drain) --exit--> SLEEPING
    SLEEPING --wake (a request, a restart)--> STARTING   (not a restart, not a crash)

READY means the model is loaded and the worker answered a heartbeat saying so.
SLEEPING is an on-demand seat with no worker process, by choice (`seatd.room`): it
starts there, and a wake asked for while it drains to sleep spawns it again after.
A memory recycle is counted in the crash window too: a seat whose model alone
is over its budget would otherwise restart forever.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from enum import StrEnum


class State(StrEnum):
    STARTING = "STARTING"
    READY = "READY"
    BUSY = "BUSY"
    BACKOFF = "BACKOFF"
    FATAL = "FATAL"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    SLEEPING = "SLEEPING"


ALIVE = (State.STARTING, State.READY, State.BUSY)


# After its drain a stopping worker gets this long to exit on its own, then KILL.
KILL_GRACE_S = 2.0


def stop_deadline(drain_s: float) -> float:
    """Seconds from SIGTERM to SIGKILL for a worker: its drain, then the grace."""
    return drain_s + KILL_GRACE_S


@dataclass(frozen=True)
class Policy:
    max_crashes: int = 5
    crash_window_s: float = 60.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    fatal_cooldown_s: float | None = None
    # How long a stopping worker may drain before it is killed (TERM, then KILL).
    stop_deadline_s: float = 22.0


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
class OverBudget:
    """The worker's resident memory passed its budget: recycle it after its request."""

    reason: str


@dataclass(frozen=True)
class Tick:
    """Time passed: back-off, cool-down and drain deadlines are checked."""


@dataclass(frozen=True)
class RestartRequested:
    pass


@dataclass(frozen=True)
class StopRequested:
    pass


@dataclass(frozen=True)
class SleepRequested:
    """Put an on-demand seat to sleep: `reason` is idle, room or request."""

    reason: str


@dataclass(frozen=True)
class WakeRequested:
    pass


Event = (Spawned | Heard | Lost | Exited | OverBudget | Tick | RestartRequested | StopRequested
         | SleepRequested | WakeRequested)

# -- actions --------------------------------------------------------------


@dataclass(frozen=True)
class Spawn:
    pass


@dataclass(frozen=True)
class Kill:
    """Kill the worker process (it is lost, asked to restart, or past its drain)."""

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
    memory_restarts: int = 0
    last_exit: str | None = None
    retry_at: float | None = None
    fatal_at: float | None = None
    # STOPPING: when the drain ends and the worker is killed; and whether a new
    # worker follows (a memory recycle) or the seat stays down (a stop).
    stop_deadline: float | None = None
    recycle: str | None = None
    # STOPPING to sleep: why; and whether a wake came meanwhile (spawn after the exit).
    sleep: str | None = None
    wake: bool = False


def backoff_delay(crashes_in_window: int, policy: Policy,
                  rng: random.Random | None = None) -> float:
    """Jittered exponential back-off: base * 2^(n-1), capped, times [0.5, 1.0)."""
    exponent = max(crashes_in_window - 1, 0)
    base = min(policy.backoff_max_s, policy.backoff_initial_s * 2.0**exponent)
    jitter = (rng or random).uniform(0.5, 1.0)
    return base * jitter


def _window(seat: SeatState, now: float, policy: Policy) -> tuple[float, ...]:
    return (*(t for t in seat.crashes if now - t <= policy.crash_window_s), now)


def _budget_spent(crashes: tuple[float, ...], policy: Policy) -> bool:
    return len(crashes) >= policy.max_crashes


def _fatal(seat: SeatState, why: str, crashes: tuple[float, ...], now: float) -> SeatState:
    return replace(seat, state=State.FATAL, pid=None, crashes=crashes, last_exit=why,
                   retry_at=None, fatal_at=now, stop_deadline=None, recycle=None)


def _crashed(seat: SeatState, reason: str, fatal: bool, now: float, policy: Policy,
             rng: random.Random | None) -> tuple[SeatState, list[Action]]:
    crashes = _window(seat, now, policy)
    if fatal:
        return _fatal(seat, reason, crashes, now), []
    if _budget_spent(crashes, policy):
        why = f"{reason}; {len(crashes)} crashes in {policy.crash_window_s:g}s"
        return _fatal(seat, why, crashes, now), []
    delay = backoff_delay(len(crashes), policy, rng)
    return replace(seat, state=State.BACKOFF, pid=None, crashes=crashes, last_exit=reason,
                   retry_at=now + delay), []


def _respawn(seat: SeatState) -> tuple[SeatState, list[Action]]:
    return replace(seat, state=State.STARTING, restarts=seat.restarts + 1, retry_at=None,
                   stop_deadline=None, recycle=None), [Spawn()]


def _stopping_exited(seat: SeatState, reason: str, now: float,
                     policy: Policy) -> tuple[SeatState, list[Action]]:
    if seat.sleep is not None:
        asleep = replace(seat, state=State.SLEEPING, pid=None, stop_deadline=None, sleep=None,
                         wake=False)
        return _woken(asleep) if seat.wake else (asleep, [])
    if seat.recycle is None:
        return replace(seat, state=State.STOPPED, pid=None, last_exit=reason,
                       stop_deadline=None), []
    why = f"{seat.recycle}; drained and {reason}"
    crashes = _window(seat, now, policy)
    if _budget_spent(crashes, policy):
        return _fatal(seat, f"{why}; {len(crashes)} restarts in {policy.crash_window_s:g}s",
                      crashes, now), []
    return _respawn(replace(seat, pid=None, crashes=crashes, last_exit=why))


def _woken(seat: SeatState) -> tuple[SeatState, list[Action]]:
    return replace(seat, state=State.STARTING, retry_at=None, stop_deadline=None,
                   recycle=None, sleep=None, wake=False), [Spawn()]


def _stop_requested(seat: SeatState, now: float, policy: Policy
                    ) -> tuple[SeatState, list[Action]]:
    s = seat.state
    if s in ALIVE:
        return replace(seat, state=State.STOPPING,
                       stop_deadline=now + policy.stop_deadline_s), [Terminate()]
    if s == State.STOPPING:
        # A recycle or a sleep in progress becomes a plain stop: nothing follows it.
        return replace(seat, recycle=None, sleep=None, wake=False), []
    if s in (State.BACKOFF, State.FATAL, State.SLEEPING):
        return replace(seat, state=State.STOPPED, retry_at=None), []
    return seat, []


def _sleep_requested(seat: SeatState, reason: str, now: float, policy: Policy
                     ) -> tuple[SeatState, list[Action]]:
    s = seat.state
    if s in ALIVE:
        return replace(seat, state=State.STOPPING, sleep=reason, wake=False,
                       stop_deadline=now + policy.stop_deadline_s), [Terminate()]
    if s in (State.BACKOFF, State.FATAL) and seat.pid is None:
        return replace(seat, state=State.SLEEPING, retry_at=None), []
    if s == State.STOPPING and seat.sleep is not None:
        return replace(seat, wake=False), []
    return seat, []


def _wake_requested(seat: SeatState) -> tuple[SeatState, list[Action]]:
    if seat.state == State.SLEEPING and seat.pid is None:
        return _woken(seat)
    if seat.state == State.STOPPING and seat.sleep is not None:
        return replace(seat, wake=True), []  # spawned again once the old one is gone
    return seat, []


def _tick(seat: SeatState, now: float, policy: Policy) -> tuple[SeatState, list[Action]]:
    """The clock's part: a drain deadline passed, a backoff over, a fatal cooldown over."""
    s = seat.state
    if s == State.STOPPING and seat.stop_deadline is not None and seat.pid is not None \
            and now >= seat.stop_deadline:
        # Kill once; the exit then ends the stop (or the recycle).
        return replace(seat, stop_deadline=None), [Kill("drain deadline passed")]
    if s == State.BACKOFF and seat.retry_at is not None and now >= seat.retry_at \
            and seat.pid is None:
        return _respawn(seat)
    if (s == State.FATAL and policy.fatal_cooldown_s is not None
            and seat.fatal_at is not None and seat.pid is None
            and now - seat.fatal_at >= policy.fatal_cooldown_s):
        return _respawn(replace(seat, crashes=(), fatal_at=None))
    return seat, []


def transition(seat: SeatState, event: Event, now: float, policy: Policy,
               rng: random.Random | None = None) -> tuple[SeatState, list[Action]]:
    s = seat.state
    match event:
        case StopRequested():
            return _stop_requested(seat, now, policy)
        case Spawned(pid=pid):
            return replace(seat, state=State.STARTING, pid=pid, retry_at=None), []
        case Heard(ready=ready, busy=busy):
            if s not in ALIVE or not ready:
                return seat, []
            return replace(seat, state=State.BUSY if busy else State.READY), []
        case Lost(reason=reason):
            if s not in ALIVE:
                return seat, []
            # The process may still exist (hung, stopped): kill it; its exit is not a
            # second crash, so the crash is counted here and the exit is then ignored.
            new, actions = _crashed(seat, reason, False, now, policy, rng)
            return replace(new, pid=seat.pid), [Kill(reason), *actions]
        case OverBudget(reason=reason):
            if s not in (State.READY, State.BUSY):
                return seat, []
            # SIGTERM makes the worker refuse new work and finish what it holds.
            return replace(seat, state=State.STOPPING, recycle=reason,
                           memory_restarts=seat.memory_restarts + 1,
                           stop_deadline=now + policy.stop_deadline_s), [Terminate()]
        case Exited(reason=reason, fatal=fatal):
            if s == State.STOPPING:
                return _stopping_exited(seat, reason, now, policy)
            if s in ALIVE:
                return _crashed(seat, reason, fatal, now, policy, rng)
            # BACKOFF/FATAL after a Lost: the killed process is now gone.
            return replace(seat, pid=None), []
        case Tick():
            return _tick(seat, now, policy)
        case SleepRequested(reason=reason):
            return _sleep_requested(seat, reason, now, policy)
        case WakeRequested():
            return _wake_requested(seat)
        case RestartRequested():
            if s == State.SLEEPING:
                return _wake_requested(seat)
            if s in (State.BACKOFF, State.FATAL, State.STOPPED):
                if seat.pid is not None:
                    return seat, []
                return _respawn(replace(seat, crashes=(), fatal_at=None))
            if s in ALIVE:
                # An operator restart is not a crash: kill, then respawn at once.
                return replace(seat, state=State.BACKOFF, retry_at=now,
                               last_exit="restart requested"), [Kill("restart requested")]
            return seat, []
    return seat, []
