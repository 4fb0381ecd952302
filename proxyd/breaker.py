"""A circuit breaker per rung, as pure functions.

    CLOSED --threshold real failures in a row--> OPEN --cooldown--> HALF_OPEN
    HALF_OPEN admits one probe: success -> CLOSED, real failure -> OPEN again

Only real failures count.  A client error or a decline is the seat working.
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
    cooldown_s: float = 10.0


@dataclass(frozen=True)
class Breaker:
    circuit: Circuit = Circuit.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    probing: bool = False


def admit(b: Breaker, now: float, policy: BreakerPolicy) -> tuple[Breaker, bool]:
    """May a request be sent to this rung now?  A half-open rung admits one probe."""
    if b.circuit is Circuit.CLOSED:
        return b, True
    if b.circuit is Circuit.OPEN:
        if now - b.opened_at >= policy.cooldown_s:
            return replace(b, circuit=Circuit.HALF_OPEN, probing=True), True
        return b, False
    if b.probing:
        return b, False
    return replace(b, probing=True), True


def record(b: Breaker, real_failure: bool, now: float, policy: BreakerPolicy) -> Breaker:
    if not real_failure:
        return Breaker()
    if b.circuit is Circuit.HALF_OPEN:
        return Breaker(Circuit.OPEN, b.failures + 1, now, False)
    failures = b.failures + 1
    if failures >= policy.threshold:
        return Breaker(Circuit.OPEN, failures, now, False)
    return replace(b, failures=failures)


def took_probe(before: Breaker, after: Breaker) -> bool:
    """Did the admission that turned `before` into `after` hand out the probe?"""
    return after.probing and not before.probing


def release(b: Breaker) -> Breaker:
    """The probe ended without a verdict (client gone, seat busy): its slot is free.
    Only the attempt that took the probe may call this."""
    return replace(b, probing=False)
