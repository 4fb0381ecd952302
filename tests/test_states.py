"""The supervisor's seat state machine, as transition tables."""

import random

import pytest

from seatd.states import (
    Exited,
    Heard,
    Kill,
    Lost,
    OverBudget,
    Policy,
    RestartRequested,
    SeatState,
    SleepRequested,
    Spawn,
    Spawned,
    State,
    StopRequested,
    Terminate,
    Tick,
    WakeRequested,
    backoff_delay,
    transition,
)

P = Policy(max_crashes=3, crash_window_s=60, backoff_initial_s=1, backoff_max_s=8,
           stop_deadline_s=10)
RNG = random.Random(0)

S = State
TABLE = [
    # state, event, next state, action types
    (S.STARTING, Spawned(10), S.STARTING, []),
    (S.STARTING, Heard(ready=False, busy=False), S.STARTING, []),
    (S.STARTING, Heard(ready=False, busy=True), S.STARTING, []),
    (S.STARTING, Heard(ready=True, busy=False), S.READY, []),
    (S.READY, Heard(ready=True, busy=True), S.BUSY, []),
    (S.BUSY, Heard(ready=True, busy=False), S.READY, []),
    (S.READY, Exited("signal:SIGKILL"), S.BACKOFF, []),
    (S.BUSY, Exited("exit:1"), S.BACKOFF, []),
    (S.STARTING, Lost("no first heartbeat"), S.BACKOFF, [Kill]),
    (S.BUSY, Lost("no heartbeat"), S.BACKOFF, [Kill]),
    (S.BUSY, Lost("stalled: no token"), S.BACKOFF, [Kill]),
    (S.STARTING, Exited("model_load_failed: /m does not exist (exit:79)", fatal=True),
     S.FATAL, []),
    (S.READY, Exited("config_error: bad (exit:78)", fatal=True), S.FATAL, []),
    (S.READY, StopRequested(), S.STOPPING, [Terminate]),
    (S.BUSY, StopRequested(), S.STOPPING, [Terminate]),
    (S.STARTING, StopRequested(), S.STOPPING, [Terminate]),
    (S.BACKOFF, StopRequested(), S.STOPPED, []),
    (S.FATAL, StopRequested(), S.STOPPED, []),
    (S.STOPPING, Exited("exit:0"), S.STOPPED, []),
    (S.STOPPING, Heard(ready=True, busy=False), S.STOPPING, []),
    (S.STOPPING, Lost("no heartbeat"), S.STOPPING, []),
    (S.STOPPING, OverBudget("memory"), S.STOPPING, []),
    (S.READY, OverBudget("memory"), S.STOPPING, [Terminate]),
    (S.BUSY, OverBudget("memory"), S.STOPPING, [Terminate]),
    (S.STARTING, OverBudget("memory"), S.STARTING, []),
    (S.FATAL, RestartRequested(), S.STARTING, [Spawn]),
    (S.BACKOFF, RestartRequested(), S.STARTING, [Spawn]),
    (S.READY, RestartRequested(), S.BACKOFF, [Kill]),
    (S.STOPPING, RestartRequested(), S.STOPPING, []),
    (S.FATAL, Tick(), S.FATAL, []),
    (S.FATAL, Heard(ready=True, busy=False), S.FATAL, []),
    # on-demand seats: sleep drains like a stop; a sleeping seat wakes without a crash
    (S.READY, SleepRequested("idle"), S.STOPPING, [Terminate]),
    (S.STARTING, SleepRequested("room"), S.STOPPING, [Terminate]),
    (S.BACKOFF, SleepRequested("idle"), S.SLEEPING, []),
    (S.SLEEPING, SleepRequested("idle"), S.SLEEPING, []),
    (S.SLEEPING, WakeRequested(), S.STARTING, [Spawn]),
    (S.SLEEPING, RestartRequested(), S.STARTING, [Spawn]),
    (S.SLEEPING, StopRequested(), S.STOPPED, []),
    (S.SLEEPING, Tick(), S.SLEEPING, []),
    (S.SLEEPING, Heard(ready=True, busy=False), S.SLEEPING, []),
    (S.READY, WakeRequested(), S.READY, []),
    (S.STOPPED, WakeRequested(), S.STOPPED, []),
]


