"""The hosted rung's retry decision: which faults are retried, how long to wait, when to move on."""

import pytest

from proxyd.retry import (
    TRANSIENT,
    GiveUp,
    RetryIn,
    RetryPolicy,
    backoff_s,
    next_try,
    parse_retry_after,
)

P = RetryPolicy(max_attempts=3, backoff_initial_s=0.5, backoff_max_s=4.0, retry_after_max_s=20.0)

# (reason, attempt_no, retry_after_s, deadline_left_s, rand) -> decision
TABLE = [
    # transient faults are retried with jittered exponential back-off
    ("upstream_500", 1, None, 60.0, 0.0, RetryIn(0.25)),
    ("upstream_500", 1, None, 60.0, 0.999, RetryIn(0.25 + 0.999 * 0.25)),
    ("upstream_502", 2, None, 60.0, 0.0, RetryIn(0.5)),
    ("upstream_503", 2, None, 60.0, 0.5, RetryIn(0.75)),
    ("upstream_504", 1, None, 60.0, 0.0, RetryIn(0.25)),
    ("connection_reset", 1, None, 60.0, 0.0, RetryIn(0.25)),
    ("upstream_429", 1, None, 60.0, 0.0, RetryIn(0.25)),
    # the attempt budget is bounded
    ("upstream_503", 3, None, 60.0, 0.0, GiveUp("attempts_exhausted")),
    ("upstream_429", 3, 1.0, 60.0, 0.0, GiveUp("attempts_exhausted")),
    # Retry-After is honoured when it fits, instead of the back-off
    ("upstream_429", 1, 2.0, 60.0, 0.9, RetryIn(2.0)),
    ("upstream_503", 1, 0.0, 60.0, 0.9, RetryIn(0.0)),
    ("upstream_429", 1, 20.0, 60.0, 0.0, RetryIn(20.0)),
    # ... and moves on at once when it does not
    ("upstream_429", 1, 21.0, 60.0, 0.0, GiveUp("retry_after_too_long")),
    ("upstream_429", 1, 5.0, 4.0, 0.0, GiveUp("retry_after_too_long")),
    ("upstream_429", 1, 4.0, 4.0, 0.0, GiveUp("retry_after_too_long")),
    # a back-off that does not fit the deadline moves on too
    ("upstream_500", 1, None, 0.2, 0.0, GiveUp("no_time_left")),
    # deterministic and silent faults are never retried
    ("silent_close", 1, None, 60.0, 0.0, GiveUp("not_transient")),  # silent, then closed
    ("first_token_timeout", 1, None, 60.0, 0.0, GiveUp("not_transient")),
    ("stall_timeout", 1, None, 60.0, 0.0, GiveUp("not_transient")),
    ("stream_cut", 1, None, 60.0, 0.0, GiveUp("not_transient")),
    ("malformed_stream", 1, None, 60.0, 0.0, GiveUp("not_transient")),
    ("connect_failed", 1, None, 60.0, 0.0, GiveUp("not_transient")),
    ("connect_timeout", 1, None, 60.0, 0.0, GiveUp("not_transient")),
    ("deadline", 1, None, 60.0, 0.0, GiveUp("not_transient")),
    ("upstream_401", 1, None, 60.0, 0.0, GiveUp("not_transient")),
    ("upstream_501", 1, None, 60.0, 0.0, GiveUp("not_transient")),
    ("upstream_error", 1, None, 60.0, 0.0, GiveUp("not_transient")),
]


@pytest.mark.parametrize(("reason", "n", "retry_after", "left", "rand", "want"), TABLE)
def test_next_try(reason: str, n: int, retry_after: float | None, left: float, rand: float,
                  want: RetryIn | GiveUp) -> None:
    """Transient faults retry within budget and deadline; everything else gives up at once."""
    got = next_try(reason, n, retry_after, left, P, rand)
    if isinstance(want, RetryIn):
        assert isinstance(got, RetryIn) and got.delay_s == pytest.approx(want.delay_s)
    else:
        assert got == want


def test_table_covers_every_transient_reason() -> None:
    """Each transient reason appears in the table with a retry."""
    retried = {r for r, *_, want in TABLE if isinstance(want, RetryIn)}
    assert retried == TRANSIENT


def test_backoff_grows_then_caps_and_jitter_stays_within_half() -> None:
    """Steps double up to the cap; jitter keeps each pause in [step/2, step)."""
    steps = [backoff_s(n, P, 0.0) * 2 for n in range(1, 8)]
    assert steps == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]
    for n in range(1, 8):
        lo, hi = backoff_s(n, P, 0.0), backoff_s(n, P, 0.9999)
        assert lo <= hi < lo * 2


def test_one_try_policy_never_retries() -> None:
    """max_attempts = 1 turns retries off."""
    assert next_try("upstream_503", 1, None, 60, RetryPolicy(max_attempts=1), 0.0) == \
        GiveUp("attempts_exhausted")


@pytest.mark.parametrize(
    ("headers", "want"),
    [
        ({}, None),
        ({"retry-after": "3"}, 3.0),
        ({"retry-after": " 1.5 "}, 1.5),
        ({"retry-after": "-4"}, 0.0),
        ({"retry-after": "soon"}, None),
        ({"retry-after-ms": "250"}, 0.25),
        ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),
        ({"retry-after-ms": "x", "retry-after": "9"}, 9.0),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:10 GMT"}, 10.0),
        ({"retry-after": "Wed, 21 Oct 2015 07:27:00 GMT"}, 0.0),
    ],
)
def test_parse_retry_after(headers: dict[str, str], want: float | None) -> None:
    """Seconds, milliseconds and HTTP dates all parse; junk is ignored."""
    now = 1445412480.0  # Wed, 21 Oct 2015 07:28:00 GMT
    assert parse_retry_after(headers, now) == want
