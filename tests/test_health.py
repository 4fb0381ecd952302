"""Progress and memory decisions of the supervisor, as tables."""

import pytest

from seatd.health import MB, Limits, Watch, over_budget, progress

L = Limits(first_token_s=10.0, stall_s=3.0)


def feed(steps: list[tuple[tuple[str, ...], int, float]]) -> list[str | None]:
    watch, out = Watch(), []
    for in_flight, tokens, now in steps:
        watch, reason = progress(watch, in_flight, tokens, now, L)
        out.append(reason)
    return out


def test_idle_worker_never_stalls() -> None:
    """No request in flight: the token count may sit still forever."""
    assert feed([((), 5, 0.0), ((), 5, 1000.0)]) == [None, None]


def test_moving_tokens_are_progress() -> None:
    """A request whose count moves every few seconds is healthy."""
    steps = [(("r",), n, float(2 * i)) for i, n in enumerate(range(0, 20))]
    assert not any(feed(steps))


def test_prefill_gets_the_first_token_limit() -> None:
    """Before its first token a request may sit for first_token_s, not stall_s."""
    got = feed([(("r",), 7, 0.0), (("r",), 7, 9.0), (("r",), 7, 10.5)])
    assert got[:2] == [None, None]
    assert got[2] is not None and "no first token" in got[2]


def test_stall_after_tokens_moved() -> None:
    """Once tokens moved, stall_s without a new one is a hung seat."""
    got = feed([(("r",), 7, 0.0), (("r",), 8, 1.0), (("r",), 8, 3.9), (("r",), 8, 4.5)])
    assert got[:3] == [None, None, None]
    assert got[3] is not None and got[3].startswith("stalled: no token for 3.5s")


def test_a_new_request_restarts_the_clock() -> None:
    """The next request is judged from its own start, not from the last one's tokens."""
    got = feed([(("r1",), 7, 0.0), (("r1",), 9, 1.0), (("r2",), 9, 50.0), (("r2",), 9, 55.0)])
    assert got == [None, None, None, None]


@pytest.mark.parametrize(("rss", "budget", "over"), [
    (None, 100, False),
    (500 * MB, None, False),
    (100 * MB, 100, False),
    (100 * MB + 1, 100, True),
    (20_000 * MB, 16_000, True),
])
def test_over_budget(rss: int | None, budget: int | None, over: bool) -> None:
    """Only a known RSS strictly past a configured budget is over it, and says by how much."""
    reason = over_budget(rss, budget)
    assert (reason is not None) is over
    if reason:
        assert f"over budget {budget} MB" in reason