@pytest.mark.parametrize(("state", "event", "after", "actions"), TABLE)
def test_transition_table(state, event, after, actions) -> None:
    """Each (state, event) pair leads to the documented state and actions."""
    pid = None if state in (S.BACKOFF, S.FATAL, S.STOPPED, S.SLEEPING) else 10
    seat = SeatState(state=state, pid=pid)
    new, got = transition(seat, event, 100.0, P, RNG)
    assert new.state is after
    assert [type(a) for a in got] == actions


def test_ready_needs_a_loaded_model_and_an_answered_heartbeat() -> None:
    """Spawning is not READY; a pong without the model is not READY; a loaded pong is."""
    seat, _ = transition(SeatState(S.BACKOFF), Spawned(5), 0.0, P, RNG)
    assert seat.state is S.STARTING and seat.pid == 5
    seat, _ = transition(seat, Heard(ready=False, busy=False), 1.0, P, RNG)
    assert seat.state is S.STARTING
    seat, _ = transition(seat, Heard(ready=True, busy=False), 2.0, P, RNG)
    assert seat.state is S.READY


def test_fatal_exit_keeps_its_reason_and_is_not_retried() -> None:
    """A load failure is FATAL at once with the worker's words, and no tick respawns it."""
    why = "model_load_failed: /m does not exist (exit:79)"
    seat, _ = transition(SeatState(S.STARTING, pid=3), Exited(why, fatal=True), 0.0, P, RNG)
    assert seat.state is S.FATAL and seat.last_exit == why and seat.restarts == 0
    for t in (1.0, 100.0, 10_000.0):
        assert transition(seat, Tick(), t, P, RNG) == (seat, [])


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
    assert seat.last_exit == "stalled", "the kill's own exit must not hide why it was killed"
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
    assert transition(seat, Tick(), t + 10_000, P, RNG)[1] == [], "FATAL stays down"


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


def test_operator_restart_of_fatal_seat_clears_its_crash_budget() -> None:
    """`sanctum restart` on a FATAL seat starts it with a fresh crash window."""
    seat = SeatState(S.FATAL, crashes=(1.0, 2.0, 3.0), fatal_at=3.0, restarts=4)
    seat, acts = transition(seat, RestartRequested(), 4.0, P, RNG)
    assert acts == [Spawn()] and seat.crashes == () and seat.restarts == 5


def test_stop_drains_then_kills_at_the_deadline() -> None:
    """Stopping sends TERM; a worker still there at the drain deadline gets one KILL."""
    seat, acts = transition(SeatState(S.BUSY, pid=4), StopRequested(), 0.0, P, RNG)
    assert acts == [Terminate()] and seat.stop_deadline == P.stop_deadline_s
    assert transition(seat, Tick(), P.stop_deadline_s - 0.1, P, RNG)[1] == []
    seat, acts = transition(seat, Tick(), P.stop_deadline_s, P, RNG)
    assert acts == [Kill("drain deadline passed")]
    assert transition(seat, Tick(), P.stop_deadline_s + 5, P, RNG)[1] == [], "kill once"
    seat, acts = transition(seat, Exited("signal:SIGKILL"), 11.0, P, RNG)
    assert seat.state is S.STOPPED and acts == []


def test_memory_recycle_drains_then_respawns_and_counts() -> None:
    """Over budget: TERM (finish the request), then a new worker; memory_restarts counts it."""
    seat, acts = transition(SeatState(S.BUSY, pid=4), OverBudget("memory: rss 9 MB"), 0.0, P,
                            RNG)
    assert seat.state is S.STOPPING and acts == [Terminate()] and seat.memory_restarts == 1
    # Still draining: pongs and further readings change nothing.
    assert transition(seat, Heard(ready=False, busy=True), 1.0, P, RNG)[0] == seat
    assert transition(seat, OverBudget("memory: rss 10 MB"), 1.0, P, RNG)[0] == seat
    seat, acts = transition(seat, Exited("exit:0"), 2.0, P, RNG)
    assert seat.state is S.STARTING and acts == [Spawn()] and seat.restarts == 1
    assert seat.last_exit == "memory: rss 9 MB; drained and exit:0"


