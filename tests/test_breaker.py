"""The circuit breaker: opens on real failures only, probes once, closes on success."""

import pytest

from proxyd.breaker import Breaker, BreakerPolicy, Circuit, admit, record, release, took_probe

P = BreakerPolicy(threshold=3, cooldown_s=10, cooldown_max_s=40)


def test_opens_after_threshold_real_failures() -> None:
    """Three real failures in a row open it; an open rung is not admitted."""
    b = Breaker()
    for i in range(3):
        assert admit(b, i, P)[1]
        b = record(b, True, i, P)
    assert b.circuit is Circuit.OPEN
    assert admit(b, 5, P) == (b, False)


def test_success_resets_the_count() -> None:
    """A success between failures means they were not in a row."""
    b = record(record(Breaker(), True, 0, P), True, 1, P)
    b = record(b, False, 2, P)
    b = record(record(b, True, 3, P), True, 4, P)
    assert b.circuit is Circuit.CLOSED


@pytest.mark.parametrize(("probe_fails", "after"), [(False, Circuit.CLOSED), (True, Circuit.OPEN)])
def test_half_open_admits_exactly_one_probe(probe_fails: bool, after: Circuit) -> None:
    """After the cool-down one probe goes through; its result decides the circuit."""
    b = Breaker(Circuit.OPEN, 3, opened_at=0)
    b, ok = admit(b, 10, P)
    assert ok and b.circuit is Circuit.HALF_OPEN
    assert admit(b, 10.1, P)[1] is False  # a second request while probing waits
    b = record(b, probe_fails, 11, P)
    assert b.circuit is after
    if probe_fails:
        assert b.opened_at == 11 and not admit(b, 12, P)[1]


def test_release_frees_an_undecided_probe() -> None:
    """A probe whose client vanished does not leave the rung stuck half-open."""
    b, _ = admit(Breaker(Circuit.OPEN, 3, 0), 10, P)
    assert admit(release(b), 10, P)[1]


@pytest.mark.parametrize(("before", "now", "admitted", "probe"), [
    (Breaker(), 0, True, False),                                 # closed: no probe
    (Breaker(Circuit.OPEN, 3, opened_at=0), 5, False, False),    # cooling down
    (Breaker(Circuit.OPEN, 3, opened_at=0), 10, True, True),     # the probe
    (Breaker(Circuit.HALF_OPEN, 3, 0, probing=True), 10, False, False),  # probe out
    (Breaker(Circuit.HALF_OPEN, 3, 0, probing=False), 10, True, True),   # slot freed
])
def test_took_probe_names_the_one_admission_that_probes(before: Breaker, now: float,
                                                        admitted: bool, probe: bool) -> None:
    after, ok = admit(before, now, P)
    assert (ok, took_probe(before, after)) == (admitted, probe)


@pytest.mark.parametrize(("failed_at", "cooldown"), [
    (10, 10),    # early in the outage: the first cool-down
    (60, 20),    # a third of the outage so far
    (200, 40),   # never longer than the longest
])
def test_a_failed_probe_waits_a_third_of_the_outage_so_far(failed_at: float,
                                                           cooldown: float) -> None:
    """The cool-down grows with the outage, between the first and the longest."""
    b = Breaker(Circuit.HALF_OPEN, 3, opened_at=failed_at - 10, probing=True, since=0)
    b = record(b, True, failed_at, P)
    assert (b.circuit, b.opened_at) == (Circuit.OPEN, failed_at)
    assert not admit(b, failed_at + cooldown - 0.01, P)[1]
    assert admit(b, failed_at + cooldown, P)[1]


def test_a_probe_that_succeeds_closes_and_the_next_outage_starts_short() -> None:
    """After a long outage ends, a new one is probed after the first cool-down again."""
    b = record(Breaker(Circuit.HALF_OPEN, 9, 290, True, 40, since=0), False, 300, P)
    assert b == Breaker()
    for _ in range(3):
        b = record(b, True, 400, P)
    assert not admit(b, 409, P)[1] and admit(b, 410, P)[1]


def test_a_late_failure_while_open_does_not_push_the_probe_back() -> None:
    """An attempt admitted before the circuit opened and failing after it leaves the
    opening's clock where it was."""
    b = record(Breaker(Circuit.CLOSED, 2), True, 0, P)
    assert b.circuit is Circuit.OPEN
    b = record(b, True, 5, P)
    assert b.opened_at == 0 and admit(b, 10, P)[1]


def recovery_delay(down_s: float, every_s: float, policy: BreakerPolicy) -> float:
    """Steady traffic (a request every `every_s`) against a rung down for `down_s`, then
    healthy: how long after its recovery a request is first admitted to it."""
    b = Breaker()
    t = 0.0
    while True:
        b, ok = admit(b, t, policy)
        if ok:
            if t >= down_s:
                return t - down_s
            b = record(b, True, t, policy)
        t = round(t + every_s, 6)


@pytest.mark.parametrize("down_s", [0.5, 2.0, 3.5, 4.0, 5.0, 5.5, 6.0])
def test_a_recovered_rung_is_back_within_two_seconds(down_s: float) -> None:
    """With the default policy (first cool-down 1 s) and a request every 0.1 s, an outage
    of up to 6 s ends with the rung back in use within 2 s of its recovery."""
    assert recovery_delay(down_s, 0.1, BreakerPolicy()) <= 2.0


@pytest.mark.parametrize("down_s", [12.0, 30.0, 120.0])
def test_a_long_outage_is_probed_ever_less_often(down_s: float) -> None:
    """A longer outage waits at most a third of its length (30 s at most) to be seen."""
    assert recovery_delay(down_s, 0.1, BreakerPolicy()) <= min(30.0, down_s / 3) + 0.2
