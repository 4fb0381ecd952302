"""The supervisor's seat state machine, as transition tables."""

import random

import pytest

from seatd.states import (
    Exited,
    Heard,
    Kill,
    Lost,
    Policy,
    RestartRequested,
    SeatState,
    Spawn,
    Spawned,
    State,
    StopRequested,
    Terminate,
    Tick,
    backoff_delay,
    transition,
)

P = Policy(max_crashes=3, crash_window_s=60, backoff_initial_s=1, backoff_max_s=8)
RNG = random.Random(0)

S = State
TABLE = [
    # state, event, next state, action types
    (S.STARTING, Spawned(10), S.STARTING, []),
    (S.STARTING, Heard(ready=False, busy=False), S.STARTING, []),
    (S.STARTING, Heard(ready=True, busy=False), S.READY, []),
    (S.READY, Heard(ready=True, busy=True), S.BUSY, []),
    (S.BUSY, Heard(ready=True, busy=False), S.READY, []),
    (S.READY, Exited("signal:SIGKILL"), S.BACKOFF, []),
    (S.BUSY, Lost("no heartbeat"), S.BACKOFF, [Kill]),
    (S.STARTING, Exited("exit:79 (model_load_failed)", fatal=True), S.FATAL, []),
    (S.READY, StopRequested(), S.STOPPING, [Terminate]),
    (S.BACKOFF, StopRequested(), S.STOPPED, []),
    (S.FATAL, StopRequested(), S.STOPPED, []),
    (S.STOPPING, Exited("exit:0"), S.STOPPED, []),
    (S.STOPPING, Heard(ready=True, busy=False), S.STOPPING, []),
    (S.FATAL, RestartRequested(), S.STARTING, [Spawn]),
    (S.READY, RestartRequested(), S.BACKOFF, [Kill]),
    (S.FATAL, Tick(), S.FATAL, []),
]


@pytest.mark.parametrize(("state", "event", "after", "actions"), TABLE)
def test_transition_table(state, event, after, actions) -> None:
    """Each (state, event) pair leads to the documented state and actions."""
    pid = None if state in (S.BACKOFF, S.FATAL, S.STOPPED) else 10
    seat = SeatState(state=state, pid=pid)
    new, got = transition(seat, event, 100.0, P, RNG)
    assert new.state is after
    assert [type(a) for a in got] == actions


def test_backoff_respawns_only_after_delay_and_exit() -> None:
    """A crashed seat waits out its back-off, then is spawned once."""
    seat, _ = transition(SeatState(S.READY, pid=1), Exited("signal:SIGKILL"), 0.0, P, RNG)
    assert seat.state is S.BACKOFF and seat.retry_at is not None
    early, acts = transition(seat, Tick(), seat.retry_at - 0.01, P, RNG)
    assert early.state is S.BACKOFF and acts == []
    late, acts = transition(seat, Tick(), seat.retry_at, P, RNG)
    assert late.state is S.STARTING and acts == [Spawn()] and late.restarts == 1


def test_lost_worker_is_not_respawned_before_it_exits() -> None:
    """After a kill the old process must be gone before a new one starts."""
    seat, acts = transition(SeatState(S.BUSY, pid=7), Lost("stalled"), 0.0, P, RNG)
    assert acts[0] == Kill("stalled") and seat.pid == 7
    seat, acts = transition(seat, Tick(), 1000.0, P, RNG)
    assert acts == [] and seat.state is S.BACKOFF
    seat, _ = transition(seat, Exited("signal:SIGKILL"), 1000.0, P, RNG)
    seat, acts = transition(seat, Tick(), 1000.0, P, RNG)
    assert acts == [Spawn()]


def test_crash_budget_goes_fatal_with_last_reason() -> None:
    """N crashes inside the window make the seat FATAL, naming the last exit."""
    seat = SeatState(S.READY, pid=1)
    t = 0.0
    for _ in range(P.max_crashes - 1):
        seat, _ = transition(seat, Exited("exit:1"), t, P, RNG)
        assert seat.state is S.BACKOFF
        seat, _ = transition(seat, Tick(), seat.retry_at or t, P, RNG)
        seat, _ = transition(seat, Spawned(2), t, P, RNG)
        t += 1
    seat, _ = transition(seat, Exited("exit:1"), t, P, RNG)
    assert seat.state is S.FATAL
    assert seat.last_exit is not None and seat.last_exit.startswith("exit:1")


def test_crashes_outside_window_do_not_count() -> None:
    """Old crashes age out of the window."""
    seat = SeatState(S.READY, pid=1, crashes=(0.0, 1.0))
    seat, _ = transition(seat, Exited("exit:1"), 500.0, P, RNG)
    assert seat.state is S.BACKOFF and seat.crashes == (500.0,)


def test_fatal_cooldown_restarts() -> None:
    """With a cool-down configured, FATAL retries after it."""
    policy = Policy(max_crashes=1, fatal_cooldown_s=30)
    seat, _ = transition(SeatState(S.READY, pid=1), Exited("exit:1"), 0.0, policy, RNG)
    assert seat.state is S.FATAL
    assert transition(seat, Tick(), 29.0, policy, RNG)[0].state is S.FATAL
    assert transition(seat, Tick(), 30.0, policy, RNG)[1] == [Spawn()]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 10])
def test_backoff_is_jittered_exponential_and_capped(n: int) -> None:
    """Delay is base*2^(n-1) capped at the max, jittered into [half, full)."""
    full = min(P.backoff_max_s, P.backoff_initial_s * 2 ** (n - 1))
    for seed in range(20):
        d = backoff_delay(n, P, random.Random(seed))
        assert full * 0.5 <= d < full
