"""A circuit breaker per rung, as pure functions.

    CLOSED --threshold real failures in a row--> OPEN --cool-down--> HALF_OPEN
    HALF_OPEN admits one probe: success -> CLOSED, real failure -> OPEN again,
    with a cool-down that grows with the outage

Only real failures count.  A client error or a decline is the seat working.  The
first cool-down is short (`cooldown_s`); after a failed probe the next one waits a
third of how long the circuit has been open (at least `cooldown_s`, at most
`cooldown_max_s`).  So a rung that keeps failing is asked less and less often, and
one that recovers is seen again, under steady traffic, within max(cooldown_s,
outage / 3): within 2 s of the end of a 6 s outage.  (Doubling the cool-down
instead would promise only "within the last cool-down", up to as long as the
outage so far.)  A probe is one try (the hosted rung does not retry it): it exists
to learn, not to hold a client.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class Circuit(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerPolicy:
    threshold: int = 3
    cooldown_s: float = 1.0  # the first cool-down after the circuit opens
    cooldown_max_s: float = 30.0  # the longest, however long the outage


@dataclass(frozen=True)
class Breaker:
    circuit: Circuit = Circuit.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    probing: bool = False
    cooldown_s: float = 0.0  # this opening's cool-down; 0: the policy's first
    since: float = 0.0  # when the circuit first opened in this outage


def cooldown(b: Breaker, policy: BreakerPolicy) -> float:
    """How long this opening of the circuit lasts before a probe."""
    return b.cooldown_s or policy.cooldown_s


def admit(b: Breaker, now: float, policy: BreakerPolicy) -> tuple[Breaker, bool]:
    """May a request be sent to this rung now?  A half-open rung admits one probe."""
    if b.circuit is Circuit.CLOSED:
        return b, True
    if b.circuit is Circuit.OPEN:
        if now - b.opened_at >= cooldown(b, policy):
            return replace(b, circuit=Circuit.HALF_OPEN, probing=True), True
        return b, False
    if b.probing:
        return b, False
    return replace(b, probing=True), True


def record(b: Breaker, real_failure: bool, now: float, policy: BreakerPolicy) -> Breaker:
    if not real_failure:
        return Breaker()
    if b.circuit is Circuit.HALF_OPEN:
        return Breaker(Circuit.OPEN, b.failures + 1, now, False,
                       next_cooldown(now - b.since, policy), b.since)
    if b.circuit is Circuit.OPEN:
        # An attempt admitted before the circuit opened ended after it: already open.
        return replace(b, failures=b.failures + 1)
    failures = b.failures + 1
    if failures >= policy.threshold:
        return Breaker(Circuit.OPEN, failures, now, False, policy.cooldown_s, now)
    return replace(b, failures=failures)


OUTAGE_SHARE = 1 / 3  # of the outage so far, the wait before the next probe


def next_cooldown(open_for_s: float, policy: BreakerPolicy) -> float:
    """The cool-down after a failed probe, the circuit open for `open_for_s` so far."""
    return min(max(policy.cooldown_s, open_for_s * OUTAGE_SHARE),
               max(policy.cooldown_max_s, policy.cooldown_s))


def took_probe(before: Breaker, after: Breaker) -> bool:
    """Did the admission that turned `before` into `after` hand out the probe?"""
    return after.probing and not before.probing


def release(b: Breaker) -> Breaker:
    """The probe ended without a verdict (client gone, seat busy): its slot is free.
    Only the attempt that took the probe may call this."""
    return replace(b, probing=False)