def test_memory_recycles_count_against_the_crash_budget() -> None:
    """A model over its budget by itself goes FATAL instead of recycling forever."""
    seat = SeatState(S.READY, pid=1)
    for t in range(P.max_crashes):
        seat, _ = transition(seat, OverBudget("memory: over"), float(t), P, RNG)
        seat, _ = transition(seat, Exited("exit:0"), float(t), P, RNG)
        if seat.state is S.STARTING:
            seat, _ = transition(seat, Spawned(t + 2), float(t), P, RNG)
            seat, _ = transition(seat, Heard(ready=True, busy=False), float(t), P, RNG)
    assert seat.state is S.FATAL and seat.memory_restarts == P.max_crashes
    assert seat.last_exit is not None and "memory: over" in seat.last_exit


def test_stop_during_a_recycle_does_not_respawn() -> None:
    """A stop that arrives while a memory recycle drains ends the seat: no new worker."""
    seat, _ = transition(SeatState(S.READY, pid=1), OverBudget("memory"), 0.0, P, RNG)
    seat, acts = transition(seat, StopRequested(), 1.0, P, RNG)
    assert acts == [] and seat.state is S.STOPPING
    seat, acts = transition(seat, Exited("exit:0"), 2.0, P, RNG)
    assert seat.state is S.STOPPED and acts == []


@pytest.mark.parametrize("n", [1, 2, 3, 4, 10])
def test_backoff_is_jittered_exponential_and_capped(n: int) -> None:
    """Delay is base*2^(n-1) capped at the max, jittered into [half, full)."""
    full = min(P.backoff_max_s, P.backoff_initial_s * 2 ** (n - 1))
    for seed in range(20):
        d = backoff_delay(n, P, random.Random(seed))
        assert full * 0.5 <= d < full


def test_a_seat_put_to_sleep_drains_and_sleeps_without_counting_a_restart() -> None:
    """Sleep: TERM, the exit is a SLEEPING seat (not a crash, no restart); a wake spawns."""
    seat, acts = transition(SeatState(S.READY, pid=4), SleepRequested("idle"), 0.0, P, RNG)
    assert seat.state is S.STOPPING and acts == [Terminate()] and seat.sleep == "idle"
    seat, acts = transition(seat, Exited("exit:0"), 1.0, P, RNG)
    assert (seat.state, seat.pid, acts, seat.restarts, seat.crashes) == (
        S.SLEEPING, None, [], 0, ())
    seat, acts = transition(seat, WakeRequested(), 2.0, P, RNG)
    assert seat.state is S.STARTING and acts == [Spawn()] and seat.restarts == 0


def test_a_wake_while_draining_to_sleep_spawns_after_the_exit() -> None:
    """A request for a seat still draining to sleep: it is spawned once the old worker is
    gone, never two at once; a stop meanwhile wins over both."""
    seat, _ = transition(SeatState(S.READY, pid=4), SleepRequested("room"), 0.0, P, RNG)
    seat, acts = transition(seat, WakeRequested(), 0.5, P, RNG)
    assert seat.state is S.STOPPING and acts == [] and seat.wake
    seat, acts = transition(seat, Exited("exit:0"), 1.0, P, RNG)
    assert seat.state is S.STARTING and acts == [Spawn()] and seat.restarts == 0
    seat, _ = transition(SeatState(S.READY, pid=4), SleepRequested("room"), 0.0, P, RNG)
    seat, _ = transition(seat, WakeRequested(), 0.5, P, RNG)
    seat, _ = transition(seat, StopRequested(), 0.6, P, RNG)
    seat, acts = transition(seat, Exited("exit:0"), 1.0, P, RNG)
    assert seat.state is S.STOPPED and acts == []
