"""Whether to try a hosted rung again, and when, as pure functions.

    next_try(reason, attempt_no, retry_after_s, deadline_left_s, policy, rand)
        -> RetryIn(delay_s) | GiveUp(why)

Only transient faults are retried on the same rung: a connection reset before
any byte of the response, and HTTP 429, 500, 502, 503, 504.  Everything else
ends the rung's attempt at once: a deterministic upstream error is answered as
it is (or moves on, for a context-length rejection, which the ladder decides),
and a silent upstream that already used its first-token timeout, or that held
the request silent and then closed (`silent_close`), is never asked again,
because waiting for it twice is the hang a gateway must not have.

`Retry-After` is honoured when it fits: when it is no longer than the policy's
`retry_after_max_s` and shorter than what is left of the request's deadline.
When it does not fit the rung gives up at once, so the ladder moves to the next
rung instead of holding the client.  Without `Retry-After` the delay is an
exponential back-off with "equal jitter": half the step fixed, half random, so
tries from many clients spread out but never come back at once.
"""

from __future__ import annotations

import email.utils
from dataclasses import dataclass

# Failed reasons (proxyd/hosted.py) worth a second try on the same rung.
TRANSIENT = frozenset({
    "connection_reset",
    "upstream_429",
    "upstream_500",
    "upstream_502",
    "upstream_503",
    "upstream_504",
})


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3  # tries on one rung for one request, the first included
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 8.0
    retry_after_max_s: float = 20.0  # a longer Retry-After moves to the next rung


@dataclass(frozen=True)
class RetryIn:
    delay_s: float


@dataclass(frozen=True)
class GiveUp:
    why: str  # not_transient | attempts_exhausted | retry_after_too_long | no_time_left


Decision = RetryIn | GiveUp


def backoff_s(attempt_no: int, policy: RetryPolicy, rand: float) -> float:
    """The pause after try number `attempt_no` (1-based); `rand` is uniform in [0, 1)."""
    step = min(policy.backoff_max_s, policy.backoff_initial_s * 2.0 ** (attempt_no - 1))
    return step / 2 + rand * step / 2


def next_try(reason: str, attempt_no: int, retry_after_s: float | None,
             deadline_left_s: float, policy: RetryPolicy, rand: float) -> Decision:
    """What to do after try number `attempt_no` of a rung failed with `reason`."""
    if reason not in TRANSIENT:
        return GiveUp("not_transient")
    if attempt_no >= policy.max_attempts:
        return GiveUp("attempts_exhausted")
    if retry_after_s is not None:
        wait = max(0.0, retry_after_s)
        if wait > policy.retry_after_max_s or wait >= deadline_left_s:
            return GiveUp("retry_after_too_long")
        return RetryIn(wait)
    delay = backoff_s(attempt_no, policy, rand)
    if delay >= deadline_left_s:
        return GiveUp("no_time_left")
    return RetryIn(delay)


def parse_retry_after(headers: dict[str, str], now_epoch: float) -> float | None:
    """Seconds to wait, from `retry-after-ms`, or `Retry-After` as seconds or an HTTP date.

    `headers` has lower-case names.  A value that does not parse is ignored.
    """
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - now_epoch)
