"""The circuit breaker: opens on real failures only, probes once, closes on success."""

import pytest

from proxyd.breaker import Breaker, BreakerPolicy, Circuit, admit, record, release, took_probe

P = BreakerPolicy(threshold=3, cooldown_s=10)


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
